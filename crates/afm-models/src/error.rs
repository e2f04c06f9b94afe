//! Errors raised while loading a model.

use crate::weights::WeightsError;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Weights(#[from] WeightsError),
    #[error("unsupported architecture '{0}' (supported: {1})")]
    UnsupportedArch(String, String),
    #[error("config: {key}: {reason}")]
    Config { key: String, reason: String },
    #[error("tensor '{name}' has shape {got:?}, expected {want:?}")]
    Shape {
        name: String,
        want: Vec<usize>,
        got: Vec<usize>,
    },
    #[error("tensor '{name}': {source}")]
    Runtime {
        name: String,
        source: afm_runtime::RuntimeError,
    },
    #[error("tensor '{name}' cannot be placed on the device: {source}")]
    Device {
        name: String,
        source: afm_runtime::compute::ComputeError,
    },
    #[error("{path}: {reason}")]
    File { path: String, reason: String },
}
