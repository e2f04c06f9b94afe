//! `deepseek_v4` (DeepSeek V4 Flash / Pro) in the general runtime, after transformers 5.24's
//! `modeling_deepseek_v4.py`:
//!
//! - shared-KV multi-query attention (one 512-wide head read as key and value) with per-head
//!   sinks, interleaved RoPE on each head's trailing dims, the output's rope slice rotated back,
//!   and a grouped low-rank output projection; every layer attends through a sliding window,
//!   CSA layers add the top-k compressed rows (ratio 4) the lightning indexer picks, HCA layers
//!   every compressed row (ratio 128): `deepseek_v4_attention.rs`;
//! - mHC: `hc_mult` residual streams, mixed in and out of each sublayer by weights computed from
//!   the streams (Sinkhorn-normalized for the stream-to-stream mix);
//! - MoE with sqrt-softplus scores, bias-corrected top-k (or a token-id hash table in the first
//!   layers), clamped SwiGLU experts and one shared expert;
//! - the `mtp.0.*` multi-token-prediction module, loaded and exposed ([`DeepseekV4::mtp`]) for
//!   speculative decoding; nothing runs it yet.
//!
//! Hyper-parameters and RoPE tables: `deepseek_v4_config.rs`.
//!
//! Models hold weights only. Every stream of state lives in the engine's KV pool, one entry per
//! token position, addressed by the sequence's block table (see `deepseek_v4_attention.rs`), so
//! prefill, decode, chunked prefill and prefix caching need nothing beyond the usual forward.
//!
//! Where it runs, on a GPU (`--device cuda`) as on the CPU: the weights, every projection
//! (attention, compressor, indexer, mHC mixes, router, experts, head) and the KV pool live on
//! the device; the mHC stream mixing, Sinkhorn, the compressors' pooling, the indexer's top-k,
//! the sink attention, the MoE routing and the clamped SwiGLU run on the host, which reads and
//! writes the pool rows it needs (`Device::kv_read_rows` / `kv_write_rows`) and moves each
//! activation across once per op. Correct, not fast: decode steps run eagerly (no CUDA graph:
//! the first read-back refuses inside one).
//!
//! Scope: safetensors with DeepSeek's names (`layers.N.attn.wq_a.weight`, with or without
//! `model.`), f32/f16/bf16 weights (not the released FP8/FP4 tensors). A `deepseek4` GGUF
//! (llama.cpp's converter) feeds the same code: [`adjust_gguf_config`] restates its metadata,
//! [`gguf_name`] maps the names, its routed experts come stacked (`ffn_gate_exps` `[E, I, H]`,
//! MXFP4 as the converter writes them) and its hash table as an I32 tensor. Its main file holds
//! no MTP.

#[path = "deepseek_v4_attention.rs"]
mod attention;
#[path = "deepseek_v4_config.rs"]
mod config;

use afm_runtime::compute::{ComputeError, Device, KvPool, Tensor, Weight};
use afm_runtime::kv_store::LayerKvShape;
use afm_runtime::WeightMatrix;

use crate::checkpoint::{Checkpoint, NormNaming};
use crate::config::TransformerConfig;
use crate::forward::{CausalLm, ForwardBatch};
use crate::layers::{Linear, RmsNorm};
use crate::ModelError;

use attention::{Attention, Streams};
use config::cfg_err;
pub use config::{adjust_gguf_config, AttnKind, V4Config};

const N: NormNaming = NormNaming::Llama;

type CResult<T> = Result<T, ComputeError>;

/// mHC weights of one sublayer: `fn` maps the normed, flattened streams to `pre`, `post` and
/// `comb` logits.
struct HyperConnection {
    proj: Linear,
    base: Vec<f32>,
    scale: Vec<f32>,
}

/// The final collapse of the streams (`hc_head`).
pub struct HyperHead {
    proj: Linear,
    base: Vec<f32>,
    scale: f32,
}

/// `down(silu(min(gate, limit)) · clamp(up, ±limit))`.
struct ClampedMlp {
    gate: Linear,
    up: Linear,
    down: Linear,
}

struct Moe {
    router: Linear,
    /// `e_score_correction_bias`: added to the scores for choosing experts only.
    bias: Option<Vec<f32>>,
    /// Hash-routed layers: `[vocab][top_k]` expert ids.
    tid2eid: Option<Vec<usize>>,
    experts: Vec<ClampedMlp>,
    shared: ClampedMlp,
}

/// One decoder block's weights.
pub struct Block {
    attn_norm: RmsNorm,
    attn: Attention,
    ffn_norm: RmsNorm,
    moe: Moe,
    attn_hc: HyperConnection,
    ffn_hc: HyperConnection,
}

/// One multi-token-prediction module (`mtp.N.*`): `e_proj(enorm(embed(next token))) +
/// h_proj(hnorm(streams))`, one sliding-window block, its own `hc_head`, then the shared
/// `norm` and head. Weights only, for the speculative decoder to come.
pub struct Mtp {
    pub e_proj: Linear,
    pub h_proj: Linear,
    pub enorm: RmsNorm,
    pub hnorm: RmsNorm,
    pub norm: RmsNorm,
    pub head: HyperHead,
    pub block: Block,
}

pub struct DeepseekV4 {
    cfg: V4Config,
    dev: Device,
    embed: Weight,
    layers: Vec<Block>,
    streams: Vec<Streams>,
    shapes: Vec<LayerKvShape>,
    hc_head: HyperHead,
    norm: RmsNorm,
    head: Linear,
    mtp: Vec<Mtp>,
}

/// Name lookups over DeepSeek's own names, prefixed by `model.` (transformers' save) or not
/// (the released checkpoints).
pub(super) struct Names<'a, 'b> {
    ck: &'a Checkpoint<'b>,
    dev: &'a Device,
    eps: f32,
}

/// DeepSeek's name (as this file asks for it: `layers.1.attn.compressor.ape`,
/// `layers.0.attn.wq_a` for a linear's stem, `hc_head_fn`) → llama.cpp's GGUF name (its
/// converter's `_map_dsv4_tensor_name`). Stems stay stems; the bare parameters, which have no
/// suffix in DeepSeek's files, gain GGUF's `.weight`.
pub fn gguf_name(ds: &str) -> String {
    let (stem, suffix) = match ds.strip_suffix(".weight") {
        Some(stem) => (stem, ".weight"),
        None => (ds, ""),
    };
    let top = match stem {
        "embed" => Some("token_embd"),
        "norm" => Some("output_norm"),
        "head" => Some("output"),
        _ => None,
    };
    if let Some(t) = top {
        return format!("{t}{suffix}");
    }
    if let Some(part) = stem.strip_prefix("hc_head_") {
        return format!("output_hc_{part}.weight");
    }
    let Some((layer, tail)) = stem.strip_prefix("layers.").and_then(|r| r.split_once('.')) else {
        return ds.to_string();
    };
    // (DeepSeek tail, GGUF short name, whether DeepSeek stores it without a suffix)
    let (short, bare) = match tail {
        "attn_norm" => ("attn_norm", false),
        "ffn_norm" => ("ffn_norm", false),
        "attn.attn_sink" => ("attn_sinks", true),
        "attn.wq_a" => ("attn_q_a", false),
        "attn.q_norm" => ("attn_q_a_norm", false),
        "attn.wq_b" => ("attn_q_b", false),
        "attn.wkv" => ("attn_kv", false),
        "attn.kv_norm" | "attn.norm" => ("attn_kv_a_norm", false),
        "attn.wo_a" => ("attn_output_a", false),
        "attn.wo_b" => ("attn_output_b", false),
        "attn.compressor.ape" => ("attn_compressor_ape", true),
        "attn.compressor.wkv" => ("attn_compressor_kv", false),
        "attn.compressor.wgate" => ("attn_compressor_gate", false),
        "attn.compressor.norm" => ("attn_compressor_norm", false),
        "attn.indexer.wq_b" => ("indexer.attn_q_b", false),
        "attn.indexer.weights_proj" => ("indexer.proj", false),
        "attn.indexer.compressor.ape" => ("indexer_compressor_ape", true),
        "attn.indexer.compressor.wkv" => ("indexer_compressor_kv", false),
        "attn.indexer.compressor.wgate" => ("indexer_compressor_gate", false),
        "attn.indexer.compressor.norm" => ("indexer_compressor_norm", false),
        "ffn.gate" => ("ffn_gate_inp", false),
        "ffn.gate.bias" => return format!("blk.{layer}.exp_probs_b.bias"),
        "ffn.gate.tid2eid" => ("ffn_gate_tid2eid", true),
        "ffn.shared_experts.w1" => ("ffn_gate_shexp", false),
        "ffn.shared_experts.w2" => ("ffn_down_shexp", false),
        "ffn.shared_experts.w3" => ("ffn_up_shexp", false),
        "ffn.experts.w1" => ("ffn_gate_exps", false),
        "ffn.experts.w2" => ("ffn_down_exps", false),
        "ffn.experts.w3" => ("ffn_up_exps", false),
        "hc_attn_fn" | "hc_attn_base" | "hc_attn_scale" | "hc_ffn_fn" | "hc_ffn_base"
        | "hc_ffn_scale" => (tail, true),
        _ => return ds.to_string(),
    };
    let suffix = if bare { ".weight" } else { suffix };
    format!("blk.{layer}.{short}{suffix}")
}

impl Names<'_, '_> {
    /// The checkpoint's name for a DeepSeek name.
    fn resolve(&self, name: &str) -> String {
        match self.ck.is_gguf() {
            true => gguf_name(name),
            false => name.to_string(),
        }
    }

    pub(super) fn has(&self, name: &str) -> bool {
        self.ck.has(&self.resolve(name), N)
    }

    /// A matrix stored without a `.weight` suffix (mHC's `hc_*_fn`).
    pub(super) fn matrix(
        &self,
        name: &str,
        rows: usize,
        cols: usize,
    ) -> Result<Weight, ModelError> {
        crate::layers::matrix(self.ck, self.dev, &self.resolve(name), N, rows, cols)
    }

    pub(super) fn first(&self, names: &[&str]) -> Result<String, ModelError> {
        names
            .iter()
            .find(|n| self.has(n))
            .map(|n| n.to_string())
            .ok_or_else(|| {
                ModelError::Weights(crate::weights::WeightsError::MissingTensor {
                    name: names.join(" or "),
                })
            })
    }

    pub(super) fn linear(&self, name: &str, out: usize, inp: usize) -> Result<Linear, ModelError> {
        Linear::load(self.ck, self.dev, &self.resolve(name), N, out, inp, false)
    }

    pub(super) fn norm(&self, name: &str, len: usize) -> Result<RmsNorm, ModelError> {
        RmsNorm::load(
            self.ck,
            self.dev,
            &self.resolve(name),
            N,
            len,
            self.eps,
            0.0,
        )
    }

    /// An integer table (the hash routing's `tid2eid`) with its shape.
    fn integers(&self, name: &str) -> Result<(Vec<usize>, Vec<i64>), ModelError> {
        self.ck.integers(&self.resolve(name), N)
    }

    /// Expert `e`'s `[rows, cols]` slice of a stacked `[E, rows, cols]` tensor (GGUF).
    fn expert(&self, name: &str, shape: [usize; 3], e: usize) -> Result<Linear, ModelError> {
        let n = self.resolve(name);
        let w = super::qwen3_5_moe::expert_rows(self.ck, &n, shape, e, 0, shape[1])?;
        let w = self
            .dev
            .weight(w)
            .map_err(|source| ModelError::Device { name: n, source })?;
        Ok(Linear { w, b: None })
    }

    /// Any tensor of exactly `shape`, as f32 on the host.
    pub(super) fn host(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, ModelError> {
        let v = self.ck.view(&self.resolve(name), N)?;
        let numel: usize = shape.iter().product();
        if v.numel() != numel || (v.shape.as_slice() != shape && shape.len() > 1) {
            return Err(ModelError::Shape {
                name: v.name,
                want: shape.to_vec(),
                got: v.shape,
            });
        }
        Ok(v.to_f32()?)
    }

    /// Rows `r0..r0 + rows` of a `[_, cols]` matrix, as their own weight.
    pub(super) fn row_block(
        &self,
        name: &str,
        total_rows: usize,
        cols: usize,
        r0: usize,
        rows: usize,
    ) -> Result<Linear, ModelError> {
        let all = self.host(name, &[total_rows, cols])?;
        let w = WeightMatrix::from_f32(rows, cols, &all[r0 * cols..(r0 + rows) * cols]);
        let w = self.dev.weight(w).map_err(|source| ModelError::Device {
            name: name.to_string(),
            source,
        })?;
        Ok(Linear { w, b: None })
    }
}

impl DeepseekV4 {
    pub fn load(ck: &Checkpoint, tc: &TransformerConfig, dev: &Device) -> Result<Self, ModelError> {
        let cfg = V4Config::from_hf(tc)?;
        let unprefixed = ck.unprefixed();
        let top = Names {
            ck: &unprefixed,
            dev,
            eps: cfg.eps,
        };
        // transformers' save keeps `model.`; the released checkpoints have none.
        let nm = Names {
            ck: if ck.has("layers.0.attn_norm.weight", N) {
                ck
            } else {
                &unprefixed
            },
            dev,
            eps: cfg.eps,
        };
        let h = cfg.hidden;
        let embed_name = nm.first(&["embed.weight", "embed_tokens.weight"])?;
        let embed = nm.matrix(&embed_name, cfg.vocab, h)?;
        let mut layers = Vec::with_capacity(cfg.kinds.len());
        for (i, &kind) in cfg.kinds.iter().enumerate() {
            layers.push(load_block(
                &nm,
                &cfg,
                &format!("layers.{i}"),
                kind,
                cfg.hash_routed[i],
            )?);
        }
        let (streams, shapes) = attention::plan_streams(&cfg);
        let hc_head = load_hyper_head(&nm, &cfg, "hc_head_fn", "hc_head.hc_fn")?;
        let head_name = top.first(&["head.weight", "lm_head.weight"])?;
        let head = top.linear(head_name.trim_end_matches(".weight"), cfg.vocab, h)?;
        let mut mtp = Vec::new();
        for j in 0..cfg.mtp_layers {
            let p = format!("mtp.{j}");
            if !top.has(&format!("{p}.e_proj.weight")) {
                break; // transformers' own saves drop the MTP weights
            }
            mtp.push(Mtp {
                e_proj: top.linear(&format!("{p}.e_proj"), h, h)?,
                h_proj: top.linear(&format!("{p}.h_proj"), h, h)?,
                enorm: top.norm(&format!("{p}.enorm"), h)?,
                hnorm: top.norm(&format!("{p}.hnorm"), h)?,
                norm: top.norm(&format!("{p}.norm"), h)?,
                head: load_hyper_head(&top, &cfg, &format!("{p}.hc_head_fn"), "")?,
                block: load_block(&top, &cfg, &p, mtp_kind(&cfg, j), false)?,
            });
        }
        Ok(Self {
            norm: nm.norm("norm", h)?,
            embed,
            layers,
            streams,
            shapes,
            hc_head,
            head,
            mtp,
            dev: dev.clone(),
            cfg,
        })
    }

    pub fn config(&self) -> &V4Config {
        &self.cfg
    }

    /// The multi-token-prediction modules, in order (empty where the checkpoint has none).
    pub fn mtp(&self) -> &[Mtp] {
        &self.mtp
    }

    /// Pre-sublayer mHC: returns the sublayer input `Σ pre_j · stream_j` (`[rows][hidden]`)
    /// and, per row, `post` (`[hc]`) and `comb` (`[hc][hc]`, Sinkhorn-normalized).
    fn hc_pre(
        &self,
        hc: &HyperConnection,
        streams: &[f32],
        rows: usize,
    ) -> CResult<(Vec<f32>, Vec<f32>, Vec<f32>)> {
        let (n, h, c) = (self.cfg.hc_mult, self.cfg.hidden, &self.cfg);
        let mixes = self.stream_mixes(&hc.proj, streams, rows)?;
        let width = (2 + n) * n;
        let mut collapsed = vec![0f32; rows * h];
        let mut post = vec![0f32; rows * n];
        let mut comb = vec![0f32; rows * n * n];
        for r in 0..rows {
            let m = &mixes[r * width..(r + 1) * width];
            let s = &streams[r * n * h..(r + 1) * n * h];
            let pre: Vec<f32> = (0..n)
                .map(|j| sigmoid(m[j] * hc.scale[0] + hc.base[j]) + c.hc_eps)
                .collect();
            for j in 0..n {
                post[r * n + j] = 2.0 * sigmoid(m[n + j] * hc.scale[1] + hc.base[n + j]);
            }
            let cm = &mut comb[r * n * n..(r + 1) * n * n];
            for (k, v) in cm.iter_mut().enumerate() {
                *v = m[2 * n + k] * hc.scale[2] + hc.base[2 * n + k];
            }
            sinkhorn(cm, n, c.sinkhorn_iters, c.hc_eps);
            let out = &mut collapsed[r * h..(r + 1) * h];
            for (j, p) in pre.iter().enumerate() {
                for (o, x) in out.iter_mut().zip(&s[j * h..(j + 1) * h]) {
                    *o += p * x;
                }
            }
        }
        Ok((collapsed, post, comb))
    }

    /// `proj(unweighted_rmsnorm(flattened streams))` for every row.
    fn stream_mixes(&self, proj: &Linear, streams: &[f32], rows: usize) -> CResult<Vec<f32>> {
        let width = self.cfg.hc_mult * self.cfg.hidden;
        let mut normed = streams.to_vec();
        for row in normed.chunks_exact_mut(width) {
            unweighted_rms_norm(row, self.cfg.eps);
        }
        let x = self.dev.tensor(rows, width, normed)?;
        self.dev.to_host(proj.forward(&self.dev, &x)?)
    }

    /// `streams_k ← post_k · out + Σ_j comb[j][k] · streams_j`.
    fn hc_post(&self, streams: &mut [f32], out: &[f32], post: &[f32], comb: &[f32]) {
        let (n, h) = (self.cfg.hc_mult, self.cfg.hidden);
        for (r, s) in streams.chunks_exact_mut(n * h).enumerate() {
            let old = s.to_vec();
            let o = &out[r * h..(r + 1) * h];
            let cm = &comb[r * n * n..(r + 1) * n * n];
            for k in 0..n {
                let dst = &mut s[k * h..(k + 1) * h];
                for (d, v) in dst.iter_mut().zip(o) {
                    *d = post[r * n + k] * v;
                }
                for j in 0..n {
                    let w = cm[j * n + k];
                    for (d, v) in dst.iter_mut().zip(&old[j * h..(j + 1) * h]) {
                        *d += w * v;
                    }
                }
            }
        }
    }

    fn hyper_head(&self, hh: &HyperHead, streams: &[f32], rows: usize) -> CResult<Vec<f32>> {
        let (n, h) = (self.cfg.hc_mult, self.cfg.hidden);
        let mixes = self.stream_mixes(&hh.proj, streams, rows)?;
        let mut out = vec![0f32; rows * h];
        for r in 0..rows {
            for j in 0..n {
                let p = sigmoid(mixes[r * n + j] * hh.scale + hh.base[j]) + self.cfg.hc_eps;
                let src = &streams[(r * n + j) * h..(r * n + j + 1) * h];
                for (o, x) in out[r * h..(r + 1) * h].iter_mut().zip(src) {
                    *o += p * x;
                }
            }
        }
        Ok(out)
    }

    fn moe(&self, m: &Moe, x: Tensor, tokens: &[u32]) -> CResult<Vec<f32>> {
        let (dev, c) = (&self.dev, &self.cfg);
        let rows = x.rows();
        let logits = dev.to_host(m.router.forward(dev, &x)?)?;
        let xh = dev.to_host(x)?;
        let mut routes: Vec<Vec<(usize, f32)>> = vec![Vec::new(); c.experts];
        for r in 0..rows {
            let scores: Vec<f32> = logits[r * c.experts..(r + 1) * c.experts]
                .iter()
                .map(|&l| softplus(l).sqrt())
                .collect();
            let chosen: Vec<usize> = match (&m.tid2eid, &m.bias) {
                (Some(table), _) => {
                    let t = tokens[r] as usize;
                    table[t * c.top_k..(t + 1) * c.top_k].to_vec()
                }
                (None, bias) => {
                    let biased: Vec<f32> = scores
                        .iter()
                        .enumerate()
                        .map(|(e, s)| s + bias.as_ref().map_or(0.0, |b| b[e]))
                        .collect();
                    top_k(&biased, c.top_k)
                }
            };
            let sum: f32 = chosen.iter().map(|&e| scores[e]).sum::<f32>() + 1e-20;
            for &e in &chosen {
                routes[e].push((r, scores[e] / sum * c.routed_scale));
            }
        }
        let h = c.hidden;
        let shared = dev.tensor(rows, h, xh.clone())?;
        let mut out = self.clamped_mlp(&m.shared, &shared)?;
        for (e, list) in routes.iter().enumerate() {
            if list.is_empty() {
                continue;
            }
            let xe: Vec<f32> = list
                .iter()
                .flat_map(|&(r, _)| xh[r * h..(r + 1) * h].iter().copied())
                .collect();
            let ye = self.clamped_mlp(&m.experts[e], &dev.tensor(list.len(), h, xe)?)?;
            for (i, &(r, w)) in list.iter().enumerate() {
                for (o, y) in out[r * h..(r + 1) * h]
                    .iter_mut()
                    .zip(&ye[i * h..(i + 1) * h])
                {
                    *o += w * y;
                }
            }
        }
        Ok(out)
    }

    fn clamped_mlp(&self, m: &ClampedMlp, x: &Tensor) -> CResult<Vec<f32>> {
        let dev = &self.dev;
        let limit = self.cfg.swiglu_limit;
        let g = dev.to_host(m.gate.forward(dev, x)?)?;
        let u = dev.to_host(m.up.forward(dev, x)?)?;
        let act: Vec<f32> = g
            .iter()
            .zip(&u)
            .map(|(&g, &u)| {
                let g = g.min(limit);
                g / (1.0 + (-g).exp()) * u.clamp(-limit, limit)
            })
            .collect();
        let a = dev.tensor(x.rows(), g.len() / x.rows().max(1), act)?;
        dev.to_host(m.down.forward(dev, &a)?)
    }

    fn rms(&self, norm: &RmsNorm, x: Vec<f32>, rows: usize) -> CResult<Tensor> {
        let mut t = self.dev.tensor(rows, self.cfg.hidden, x)?;
        norm.forward_inplace(&self.dev, &mut t)?;
        Ok(t)
    }
}

fn mtp_kind(c: &V4Config, j: usize) -> AttnKind {
    c.mtp_kinds.get(j).copied().unwrap_or(AttnKind::Sliding)
}

fn load_block(
    nm: &Names,
    c: &V4Config,
    p: &str,
    kind: AttnKind,
    hashed: bool,
) -> Result<Block, ModelError> {
    let h = c.hidden;
    let hc = |which: &str| -> Result<HyperConnection, ModelError> {
        let n = c.hc_mult;
        let width = (2 + n) * n;
        Ok(HyperConnection {
            proj: Linear {
                w: nm.matrix(&format!("{p}.hc_{which}_fn"), width, n * h)?,
                b: None,
            },
            base: nm.host(&format!("{p}.hc_{which}_base"), &[width])?,
            scale: nm.host(&format!("{p}.hc_{which}_scale"), &[3])?,
        })
    };
    Ok(Block {
        attn_norm: nm.norm(&format!("{p}.attn_norm"), h)?,
        attn: Attention::load(nm, c, &format!("{p}.attn"), kind)?,
        ffn_norm: nm.norm(&format!("{p}.ffn_norm"), h)?,
        moe: load_moe(nm, c, &format!("{p}.ffn"), hashed)?,
        attn_hc: hc("attn")?,
        ffn_hc: hc("ffn")?,
    })
}

fn load_moe(nm: &Names, c: &V4Config, p: &str, hashed: bool) -> Result<Moe, ModelError> {
    let (h, i) = (c.hidden, c.moe_inter);
    let mlp = |q: &str| -> Result<ClampedMlp, ModelError> {
        Ok(ClampedMlp {
            gate: nm.linear(&format!("{q}.w1"), i, h)?,
            up: nm.linear(&format!("{q}.w3"), i, h)?,
            down: nm.linear(&format!("{q}.w2"), h, i)?,
        })
    };
    let tid2eid = if hashed {
        let name = format!("{p}.gate.tid2eid");
        let (shape, ids) = nm.integers(&name)?;
        if shape != [c.vocab, c.top_k] {
            return Err(ModelError::Shape {
                name,
                want: vec![c.vocab, c.top_k],
                got: shape,
            });
        }
        if let Some(bad) = ids.iter().find(|&&e| e < 0 || e as usize >= c.experts) {
            return Err(cfg_err(
                &name,
                format!("expert id {bad} (below n_routed_experts {})", c.experts),
            ));
        }
        Some(ids.into_iter().map(|e| e as usize).collect())
    } else {
        None
    };
    let bias_name = format!("{p}.gate.bias");
    Ok(Moe {
        router: nm.linear(&format!("{p}.gate"), c.experts, h)?,
        bias: if nm.has(&bias_name) {
            Some(nm.host(&bias_name, &[c.experts])?)
        } else {
            None
        },
        tid2eid,
        experts: (0..c.experts)
            .map(|e| match nm.ck.is_gguf() {
                // llama.cpp stacks each projection over the experts.
                true => Ok(ClampedMlp {
                    gate: nm.expert(&format!("{p}.experts.w1.weight"), [c.experts, i, h], e)?,
                    up: nm.expert(&format!("{p}.experts.w3.weight"), [c.experts, i, h], e)?,
                    down: nm.expert(&format!("{p}.experts.w2.weight"), [c.experts, h, i], e)?,
                }),
                false => mlp(&format!("{p}.experts.{e}")),
            })
            .collect::<Result<_, _>>()?,
        shared: mlp(&format!("{p}.shared_experts"))?,
    })
}

fn load_hyper_head(
    nm: &Names,
    c: &V4Config,
    name: &str,
    alt: &str,
) -> Result<HyperHead, ModelError> {
    let n = c.hc_mult;
    let fn_name = nm.first(&[name, alt])?;
    // `hc_head_fn` → `hc_head_base`; transformers' save: `hc_head.hc_fn` → `hc_head.hc_base`.
    let stem = fn_name.trim_end_matches("_fn");
    let (base, scale) = (format!("{stem}_base"), format!("{stem}_scale"));
    Ok(HyperHead {
        proj: Linear {
            w: nm.matrix(&fn_name, n, n * c.hidden)?,
            b: None,
        },
        base: nm.host(&base, &[n])?,
        scale: nm.host(&scale, &[1])?[0],
    })
}

impl CausalLm for DeepseekV4 {
    fn forward(&self, batch: &ForwardBatch, kv: &mut KvPool) -> Result<Vec<f32>, ComputeError> {
        let (dev, c) = (&self.dev, &self.cfg);
        let seqs = batch.attn_seqs();
        // Checks block tables and ids against the pool once, for every stream. The CPU arm
        // only checks: attention here reads the pool through `kv_read_rows`, on any device.
        let step = Device::Cpu.step(&seqs, kv, c.n_heads)?;
        let rows = step.n_rows();
        let positions = batch.positions();
        let (n, h) = (c.hc_mult, c.hidden);
        // The first read-back: inside a CUDA decode graph it fails here, before any pool row
        // is touched, and the engine runs this model's decode steps eagerly.
        let emb = dev.read_back(&dev.embed(&self.embed, batch.tokens, 1.0)?)?;
        let mut streams = vec![0f32; rows * n * h];
        for (r, e) in emb.chunks_exact(h).enumerate() {
            for j in 0..n {
                streams[(r * n + j) * h..(r * n + j + 1) * h].copy_from_slice(e);
            }
        }
        // A pool made from another model's shapes would index past a stream or mis-size a row.
        if kv.num_layers() != self.shapes.len() {
            return Err(ComputeError::Shape {
                what: "KV pool streams (deepseek_v4's kv_shapes)",
                got: kv.num_layers(),
                want: self.shapes.len(),
            });
        }
        for (i, want) in self.shapes.iter().enumerate() {
            let got = kv.layer_shape(i).map_or(0, |l| l.n_kv_heads * l.head_dim);
            if kv.layer_shape(i) != Some(*want) {
                return Err(ComputeError::Shape {
                    what: "KV pool stream width (heads × head_dim of kv_shapes)",
                    got,
                    want: want.n_kv_heads * want.head_dim,
                });
            }
        }
        for (b, st) in self.layers.iter().zip(&self.streams) {
            let (x, post, comb) = self.hc_pre(&b.attn_hc, &streams, rows)?;
            let x = self.rms(&b.attn_norm, x, rows)?;
            let a = b.attn.forward(dev, c, st, x, kv, &seqs, &positions)?;
            self.hc_post(&mut streams, &a, &post, &comb);
            let (x, post, comb) = self.hc_pre(&b.ffn_hc, &streams, rows)?;
            let x = self.rms(&b.ffn_norm, x, rows)?;
            let m = self.moe(&b.moe, x, batch.tokens)?;
            self.hc_post(&mut streams, &m, &post, &comb);
        }
        let wanted = batch.logit_rows();
        let last: Vec<f32> = wanted
            .iter()
            .flat_map(|&r| streams[r * n * h..(r + 1) * n * h].iter().copied())
            .collect();
        let x = self.hyper_head(&self.hc_head, &last, wanted.len())?;
        let x = self.rms(&self.norm, x, wanted.len())?;
        dev.to_host(self.head.forward(dev, &x)?)
    }

    /// One entry per stream, not per layer: see `deepseek_v4_attention.rs`.
    fn kv_shapes(&self) -> Vec<LayerKvShape> {
        self.shapes.clone()
    }

    fn vocab_size(&self) -> usize {
        self.cfg.vocab
    }
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// PyTorch's `softplus` (β 1, linear above 20).
fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

pub(super) fn unweighted_rms_norm(x: &mut [f32], eps: f32) {
    let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len().max(1) as f32;
    let inv = 1.0 / (ms + eps).sqrt();
    x.iter_mut().for_each(|v| *v *= inv);
}

/// Indices of the `k` largest values, ties to the lower index.
pub(super) fn top_k(x: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..x.len()).collect();
    idx.sort_by(|&a, &b| x[b].total_cmp(&x[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

/// Row softmax (+eps), then column / row normalizations to a near doubly-stochastic matrix,
/// as transformers' `DeepseekV4HyperConnection` orders them.
fn sinkhorn(m: &mut [f32], n: usize, iters: usize, eps: f32) {
    for row in m.chunks_exact_mut(n) {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0.0;
        for v in row.iter_mut() {
            *v = (*v - max).exp();
            sum += *v;
        }
        row.iter_mut().for_each(|v| *v = *v / sum + eps);
    }
    let cols = |m: &mut [f32]| {
        for k in 0..n {
            let s: f32 = (0..n).map(|j| m[j * n + k]).sum::<f32>() + eps;
            (0..n).for_each(|j| m[j * n + k] /= s);
        }
    };
    cols(m);
    for _ in 1..iters {
        for row in m.chunks_exact_mut(n) {
            let s: f32 = row.iter().sum::<f32>() + eps;
            row.iter_mut().for_each(|v| *v /= s);
        }
        cols(m);
    }
}
