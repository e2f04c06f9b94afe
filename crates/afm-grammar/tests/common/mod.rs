//! What the walk tests share: a reproducible RNG and a random walker that picks uniformly among
//! a constraint's allowed tokens on a real vocabulary (a random-weight model with that
//! vocabulary, in effect), steered toward closing what is open so that walks end.

use std::path::PathBuf;

use afm_chat::Tokenizer;
use afm_engine::TokenConstraint;
use afm_grammar::Compiled;

/// The workspace root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// SmolLM2's tokenizer (committed fixture).
pub fn smollm2() -> Tokenizer {
    Tokenizer::from_hf_dir(&root().join("tests/fixtures/tokenizer/smollm2")).expect("tokenizer")
}

/// xorshift64*: reproducible walks without a dependency.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    pub fn chance(&mut self, p: f64) -> bool {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64 > 1.0 - p
    }
}

/// What closes things the walk may be inside of: element closers of every dialect, string
/// delimiters, JSON closers.
pub const CLOSERS: [&str; 17] = [
    "\n</parameter>\n",
    "</parameter>\n",
    "</arg_value>",
    "</｜DSML｜parameter>\n",
    "<|\"|>",
    "\"",
    "}",
    "]",
    "\n</tool_call>",
    "</function>",
    "<tool_call|>",
    ",",
    "</invoke>\n</minimax:tool_call>",
    "<|tool_calls_section_end|>",
    "<｜tool▁calls▁end｜>",
    "</｜DSML｜invoke>\n</｜DSML｜function_calls>",
    "</｜DSML｜invoke>\n</｜DSML｜tool_calls>",
];

pub struct Walker<'a> {
    tok: &'a Tokenizer,
    bytes: Vec<Vec<u8>>,
    eos: Vec<u32>,
}

impl<'a> Walker<'a> {
    pub fn new(tok: &'a Tokenizer) -> Self {
        let bytes = (0..tok.vocab_size() as u32)
            .map(|id| tok.token_bytes(id))
            .collect();
        Walker {
            tok,
            bytes,
            eos: tok.eos_ids().to_vec(),
        }
    }

    /// Allowed tokens that continue closing something: a token that is a prefix of what is
    /// left of a closer whose start the text already ends with (possibly nothing yet); those
    /// that continue the furthest-along closer win, so a closer once begun gets finished.
    fn closing(&self, out: &[u8], allowed: &[u32]) -> Vec<u32> {
        let mut found: Vec<(usize, u32)> = Vec::new();
        for c in CLOSERS.iter().map(|c| c.as_bytes()) {
            let done = (0..c.len())
                .rev()
                .find(|&k| out.ends_with(&c[..k]))
                .unwrap_or(0);
            let rest = &c[done..];
            for &id in allowed {
                let b = &self.bytes[id as usize];
                if !b.is_empty() && rest.starts_with(b) {
                    found.push((done, id));
                }
            }
        }
        let top = found.iter().map(|f| f.0).max().unwrap_or(0);
        found
            .into_iter()
            .filter(|f| f.0 == top)
            .map(|f| f.1)
            .collect()
    }

    /// One walk through a fresh constraint of `compiled` (no reasoning gate): its text, or `None`
    /// after printing the tail of a walk that did not end (`label` names the grammar).
    pub fn walk_once(&self, compiled: &Compiled, rng: &mut Rng, label: &str) -> Option<String> {
        let mut con = compiled.constraint(false, false);
        match self.walk(con.as_mut(), rng) {
            Ok(text) => Some(text),
            Err(partial) => {
                let tail: String = partial.chars().rev().take(300).collect();
                let tail: String = tail.chars().rev().collect();
                eprintln!("{label}: a walk did not end: …{tail:?}");
                None
            }
        }
    }

    /// One walk; Err(text so far) if it did not end within the step budget.
    pub fn walk(&self, c: &mut dyn TokenConstraint, rng: &mut Rng) -> Result<String, String> {
        let n = self.tok.vocab_size();
        let mut out: Vec<u8> = Vec::new();
        for step in 0..4000 {
            let mut bits = vec![0u32; n.div_ceil(32)];
            assert!(c.allowed(&mut bits).expect("mask"), "constrained");
            let allowed: Vec<u32> = (0..n as u32)
                .filter(|&i| bits[i as usize / 32] & (1 << (i % 32)) != 0)
                .collect();
            assert!(
                !allowed.is_empty(),
                "dead end after {:?}",
                String::from_utf8_lossy(&out)
            );
            let eos = allowed.iter().find(|t| self.eos.contains(t)).copied();
            let text: Vec<u32> = allowed
                .iter()
                .copied()
                .filter(|t| !self.eos.contains(t))
                .collect();
            let pick = match eos {
                Some(e) if text.is_empty() || rng.chance(0.5) => e,
                _ => {
                    let steer = (step as f64 / 40.0).min(0.85);
                    let closing = match rng.chance(steer) {
                        true => self.closing(&out, &text),
                        false => Vec::new(),
                    };
                    match closing.is_empty() {
                        true => text[rng.below(text.len())],
                        false => closing[rng.below(closing.len())],
                    }
                }
            };
            c.commit(pick).expect("commit");
            if self.eos.contains(&pick) {
                return Ok(String::from_utf8(out).expect("utf-8"));
            }
            out.extend_from_slice(&self.bytes[pick as usize]);
            if c.is_finished() {
                return Ok(String::from_utf8(out).expect("utf-8"));
            }
        }
        Err(String::from_utf8_lossy(&out).into_owned())
    }
}
