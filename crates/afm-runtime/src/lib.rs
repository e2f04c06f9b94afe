//! afm-runtime: the compute side of afm. It owns weight storage formats (f32, f16, bf16 and
//! the GGML block quantizations), the kernels that multiply by them, the element-wise ops of a
//! transformer (norms, RoPE, activations), paged attention and the KV storage it reads.
//!
//! It knows nothing of checkpoints, tokenizers or requests: callers hand it bytes and shapes.

pub mod bytes;
pub mod dtype;
pub mod error;
pub mod matmul;
pub mod quant;
// Only the CUDA paths read their switches; a CPU build can still set them.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
mod switch;
pub mod threads;

pub mod attention;
pub mod compute;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod kv_quant;
pub mod kv_store;
pub mod ops;

pub use bytes::WeightBytes;
pub use dtype::DType;
pub use error::RuntimeError;
pub use matmul::WeightMatrix;
