//! Low-level scanning shared by the dialect bodies: marker search that holds back a possible
//! partial marker, whitespace peeking, and an incremental JSON value scanner that knows when
//! a value ends (string and escape aware, so `}` or `</tool_call>` inside a string never do).

/// Does `input` start with `marker`, or could it once more input arrives?
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Peek {
    Yes,
    Maybe,
    No,
}

pub(crate) fn peek(input: &str, marker: &str) -> Peek {
    if input.starts_with(marker) {
        Peek::Yes
    } else if marker.starts_with(input) {
        Peek::Maybe
    } else {
        Peek::No
    }
}

/// The first of `markers` that `input` starts with (its index); `Err(true)` when one of them
/// may still follow (input is a proper prefix), `Err(false)` when none can.
pub(crate) fn peek_any(input: &str, markers: &[&str]) -> Result<usize, bool> {
    let mut maybe = false;
    for (i, m) in markers.iter().enumerate() {
        match peek(input, m) {
            Peek::Yes => return Ok(i),
            Peek::Maybe => maybe = true,
            Peek::No => {}
        }
    }
    Err(maybe)
}

/// Byte length of leading whitespace.
pub(crate) fn ws_len(input: &str) -> usize {
    input.len() - input.trim_start().len()
}

/// Length of the longest suffix of `s` that is a proper prefix of one of `markers`: the part
/// that must be held back because a marker may be starting there.
pub(crate) fn partial_suffix_len(s: &str, markers: &[&str]) -> usize {
    let longest = markers.iter().map(|m| m.len()).max().unwrap_or(0);
    let mut from = s.len().saturating_sub(longest.saturating_sub(1));
    while !s.is_char_boundary(from) {
        from += 1;
    }
    for (i, _) in s[from..].char_indices() {
        let tail = &s[from + i..];
        if markers
            .iter()
            .any(|m| m.len() > tail.len() && m.starts_with(tail))
        {
            return tail.len();
        }
    }
    0
}

/// Where `marker` is in `input`: `Ok(at)`, or `Err(safe)` with the length that can be passed
/// on because no marker can start in it.
pub(crate) fn find_marker(input: &str, marker: &str) -> Result<usize, usize> {
    match input.find(marker) {
        Some(at) => Ok(at),
        None => Err(input.len() - partial_suffix_len(input, &[marker])),
    }
}

/// Reads up to `end`; `Some((text, consumed))` with `end` consumed, `None` if it has not
/// arrived yet.
pub(crate) fn read_until<'a>(input: &'a str, end: &str) -> Option<(&'a str, usize)> {
    input.find(end).map(|at| (&input[..at], at + end.len()))
}

/// How a [`JsonScan::feed`] call ended.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum ScanEnd {
    /// The value is complete.
    Done,
    /// Everything shown was consumed (or held back); more is needed.
    More,
    /// A stop marker appeared outside any string: the value was cut off.
    Stopped,
}

/// Incremental scanner for one JSON value (object, array, string or scalar). Single quotes
/// also delimit strings: valid JSON never has one outside a string, and models that write
/// Python-style dicts then still end where they should.
#[derive(Debug, Default)]
pub(crate) struct JsonScan {
    depth: usize,
    quote: Option<u8>,
    escape: bool,
    started: bool,
    scalar: bool,
    /// The value is a string (its end is its closing quote).
    pub(crate) is_string: bool,
}

impl JsonScan {
    /// Consumes the value's bytes from `input` (which must not start with whitespace when the
    /// value has not started). Stops, without consuming, at any of `stops` met outside a
    /// string, holding back a possible partial stop at the end of input unless `eof`.
    pub(crate) fn feed(&mut self, input: &str, stops: &[&str], eof: bool) -> (usize, ScanEnd) {
        let b = input.as_bytes();
        let mut i = 0;
        while i < b.len() {
            let c = b[i];
            if let Some(q) = self.quote {
                if self.escape {
                    self.escape = false;
                } else if c == b'\\' {
                    self.escape = true;
                } else if c == q {
                    self.quote = None;
                    if self.depth == 0 {
                        return (i + 1, ScanEnd::Done);
                    }
                }
                i += 1;
                continue;
            }
            if self.scalar {
                if matches!(c, b',' | b'}' | b']' | b'<' | b'[') || c.is_ascii_whitespace() {
                    return (i, ScanEnd::Done);
                }
                i += 1;
                continue;
            }
            if input.is_char_boundary(i) && stops.iter().any(|m| m.as_bytes().first() == Some(&c)) {
                let tail = &input[i..];
                if stops.iter().any(|m| tail.starts_with(m)) {
                    return (i, ScanEnd::Stopped);
                }
                if !eof && stops.iter().any(|m| m.starts_with(tail)) {
                    return (i, ScanEnd::More);
                }
            }
            if !self.started {
                self.started = true;
                match c {
                    b'{' | b'[' => self.depth = 1,
                    b'"' | b'\'' => {
                        self.quote = Some(c);
                        self.is_string = true;
                    }
                    _ => self.scalar = true,
                }
                i += 1;
                continue;
            }
            match c {
                b'{' | b'[' => self.depth += 1,
                b'}' | b']' => {
                    self.depth = self.depth.saturating_sub(1);
                    if self.depth == 0 {
                        return (i + 1, ScanEnd::Done);
                    }
                }
                b'"' | b'\'' => self.quote = Some(c),
                _ => {}
            }
            i += 1;
        }
        if self.scalar && eof {
            return (b.len(), ScanEnd::Done);
        }
        (b.len(), ScanEnd::More)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partial_suffix_holds_back_only_marker_prefixes() {
        assert_eq!(partial_suffix_len("abc<tool", &["<tool_call>"]), 5);
        assert_eq!(partial_suffix_len("abc<", &["<tool_call>"]), 1);
        assert_eq!(partial_suffix_len("abc<x", &["<tool_call>"]), 0);
        assert_eq!(partial_suffix_len("<tool_call>", &["<tool_call>"]), 0);
        assert_eq!(partial_suffix_len("é<｜DSML", &["<｜DSML｜tool_calls>"]), 8);
    }

    #[test]
    fn json_scan_ignores_closers_inside_strings() {
        let text = r#"{"a": "}</tool_call>\"}", "b": [1, {"c": 2}]} tail"#;
        let mut s = JsonScan::default();
        let (n, end) = s.feed(text, &["</tool_call>"], false);
        assert_eq!(end, ScanEnd::Done);
        assert_eq!(&text[n..], " tail");
    }

    #[test]
    fn json_scan_stops_at_a_closer_outside_strings() {
        let mut s = JsonScan::default();
        let (n, end) = s.feed(r#"{"a": 1</tool_call>"#, &["</tool_call>"], false);
        assert_eq!((n, end), (7, ScanEnd::Stopped));
        let mut s = JsonScan::default();
        let (n, end) = s.feed(r#"{"a": 1</to"#, &["</tool_call>"], false);
        assert_eq!((n, end), (7, ScanEnd::More));
    }
}
