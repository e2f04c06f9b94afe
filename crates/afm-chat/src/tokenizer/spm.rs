//! SentencePiece-style tokenization (llama.cpp's `llm_tokenizer_spm`): start from UTF-8 chars,
//! repeatedly merge the adjacent pair whose concatenation is the vocabulary token with the highest
//! score (ties: leftmost), and spell chars the vocabulary lacks as `<0xNN>` byte tokens.

use super::unicode::utf8_len;
use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

struct Sym {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    size: usize,
}

impl PartialEq for Bigram {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == Ordering::Equal
    }
}
impl Eq for Bigram {}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Bigram {
    // Max-heap: higher score first, then lower left index.
    fn cmp(&self, o: &Self) -> Ordering {
        self.score
            .total_cmp(&o.score)
            .then_with(|| o.left.cmp(&self.left))
    }
}

/// Tokenizes `text` (spaces already escaped to U+2581) and appends the ids to `out`.
pub(crate) fn tokenize(
    text: &str,
    ids: &HashMap<String, u32>,
    scores: &[f32],
    byte_token: &dyn Fn(u8) -> Option<u32>,
    out: &mut Vec<u32>,
) {
    let bytes = text.as_bytes();
    let mut syms = Vec::new();
    let mut offs = 0;
    while offs < bytes.len() {
        let len = utf8_len(bytes[offs]).min(bytes.len() - offs);
        syms.push(Sym {
            start: offs,
            len,
            prev: syms.len().checked_sub(1),
            next: None,
        });
        offs += len;
    }
    let n = syms.len();
    for (i, s) in syms.iter_mut().enumerate() {
        s.next = (i + 1 < n).then_some(i + 1);
    }
    let mut heap = BinaryHeap::new();
    let try_add =
        |heap: &mut BinaryHeap<Bigram>, syms: &[Sym], left: Option<usize>, right: Option<usize>| {
            let (Some(l), Some(r)) = (left, right) else {
                return;
            };
            let (start, size) = (syms[l].start, syms[l].len + syms[r].len);
            // Symbols are contiguous in the text, so the pair is one slice.
            let Some(piece) = text.get(start..start + size) else {
                return;
            };
            if let Some(&id) = ids.get(piece) {
                let score = scores.get(id as usize).copied().unwrap_or(0.0);
                heap.push(Bigram {
                    score,
                    left: l,
                    right: r,
                    size,
                });
            }
        };
    for i in 1..n {
        try_add(&mut heap, &syms, Some(i - 1), Some(i));
    }
    while let Some(b) = heap.pop() {
        let (l, r) = (b.left, b.right);
        if syms[l].len == 0 || syms[r].len == 0 || syms[l].len + syms[r].len != b.size {
            continue;
        }
        syms[l].len += syms[r].len;
        syms[r].len = 0;
        syms[l].next = syms[r].next;
        if let Some(nn) = syms[r].next {
            syms[nn].prev = Some(l);
        }
        try_add(&mut heap, &syms, syms[l].prev, Some(l));
        try_add(&mut heap, &syms, Some(l), syms[l].next);
    }
    let mut i = if n > 0 { Some(0) } else { None };
    while let Some(idx) = i {
        let s = &syms[idx];
        let piece = &bytes[s.start..s.start + s.len];
        match std::str::from_utf8(piece).ok().and_then(|p| ids.get(p)) {
            Some(&id) => out.push(id),
            // Merged symbols are always tokens, so only single chars reach the byte fallback.
            None => out.extend(piece.iter().filter_map(|&b| byte_token(b))),
        }
        i = s.next;
    }
}
