//! Running requests by their public id (`chatcmpl-…`, `cmpl-…`), so that
//! `POST /v1/chat/completions/{id}/cancel` can reach the engine requests behind one.
//! A [`Registration`] removes its entry when the request's stream is dropped.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use afm_engine::RequestId;

#[derive(Default)]
pub struct Registry {
    running: Mutex<HashMap<String, Vec<RequestId>>>,
}

impl Registry {
    pub fn register(self: &Arc<Self>, public_id: &str) -> Registration {
        self.lock().insert(public_id.to_string(), Vec::new());
        Registration {
            registry: self.clone(),
            public_id: public_id.to_string(),
        }
    }

    /// The engine requests behind `public_id`, if it is still running.
    pub fn lookup(&self, public_id: &str) -> Option<Vec<RequestId>> {
        self.lock().get(public_id).cloned()
    }

    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Vec<RequestId>>> {
        // The map stays consistent even if a holder panicked: every update is one call.
        self.running.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

pub struct Registration {
    registry: Arc<Registry>,
    public_id: String,
}

impl Registration {
    pub fn add(&self, id: RequestId) {
        if let Some(ids) = self.registry.lock().get_mut(&self.public_id) {
            ids.push(id);
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.registry.lock().remove(&self.public_id);
    }
}
