//! The real engine behind the [`Generator`] seam.

use afm_engine::{
    EngineError, EngineHandle, EventReceiver, GenerateRequest, RequestId, TokenConstraint,
};

use crate::seams::{Generator, SubmitError};

impl Generator for EngineHandle {
    fn submit(&self, req: GenerateRequest) -> Result<(RequestId, EventReceiver), SubmitError> {
        Generator::submit_constrained(self, req, None)
    }

    fn submit_constrained(
        &self,
        req: GenerateRequest,
        constraint: Option<Box<dyn TokenConstraint>>,
    ) -> Result<(RequestId, EventReceiver), SubmitError> {
        EngineHandle::submit_constrained(self, req, constraint).map_err(|e| match e {
            EngineError::QueueFull { limit } => SubmitError::QueueFull { limit },
            EngineError::PromptTooLong { prompt, limit } => {
                SubmitError::PromptTooLong { prompt, limit }
            }
            EngineError::Stopped => SubmitError::Stopped,
            other => SubmitError::Other(other.to_string()),
        })
    }

    fn cancel(&self, id: RequestId) {
        EngineHandle::cancel(self, id)
    }

    fn max_context(&self) -> usize {
        EngineHandle::max_context(self)
    }

    fn metrics(&self) -> Option<&afm_engine::EngineMetrics> {
        Some(EngineHandle::metrics(self))
    }

    fn device_profile(&self) -> Option<&afm_engine::gpu_profile::DeviceProfile> {
        EngineHandle::device_profile(self)
    }
}
