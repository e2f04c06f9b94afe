//! Splits generated text into `reasoning_content` and `content` at `<think>…</think>`, as it
//! streams. The opening tag is recognised the moment it arrives ("eager reasoning tag": the
//! client sees a reasoning delta at once), and a `<think>` already opened by the chat template's
//! generation prompt starts the answer in reasoning. The open tag counts only before any
//! visible content, so an answer that talks about `<think>` tags is left alone.
//!
//! ```text
//!   [ws] <think> [ws] reasoning … </think> [ws] content …
//!   └ Start ┘    └─ Reasoning ───────────┘ └ AfterThink ┘└ Content
//! ```

pub const OPEN: &str = "<think>";
pub const CLOSE: &str = "</think>";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Nothing visible yet: an opening tag may still come.
    Start,
    Reasoning,
    /// Just closed: leading whitespace of the answer is dropped.
    AfterThink,
    Content,
}

/// Text of one step, split.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Split {
    pub reasoning: String,
    pub content: String,
    /// The opening tag was recognised in this step (send a reasoning delta even if empty).
    pub opened: bool,
}

#[derive(Debug, Clone)]
pub struct ReasoningSplitter {
    state: State,
    held: String,
    /// Right after an open tag: leading whitespace of the reasoning is dropped.
    reasoning_started: bool,
}

impl ReasoningSplitter {
    /// `opened_by_template`: the rendered prompt ends inside `<think>`.
    pub fn new(opened_by_template: bool) -> Self {
        ReasoningSplitter {
            state: if opened_by_template {
                State::Reasoning
            } else {
                State::Start
            },
            held: String::new(),
            reasoning_started: false,
        }
    }

    /// Whether the prompt leaves the model inside a reasoning block.
    pub fn prompt_opens_reasoning(prompt: &str) -> bool {
        let tail = prompt.trim_end();
        tail.ends_with(OPEN)
    }

    pub fn push(&mut self, piece: &str) -> Split {
        self.held.push_str(piece);
        let mut out = Split::default();
        while self.step(&mut out) {}
        out
    }

    /// Releases held text at the end (an unfinished tag is plain text).
    pub fn finish(&mut self) -> Split {
        let mut out = Split::default();
        let rest = std::mem::take(&mut self.held);
        match self.state {
            State::Reasoning => self.reasoning_text(&mut out, &rest),
            State::AfterThink => out.content.push_str(rest.trim_start()),
            State::Start | State::Content => out.content.push_str(&rest),
        }
        out
    }

    /// Consumes what it can from `held`; true when the state changed and another pass may help.
    fn step(&mut self, out: &mut Split) -> bool {
        match self.state {
            State::Start => {
                let trimmed = self.held.trim_start();
                if let Some(rest) = trimmed.strip_prefix(OPEN) {
                    self.held = rest.to_string();
                    self.state = State::Reasoning;
                    out.opened = true;
                    return true;
                }
                if !trimmed.is_empty() && !OPEN.starts_with(trimmed) {
                    self.state = State::Content;
                    return true;
                }
                false // only whitespace or a partial tag so far
            }
            State::Reasoning => {
                if let Some(at) = self.held.find(CLOSE) {
                    let before = self.held[..at].to_string();
                    self.reasoning_text(out, &before);
                    self.held.drain(..at + CLOSE.len());
                    self.state = State::AfterThink;
                    return true;
                }
                let keep = partial_suffix(&self.held, CLOSE);
                let text: String = self.held.drain(..self.held.len() - keep).collect();
                self.reasoning_text(out, &text);
                false
            }
            State::AfterThink => {
                let trimmed = self.held.trim_start();
                if trimmed.is_empty() {
                    self.held.clear();
                    return false;
                }
                self.held = trimmed.to_string();
                self.state = State::Content;
                true
            }
            State::Content => {
                out.content.push_str(&self.held);
                self.held.clear();
                false
            }
        }
    }

    fn reasoning_text(&mut self, out: &mut Split, text: &str) {
        let text = if self.reasoning_started {
            text
        } else {
            text.trim_start()
        };
        if !text.is_empty() {
            self.reasoning_started = true;
            out.reasoning.push_str(text);
        }
    }
}

/// Length of the longest suffix of `text` that is a proper prefix of `tag`.
fn partial_suffix(text: &str, tag: &str) -> usize {
    (1..tag.len())
        .rev()
        .find(|&k| text.ends_with(&tag[..k]))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(template_opened: bool, pieces: &[&str]) -> (String, String, usize) {
        let mut s = ReasoningSplitter::new(template_opened);
        let (mut r, mut c, mut opened_at) = (String::new(), String::new(), usize::MAX);
        for (i, p) in pieces.iter().enumerate() {
            let out = s.push(p);
            if out.opened {
                opened_at = i;
            }
            r += &out.reasoning;
            c += &out.content;
        }
        let out = s.finish();
        (r + &out.reasoning, c + &out.content, opened_at)
    }

    #[test]
    fn splits_think_block_across_pieces() {
        let (r, c, opened) = run(
            false,
            &["<th", "ink>\nLet me", " think.</th", "ink>\n\nHi!"],
        );
        assert_eq!((r.as_str(), c.as_str()), ("Let me think.", "Hi!"));
        assert_eq!(
            opened, 1,
            "the open tag is recognised as soon as it completes"
        );
    }

    #[test]
    fn eager_open_tag_reports_before_any_reasoning_text() {
        let mut s = ReasoningSplitter::new(false);
        let out = s.push("<think>");
        assert!(out.opened);
        assert_eq!((out.reasoning.as_str(), out.content.as_str()), ("", ""));
    }

    #[test]
    fn template_opened_think() {
        let (r, c, _) = run(true, &["plan", "</think>", "answer"]);
        assert_eq!((r.as_str(), c.as_str()), ("plan", "answer"));
        assert!(ReasoningSplitter::prompt_opens_reasoning(
            "<|im_start|>assistant\n<think>\n"
        ));
    }

    #[test]
    fn plain_answers_and_late_tags_are_content() {
        assert_eq!(run(false, &["Hello", " world"]).1, "Hello world");
        let (r, c, _) = run(false, &["Use ", "<think> tags"]);
        assert_eq!((r.as_str(), c.as_str()), ("", "Use <think> tags"));
        // Leading whitespace before a plain answer is kept.
        assert_eq!(run(false, &["  ", "x"]).1, "  x");
    }

    #[test]
    fn unfinished_reasoning_stays_reasoning() {
        let (r, c, _) = run(false, &["<think>still going</thi"]);
        assert_eq!((r.as_str(), c.as_str()), ("still going</thi", ""));
    }
}
