//! Decoding checked bit for bit against gguf-py's own dequantizer
//! (fixture written by `tests/gen_quant_fixtures.py`).

use super::dequantize_row;
use crate::DType;

struct Case {
    label: String,
    dtype: DType,
    raw: Vec<u8>,
    want: Vec<f32>,
}

fn u32_at(b: &[u8], at: &mut usize) -> u32 {
    let v = u32::from_le_bytes(b[*at..*at + 4].try_into().expect("4 bytes"));
    *at += 4;
    v
}

fn fixture_cases() -> Vec<Case> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/quant_rows.bin");
    let b = std::fs::read(path).expect("fixture present (tests/gen_quant_fixtures.py)");
    assert_eq!(&b[0..4], b"AFMQ");
    let mut at = 4;
    assert_eq!(u32_at(&b, &mut at), 1, "fixture version");
    let count = u32_at(&b, &mut at) as usize;
    let mut cases = Vec::with_capacity(count);
    for _ in 0..count {
        let id = u32_at(&b, &mut at);
        let n = u32_at(&b, &mut at) as usize;
        let nb = u32_at(&b, &mut at) as usize;
        let nl = u32_at(&b, &mut at) as usize;
        let label = String::from_utf8(b[at..at + nl].to_vec()).expect("utf-8 label");
        at += nl;
        let raw = b[at..at + nb].to_vec();
        at += nb;
        let want = b[at..at + 4 * n]
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        at += 4 * n;
        let dtype = DType::from_ggml_id(id).expect("fixture type is one afm supports");
        cases.push(Case {
            label,
            dtype,
            raw,
            want,
        });
    }
    assert_eq!(at, b.len(), "trailing bytes in fixture");
    cases
}

#[test]
fn dequantize_matches_gguf_py_bit_for_bit() {
    let cases = fixture_cases();
    let mut seen = std::collections::HashSet::new();
    for c in &cases {
        let mut got = vec![f32::NAN; c.want.len()];
        dequantize_row(c.dtype, &c.raw, &mut got);
        for (i, (g, w)) in got.iter().zip(&c.want).enumerate() {
            assert_eq!(
                g.to_bits(),
                w.to_bits(),
                "{}: element {i}: got {g}, gguf-py {w}",
                c.label
            );
        }
        seen.insert(c.dtype);
    }
    for dtype in DType::ALL {
        assert!(
            seen.contains(&dtype),
            "fixture has no {} rows",
            dtype.name()
        );
    }
}
