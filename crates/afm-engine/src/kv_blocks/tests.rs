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
