//! `afm_profile` in responses: added when the server runs with `--gpu-profile` or the request
//! carries `X-AFM-Profile: true`, on a generator with a device profile (a GPU engine). The
//! request's rates come from the response's own `usage`, so the profile and the usage agree.
//! A streamed response carries it in its last chunk before `[DONE]` (the usage chunk when the
//! client asked for usage, else a chunk with no choices).

use std::sync::Arc;

use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;
use serde_json::Value;

use crate::AppState;

/// Whether this request's response carries a profile.
pub fn wanted(state: &AppState, headers: &HeaderMap) -> bool {
    let Some(p) = state.model.generator.device_profile() else {
        return false;
    };
    p.always
        || headers
            .get("x-afm-profile")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.trim().eq_ignore_ascii_case("true") || v.trim() == "1")
}

/// The response JSON with `afm_profile` added (the plain response if it cannot be built).
pub fn with_profile(state: &AppState, body: &impl Serialize) -> Response {
    let Ok(mut v) = serde_json::to_value(body) else {
        return Json(Value::Null).into_response();
    };
    let profile = report(state, &v["usage"]);
    insert(&mut v, profile);
    Json(v).into_response()
}

/// Makes a stream's `afm_profile`: the server state the device profile lives in.
#[derive(Clone)]
pub struct Profiler(Arc<AppState>);

impl Profiler {
    /// A profiler when this request's response carries a profile (`wanted`).
    pub fn for_request(state: &Arc<AppState>, headers: &HeaderMap) -> Option<Self> {
        wanted(state, headers).then(|| Self(Arc::clone(state)))
    }

    /// `chunk` (a stream's last chunk) as JSON with `afm_profile` from `usage` added.
    pub fn chunk(&self, chunk: &impl Serialize, usage: &impl Serialize) -> Value {
        let mut v = serde_json::to_value(chunk).unwrap_or(Value::Null);
        let usage = serde_json::to_value(usage).unwrap_or(Value::Null);
        let profile = report(&self.0, &usage);
        insert(&mut v, profile);
        v
    }
}

fn insert(v: &mut Value, profile: Option<Value>) {
    if let (Value::Object(m), Some(r)) = (v, profile) {
        m.insert("afm_profile".into(), r);
    }
}

/// The profile of a request whose `usage` (as JSON) is given; logged with `--gpu-profile`.
fn report(state: &AppState, u: &Value) -> Option<Value> {
    let p = state.model.generator.device_profile()?;
    let n = |x: &Value| x.as_u64().unwrap_or(0) as usize;
    let cached = n(&u["prompt_tokens_details"]["cached_tokens"]);
    let report = p.report(
        n(&u["prompt_tokens"]).saturating_sub(cached),
        n(&u["completion_tokens"]),
        u["prompt_time"].as_f64().unwrap_or(0.0),
        u["completion_time"].as_f64().unwrap_or(0.0),
    );
    if p.always {
        eprintln!(
            "[GPU profile] prefill {:.0} tok/s, decode {:.1} tok/s, {:.1} GB/s = {:.0}% of peak, memory {:.2} GiB (peak {:.2} GiB)",
            report.prefill_tokens_per_second,
            report.decode_tokens_per_second,
            report.bandwidth_bytes_per_second / 1e9,
            100.0 * report.bandwidth_fraction_of_peak,
            report.memory_used_bytes as f64 / (1u64 << 30) as f64,
            report.memory_peak_bytes as f64 / (1u64 << 30) as f64
        );
    }
    serde_json::to_value(&report).ok()
}
