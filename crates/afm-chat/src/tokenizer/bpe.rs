//! BPE merging of one pre-tokenized word: repeatedly merge the adjacent pair with the lowest merge
//! rank (ties: leftmost), as llama.cpp's `llm_tokenizer_bpe_session` and HF `tokenizers` both do.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

/// Merge table: (left id, right id) -> (rank, merged id).
pub(crate) type MergeTable = HashMap<(u32, u32), (u32, u32)>;

/// One symbol of a word being merged; `id` is `None` for a char the vocabulary lacks.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Symbol {
    pub id: Option<u32>,
    /// Byte range of the symbol in the word.
    pub start: usize,
    pub len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

impl Symbol {
    pub(crate) fn new(id: Option<u32>, start: usize, len: usize) -> Self {
        Self {
            id,
            start,
            len,
            prev: None,
            next: None,
        }
    }
}

/// Merges `symbols` in place and returns the survivors in order.
pub(crate) fn merge(mut symbols: Vec<Symbol>, merges: &MergeTable) -> Vec<Symbol> {
    let n = symbols.len();
    for (i, s) in symbols.iter_mut().enumerate() {
        s.prev = i.checked_sub(1);
        s.next = (i + 1 < n).then_some(i + 1);
    }
    // Heap entries: (rank, left index, left id, right id); outdated entries are skipped on pop.
    let mut heap: BinaryHeap<Reverse<(u32, usize, u32, u32)>> = BinaryHeap::new();
    let push = |heap: &mut BinaryHeap<_>, symbols: &[Symbol], left: usize| {
        let Some(right) = symbols[left].next else {
            return;
        };
        if let (Some(a), Some(b)) = (symbols[left].id, symbols[right].id) {
            if let Some(&(rank, _)) = merges.get(&(a, b)) {
                heap.push(Reverse((rank, left, a, b)));
            }
        }
    };
    for i in 0..n.saturating_sub(1) {
        push(&mut heap, &symbols, i);
    }
    while let Some(Reverse((_, left, a, b))) = heap.pop() {
        let Some(right) = symbols[left].next else {
            continue;
        };
        if symbols[left].len == 0 || symbols[left].id != Some(a) || symbols[right].id != Some(b) {
            continue;
        }
        let Some(&(_, merged)) = merges.get(&(a, b)) else {
            continue;
        };
        symbols[left].id = Some(merged);
        symbols[left].len += symbols[right].len;
        symbols[right].len = 0;
        symbols[left].next = symbols[right].next;
        if let Some(nn) = symbols[right].next {
            symbols[nn].prev = Some(left);
        }
        if let Some(p) = symbols[left].prev {
            push(&mut heap, &symbols, p);
        }
        push(&mut heap, &symbols, left);
    }
    symbols.into_iter().filter(|s| s.len > 0).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lowest_rank_wins_then_leftmost() {
        // ids: a=0 b=1 ab=2 bb=3 abb=4; merges: (b,b)->bb rank 0, (a,b)->ab rank 1, (a,bb)->abb rank 2
        let merges: MergeTable = [((1, 1), (0, 3)), ((0, 1), (1, 2)), ((0, 3), (2, 4))]
            .into_iter()
            .collect();
        let syms = vec![
            Symbol::new(Some(0), 0, 1),
            Symbol::new(Some(1), 1, 1),
            Symbol::new(Some(1), 2, 1),
        ];
        let out: Vec<_> = merge(syms, &merges).iter().map(|s| s.id).collect();
        assert_eq!(out, [Some(4)]);
        let syms = vec![
            Symbol::new(Some(1), 0, 1),
            Symbol::new(Some(1), 1, 1),
            Symbol::new(Some(1), 2, 1),
        ];
        let out: Vec<_> = merge(syms, &merges).iter().map(|s| s.id).collect();
        assert_eq!(out, [Some(3), Some(1)]);
    }
}
