//! The sparse MLP of `qwen3_5_moe`: softmax top-k routing over the experts (weights
//! renormalised over the chosen k), SwiGLU experts, and a shared expert scaled by a sigmoid
//! gate. The rest of the model is `qwen3_5.rs`.
//!
//! Experts come fused (`experts.gate_up_proj` `[E, 2I, H]`, `experts.down_proj` `[E, H, I]`,
//! transformers 5), stacked one tensor per projection (llama.cpp's `ffn_gate_exps` `[E, I, H]`,
//! ...) or one by one (`experts.{e}.gate_proj.weight`, ...); each expert is bound as three
//! matrices sharing the checkpoint's bytes.

use afm_runtime::compute::{Activation, ComputeError, Device, Tensor, Weight};
use afm_runtime::WeightMatrix;

use crate::checkpoint::{Checkpoint, NormNaming};
use crate::layers::{GatedMlp, Linear};
use crate::ModelError;

const N: NormNaming = NormNaming::Llama;

#[derive(Debug, Clone, Copy)]
pub struct MoeShape {
    pub num_experts: usize,
    pub top_k: usize,
    pub expert_inter: usize,
    pub shared_inter: usize,
}

struct Expert {
    gate: Weight,
    up: Weight,
    down: Weight,
}

pub struct SparseMoe {
    router: Linear,
    experts: Vec<Expert>,
    top_k: usize,
    shared: GatedMlp,
    shared_gate: Linear,
}

/// Expert `e`'s rows `r0..r0 + rows` of a stacked `[E, R, C]` tensor, without copying.
pub(crate) fn expert_rows(
    ck: &Checkpoint,
    name: &str,
    shape: [usize; 3],
    e: usize,
    r0: usize,
    rows: usize,
) -> Result<WeightMatrix, ModelError> {
    let v = ck.view(name, N)?;
    if v.shape != shape {
        return Err(ModelError::Shape {
            name: v.name,
            want: shape.to_vec(),
            got: v.shape,
        });
    }
    let row_bytes = v
        .dtype
        .row_bytes(shape[2])
        .ok_or_else(|| ModelError::Config {
            key: name.into(),
            reason: format!(
                "rows of {} are not whole {} blocks",
                shape[2],
                v.dtype.name()
            ),
        })?;
    let start = (e * shape[1] + r0) * row_bytes;
    let bytes = v
        .bytes
        .sub(start, rows * row_bytes)
        .ok_or_else(|| ModelError::Shape {
            name: v.name.clone(),
            want: shape.to_vec(),
            got: vec![v.bytes.len()],
        })?;
    WeightMatrix::new(v.dtype, rows, shape[2], bytes).map_err(|source| ModelError::Runtime {
        name: v.name,
        source,
    })
}

fn placed(dev: &Device, name: &str, w: WeightMatrix) -> Result<Weight, ModelError> {
    dev.weight(w).map_err(|source| ModelError::Device {
        name: name.into(),
        source,
    })
}

impl SparseMoe {
    /// `prefix` is the MLP's (`layers.3.mlp`); `name` turns an HF tensor name into the
    /// checkpoint's own (the identity for safetensors, llama.cpp's names for a GGUF).
    pub fn load(
        ck: &Checkpoint,
        dev: &Device,
        prefix: &str,
        name: &dyn Fn(&str) -> String,
        hidden: usize,
        s: MoeShape,
    ) -> Result<Self, ModelError> {
        let (e_n, i) = (s.num_experts, s.expert_inter);
        let nm = |m: &str| name(&format!("{prefix}.{m}"));
        let lin =
            |m: &str, out: usize, inp: usize| Linear::load(ck, dev, &nm(m), N, out, inp, false);
        let fused = nm("experts.gate_up_proj");
        // llama.cpp's layout: gate, up and down each stacked over the experts.
        let stacked = nm("experts.gate_proj.weight");
        let mut experts = Vec::with_capacity(e_n);
        for e in 0..e_n {
            let expert = if ck.has(&fused, N) {
                let down = nm("experts.down_proj");
                Expert {
                    gate: placed(
                        dev,
                        &fused,
                        expert_rows(ck, &fused, [e_n, 2 * i, hidden], e, 0, i)?,
                    )?,
                    up: placed(
                        dev,
                        &fused,
                        expert_rows(ck, &fused, [e_n, 2 * i, hidden], e, i, i)?,
                    )?,
                    down: placed(
                        dev,
                        &down,
                        expert_rows(ck, &down, [e_n, hidden, i], e, 0, hidden)?,
                    )?,
                }
            } else if ck.has(&stacked, N) {
                let part = |m: &str, shape: [usize; 3]| {
                    let n = nm(m);
                    placed(dev, &n, expert_rows(ck, &n, shape, e, 0, shape[1])?)
                };
                Expert {
                    gate: part("experts.gate_proj.weight", [e_n, i, hidden])?,
                    up: part("experts.up_proj.weight", [e_n, i, hidden])?,
                    down: part("experts.down_proj.weight", [e_n, hidden, i])?,
                }
            } else {
                let one = |m: &str, out: usize, inp: usize| {
                    lin(&format!("experts.{e}.{m}"), out, inp).map(|l| l.w)
                };
                Expert {
                    gate: one("gate_proj", i, hidden)?,
                    up: one("up_proj", i, hidden)?,
                    down: one("down_proj", hidden, i)?,
                }
            };
            experts.push(expert);
        }
        let si = s.shared_inter;
        Ok(Self {
            router: lin("gate", e_n, hidden)?,
            experts,
            top_k: s.top_k,
            shared: GatedMlp {
                gate: lin("shared_expert.gate_proj", si, hidden)?,
                up: lin("shared_expert.up_proj", si, hidden)?,
                down: lin("shared_expert.down_proj", hidden, si)?,
                act: Activation::Silu,
            },
            shared_gate: lin("shared_expert_gate", 1, hidden)?,
        })
    }

    pub fn forward(&self, dev: &Device, x: &Tensor) -> Result<Tensor, ComputeError> {
        let (rows, hidden) = (x.rows(), x.cols());
        let logits = dev.to_host(self.router.forward(dev, x)?)?;
        let routes = route(&logits, self.experts.len(), self.top_k);
        let mut acc = vec![0f32; rows * hidden];
        for (expert, chosen) in self.experts.iter().zip(&routes) {
            if chosen.is_empty() {
                continue;
            }
            let token_rows: Vec<usize> = chosen.iter().map(|&(r, _)| r).collect();
            let xe = dev.gather_rows(x, &token_rows)?;
            let mut g = dev.linear(&xe, &expert.gate, None)?;
            let u = dev.linear(&xe, &expert.up, None)?;
            dev.gated_act(Activation::Silu, &mut g, &u)?;
            let y = dev.to_host(dev.linear(&g, &expert.down, None)?)?;
            for (&(r, w), yr) in chosen.iter().zip(y.chunks_exact(hidden)) {
                for (a, b) in acc[r * hidden..(r + 1) * hidden].iter_mut().zip(yr) {
                    *a += w * b;
                }
            }
        }
        let shared = self.shared.forward(dev, x)?;
        let gate = self.shared_gate.forward(dev, x)?;
        dev.host_compute("moe combine", &[&shared, &gate], rows, hidden, |v| {
            let (s, g) = (v[0], v[1]);
            for (r, a) in acc.chunks_exact_mut(hidden).enumerate() {
                let sg = 1.0 / (1.0 + (-g[r]).exp());
                for (a, b) in a.iter_mut().zip(&s[r * hidden..(r + 1) * hidden]) {
                    *a += sg * b;
                }
            }
            Ok(acc)
        })
    }
}

/// For each expert, the `(row, weight)` pairs routed to it: softmax over the router logits,
/// the top k (ties to the lower expert id), renormalised to sum to 1.
fn route(logits: &[f32], experts: usize, k: usize) -> Vec<Vec<(usize, f32)>> {
    let mut routes = vec![Vec::new(); experts];
    let mut order: Vec<usize> = Vec::with_capacity(experts);
    for (r, row) in logits.chunks_exact(experts.max(1)).enumerate() {
        let mut p = row.to_vec();
        afm_runtime::ops::softmax(&mut p);
        order.clear();
        order.extend(0..experts);
        order.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
        let top = &order[..k.min(experts)];
        let sum: f32 = top.iter().map(|&e| p[e]).sum();
        for &e in top {
            routes[e].push((r, p[e] / sum));
        }
    }
    routes
}

#[cfg(test)]
mod tests {
    use super::route;

    #[test]
    fn routing_keeps_the_top_k_renormalised() {
        // Row 0 prefers experts 2 then 0; row 1 prefers 1 then 3.
        let logits = [1.0, 0.0, 2.0, -1.0, 0.0, 3.0, 0.0, 1.0];
        let r = route(&logits, 4, 2);
        let w20 = r[2][0].1;
        assert_eq!((r[2][0].0, r[0][0].0, r[1][0].0, r[3][0].0), (0, 0, 1, 1));
        assert!((w20 - 1.0 / (1.0 + (-1f32).exp())).abs() < 1e-6);
        assert!((r[2][0].1 + r[0][0].1 - 1.0).abs() < 1e-6);
    }
}
