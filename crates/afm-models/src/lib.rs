//! afm-models: everything between a checkpoint on disk and a model ready to run. It finds and
//! opens weights (GGUF, safetensors), reads configs, and binds weights into one struct per
//! architecture. Models hold weights only: the KV cache and positions come in as inputs to
//! [`CausalLm::forward`].
//!
//! It knows nothing of requests and scheduling (afm-engine); kernels live in afm-runtime.

pub mod arch;
pub mod checkpoint;
pub mod config;
pub mod error;
pub mod forward;
pub mod layers;
pub mod loader;
pub mod moe;
pub mod random_ids;
pub mod source;
pub mod weights;

pub use config::TransformerConfig;
pub use error::ModelError;
pub use forward::{CausalLm, ForwardBatch, SeqChunk};
pub use loader::{load_model, load_model_on, LoadedModel};
