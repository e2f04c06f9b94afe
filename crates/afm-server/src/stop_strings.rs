//! Stop strings matched on the generated text as it streams, across token boundaries. Text
//! that might be the start of a stop string is held back until it is known not to be, so a
//! stop string (and anything after it) is never emitted.

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopOutcome {
    /// Safe to emit; no stop string seen yet.
    Emit(String),
    /// A stop string was found: emit this text (what preceded it) and end the generation.
    Stopped(String),
}

#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> Self {
        StopMatcher {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            held: String::new(),
        }
    }

    pub fn push(&mut self, piece: &str) -> StopOutcome {
        if self.stops.is_empty() {
            return StopOutcome::Emit(piece.to_string());
        }
        self.held.push_str(piece);
        // Earlier pushes held no complete stop string, so the earliest match is the one to cut at.
        let first = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min();
        if let Some(at) = first {
            let before = self.held[..at].to_string();
            self.held.clear();
            return StopOutcome::Stopped(before);
        }
        let keep = self.partial_suffix_len();
        let emit_to = self.held.len() - keep;
        let emitted = self.held[..emit_to].to_string();
        self.held.drain(..emit_to);
        StopOutcome::Emit(emitted)
    }

    /// Releases held text at the end of generation (it never completed a stop string).
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// Length of the longest suffix of `held` that is a proper prefix of some stop string.
    fn partial_suffix_len(&self) -> usize {
        self.stops
            .iter()
            .filter_map(|stop| {
                (1..stop.len())
                    .rev()
                    .filter(|&k| stop.is_char_boundary(k))
                    .find(|&k| self.held.ends_with(&stop[..k]))
            })
            .max()
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for p in pieces {
            match m.push(p) {
                StopOutcome::Emit(t) => out.push_str(&t),
                StopOutcome::Stopped(t) => {
                    out.push_str(&t);
                    return (out, true);
                }
            }
        }
        out.push_str(&m.finish());
        (out, false)
    }

    #[test]
    fn stop_across_token_boundaries_is_not_emitted() {
        assert_eq!(
            run(&["END"], &["Hello E", "N", "D more"]),
            ("Hello ".into(), true)
        );
        assert_eq!(run(&["\n\n"], &["a\n", "\nb"]), ("a".into(), true));
    }

    #[test]
    fn false_starts_are_released() {
        assert_eq!(
            run(&["END"], &["Hello E", "N", "d"]),
            ("Hello ENd".into(), false)
        );
        assert_eq!(run(&["END"], &["xEN"]), ("xEN".into(), false));
    }

    #[test]
    fn earliest_stop_wins_and_held_text_waits() {
        let mut m = StopMatcher::new(vec!["bc".into(), "abcd".into()]);
        assert_eq!(m.push("xa"), StopOutcome::Emit("x".into()));
        // "abcd" starts before "bc": nothing more is emitted.
        assert_eq!(m.push("bcd"), StopOutcome::Stopped(String::new()));
    }

    #[test]
    fn unicode_stop_strings() {
        assert_eq!(run(&["été"], &["un é", "t", "é!"]), ("un ".into(), true));
        assert_eq!(run(&["é"], &["caf", "é"]), ("caf".into(), true));
    }

    #[test]
    fn no_stops_passes_through() {
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), false));
    }
}
