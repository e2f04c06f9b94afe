//! A mixture-of-experts feed-forward block: the experts' gated-MLP weights and the sparse
//! forward over routes an architecture's own router chose. Routing (softmax or sigmoid scores,
//! grouping, bias correction, per-expert scales, shared experts) stays in the architecture
//! file; [`softmax_top_k`] is the common softmax → top-k → renormalize case, as a helper.
//!
//! ```text
//! x: [rows][hidden]      routes: (row, expert, weight), any order, ≤ 1 per (row, expert)
//!
//! for each expert e with routes:   xe  = x[rows routed to e]            gather
//!                                  ye  = down_e(act(gate_e(xe)) · up_e(xe))
//!                                  out[row] += weight · ye[row]         weighted index add
//! ```
//!
//! Weights come from fused 3-D tensors (transformers 5: `gate_up_proj` `[E, 2·I, H]`, gate rows
//! first, and `down_proj` `[E, H, I]`; llama.cpp: `ffn_{gate,up,down}_exps` `[E, rows, cols]`)
//! or one 2-D tensor per expert (`{prefix}.{e}.gate_proj.weight`, Mixtral/Qwen-MoE style).
//! Each expert's matrix is a view into the checkpoint's bytes, not a copy.

use afm_runtime::compute::{Activation, ComputeError, Device, Tensor, Weight};
use afm_runtime::WeightMatrix;

use crate::checkpoint::{Checkpoint, NormNaming};
use crate::layers::matrix;
use crate::ModelError;

/// One token's share of one expert: `weight · expert(x[row])` is added to output row `row`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Route {
    pub row: usize,
    pub expert: usize,
    pub weight: f32,
}

/// Sizes of every expert: `hidden` in and out, `inter` between.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertShape {
    pub num_experts: usize,
    pub hidden: usize,
    pub inter: usize,
}

/// The experts of one layer, on one device.
pub struct Experts {
    gate: Vec<Weight>,
    up: Vec<Weight>,
    down: Vec<Weight>,
    act: Activation,
    shape: ExpertShape,
}

impl Experts {
    /// transformers 5's fused tensors: `gate_up` `[E, 2·I, H]` (each expert's gate rows, then
    /// its up rows) and `down` `[E, H, I]`.
    pub fn load_fused(
        ck: &Checkpoint,
        dev: &Device,
        gate_up: &str,
        down: &str,
        n: NormNaming,
        shape: ExpertShape,
        act: Activation,
    ) -> Result<Self, ModelError> {
        let (h, i) = (shape.hidden, shape.inter);
        Ok(Self {
            gate: stacked(ck, dev, gate_up, n, shape.num_experts, [2 * i, h], 0, i)?,
            up: stacked(ck, dev, gate_up, n, shape.num_experts, [2 * i, h], i, i)?,
            down: stacked(ck, dev, down, n, shape.num_experts, [h, i], 0, h)?,
            act,
            shape,
        })
    }

    /// One 3-D tensor per projection (llama.cpp's `ffn_gate_exps` etc.): `gate` and `up`
    /// `[E, I, H]`, `down` `[E, H, I]`.
    pub fn load_stacked(
        ck: &Checkpoint,
        dev: &Device,
        [gate, up, down]: [&str; 3],
        n: NormNaming,
        shape: ExpertShape,
        act: Activation,
    ) -> Result<Self, ModelError> {
        let (e, h, i) = (shape.num_experts, shape.hidden, shape.inter);
        Ok(Self {
            gate: stacked(ck, dev, gate, n, e, [i, h], 0, i)?,
            up: stacked(ck, dev, up, n, e, [i, h], 0, i)?,
            down: stacked(ck, dev, down, n, e, [h, i], 0, h)?,
            act,
            shape,
        })
    }

    /// One matrix per expert and projection: `{prefix}.{e}.{gate,up,down}_proj.weight`.
    pub fn load_per_expert(
        ck: &Checkpoint,
        dev: &Device,
        prefix: &str,
        n: NormNaming,
        shape: ExpertShape,
        act: Activation,
    ) -> Result<Self, ModelError> {
        let (h, i) = (shape.hidden, shape.inter);
        let each = |proj: &str, rows: usize, cols: usize| {
            (0..shape.num_experts)
                .map(|e| {
                    matrix(
                        ck,
                        dev,
                        &format!("{prefix}.{e}.{proj}.weight"),
                        n,
                        rows,
                        cols,
                    )
                })
                .collect::<Result<Vec<_>, _>>()
        };
        Ok(Self {
            gate: each("gate_proj", i, h)?,
            up: each("up_proj", i, h)?,
            down: each("down_proj", h, i)?,
            act,
            shape,
        })
    }

    pub fn shape(&self) -> ExpertShape {
        self.shape
    }

    /// `[x.rows][hidden]`: for every route, `weight · down(act(gate(x[row])) · up(x[row]))`
    /// summed into its row; rows no route names stay zero. Experts run in ascending order
    /// (as transformers' loop does), each over all of its rows at once.
    pub fn forward(
        &self,
        dev: &Device,
        x: &Tensor,
        routes: &[Route],
    ) -> Result<Tensor, ComputeError> {
        let mut per_expert = vec![(Vec::new(), Vec::new()); self.shape.num_experts];
        for r in routes {
            if r.row >= x.rows() {
                return Err(ComputeError::Shape {
                    what: "route row (below the input's rows)",
                    got: r.row,
                    want: x.rows(),
                });
            }
            let (rows, weights) = per_expert.get_mut(r.expert).ok_or(ComputeError::Shape {
                what: "route expert (below the number of experts)",
                got: r.expert,
                want: self.shape.num_experts,
            })?;
            rows.push(r.row);
            weights.push(r.weight);
        }
        let mut out = dev.zeros(x.rows(), self.shape.hidden)?;
        for (e, (rows, weights)) in per_expert.iter().enumerate() {
            if rows.is_empty() {
                continue;
            }
            let xe = dev.gather_rows(x, rows)?;
            let mut g = dev.linear(&xe, &self.gate[e], None)?;
            let u = dev.linear(&xe, &self.up[e], None)?;
            dev.gated_act(self.act, &mut g, &u)?;
            let y = dev.linear(&g, &self.down[e], None)?;
            dev.index_add_rows(&mut out, &y, rows, weights)?;
        }
        Ok(out)
    }
}

/// Rows `r0..r0 + rows` of each expert's `[per_expert[0], per_expert[1]]` slab of the 3-D
/// tensor `name` (`[experts, per_expert[0], per_expert[1]]`), one matrix per expert.
#[allow(clippy::too_many_arguments)]
fn stacked(
    ck: &Checkpoint,
    dev: &Device,
    name: &str,
    n: NormNaming,
    experts: usize,
    per_expert: [usize; 2],
    r0: usize,
    rows: usize,
) -> Result<Vec<Weight>, ModelError> {
    let v = ck.view(name, n)?;
    let [slab_rows, cols] = per_expert;
    if v.shape != [experts, slab_rows, cols] {
        return Err(ModelError::Shape {
            name: v.name,
            want: vec![experts, slab_rows, cols],
            got: v.shape,
        });
    }
    let bad = |why: String| ModelError::Config {
        key: v.name.clone(),
        reason: why,
    };
    let row_bytes = v.dtype.row_bytes(cols).ok_or_else(|| {
        bad(format!(
            "rows of {cols} values are not whole {} blocks",
            v.dtype.name()
        ))
    })?;
    (0..experts)
        .map(|e| {
            let offset = (e * slab_rows + r0) * row_bytes;
            let bytes = v
                .bytes
                .sub(offset, rows * row_bytes)
                .ok_or_else(|| bad(format!("expert {e} lies beyond the tensor's bytes")))?;
            let w = WeightMatrix::new(v.dtype, rows, cols, bytes).map_err(|source| {
                ModelError::Runtime {
                    name: format!("{}[{e}]", v.name),
                    source,
                }
            })?;
            dev.weight(w).map_err(|source| ModelError::Device {
                name: format!("{}[{e}]", v.name),
                source,
            })
        })
        .collect()
}

/// The common router: per row of `logits` (`[rows][n_experts]`), softmax, the `k` largest
/// probabilities (ties to the lower expert id), renormalized to sum to 1 when `renormalize`.
pub fn softmax_top_k(logits: &[f32], n_experts: usize, k: usize, renormalize: bool) -> Vec<Route> {
    let mut routes = Vec::with_capacity(logits.len() / n_experts.max(1) * k);
    for (row, l) in logits.chunks_exact(n_experts.max(1)).enumerate() {
        let mut p = l.to_vec();
        afm_runtime::ops::softmax(&mut p);
        let mut order: Vec<usize> = (0..p.len()).collect();
        order.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
        order.truncate(k);
        let sum: f32 = order.iter().map(|&e| p[e]).sum();
        let norm = if renormalize && sum > 0.0 { sum } else { 1.0 };
        routes.extend(order.into_iter().map(|expert| Route {
            row,
            expert,
            weight: p[expert] / norm,
        }));
    }
    routes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_picks_the_largest_and_renormalizes() {
        // Row 0 prefers experts 2 then 0; row 1 prefers 1 then 3.
        let logits = [1.0, -1.0, 2.0, 0.0, 0.0, 3.0, -2.0, 1.0];
        let r = softmax_top_k(&logits, 4, 2, true);
        let picked: Vec<(usize, usize)> = r.iter().map(|r| (r.row, r.expert)).collect();
        assert_eq!(picked, vec![(0, 2), (0, 0), (1, 1), (1, 3)]);
        let w0 = r[0].weight + r[1].weight;
        assert!((w0 - 1.0).abs() < 1e-6);
        // e^2 / (e^2 + e^1) for the first choice of row 0.
        let want = 1.0 / (1.0 + (-1.0f32).exp());
        assert!((r[0].weight - want).abs() < 1e-6);
    }

    #[test]
    fn forward_sums_weighted_experts_per_row() {
        // Two experts over hidden 2, inter 1, SiLU: expert e computes down_e · silu(g_e·x) · (u_e·x).
        let dev = Device::Cpu;
        let w = |rows, cols, v: &[f32]| dev.weight(WeightMatrix::from_f32(rows, cols, v)).unwrap();
        let experts = Experts {
            gate: vec![w(1, 2, &[1.0, 0.0]), w(1, 2, &[0.0, 1.0])],
            up: vec![w(1, 2, &[1.0, 1.0]), w(1, 2, &[2.0, 0.0])],
            down: vec![w(2, 1, &[1.0, -1.0]), w(2, 1, &[0.5, 0.5])],
            act: Activation::Silu,
            shape: ExpertShape {
                num_experts: 2,
                hidden: 2,
                inter: 1,
            },
        };
        let x = Tensor::from_host(2, 2, vec![1.0, 2.0, -1.0, 0.5]).unwrap();
        let routes = [
            Route {
                row: 0,
                expert: 0,
                weight: 0.25,
            },
            Route {
                row: 0,
                expert: 1,
                weight: 0.75,
            },
            Route {
                row: 1,
                expert: 1,
                weight: 1.0,
            },
        ];
        let got = dev
            .to_host(experts.forward(&dev, &x, &routes).unwrap())
            .unwrap();
        let silu = afm_runtime::ops::silu;
        let e0 = |x: [f32; 2]| {
            let h = silu(x[0]) * (x[0] + x[1]);
            [h, -h]
        };
        let e1 = |x: [f32; 2]| {
            let h = silu(x[1]) * (2.0 * x[0]);
            [0.5 * h, 0.5 * h]
        };
        let (a, b, c) = (e0([1.0, 2.0]), e1([1.0, 2.0]), e1([-1.0, 0.5]));
        let want = [
            0.25 * a[0] + 0.75 * b[0],
            0.25 * a[1] + 0.75 * b[1],
            c[0],
            c[1],
        ];
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() < 1e-6, "{got:?} vs {want:?}");
        }
        let bad = [Route {
            row: 0,
            expert: 2,
            weight: 1.0,
        }];
        assert!(experts.forward(&dev, &x, &bad).is_err());
    }
}
