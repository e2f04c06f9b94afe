//! KV block accounting and the prefix cache, with integers only: block ids, reference counts, a
//! free list, an LRU of idle cached blocks and `hash(parent_hash, block_tokens) -> block`.
//! It owns no K/V data (that is `afm_runtime::kv_store`) and knows nothing of sequences beyond
//! the block tables the scheduler hands it.
//!
//! ```text
//!  sequence tokens:  t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9 .  .     (block_size = 4)
//!  block table:      [   17      ,     3       ,    42     ]    position p -> block table[p / 4],
//!                                                               slot p % 4 of that block
//!  pool (num_blocks blocks x block_size slots):
//!   id:    0    1    2    3    ...   17  ...   42
//!        [....][....][....][t4..t7] [t0..t3] [t8 t9 . .]
//!                          full      full     partial: private, never shared
//!
//!  prefix cache: hash chain over FULL blocks only
//!   h0 = H(ROOT, t0..t3) -> 17      h1 = H(h0, t4..t7) -> 3
//!
//!  every block is in exactly one place:
//!   free list   ref 0, holds nothing reusable        (allocated first)
//!   LRU         ref 0, published, still hit-able      (evicted oldest-first when free is empty)
//!   in use      ref = number of block tables holding it
//! ```
//!
//! A hit is never trusted on the hash alone: the stored token ids must match, and so must the
//! identity (block id + generation) of the parent block the lookup walked through, so a hit is
//! exact even when hashes collide or a parent block was evicted and reused.
//!
//! Hybrid models (recurrent state beside the K/V, e.g. Gated DeltaNet) also need the state at
//! the point a hit resumes, so their manager hands out snapshot ids from a fixed pool
//! ([`with_state_snapshots`](BlockManager::with_state_snapshots)). A snapshot belongs to one
//! published block and holds the state after that block's last token; it is freed when the
//! block leaves the prefix cache, or taken from the least recently used idle block when the
//! pool runs dry. A hit is cut back to the last block holding a snapshot:
//!
//! ```text
//!  cached chain:   [b0][b1][b2][b3]            snapshot on b1 only
//!  new prompt:      =   =   =   =   x x
//!  hit:            [b0][b1]                    K/V of 0..8 shared, state restored from b1's
//!                          ^ kv_tokens = 16: a chunk ends here, so the next request finds
//!                            a snapshot on b3 (the scheduler's business)
//! ```

use std::collections::{BTreeMap, HashMap, VecDeque};

/// Index of a block in the pool (the same id in every layer's storage).
pub type BlockId = u32;

/// Index of a recurrent-state snapshot (the same id in the state pool's snapshot buffers).
pub type SnapshotId = u32;

/// The pool cannot supply the blocks a table needs; the scheduler answers by preempting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("out of KV blocks: need {needed} more, {available} available")]
pub struct OutOfBlocks {
    pub needed: usize,
    pub available: usize,
}

/// Prefix-cache counters (cumulative) and the pool's current occupancy.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// `acquire_prefix` calls that reused at least one block / reused none.
    pub hit_queries: u64,
    pub miss_queries: u64,
    /// Tokens served from the cache / tokens left to compute, over all queries.
    pub hit_tokens: u64,
    pub miss_tokens: u64,
    /// Blocks holding nothing reusable.
    pub blocks_free: usize,
    /// Idle blocks (ref 0) still in the prefix cache, reclaimable on demand.
    pub blocks_cached: usize,
    /// Blocks referenced by at least one table.
    pub blocks_used: usize,
    /// Recurrent-state snapshots in the pool / attached to a published block (hybrid models).
    pub snapshots_total: usize,
    pub snapshots_held: usize,
}

/// What a prefix lookup would reuse, without taking references (see [`BlockManager::find_prefix`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrefixHit {
    pub blocks: Vec<BlockId>,
    pub tokens: usize,
    /// How many of `blocks` sit idle in the LRU: acquiring them shrinks `num_free` by this much.
    pub idle_blocks: usize,
    /// Hybrid models: the snapshot of the last hit block, to restore before computing on.
    pub snapshot: Option<SnapshotId>,
    /// Tokens of the cached chain matched before cutting back to the last snapshot (equal to
    /// `tokens` without snapshots); where a later chunk should end to leave one.
    pub kv_tokens: usize,
}

/// A block's identity across reuse: the generation changes every time the block is reallocated,
/// so a stale parent link can never match a block that now holds other tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Ident {
    id: BlockId,
    generation: u64,
}

/// What a full block holds, fixed once its tokens are computed.
#[derive(Debug, Clone)]
struct Chain {
    hash: u64,
    /// Canonical identity of the previous block's content; `None` for a sequence's first block.
    parent: Option<Ident>,
    /// The published block holding this content: itself, or the one it duplicates.
    canonical: Ident,
    tokens: Vec<u32>,
}

#[derive(Debug, Clone, Default)]
struct Block {
    refs: u32,
    generation: u64,
    /// Set once the block is full and computed; `None` while it is being filled.
    chain: Option<Chain>,
    /// Whether the prefix-cache map points at this block.
    published: bool,
    /// Recency stamp, meaningful while the block sits in the LRU.
    lru_stamp: u64,
    /// Recurrent state after this block's last token (published blocks of hybrid models only).
    snapshot: Option<SnapshotId>,
}

/// Chain seed for a sequence's first block.
const ROOT_HASH: u64 = 0x9e37_79b9_7f4a_7c15;

/// Cheap deterministic hash of one block; quality only affects speed, since hits are re-checked.
fn hash_block(parent: u64, tokens: &[u32]) -> u64 {
    let mut h = parent ^ (tokens.len() as u64).wrapping_mul(0xff51_afd7_ed55_8ccd);
    for &t in tokens {
        h = (h.rotate_left(23) ^ u64::from(t)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
    h ^ (h >> 29)
}

/// Fixed pool of `num_blocks` blocks of `block_size` token slots, with an optional prefix cache.
#[derive(Debug)]
pub struct BlockManager {
    block_size: usize,
    prefix_caching: bool,
    blocks: Vec<Block>,
    /// Ref-0 blocks with nothing worth keeping; allocated before evicting cached ones.
    free: VecDeque<BlockId>,
    /// Ref-0 published blocks by recency stamp, oldest first.
    lru: BTreeMap<u64, BlockId>,
    next_stamp: u64,
    prefix_cache: HashMap<u64, BlockId>,
    stats: CacheStats,
    /// Hybrid models: a hit must end on a block holding a state snapshot.
    needs_snapshots: bool,
    /// Snapshot ids not attached to any block, and the block each attached one belongs to.
    snap_free: Vec<SnapshotId>,
    snap_owner: Vec<Option<BlockId>>,
    /// Swappable so tests can force hash collisions.
    hasher: fn(u64, &[u32]) -> u64,
}

impl BlockManager {
    /// `block_size` and `num_blocks` are validated at start-up; a zero block size is raised to 1.
    pub fn new(num_blocks: usize, block_size: usize, prefix_caching: bool) -> Self {
        let num_blocks = num_blocks.min(BlockId::MAX as usize);
        Self {
            block_size: block_size.max(1),
            prefix_caching,
            blocks: vec![Block::default(); num_blocks],
            free: (0..num_blocks as BlockId).collect(),
            lru: BTreeMap::new(),
            next_stamp: 0,
            prefix_cache: HashMap::new(),
            stats: CacheStats::default(),
            needs_snapshots: false,
            snap_free: Vec::new(),
            snap_owner: Vec::new(),
            hasher: hash_block,
        }
    }

    /// For a model with recurrent state: hits resume only where one of `num_snapshots`
    /// state snapshots was kept (see the module notes).
    pub fn with_state_snapshots(mut self, num_snapshots: usize) -> Self {
        let n = num_snapshots.min(SnapshotId::MAX as usize);
        self.needs_snapshots = true;
        // Lowest id first, so small tests see snapshot 0 first.
        self.snap_free = (0..n as SnapshotId).rev().collect();
        self.snap_owner = vec![None; n];
        self
    }

    /// Whether hits need a state snapshot (a hybrid model's manager).
    pub fn needs_snapshots(&self) -> bool {
        self.needs_snapshots && self.prefix_caching
    }

    /// The snapshot attached to block `id`, if any. For diagnostics and tests.
    pub fn snapshot_of(&self, id: BlockId) -> Option<SnapshotId> {
        self.blocks.get(id as usize).and_then(|b| b.snapshot)
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks available to `grow`: truly free plus idle cached ones (evictable).
    pub fn num_free(&self) -> usize {
        self.free.len() + self.lru.len()
    }

    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    pub fn prefix_caching(&self) -> bool {
        self.prefix_caching
    }

    /// Blocks needed to hold `tokens` slots.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// Number of tables holding `id` (0 for an unknown id). For diagnostics and tests.
    pub fn ref_count(&self, id: BlockId) -> u32 {
        self.blocks.get(id as usize).map_or(0, |b| b.refs)
    }

    /// Whether a prefix lookup can currently land on `id`.
    pub fn is_published(&self, id: BlockId) -> bool {
        self.blocks.get(id as usize).is_some_and(|b| b.published)
    }

    fn ident(&self, id: BlockId) -> Ident {
        Ident {
            id,
            generation: self.blocks[id as usize].generation,
        }
    }

    /// Does published block `id` hold exactly `tokens` after the parent content `parent`?
    fn verifies(&self, id: BlockId, tokens: &[u32], parent: Option<Ident>) -> bool {
        let b = &self.blocks[id as usize];
        b.published
            && b.chain
                .as_ref()
                .is_some_and(|c| c.tokens == tokens && c.parent == parent)
    }

    /// The longest cached prefix of `tokens` in full blocks, leaving at least one token to
    /// compute (for hybrid models, up to the last block with a state snapshot); pure, so the
    /// scheduler can check that admission fits before committing.
    pub fn find_prefix(&self, tokens: &[u32]) -> PrefixHit {
        let mut hit = PrefixHit::default();
        if !self.prefix_caching {
            return hit;
        }
        let bs = self.block_size;
        let (mut parent, mut parent_hash) = (None, ROOT_HASH);
        for chunk in tokens[..tokens.len().saturating_sub(1)].chunks_exact(bs) {
            let h = (self.hasher)(parent_hash, chunk);
            let Some(&id) = self.prefix_cache.get(&h) else {
                break;
            };
            if !self.verifies(id, chunk, parent) {
                break;
            }
            hit.blocks.push(id);
            parent = Some(self.ident(id));
            parent_hash = h;
        }
        hit.kv_tokens = hit.blocks.len() * bs;
        if self.needs_snapshots {
            let resumable = hit
                .blocks
                .iter()
                .rposition(|&id| self.blocks[id as usize].snapshot.is_some());
            hit.blocks.truncate(resumable.map_or(0, |i| i + 1));
            hit.snapshot = hit.blocks.last().and_then(|&id| self.snapshot_of(id));
        }
        hit.tokens = hit.blocks.len() * bs;
        hit.idle_blocks = hit
            .blocks
            .iter()
            .filter(|&&id| self.blocks[id as usize].refs == 0)
            .count();
        hit
    }

    /// Longest cached prefix of `tokens` made of full blocks, re-checking token ids and parent
    /// links on every hit. Takes a reference on each returned block. Never returns all of
    /// `tokens`: at least one token remains to compute so the step produces logits.
    pub fn acquire_prefix(&mut self, tokens: &[u32]) -> PrefixHit {
        if !self.prefix_caching {
            return PrefixHit::default();
        }
        let hit = self.find_prefix(tokens);
        for &id in &hit.blocks {
            self.take_ref(id);
        }
        if hit.tokens > 0 {
            self.stats.hit_queries += 1;
        } else {
            self.stats.miss_queries += 1;
        }
        self.stats.hit_tokens += hit.tokens as u64;
        self.stats.miss_tokens += (tokens.len() - hit.tokens) as u64;
        hit
    }

    fn take_ref(&mut self, id: BlockId) {
        let b = &mut self.blocks[id as usize];
        if b.refs == 0 {
            self.lru.remove(&b.lru_stamp);
        }
        b.refs += 1;
    }

    /// Grow `table` so it can hold `total_tokens` slots; all-or-nothing, so a failed call
    /// changes nothing. Err means: preempt someone (or wait).
    pub fn grow(
        &mut self,
        table: &mut Vec<BlockId>,
        total_tokens: usize,
    ) -> Result<(), OutOfBlocks> {
        let needed = self.blocks_for(total_tokens).saturating_sub(table.len());
        if needed > self.num_free() {
            return Err(OutOfBlocks {
                needed,
                available: self.num_free(),
            });
        }
        for _ in 0..needed {
            let id = self.allocate().expect("num_free() counted this block");
            table.push(id);
        }
        Ok(())
    }

    /// A fresh block with ref 1: from the free list, else the least recently used cached block.
    fn allocate(&mut self) -> Option<BlockId> {
        let id = match self.free.pop_front() {
            Some(id) => id,
            None => {
                let (_, id) = self.lru.pop_first()?;
                self.forget(id);
                id
            }
        };
        let b = &mut self.blocks[id as usize];
        debug_assert_eq!(b.refs, 0);
        b.refs = 1;
        b.generation += 1;
        b.chain = None;
        Some(id)
    }

    /// Drop `id` from the prefix-cache map if the map points at it, with its snapshot.
    fn forget(&mut self, id: BlockId) {
        self.drop_snapshot_of(id);
        let b = &mut self.blocks[id as usize];
        if b.published {
            b.published = false;
            if let Some(c) = &b.chain {
                if self.prefix_cache.get(&c.hash) == Some(&id) {
                    self.prefix_cache.remove(&c.hash);
                }
            }
        }
    }

    /// After `tokens[..computed]` are in the cache: register every newly full block of `table`.
    /// A block whose content is already published stays private and links to the published copy.
    pub fn publish_full_blocks(&mut self, table: &[BlockId], tokens: &[u32], computed: usize) {
        if !self.prefix_caching {
            return;
        }
        let bs = self.block_size;
        let full = (computed.min(tokens.len()) / bs).min(table.len());
        // Blocks are processed in order, so the unprocessed ones form a suffix of `full`.
        let mut first = full;
        while first > 0 && self.blocks[table[first - 1] as usize].chain.is_none() {
            first -= 1;
        }
        for i in first..full {
            let (parent, parent_hash) = match i.checked_sub(1) {
                None => (None, ROOT_HASH),
                Some(p) => {
                    let c = self.blocks[table[p] as usize].chain.as_ref();
                    let c = c.expect("blocks before `first` are processed");
                    (Some(c.canonical), c.hash)
                }
            };
            let chunk = &tokens[i * bs..(i + 1) * bs];
            self.publish_one(table[i], chunk, parent, (self.hasher)(parent_hash, chunk));
        }
    }

    fn publish_one(&mut self, id: BlockId, tokens: &[u32], parent: Option<Ident>, hash: u64) {
        let canonical = match self.prefix_cache.get(&hash).copied() {
            Some(other) if other != id && self.verifies(other, tokens, parent) => self.ident(other),
            existing => {
                // A colliding or orphaned entry loses its slot to the newer, verified content.
                if let Some(other) = existing.filter(|&o| o != id) {
                    self.unpublish(other);
                }
                self.prefix_cache.insert(hash, id);
                self.blocks[id as usize].published = true;
                self.ident(id)
            }
        };
        let chain = Chain {
            hash,
            parent,
            canonical,
            tokens: tokens.to_vec(),
        };
        self.blocks[id as usize].chain = Some(chain);
    }

    /// Take `id` out of the prefix cache; an idle one returns to the free list.
    fn unpublish(&mut self, id: BlockId) {
        self.forget(id);
        let b = &mut self.blocks[id as usize];
        if b.refs == 0 {
            self.lru.remove(&b.lru_stamp);
            b.chain = None;
            self.free.push_back(id);
        }
    }

    /// Drop the references of `table` and empty it. Published blocks reaching ref 0 go to the
    /// LRU and stay hit-able until reused; the table's tail is released first so it is evicted
    /// before the head, which more requests share.
    pub fn release(&mut self, table: &mut Vec<BlockId>) {
        for id in table.drain(..).rev() {
            let b = &mut self.blocks[id as usize];
            debug_assert!(b.refs > 0, "block {id} released more often than acquired");
            b.refs = b.refs.saturating_sub(1);
            if b.refs > 0 {
                continue;
            }
            if b.published {
                b.lru_stamp = self.next_stamp;
                self.next_stamp += 1;
                self.lru.insert(b.lru_stamp, id);
            } else {
                b.chain = None;
                self.free.push_back(id);
            }
        }
    }

    /// After a sequence's state holds exactly `tokens_in_state` tokens, a block boundary: the
    /// snapshot id the caller must fill from that state, attached to the block ending there
    /// (or to the published block it duplicates). `None` when the block is not cached, already
    /// has a snapshot, or no snapshot can be freed. Call after [`publish_full_blocks`].
    ///
    /// [`publish_full_blocks`]: Self::publish_full_blocks
    pub fn attach_snapshot(
        &mut self,
        table: &[BlockId],
        tokens_in_state: usize,
    ) -> Option<SnapshotId> {
        if !self.needs_snapshots()
            || tokens_in_state == 0
            || !tokens_in_state.is_multiple_of(self.block_size)
        {
            return None;
        }
        let &id = table.get(tokens_in_state / self.block_size - 1)?;
        let canonical = self.blocks[id as usize].chain.as_ref()?.canonical;
        let target = canonical.id;
        let b = &self.blocks[target as usize];
        // A canonical copy evicted meanwhile (other generation) is no hit target any more.
        if b.generation != canonical.generation || !b.published || b.snapshot.is_some() {
            return None;
        }
        let snap = match self.snap_free.pop() {
            Some(s) => s,
            None => self.evict_idle_snapshot()?,
        };
        self.snap_owner[snap as usize] = Some(target);
        self.blocks[target as usize].snapshot = Some(snap);
        Some(snap)
    }

    /// Frees a snapshot whose state could not be saved, so no hit resumes from it.
    pub fn discard_snapshot(&mut self, snap: SnapshotId) {
        if let Some(Some(owner)) = self.snap_owner.get(snap as usize).copied() {
            self.drop_snapshot_of(owner);
        }
    }

    /// Takes the snapshot of the least recently used idle block that has one.
    fn evict_idle_snapshot(&mut self) -> Option<SnapshotId> {
        let victim = self
            .lru
            .values()
            .copied()
            .find(|&id| self.blocks[id as usize].snapshot.is_some())?;
        self.drop_snapshot_of(victim);
        self.snap_free.pop()
    }

    fn drop_snapshot_of(&mut self, id: BlockId) {
        if let Some(snap) = self.blocks[id as usize].snapshot.take() {
            self.snap_owner[snap as usize] = None;
            self.snap_free.push(snap);
        }
    }

    pub fn stats(&self) -> CacheStats {
        CacheStats {
            blocks_free: self.free.len(),
            blocks_cached: self.lru.len(),
            blocks_used: self.blocks.len() - self.free.len() - self.lru.len(),
            snapshots_total: self.snap_owner.len(),
            snapshots_held: self.snap_owner.len() - self.snap_free.len(),
            ..self.stats
        }
    }
}

#[cfg(test)]
mod tests;
