//! Errors raised while binding weights to kernels.

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error(
        "tensor of type {dtype} with {cols} columns: the row length must be a multiple of {block}"
    )]
    RowNotBlockAligned {
        dtype: &'static str,
        cols: usize,
        block: usize,
    },
    #[error("tensor of type {dtype} and shape [{rows}, {cols}] needs {want} bytes, got {got}")]
    SizeMismatch {
        dtype: &'static str,
        rows: usize,
        cols: usize,
        want: usize,
        got: usize,
    },
    #[error("tensor type {0} is not supported")]
    UnsupportedType(String),
}
