//! The HTTP target: one workload request as a streamed `POST /v1/completions` to a running
//! OpenAI-compatible server (afm, llama-server, vLLM), timed from the client's side.
//!
//! The prompt goes as token ids (the same synthetic prompts as the in-process run), greedy,
//! `max_tokens = gen_len`, `ignore_eos` (honoured by llama-server and vLLM; afm ignores it and
//! may stop at an end token, so completion counts come from the server's `usage`), and
//! `stream_options.include_usage` for prompt, cached and completion token counts.
//!
//! ```text
//! t0 ─ send ─ … ─ first text chunk (TTFT) ─ chunk ─ chunk … ─ last chunk ─ usage ─ [DONE]
//!                 └────────── gaps between text chunks = inter-token latency ──┘
//! ```

use std::time::{Duration, Instant};

use futures::StreamExt;
use serde_json::{json, Value};

use crate::Sample;

/// A running server to drive.
#[derive(Debug, Clone)]
pub struct HttpTarget {
    client: reqwest::Client,
    /// `http://host:port`, without a trailing slash or `/v1`.
    base: String,
    /// The `model` field of each request (servers that host several pick by it).
    pub model: String,
    api_key: Option<String>,
}

impl HttpTarget {
    /// `url` as given by the user (`http://127.0.0.1:9999`, with or without `/v1`).
    pub fn new(url: &str, model: Option<String>, api_key: Option<String>) -> Result<Self, String> {
        let base = url
            .trim_end_matches('/')
            .trim_end_matches("/v1")
            .to_string();
        if !base.starts_with("http://") {
            return Err(format!(
                "--url {url}: expected http://HOST:PORT (TLS is not built in)"
            ));
        }
        let client = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .build()
            .map_err(|e| format!("building the HTTP client: {e}"))?;
        Ok(Self {
            client,
            base,
            model: model.unwrap_or_default(),
            api_key,
        })
    }

    pub fn base(&self) -> &str {
        &self.base
    }

    fn post(&self, path: &str) -> reqwest::RequestBuilder {
        let r = self.client.post(format!("{}{path}", self.base));
        match &self.api_key {
            Some(k) => r.bearer_auth(k),
            None => r,
        }
    }

    /// The first model `GET /v1/models` lists (its id), if the server answers.
    pub async fn served_model(&self) -> Result<String, String> {
        let mut r = self.client.get(format!("{}/v1/models", self.base));
        if let Some(k) = &self.api_key {
            r = r.bearer_auth(k);
        }
        let v: Value = r
            .send()
            .await
            .map_err(|e| format!("GET {}/v1/models: {e}", self.base))?
            .json()
            .await
            .map_err(|e| format!("GET {}/v1/models: {e}", self.base))?;
        v["data"][0]["id"]
            .as_str()
            .map(str::to_string)
            .ok_or_else(|| format!("GET {}/v1/models listed no model: {v}", self.base))
    }

    /// One streamed request, timed.
    pub(crate) async fn one(&self, prompt: Vec<u32>, gen_len: usize) -> Result<Sample, String> {
        let n_prompt = prompt.len();
        let body = json!({
            "model": self.model,
            "prompt": prompt,
            "max_tokens": gen_len,
            "temperature": 0.0,
            "ignore_eos": true,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        let t0 = Instant::now();
        let resp = self
            .post("/v1/completions")
            .json(&body)
            .send()
            .await
            .map_err(|e| format!("POST /v1/completions: {e}"))?;
        let status = resp.status();
        if !status.is_success() {
            let text = resp.text().await.unwrap_or_default();
            return Err(format!("POST /v1/completions: HTTP {status}: {text}"));
        }
        let mut stream = resp.bytes_stream();
        let mut events = SseEvents::default();
        let mut t = Timing::new(t0);
        let mut usage = None;
        while let Some(bytes) = stream.next().await {
            let bytes = bytes.map_err(|e| format!("reading the stream: {e}"))?;
            let now = Instant::now();
            for data in events.push(&bytes) {
                if data == "[DONE]" {
                    return t.finish(usage, n_prompt);
                }
                let v: Value = serde_json::from_str(&data)
                    .map_err(|e| format!("stream chunk is not JSON ({e}): {data}"))?;
                if let Some(err) = v.get("error") {
                    return Err(format!("server error in the stream: {err}"));
                }
                let text = v["choices"][0]["text"].as_str().unwrap_or("");
                if !text.is_empty() {
                    t.chunk(now);
                }
                if v["usage"].is_object() {
                    usage = Some(v["usage"].clone());
                }
            }
        }
        // Some servers close without `[DONE]`; what arrived still counts.
        t.finish(usage, n_prompt)
    }
}

/// Arrival times of the text chunks of one response.
struct Timing {
    t0: Instant,
    first: Option<Instant>,
    last: Instant,
    gaps: Vec<f64>,
    chunks: usize,
}

impl Timing {
    fn new(t0: Instant) -> Self {
        Self {
            t0,
            first: None,
            last: t0,
            gaps: Vec::new(),
            chunks: 0,
        }
    }

    fn chunk(&mut self, now: Instant) {
        match self.first {
            None => self.first = Some(now),
            Some(_) => self.gaps.push((now - self.last).as_secs_f64()),
        }
        self.last = now;
        self.chunks += 1;
    }

    /// Token counts from `usage` when the server sent it, else one token per text chunk.
    fn finish(self, usage: Option<Value>, n_prompt: usize) -> Result<Sample, String> {
        let Some(first) = self.first else {
            return Err("the stream carried no text".into());
        };
        let count = |v: &Value| v.as_u64().map(|n| n as usize);
        let u = usage.unwrap_or(Value::Null);
        Ok(Sample {
            ttft: (first - self.t0).as_secs_f64(),
            gaps: self.gaps,
            prompt_tokens: count(&u["prompt_tokens"]).unwrap_or(n_prompt),
            cached_tokens: count(&u["prompt_tokens_details"]["cached_tokens"]).unwrap_or(0),
            gen_tokens: count(&u["completion_tokens"]).unwrap_or(self.chunks),
            decode_time: (self.last - first).as_secs_f64(),
        })
    }
}

/// Splits a byte stream into server-sent events' `data:` payloads (multi-line data joined
/// by newlines; CRLF tolerated; comments and other fields ignored).
#[derive(Default)]
struct SseEvents {
    buf: Vec<u8>,
}

impl SseEvents {
    fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        self.buf.extend_from_slice(bytes);
        let mut out = Vec::new();
        while let Some((end, sep)) = find_event_end(&self.buf) {
            let event = String::from_utf8_lossy(&self.buf[..end]).into_owned();
            self.buf.drain(..end + sep);
            let data: Vec<&str> = event
                .lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .map(|d| d.strip_prefix(' ').unwrap_or(d))
                .collect();
            if !data.is_empty() {
                out.push(data.join("\n"));
            }
        }
        out
    }
}

/// Position and length of the first blank-line separator (`\n\n` or `\r\n\r\n`).
fn find_event_end(b: &[u8]) -> Option<(usize, usize)> {
    let lf = b.windows(2).position(|w| w == b"\n\n").map(|i| (i, 2));
    let crlf = b.windows(4).position(|w| w == b"\r\n\r\n").map(|i| (i, 4));
    match (lf, crlf) {
        (Some(a), Some(c)) => Some(if a.0 <= c.0 { a } else { c }),
        (a, c) => a.or(c),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_events_survive_arbitrary_splits() {
        let stream = "data: {\"a\":1}\n\n: keep-alive\n\ndata: {\"b\":2}\r\n\r\ndata: [DONE]\n\n";
        for cut in 0..stream.len() {
            let mut s = SseEvents::default();
            let mut got = s.push(&stream.as_bytes()[..cut]);
            got.extend(s.push(&stream.as_bytes()[cut..]));
            assert_eq!(
                got,
                vec!["{\"a\":1}", "{\"b\":2}", "[DONE]"],
                "cut at {cut}"
            );
        }
    }

    #[test]
    fn timing_counts_tokens_from_usage_and_gaps_from_chunks() {
        let t0 = Instant::now();
        let mut t = Timing::new(t0);
        for ms in [100, 110, 125] {
            t.chunk(t0 + Duration::from_millis(ms));
        }
        let usage = json!({"prompt_tokens": 50, "completion_tokens": 3,
                           "prompt_tokens_details": {"cached_tokens": 32}});
        let s = t.finish(Some(usage), 50).unwrap();
        assert!((s.ttft - 0.1).abs() < 1e-9);
        assert_eq!(s.gaps.len(), 2);
        assert!((s.decode_time - 0.025).abs() < 1e-9);
        assert_eq!(
            (s.prompt_tokens, s.cached_tokens, s.gen_tokens),
            (50, 32, 3)
        );
        let empty = Timing::new(t0).finish(None, 5);
        assert!(empty.is_err());
    }
}
