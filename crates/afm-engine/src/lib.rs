//! afm-engine: the serving engine. One thread (the engine loop) owns all mutable state: the
//! scheduler, the KV block manager and prefix cache, the model runner and the samplers.
//! Everything else talks to it through [`EngineHandle`] over channels.
//!
//! Requests arrive already tokenized ([`GenerateRequest`]); text-level work (templates, stop
//! strings, reasoning and tool-call parsing) happens in the caller.

pub mod api;
pub mod constraint;
pub mod engine;
pub mod gpu_profile;
pub mod kv_blocks;
pub mod metrics;
pub mod sampling;
pub mod scheduler;
pub mod sequence;
pub mod state_slots;

pub use api::*;
pub use constraint::{ConstraintError, TokenConstraint};
pub use engine::{Engine, EngineConfig, EngineError, EngineHandle};
pub use metrics::EngineMetrics;
