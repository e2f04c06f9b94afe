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
mod tests {
    use super::*;

    /// A table for `tokens` with all of them computed and published, as after a finished prefill.
    fn computed(m: &mut BlockManager, tokens: &[u32]) -> Vec<BlockId> {
        let (mut table, cached) = acquire(m, tokens);
        m.grow(&mut table, tokens.len()).unwrap();
        assert!(cached <= tokens.len());
        m.publish_full_blocks(&table, tokens, tokens.len());
        table
    }

    /// `acquire_prefix` as (blocks, tokens).
    fn acquire(m: &mut BlockManager, tokens: &[u32]) -> (Vec<BlockId>, usize) {
        let hit = m.acquire_prefix(tokens);
        (hit.blocks, hit.tokens)
    }

    fn accounted(m: &BlockManager) -> usize {
        let s = m.stats();
        s.blocks_free + s.blocks_cached + s.blocks_used
    }

    #[test]
    fn grow_is_all_or_nothing() {
        let mut m = BlockManager::new(3, 4, true);
        let mut a = Vec::new();
        m.grow(&mut a, 9).unwrap();
        assert_eq!(a.len(), 3, "9 tokens need 3 blocks of 4");
        let mut b = vec![];
        assert_eq!(
            m.grow(&mut b, 1),
            Err(OutOfBlocks {
                needed: 1,
                available: 0
            })
        );
        assert!(b.is_empty());
        m.release(&mut a);
        m.grow(&mut a, 5).unwrap();
        let before = a.clone();
        assert!(m.grow(&mut a, 13).is_err(), "13 tokens need a 4th block");
        assert_eq!(a, before, "a failed grow leaves the table untouched");
        assert_eq!(accounted(&m), 3);
    }

    #[test]
    fn prefix_hit_shares_blocks_and_leaves_a_token_to_compute() {
        let mut m = BlockManager::new(8, 4, true);
        let prompt: Vec<u32> = (1..=10).collect();
        let a = computed(&mut m, &prompt);
        let mut other = prompt[..8].to_vec();
        other.extend([77, 78, 79]);
        let (hit, cached) = acquire(&mut m, &other);
        assert_eq!((hit.as_slice(), cached), (&a[..2], 8));
        assert_eq!(m.ref_count(a[0]), 2);
        assert_eq!(
            m.ref_count(a[2]),
            1,
            "the partial third block is never shared"
        );
        // The whole 8-token prompt is cached, yet one block is recomputed to get logits.
        let (hit, cached) = acquire(&mut m, &prompt[..8]);
        assert_eq!((hit.len(), cached), (1, 4));
        let s = m.stats();
        assert_eq!((s.hit_queries, s.hit_tokens), (2, 12));
    }

    #[test]
    fn publishes_only_full_blocks() {
        let mut m = BlockManager::new(4, 4, true);
        let tokens: Vec<u32> = (1..=7).collect();
        let mut table = Vec::new();
        m.grow(&mut table, 7).unwrap();
        m.publish_full_blocks(&table, &tokens, 7);
        assert!(m.is_published(table[0]));
        assert!(!m.is_published(table[1]), "block 1 holds 3 of 4 tokens");
        let probe: Vec<u32> = (1..=12).collect();
        assert_eq!(m.find_prefix(&probe).tokens, 4);
        // Computed tokens, not known tokens, decide: 8 known but 7 computed publishes nothing new.
        let eight: Vec<u32> = (1..=8).collect();
        m.publish_full_blocks(&table, &eight, 7);
        assert!(!m.is_published(table[1]));
        m.publish_full_blocks(&table, &eight, 8);
        assert!(m.is_published(table[1]));
        assert_eq!(m.find_prefix(&probe).tokens, 8);
    }

    #[test]
    fn hash_collision_is_caught_by_token_recheck() {
        let mut m = BlockManager::new(8, 2, true);
        m.hasher = |_, _| 42; // every block collides
        let a = computed(&mut m, &[1, 2, 3]);
        assert_eq!(
            acquire(&mut m, &[9, 9, 9]),
            (vec![], 0),
            "same hash, other tokens: miss"
        );
        assert_eq!(m.find_prefix(&[1, 2, 3]).blocks, vec![a[0]]);
    }

    #[test]
    fn collision_on_parent_is_caught_by_parent_recheck() {
        // The hash ignores the parent, so [5,6] after [1,2] and after [3,4] collide.
        let mut m = BlockManager::new(8, 2, true);
        m.hasher = |_, t| u64::from(t[0]);
        let mut a = computed(&mut m, &[1, 2, 5, 6, 0]);
        let mut d = computed(&mut m, &[3, 4, 5, 6, 0]);
        // d's [5,6] took the map slot; a's chain must not resume through it.
        assert_eq!(m.find_prefix(&[1, 2, 5, 6, 0]).blocks, vec![a[0]]);
        assert_eq!(m.find_prefix(&[3, 4, 5, 6, 0]).blocks, d[..2].to_vec());
        m.release(&mut a);
        m.release(&mut d);
        assert_eq!(accounted(&m), 8);
    }

    #[test]
    fn released_blocks_stay_hittable_until_evicted_oldest_first() {
        let mut m = BlockManager::new(4, 2, true);
        let mut a = computed(&mut m, &[1, 2, 3, 4]);
        let mut b = computed(&mut m, &[5, 6, 7, 8]);
        m.release(&mut a);
        m.release(&mut b);
        let s = m.stats();
        assert_eq!(
            (s.blocks_free, s.blocks_cached, s.blocks_used, m.num_free()),
            (0, 4, 0, 4)
        );
        assert_eq!(
            m.find_prefix(&[1, 2, 3, 4, 0]).tokens,
            4,
            "idle blocks still hit"
        );
        // Touch a's prefix again: a becomes most recently used, b is now the oldest.
        let (mut again, _) = acquire(&mut m, &[1, 2, 3, 4, 0]);
        m.release(&mut again);
        let mut x = Vec::new();
        m.grow(&mut x, 1).unwrap();
        // Within a table the tail goes first, so b's head block survives the first eviction.
        assert_eq!(m.find_prefix(&[5, 6, 7, 8, 0]).tokens, 2);
        m.grow(&mut x, 3).unwrap();
        assert_eq!(m.find_prefix(&[5, 6, 7, 8, 0]).tokens, 0);
        assert_eq!(m.find_prefix(&[1, 2, 3, 4, 0]).tokens, 4);
        m.grow(&mut x, 5).unwrap();
        assert_eq!(m.find_prefix(&[1, 2, 3, 4, 0]).tokens, 2);
        assert_eq!(accounted(&m), 4);
    }

    #[test]
    fn free_blocks_are_used_before_cached_ones() {
        let mut m = BlockManager::new(3, 2, true);
        let mut a = computed(&mut m, &[1, 2]);
        m.release(&mut a);
        let mut x = Vec::new();
        m.grow(&mut x, 4).unwrap();
        assert_eq!(
            m.find_prefix(&[1, 2, 0]).tokens,
            2,
            "two free blocks spared the cached one"
        );
    }

    #[test]
    fn duplicate_content_stays_private_and_chains_through_the_published_copy() {
        let mut m = BlockManager::new(8, 2, true);
        let tokens = [1, 2, 3, 4, 5];
        // Both computed the same prompt before either published.
        let (mut a, mut b) = (Vec::new(), Vec::new());
        m.grow(&mut a, 5).unwrap();
        m.grow(&mut b, 5).unwrap();
        m.publish_full_blocks(&a, &tokens, 4);
        m.publish_full_blocks(&b, &tokens, 4);
        assert!(!m.is_published(b[0]) && !m.is_published(b[1]));
        // b's next block still chains onto a's published copies.
        let more = [1, 2, 3, 4, 5, 6, 0];
        let mut b_ext = b.clone();
        m.grow(&mut b_ext, 6).unwrap();
        m.publish_full_blocks(&b_ext, &more, 6);
        assert_eq!(m.find_prefix(&more).blocks, vec![a[0], a[1], b_ext[2]]);
        m.release(&mut b_ext);
        assert_eq!(
            m.stats().blocks_free,
            8 - 3 - 1,
            "b's private duplicates went back free"
        );
        m.release(&mut a);
        let _ = b;
    }

    #[test]
    fn disabled_prefix_caching_never_hits() {
        let mut m = BlockManager::new(4, 2, false);
        let mut a = computed(&mut m, &[1, 2, 3]);
        m.release(&mut a);
        assert_eq!(acquire(&mut m, &[1, 2, 3]), (vec![], 0));
        assert_eq!(m.stats().blocks_free, 4);
    }

    #[test]
    fn reused_parent_block_does_not_revive_its_old_children() {
        // The hash ignores the parent, so only the parent's generation tells the chains apart.
        let mut m = BlockManager::new(3, 2, true);
        m.hasher = |_, t| u64::from(t[0]);
        let mut t = Vec::new();
        m.grow(&mut t, 4).unwrap();
        m.publish_full_blocks(&t, &[1, 2, 3, 4], 4);
        let (x, mut child) = (t[0], vec![t[1]]);
        m.release(&mut vec![x]); // parent idle in the LRU, child still held
        let (mut z, mut w) = (Vec::new(), Vec::new());
        m.grow(&mut z, 2).unwrap(); // the free block
        m.grow(&mut w, 2).unwrap(); // evicts the parent and reuses its id
        assert_eq!(w, vec![x]);
        m.publish_full_blocks(&w, &[7, 8], 2);
        // Same block id at the head, same tokens in the child, yet a different prefix.
        assert_eq!(m.find_prefix(&[7, 8, 3, 4, 0]).tokens, 2);
        for table in [&mut child, &mut z, &mut w] {
            m.release(table);
        }
        assert_eq!(accounted(&m), 3);
    }

    fn hybrid(num_blocks: usize, block_size: usize, snapshots: usize) -> BlockManager {
        BlockManager::new(num_blocks, block_size, true).with_state_snapshots(snapshots)
    }

    #[test]
    fn a_hybrid_hit_ends_at_the_last_block_with_a_snapshot() {
        let mut m = hybrid(8, 2, 2);
        let tokens: Vec<u32> = (1..=7).collect();
        let mut a = computed(&mut m, &tokens);
        let probe = [1, 2, 3, 4, 5, 6, 9];
        let none = m.find_prefix(&probe);
        assert_eq!((none.tokens, none.kv_tokens, none.snapshot), (0, 6, None));
        assert_eq!(m.attach_snapshot(&a, 3), None, "3 is no block boundary");
        assert_eq!(m.attach_snapshot(&a, 4), Some(0));
        assert_eq!(m.attach_snapshot(&a, 4), None, "one snapshot per block");
        let hit = m.find_prefix(&probe);
        assert_eq!(
            (
                hit.blocks.as_slice(),
                hit.tokens,
                hit.kv_tokens,
                hit.snapshot
            ),
            (&a[..2], 4, 6, Some(0))
        );
        // Idle blocks keep their snapshots; evicting a block frees its snapshot.
        m.release(&mut a);
        assert_eq!(m.find_prefix(&probe).snapshot, Some(0));
        let mut x = Vec::new();
        m.grow(&mut x, 16).unwrap();
        let s = m.stats();
        assert_eq!((s.snapshots_total, s.snapshots_held), (2, 0));
        assert_eq!(m.find_prefix(&probe).tokens, 0);
    }

    #[test]
    fn a_dry_snapshot_pool_takes_from_the_oldest_idle_block_never_a_held_one() {
        let mut m = hybrid(8, 2, 1);
        let mut a = computed(&mut m, &[1, 2, 3]);
        let b = computed(&mut m, &[5, 6, 7]);
        assert_eq!(m.attach_snapshot(&a, 2), Some(0));
        assert_eq!(m.attach_snapshot(&b, 2), None, "a still holds its block");
        let a0 = a[0];
        m.release(&mut a);
        assert_eq!(m.attach_snapshot(&b, 2), Some(0), "taken from idle a");
        assert_eq!(m.snapshot_of(a0), None);
        assert_eq!(m.find_prefix(&[1, 2, 0]).tokens, 0);
        assert_eq!(m.find_prefix(&[5, 6, 0]).tokens, 2);
        m.discard_snapshot(0);
        assert_eq!(
            m.find_prefix(&[5, 6, 0]).tokens,
            0,
            "a discarded snapshot is gone"
        );
        assert_eq!(m.stats().snapshots_held, 0);
    }

    #[test]
    fn a_duplicate_block_snapshots_onto_the_published_copy() {
        let mut m = hybrid(8, 2, 2);
        let tokens = [1, 2, 3];
        let (mut a, mut b) = (Vec::new(), Vec::new());
        m.grow(&mut a, 3).unwrap();
        m.grow(&mut b, 3).unwrap();
        m.publish_full_blocks(&a, &tokens, 2);
        m.publish_full_blocks(&b, &tokens, 2);
        assert!(!m.is_published(b[0]));
        assert_eq!(m.attach_snapshot(&b, 2), Some(0));
        assert_eq!(m.snapshot_of(a[0]), Some(0));
        assert_eq!(m.find_prefix(&[1, 2, 9]).blocks, vec![a[0]]);
        m.release(&mut a);
        m.release(&mut b);
        assert_eq!(accounted(&m), 8);
    }

    #[test]
    fn without_state_snapshots_no_snapshot_is_attached() {
        let mut m = BlockManager::new(4, 2, true);
        let a = computed(&mut m, &[1, 2, 3]);
        assert_eq!(m.attach_snapshot(&a, 2), None);
        assert_eq!(
            m.find_prefix(&[1, 2, 3]).tokens,
            2,
            "plain models hit on K/V alone"
        );
        let mut off = BlockManager::new(4, 2, false).with_state_snapshots(2);
        let b = computed(&mut off, &[1, 2, 3]);
        assert!(!off.needs_snapshots());
        assert_eq!(off.attach_snapshot(&b, 2), None);
    }
}
