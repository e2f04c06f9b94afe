//! Recurrent-state slot ids for hybrid models (Qwen3.5's Gated DeltaNet): integers only, like
//! the KV block manager. The engine gives each running sequence a [`StateSlot`]; dropping it
//! (finish, cancel, failed step, preemption) returns the id through a channel, so no path can
//! leak one. The state memory itself is the KV pool's `StatePool`; a slot handed out is zeroed
//! there by the engine before its first use.

use std::sync::mpsc;

/// A slot held by one sequence; returned to its [`StateSlots`] when dropped.
#[derive(Debug)]
pub struct StateSlot {
    id: u32,
    back: mpsc::Sender<u32>,
}

impl StateSlot {
    pub fn id(&self) -> u32 {
        self.id
    }
}

impl Drop for StateSlot {
    fn drop(&mut self) {
        // The receiver lives as long as the engine; after it, there is nothing to return to.
        let _ = self.back.send(self.id);
    }
}

#[derive(Debug)]
pub struct StateSlots {
    free: Vec<u32>,
    total: usize,
    back: mpsc::Sender<u32>,
    returned: mpsc::Receiver<u32>,
}

impl StateSlots {
    pub fn new(total: usize) -> Self {
        let (back, returned) = mpsc::channel();
        Self {
            // Lowest id first, so small tests see slot 0 first.
            free: (0..total as u32).rev().collect(),
            total,
            back,
            returned,
        }
    }

    fn collect_returned(&mut self) {
        while let Ok(id) = self.returned.try_recv() {
            self.free.push(id);
        }
    }

    /// A free slot, or `None` when every slot is held.
    pub fn acquire(&mut self) -> Option<StateSlot> {
        self.collect_returned();
        self.free.pop().map(|id| StateSlot {
            id,
            back: self.back.clone(),
        })
    }

    pub fn num_free(&mut self) -> usize {
        self.collect_returned();
        self.free.len()
    }

    pub fn total(&self) -> usize {
        self.total
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dropped_slots_come_back_and_ids_are_never_shared() {
        let mut s = StateSlots::new(2);
        let a = s.acquire().expect("first");
        let b = s.acquire().expect("second");
        assert_ne!(a.id(), b.id());
        assert!(s.acquire().is_none(), "only two slots");
        let a_id = a.id();
        drop(a);
        assert_eq!(s.num_free(), 1);
        let c = s.acquire().expect("the returned one");
        assert_eq!(c.id(), a_id);
        drop((b, c));
        assert_eq!(s.num_free(), 2);
    }
}
