//! Usage and timing of a whole request, summed over its choices: each distinct prompt counts
//! once, as in OpenAI; times are the slowest choice's (choices run side by side).

use std::collections::BTreeMap;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use afm_api::Usage;
use rand::distributions::Alphanumeric;
use rand::Rng;

use crate::generation::ChoiceStats;

#[derive(Debug, Clone)]
pub struct UsageAcc {
    started: Instant,
    /// prompt index → (prompt tokens, cached tokens)
    prompts: BTreeMap<usize, (usize, usize)>,
    completion_tokens: usize,
    prompt_time: f64,
    completion_time: f64,
}

impl UsageAcc {
    pub fn new(started: Instant) -> Self {
        UsageAcc {
            started,
            prompts: BTreeMap::new(),
            completion_tokens: 0,
            prompt_time: 0.0,
            completion_time: 0.0,
        }
    }

    pub fn add(&mut self, s: &ChoiceStats) {
        let entry = self
            .prompts
            .entry(s.prompt_index)
            .or_insert((s.prompt_tokens, 0));
        entry.1 = entry.1.max(s.cached_tokens);
        self.completion_tokens += s.completion_tokens;
        self.prompt_time = self.prompt_time.max(s.prompt_time);
        self.completion_time = self.completion_time.max(s.completion_time);
    }

    pub fn usage(&self) -> Usage {
        let prompt: usize = self.prompts.values().map(|p| p.0).sum();
        let cached: usize = self.prompts.values().map(|p| p.1).sum();
        Usage::new(
            prompt,
            cached,
            self.completion_tokens,
            self.prompt_time,
            self.completion_time,
            self.started.elapsed().as_secs_f64(),
        )
    }
}

/// Seconds since the Unix epoch, for `created`.
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A fresh public id such as `chatcmpl-3kT9…` (24 random alphanumerics).
pub fn new_id(prefix: &str) -> String {
    let suffix: String = rand::thread_rng()
        .sample_iter(&Alphanumeric)
        .take(24)
        .map(char::from)
        .collect();
    format!("{prefix}{suffix}")
}
