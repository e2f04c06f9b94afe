//! CUDA graphs for decode steps: one graph per (batch bucket, context class), captured from the
//! model's own forward and replayed with new inputs.
//!
//! ```text
//! host per step:  tokens[B] positions[B] meta(tables[B][max_blocks] seqs[B][4] ...)
//!                      │ copied into the static buffers (B = bucket ≥ sequences; padding
//!                      ▼ rows have length 0: no KV write, no attention)
//! graph (B, class):    embed → layers → norm → lm_head → logits[B][vocab] (static buffer)
//! ```
//! While a static forward runs (warm-up or capture), `CudaDevice`'s ops read the static buffers
//! instead of uploading, and `to_host` copies the logits into the static output instead of
//! downloading. Everything else a forward allocates is allocated and freed inside the graph
//! (stream-ordered allocation nodes). Scratch buffers are the graphs' own (`ws`), grown by the
//! uncaptured warm-up before capture; if one moves, every graph is dropped and recaptured.
//!
//! Context classes fix the attention's key-range split count and table width per graph:
//! contexts up to 1k, 4k, 16k and the engine's limit.

use std::collections::HashMap;
use std::time::Instant;

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::CudaGraph;

use super::{CudaDevice, Result};
use crate::attention::AttnSeq;
use crate::compute::{
    ComputeError, DecodeForward, DeviceLogits, KvData, KvPool, SampledIds, StepTokens,
};
use crate::cuda::{AttnBatch, CudaError, CudaSlice, Readback, Workspace};

/// Batch sizes graphs are captured for; a step runs in the smallest that holds it.
pub const BUCKETS: [usize; 7] = [1, 2, 4, 8, 16, 32, 64];
/// Context caps of the classes below the engine's limit.
const CLASS_CAPS: [usize; 3] = [1024, 4096, 16384];

/// Addresses of the static buffers for one bucket and class, read by the ops.
#[derive(Debug, Clone, Copy)]
pub(crate) struct StaticIo {
    pub bucket: usize,
    pub max_blocks: usize,
    pub tokens: u64,
    pub positions: u64,
    pub meta: u64,
    pub logits: u64,
    pub logits_len: usize,
}

/// A captured graph. cudarc leaves `CudaGraph` `!Send` because graph objects must not be used
/// from two threads at once; these live behind `CudaDevice::graphs`' mutex, which serializes
/// every use.
struct Graph(CudaGraph);

// SAFETY: see above: only used with the `graphs` mutex held.
unsafe impl Send for Graph {}

pub(crate) struct Graphs {
    max_batch: usize,
    /// The largest bucket captured: the smallest that holds `max_batch`.
    top: usize,
    vocab: usize,
    caps: Vec<usize>,
    tokens: CudaSlice<i32>,
    positions: CudaSlice<i32>,
    meta: CudaSlice<i32>,
    logits: CudaSlice<f32>,
    /// The last step's sampled ids (device sampling's output), and their copies on the host:
    /// two slots, so one step's ids can be on their way while the step before's are read.
    ids: CudaSlice<i32>,
    readback: Readback,
    /// Samplings issued so far; sampling k (from 1) is read back into slot (k - 1) % 2, so
    /// the slots hold the last two.
    issued: u64,
    ws: Workspace,
    fingerprint: Vec<(u64, usize)>,
    table: HashMap<(usize, usize), Graph>,
    /// Set when a capture failed: decode steps then run eagerly.
    failed: bool,
    /// `AFM_GRAPH_TIMING=1`: device time of each replay, summed per (bucket, class) and
    /// printed every [`TIMING_EVERY`] replays (adds a wait per step: diagnostics only).
    timing: Option<(crate::cuda::GpuTimer, ReplayTimes)>,
}

/// Per (bucket, class): milliseconds summed and replays counted since the last print.
type ReplayTimes = HashMap<(usize, usize), (f64, usize)>;

const TIMING_EVERY: usize = 256;

fn graphs_off(device: &str, what: &'static str) -> ComputeError {
    ComputeError::Unsupported {
        what,
        value: "graphs not enabled".into(),
        device: device.to_string(),
        supported: "after enable_graphs",
    }
}

/// Sampled ids asked for after later samplings replaced them (an engine bug, not bad input).
fn stale_ids(device: &str) -> ComputeError {
    ComputeError::Unsupported {
        what: "sampled ids",
        value: "a sampling replaced by later ones".into(),
        device: device.to_string(),
        supported: "the latest sampling (fed to a step), or one of the last two (read)",
    }
}

fn gerr(e: cudarc::driver::DriverError) -> ComputeError {
    ComputeError::Cuda(CudaError::Driver(e))
}

impl Graphs {
    fn buckets(&self) -> impl Iterator<Item = usize> + '_ {
        BUCKETS.iter().copied().filter(|&b| b <= self.top)
    }

    fn io(
        &self,
        ctx: &crate::cuda::CudaContext,
        bucket: usize,
        class: usize,
        bs: usize,
    ) -> StaticIo {
        StaticIo {
            bucket,
            max_blocks: self.caps[class].div_ceil(bs),
            tokens: ptr(ctx, &self.tokens),
            positions: ptr(ctx, &self.positions),
            meta: ptr(ctx, &self.meta),
            logits: ptr(ctx, &self.logits),
            logits_len: bucket * self.vocab,
        }
    }
}

fn ptr<T>(ctx: &crate::cuda::CudaContext, x: &CudaSlice<T>) -> u64 {
    use cudarc::driver::DevicePtr;
    x.device_ptr(ctx.stream()).0
}

fn kv_geometry(kv: &KvPool) -> Result<(usize, usize)> {
    match &kv.data {
        KvData::Cuda(c) => Ok((c.block_size(), c.num_blocks())),
        #[allow(unreachable_patterns)]
        _ => Err(super::wrong("graph decode", "cpu", "cuda")),
    }
}

impl CudaDevice {
    /// Prepares graphs for batches up to `max_batch` sequences and contexts up to
    /// `max_context` tokens with `vocab` logits per row (static buffers only; graphs are
    /// captured by [`prewarm_graphs`](Self::prewarm_graphs) or on first use).
    pub(in crate::compute) fn enable_graphs(
        &self,
        max_batch: usize,
        max_context: usize,
        vocab: usize,
        block_size: usize,
    ) -> Result<()> {
        let max_batch = max_batch.clamp(1, *BUCKETS.last().expect("non-empty"));
        let top = BUCKETS
            .iter()
            .copied()
            .find(|&b| b >= max_batch)
            .unwrap_or(64);
        let mut caps: Vec<usize> = CLASS_CAPS
            .iter()
            .copied()
            .filter(|&c| c < max_context)
            .collect();
        caps.push(max_context.max(1));
        let meta_len = AttnBatch::fixed_decode_len(top, max_context.div_ceil(block_size.max(1)));
        let ctx = self.lock();
        let g = Graphs {
            max_batch,
            top,
            vocab,
            caps,
            tokens: ctx.zeros(top)?,
            positions: ctx.zeros(top)?,
            meta: ctx.zeros(meta_len)?,
            logits: ctx.zeros(top * vocab.max(1))?,
            ids: ctx.zeros(top)?,
            readback: ctx.readback(2, top)?,
            issued: 0,
            ws: Workspace::default(),
            fingerprint: Vec::new(),
            table: HashMap::new(),
            failed: false,
            timing: match std::env::var("AFM_GRAPH_TIMING").as_deref() {
                Ok("1") => Some((ctx.timer()?, HashMap::new())),
                _ => None,
            },
        };
        *self.graphs.lock().unwrap_or_else(|e| e.into_inner()) = Some(g);
        Ok(())
    }

    /// Captures every (bucket, class) graph; returns how many and the milliseconds it took.
    pub(in crate::compute) fn prewarm_graphs(
        &self,
        kv: &mut KvPool,
        forward: &mut DecodeForward,
    ) -> Result<(usize, f64)> {
        let t = Instant::now();
        let (bs, nb) = kv_geometry(kv)?;
        let mut guard = self.graphs.lock().unwrap_or_else(|e| e.into_inner());
        let Some(g) = guard.as_mut() else {
            return Ok((0, 0.0));
        };
        let combos: Vec<(usize, usize)> = g
            .buckets()
            .flat_map(|b| (0..g.caps.len()).map(move |c| (b, c)))
            .collect();
        // Warm every combination first so the scratch buffers reach their final sizes; then
        // no capture moves them.
        for &(b, c) in combos.iter().rev() {
            self.fill_static(g, StepTokens::Host(&[]), &[], b, c, bs, nb)?;
            self.static_forward(g, b, c, bs, kv, forward, false)?;
        }
        // Captured smallest bucket first. Measured on the H200 (Qwen3-0.6B, session 13): the
        // batch-1 graph replayed in 0.801 ms of device time when captured after the larger
        // buckets' graphs and in 0.761 ms when captured first, as in an engine of one sequence
        // (0.762 ms); the larger buckets' speeds did not move. Why is not known: the graphs'
        // intermediate tensors are stream-ordered allocations captured as graph memory nodes,
        // and where a graph's allocations land depends on the graphs captured before it.
        for &(b, c) in &combos {
            if !g.table.contains_key(&(b, c)) {
                self.fill_static(g, StepTokens::Host(&[]), &[], b, c, bs, nb)?;
                self.static_forward(g, b, c, bs, kv, forward, true)?;
            }
        }
        self.lock().synchronize()?;
        Ok((g.table.len(), t.elapsed().as_secs_f64() * 1e3))
    }

    /// Runs a decode step (one new token per sequence) through its graph, capturing the graph
    /// first if needed. `None`: graphs are off, or the step fits no bucket or class; run it
    /// eagerly (with [`StepTokens::Sampled`] the caller must then resolve those ids first).
    pub(in crate::compute) fn graph_decode(
        &self,
        tokens: StepTokens,
        seqs: &[AttnSeq],
        kv: &mut KvPool,
        forward: &mut DecodeForward,
    ) -> Result<Option<DeviceLogits>> {
        let (bs, nb) = kv_geometry(kv)?;
        let mut guard = self.graphs.lock().unwrap_or_else(|e| e.into_inner());
        let Some(g) = guard.as_mut() else {
            return Ok(None);
        };
        let n = seqs.len();
        if g.failed || n == 0 || n > g.max_batch || seqs.iter().any(|s| s.len != 1) {
            return Ok(None);
        }
        let Some(bucket) = g.buckets().find(|&b| b >= n) else {
            return Ok(None);
        };
        let context = seqs.iter().map(|s| s.pos0 + 1).max().unwrap_or(1);
        let Some(class) = g.caps.iter().position(|&c| c >= context) else {
            return Ok(None);
        };
        self.fill_static(g, tokens, seqs, bucket, class, bs, nb)?;
        if !g.table.contains_key(&(bucket, class)) {
            if let Err(e) = self.static_forward(g, bucket, class, bs, kv, forward, true) {
                g.failed = true;
                eprintln!("[CUDA] graph capture failed ({e}); decode steps run without graphs");
                // The eager warm-up may not have run: refill and let the caller run eagerly.
                return Ok(None);
            }
        }
        let graph = g.table.get(&(bucket, class)).expect("captured above");
        match &mut g.timing {
            None => graph.0.launch().map_err(gerr)?,
            Some((timer, sums)) => {
                let ctx = self.lock();
                timer.start(&ctx)?;
                graph.0.launch().map_err(gerr)?;
                timer.stop(&ctx)?;
                let ms = timer.elapsed_ms()? as f64;
                let e = sums.entry((bucket, class)).or_insert((0.0, 0));
                *e = (e.0 + ms, e.1 + 1);
                if e.1 == TIMING_EVERY {
                    eprintln!(
                        "[CUDA graphs] batch bucket {bucket}, context up to {}: {:.3} ms of device time per replay ({TIMING_EVERY} replays)",
                        g.caps[class],
                        e.0 / e.1 as f64
                    );
                    *e = (0.0, 0);
                }
            }
        }
        Ok(Some(DeviceLogits {
            rows: n,
            vocab: g.vocab,
        }))
    }

    /// Copies one step's inputs into the static buffers in the layout of `bucket`/`class`.
    /// With [`StepTokens::Sampled`], row i's token is row i of that sampling, copied on the
    /// device (padding rows keep whatever ids they held: rows of length 0 read no cache).
    #[allow(clippy::too_many_arguments)]
    fn fill_static(
        &self,
        g: &mut Graphs,
        tokens: StepTokens,
        seqs: &[AttnSeq],
        bucket: usize,
        class: usize,
        bs: usize,
        num_blocks: usize,
    ) -> Result<()> {
        let max_blocks = g.caps[class].div_ceil(bs);
        let meta = AttnBatch::pack_fixed_decode(seqs, bucket, max_blocks, bs, num_blocks)?;
        let mut pos = vec![0i32; bucket];
        for (i, s) in seqs.iter().enumerate() {
            pos[i] = s.pos0 as i32;
        }
        let ctx = self.lock();
        match tokens {
            StepTokens::Host(tokens) => {
                let mut tok = vec![0i32; bucket];
                for (i, s) in seqs.iter().enumerate() {
                    tok[i] = tokens.get(s.row0).copied().unwrap_or(0) as i32;
                }
                ctx.upload_into(&tok, &mut g.tokens)?;
            }
            StepTokens::Sampled(ids) => {
                if ids.seq != g.issued || ids.rows != seqs.len() {
                    return Err(stale_ids(&self.name));
                }
                ctx.copy(&g.ids, &mut g.tokens)?;
            }
        }
        ctx.upload_into(&pos, &mut g.positions)?;
        ctx.upload_into(&meta, &mut g.meta)?;
        Ok(())
    }

    /// One forward against the static buffers, with the graphs' scratch swapped in: eager
    /// (warm-up) or captured into the table.
    #[allow(clippy::too_many_arguments)]
    fn static_forward(
        &self,
        g: &mut Graphs,
        bucket: usize,
        class: usize,
        bs: usize,
        kv: &mut KvPool,
        forward: &mut DecodeForward,
        capture: bool,
    ) -> Result<()> {
        let io = g.io(&self.lock(), bucket, class, bs);
        *self.io.lock().unwrap_or_else(|e| e.into_inner()) = Some(io);
        self.lock().swap_workspace(&mut g.ws);
        let tokens = vec![0u32; bucket];
        let table = [0u32];
        let seqs: Vec<AttnSeq> = (0..bucket)
            .map(|i| AttnSeq {
                row0: i,
                len: 1,
                pos0: 0,
                block_table: &table,
            })
            .collect();
        let result = (|| -> Result<()> {
            if capture {
                forward(&tokens, &seqs, kv)?; // warm-up: loads kernels, sizes scratch
            }
            let fp = self.lock().workspace_fingerprint();
            if fp != g.fingerprint {
                g.table.clear(); // their scratch moved
                g.fingerprint = fp;
            }
            if !capture {
                return forward(&tokens, &seqs, kv).map(|_| ());
            }
            let stream = self.lock().stream().clone();
            // A hand-over left by a forward (a copy no product took; cuda/handover.rs) is
            // forgotten on both sides of the capture, so none crosses into or out of a graph.
            self.lock().clear_prepared();
            stream
                .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
                .map_err(gerr)?;
            let ran = forward(&tokens, &seqs, kv);
            self.lock().clear_prepared();
            let graph = stream.end_capture(CUgraphInstantiate_flags(0));
            ran?;
            let graph = graph.map_err(gerr)?.ok_or(ComputeError::Unsupported {
                what: "CUDA graph capture",
                value: "an empty graph".into(),
                device: self.name.clone(),
                supported: "a forward that launches work",
            })?;
            graph.upload().map_err(gerr)?;
            if self.lock().workspace_fingerprint() != g.fingerprint {
                return Err(ComputeError::Unsupported {
                    what: "scratch allocation under CUDA graph capture",
                    value: "a scratch buffer grew".into(),
                    device: self.name.clone(),
                    supported: "scratch sized by the warm-up",
                });
            }
            g.table.insert((bucket, class), Graph(graph));
            Ok(())
        })();
        self.lock().swap_workspace(&mut g.ws);
        *self.io.lock().unwrap_or_else(|e| e.into_inner()) = None;
        result
    }

    /// Draws one token per row of `l` on the device: bias and penalties, then greedy or
    /// top-k/top-p/min-p with each row's uniform draw. Returns at once: the ids are copied to
    /// the host behind the step ([`sampled`](Self::sampled) waits for them) and stay on the
    /// device for the next step ([`StepTokens::Sampled`]) until the next sampling.
    pub(in crate::compute) fn sample_start(
        &self,
        l: &DeviceLogits,
        params: &[crate::cuda::SampleParams],
        adjust: &[crate::cuda::LogitAdjust],
    ) -> Result<SampledIds> {
        let mut guard = self.graphs.lock().unwrap_or_else(|e| e.into_inner());
        let g = guard
            .as_mut()
            .ok_or_else(|| graphs_off(&self.name, "device sampling"))?;
        super::check("sampled rows (the step's)", params.len(), l.rows)?;
        super::check(
            "sampled rows (at most the largest bucket)",
            l.rows.min(g.top),
            l.rows,
        )?;
        let n = l.rows * l.vocab;
        let mut ctx = self.lock();
        let base = ptr(&ctx, &g.logits);
        // SAFETY: the static logits buffer lives in `self.graphs`, held locked here.
        let mut logits = unsafe { crate::cuda::Buf::<f32>::borrowed(&ctx, base, n) };
        ctx.adjust_logits(&mut *logits, l.vocab, adjust)?;
        ctx.sample(&*logits, l.vocab, params, &mut g.ids.slice_mut(0..l.rows))?;
        let slot = (g.issued % 2) as usize;
        ctx.queue_readback(&g.ids, &mut g.readback, slot)?;
        g.issued += 1;
        Ok(SampledIds {
            rows: l.rows,
            slot,
            seq: g.issued,
        })
    }

    /// The ids of a [`sample_start`](Self::sample_start), once they are on the host. Each
    /// sampling's ids can be read until two later samplings have been issued.
    pub(in crate::compute) fn sampled(&self, ids: &SampledIds) -> Result<Vec<u32>> {
        let guard = self.graphs.lock().unwrap_or_else(|e| e.into_inner());
        let g = guard
            .as_ref()
            .ok_or_else(|| graphs_off(&self.name, "device sampling"))?;
        // One of the last two samplings: a later one of the same parity took its slot.
        if ids.seq > g.issued || g.issued - ids.seq >= 2 {
            return Err(stale_ids(&self.name));
        }
        let v = g.readback.take(ids.slot, ids.rows)?;
        Ok(v.into_iter().map(|t| t as u32).collect())
    }

    /// Row `row` of `l` in host memory (for requests that sample on the host).
    pub(in crate::compute) fn logits_row(&self, l: &DeviceLogits, row: usize) -> Result<Vec<f32>> {
        let guard = self.graphs.lock().unwrap_or_else(|e| e.into_inner());
        let g = guard
            .as_ref()
            .ok_or_else(|| graphs_off(&self.name, "device logits"))?;
        if row >= l.rows {
            return Err(ComputeError::Shape {
                what: "logits row (below the step's rows)",
                got: row,
                want: l.rows,
            });
        }
        let ctx = self.lock();
        Ok(ctx.download(&g.logits.slice(row * l.vocab..(row + 1) * l.vocab))?)
    }
}
