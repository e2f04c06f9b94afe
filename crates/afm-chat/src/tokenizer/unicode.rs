//! Codepoint classification and the GPT-2 byte<->unicode map, as llama.cpp's pre-tokenizers see them.
//! Owns no tokenizer state; the tables come from `unicode_data.rs` (generated).

use super::unicode_data::{CATEGORY_RUNS, WHITESPACE};
use std::sync::OnceLock;

/// Unicode general category class of a codepoint (llama.cpp's `unicode_cpt_flags` categories).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Category {
    Number,
    Letter,
    Separator,
    Mark,
    Punctuation,
    Symbol,
    Control,
}

pub(crate) fn category(cp: u32) -> Category {
    let idx = CATEGORY_RUNS.partition_point(|&(start, _)| start <= cp);
    // idx >= 1 because the first run starts at 0.
    match CATEGORY_RUNS[idx.saturating_sub(1)].1 {
        1 => Category::Number,
        2 => Category::Letter,
        3 => Category::Separator,
        4 => Category::Mark,
        5 => Category::Punctuation,
        6 => Category::Symbol,
        _ => Category::Control,
    }
}

pub(crate) fn is_whitespace(cp: u32) -> bool {
    WHITESPACE.binary_search(&cp).is_ok()
}

/// Per-codepoint flags used by the hand-written gpt2/llama3 splitters. `None` (out of the
/// fragment) reads as "no flags", like llama.cpp's OUT_OF_RANGE position.
#[derive(Clone, Copy, Default)]
pub(crate) struct Flags {
    pub present: bool,
    pub letter: bool,
    pub number: bool,
    pub whitespace: bool,
}

pub(crate) fn flags(cp: Option<u32>) -> Flags {
    match cp {
        None => Flags::default(),
        Some(cp) => {
            let cat = category(cp);
            Flags {
                present: true,
                letter: cat == Category::Letter,
                number: cat == Category::Number,
                whitespace: is_whitespace(cp),
            }
        }
    }
}

/// GPT-2's reversible byte -> printable-char map used by byte-level BPE vocabularies.
pub(crate) fn byte_to_char(b: u8) -> char {
    byte_tables().0[b as usize]
}

/// Inverse of [`byte_to_char`]; `None` for chars outside the 256 mapped ones.
pub(crate) fn char_to_byte(c: char) -> Option<u8> {
    let cp = c as u32;
    if cp >= 512 {
        return None;
    }
    byte_tables().1[cp as usize]
}

type ByteTables = ([char; 256], [Option<u8>; 512]);

fn byte_tables() -> &'static ByteTables {
    static TABLES: OnceLock<ByteTables> = OnceLock::new();
    TABLES.get_or_init(|| {
        let mut fwd = ['\0'; 256];
        let mut inv = [None; 512];
        let printable = |b: u32| {
            (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b)
        };
        let mut n = 0;
        for b in 0..256u32 {
            let cp = if printable(b) {
                b
            } else {
                n += 1;
                255 + n
            };
            let c = char::from_u32(cp).expect("codepoints below 512 are valid chars");
            fwd[b as usize] = c;
            inv[cp as usize] = Some(b as u8);
        }
        (fwd, inv)
    })
}

/// Byte-level encoding of a UTF-8 piece (each byte becomes one printable char).
pub(crate) fn byte_encode(piece: &str, out: &mut String) {
    for &b in piece.as_bytes() {
        out.push(byte_to_char(b));
    }
}

/// Length of the UTF-8 sequence started by byte `b`, llama.cpp's `unicode_len_utf8`.
pub(crate) fn utf8_len(b: u8) -> usize {
    const LOOKUP: [usize; 16] = [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4];
    LOOKUP[(b >> 4) as usize]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn categories_of_common_chars() {
        assert_eq!(category('a' as u32), Category::Letter);
        assert_eq!(category('7' as u32), Category::Number);
        assert_eq!(category('中' as u32), Category::Letter);
        assert_eq!(category('!' as u32), Category::Punctuation);
        assert_eq!(category('$' as u32), Category::Symbol);
        assert_eq!(category('\u{301}' as u32), Category::Mark);
        assert_eq!(category(0x1F600), Category::Symbol);
        assert!(is_whitespace(' ' as u32) && is_whitespace(0x3000) && !is_whitespace(0x1C));
    }

    #[test]
    fn byte_map_round_trips() {
        assert_eq!(byte_to_char(b' '), 'Ġ');
        assert_eq!(byte_to_char(b'\n'), 'Ċ');
        for b in 0..=255u8 {
            assert_eq!(char_to_byte(byte_to_char(b)), Some(b));
        }
    }
}
