//! The engine's per-sequence recurrent state for hybrid models (Gated DeltaNet's rolling conv
//! window and its per-head state matrix): fixed slots of fixed size, addressed by a slot id the
//! engine hands each running sequence. It owns memory and token counts, never policy: which
//! sequence holds which slot is the engine's business.
//!
//! ```text
//! slot s:  seen = tokens folded in so far
//!          [ layer 0: conv (K−1)·C | ssm H·Dk·Dv ][ layer 1: ... ] ...     one f32 buffer
//! snapshot: a copy of one slot's buffer and `seen`, restorable into any slot
//!
//! prefix snapshots (sized at start-up, ids handed out by the engine's block manager):
//!  snap n:  seen = the block boundary it was taken at
//!          [ same layout as a slot ]                                     one more f32 buffer
//! ```
//!
//! Host memory on every device for now: the recurrent ops have no GPU kernel yet (their GPU
//! arm runs through [`Device::host_compute`](super::Device::host_compute)).

use super::{ComputeError, Result};

/// One recurrent layer's state, in f32 values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerStateShape {
    /// The causal convolution's window of past inputs.
    pub conv: usize,
    /// The recurrent state proper (e.g. DeltaNet's heads × key dim × value dim).
    pub ssm: usize,
}

/// A copy of one slot (prefix-cache snapshots, speculative rollback).
#[derive(Debug, Clone)]
pub struct StateSnapshot {
    seen: usize,
    values: Vec<f32>,
}

impl StateSnapshot {
    pub fn seen(&self) -> usize {
        self.seen
    }
}

pub struct StatePool {
    layers: Vec<LayerStateShape>,
    /// Offset of each layer inside a slot.
    offsets: Vec<usize>,
    per_slot: usize,
    seen: Vec<usize>,
    values: Vec<f32>,
    /// Prefix-cache snapshots: `seen` and values per id, same layout as a slot.
    snap_seen: Vec<usize>,
    snap_values: Vec<f32>,
}

impl StatePool {
    /// `num_slots` zeroed slots holding every layer of `layers`, and no prefix snapshots.
    pub fn new(layers: &[LayerStateShape], num_slots: usize) -> Self {
        Self::with_snapshots(layers, num_slots, 0)
    }

    /// Like [`new`](Self::new), plus `num_snapshots` snapshot buffers for the prefix cache
    /// (allocated zeroed, so pages are touched only when a snapshot is first saved).
    pub fn with_snapshots(
        layers: &[LayerStateShape],
        num_slots: usize,
        num_snapshots: usize,
    ) -> Self {
        let mut offsets = Vec::with_capacity(layers.len());
        let mut per_slot = 0;
        for l in layers {
            offsets.push(per_slot);
            per_slot += l.conv + l.ssm;
        }
        Self {
            layers: layers.to_vec(),
            offsets,
            per_slot,
            seen: vec![0; num_slots],
            values: vec![0.0; per_slot * num_slots],
            snap_seen: vec![0; num_snapshots],
            snap_values: vec![0.0; per_slot * num_snapshots],
        }
    }

    pub fn num_snapshots(&self) -> usize {
        self.snap_seen.len()
    }

    fn check_snapshot(&self, snap: u32) -> Result<usize> {
        let n = snap as usize;
        if n >= self.snap_seen.len() {
            return Err(ComputeError::Shape {
                what: "state snapshot id (below the number of snapshots)",
                got: n,
                want: self.snap_seen.len(),
            });
        }
        Ok(n)
    }

    /// Copies `slot` (its values and token count) into snapshot `snap`.
    pub fn save_snapshot(&mut self, slot: u32, snap: u32) -> Result<()> {
        let (s, n, w) = (
            self.check_slot(slot)?,
            self.check_snapshot(snap)?,
            self.per_slot,
        );
        self.snap_seen[n] = self.seen[s];
        self.snap_values[n * w..(n + 1) * w].copy_from_slice(&self.values[s * w..(s + 1) * w]);
        Ok(())
    }

    /// Copies snapshot `snap` into `slot`; returns the tokens the slot now holds.
    pub fn restore_snapshot(&mut self, snap: u32, slot: u32) -> Result<usize> {
        let (s, n, w) = (
            self.check_slot(slot)?,
            self.check_snapshot(snap)?,
            self.per_slot,
        );
        self.seen[s] = self.snap_seen[n];
        self.values[s * w..(s + 1) * w].copy_from_slice(&self.snap_values[n * w..(n + 1) * w]);
        Ok(self.seen[s])
    }

    /// Bytes one slot takes (for the start-up line and memory budgets).
    pub fn bytes_per_slot(layers: &[LayerStateShape]) -> usize {
        layers.iter().map(|l| (l.conv + l.ssm) * 4).sum()
    }

    pub fn num_slots(&self) -> usize {
        self.seen.len()
    }

    pub fn layers(&self) -> &[LayerStateShape] {
        &self.layers
    }

    fn check_slot(&self, slot: u32) -> Result<usize> {
        let s = slot as usize;
        if s >= self.seen.len() {
            return Err(ComputeError::Shape {
                what: "state slot id (below the number of slots)",
                got: s,
                want: self.seen.len(),
            });
        }
        Ok(s)
    }

    /// Tokens folded into `slot` since its last reset.
    pub fn seen(&self, slot: u32) -> Result<usize> {
        Ok(self.seen[self.check_slot(slot)?])
    }

    pub fn set_seen(&mut self, slot: u32, seen: usize) -> Result<()> {
        let s = self.check_slot(slot)?;
        self.seen[s] = seen;
        Ok(())
    }

    /// Zeroes `slot`: a sequence starting from its first token.
    pub fn reset(&mut self, slot: u32) -> Result<()> {
        let s = self.check_slot(slot)?;
        self.seen[s] = 0;
        self.values[s * self.per_slot..(s + 1) * self.per_slot].fill(0.0);
        Ok(())
    }

    /// `(conv, ssm)` of one layer of one slot.
    pub fn layer_mut(&mut self, slot: u32, layer: usize) -> Result<(&mut [f32], &mut [f32])> {
        let s = self.check_slot(slot)?;
        let Some(shape) = self.layers.get(layer) else {
            return Err(ComputeError::Shape {
                what: "state layer index (below the pool's recurrent layers)",
                got: layer,
                want: self.layers.len(),
            });
        };
        let start = s * self.per_slot + self.offsets[layer];
        let buf = &mut self.values[start..start + shape.conv + shape.ssm];
        Ok(buf.split_at_mut(shape.conv))
    }

    pub fn snapshot(&self, slot: u32) -> Result<StateSnapshot> {
        let s = self.check_slot(slot)?;
        Ok(StateSnapshot {
            seen: self.seen[s],
            values: self.values[s * self.per_slot..(s + 1) * self.per_slot].to_vec(),
        })
    }

    pub fn restore(&mut self, slot: u32, snap: &StateSnapshot) -> Result<()> {
        let s = self.check_slot(slot)?;
        if snap.values.len() != self.per_slot {
            return Err(ComputeError::Shape {
                what: "state snapshot length (the pool's slot size)",
                got: snap.values.len(),
                want: self.per_slot,
            });
        }
        self.seen[s] = snap.seen;
        self.values[s * self.per_slot..(s + 1) * self.per_slot].copy_from_slice(&snap.values);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_disjoint_and_reset_zeroes_one() {
        let shapes = [
            LayerStateShape { conv: 3, ssm: 4 },
            LayerStateShape { conv: 2, ssm: 1 },
        ];
        let mut p = StatePool::new(&shapes, 2);
        p.layer_mut(0, 1).unwrap().1[0] = 5.0;
        p.layer_mut(1, 1).unwrap().1[0] = 7.0;
        p.set_seen(1, 9).unwrap();
        let snap = p.snapshot(1).unwrap();
        p.reset(1).unwrap();
        assert_eq!(p.layer_mut(0, 1).unwrap().1[0], 5.0, "slot 0 untouched");
        assert_eq!(
            (p.layer_mut(1, 1).unwrap().1[0], p.seen(1).unwrap()),
            (0.0, 0)
        );
        p.restore(0, &snap).unwrap();
        assert_eq!(
            (p.layer_mut(0, 1).unwrap().1[0], p.seen(0).unwrap()),
            (7.0, 9)
        );
        assert!(p.reset(2).is_err(), "slot beyond the pool is refused");
    }

    #[test]
    fn prefix_snapshots_copy_a_slot_and_restore_it_elsewhere() {
        let shapes = [LayerStateShape { conv: 2, ssm: 3 }];
        let mut p = StatePool::with_snapshots(&shapes, 2, 3);
        p.layer_mut(0, 0).unwrap().0[1] = 4.0;
        p.layer_mut(0, 0).unwrap().1[2] = 6.0;
        p.set_seen(0, 16).unwrap();
        p.save_snapshot(0, 2).unwrap();
        // The sequence moves on; the snapshot keeps the boundary.
        p.layer_mut(0, 0).unwrap().1[2] = -1.0;
        p.set_seen(0, 17).unwrap();
        assert_eq!(p.restore_snapshot(2, 1).unwrap(), 16);
        let (conv, ssm) = p.layer_mut(1, 0).unwrap();
        assert_eq!((conv[1], ssm[2]), (4.0, 6.0));
        assert_eq!(
            p.layer_mut(0, 0).unwrap().1[2],
            -1.0,
            "the source slot is untouched"
        );
        assert!(
            p.save_snapshot(0, 3).is_err(),
            "snapshot beyond the pool is refused"
        );
        assert!(
            p.restore_snapshot(0, 2).is_err(),
            "slot beyond the pool is refused"
        );
        assert_eq!(StatePool::new(&shapes, 1).num_snapshots(), 0);
    }
}
