//! Device dispatch: the CPU arm is the host code; with `--features cuda` and
//! `AFM_TEST_DEVICE=cuda`, every op on the GPU matches the CPU arm.

use super::*;

#[test]
fn device_choice_parses_what_users_type() {
    assert_eq!("cpu".parse::<DeviceChoice>(), Ok(DeviceChoice::Cpu));
    assert_eq!("cuda".parse::<DeviceChoice>(), Ok(DeviceChoice::Cuda(0)));
    assert_eq!("CUDA:3".parse::<DeviceChoice>(), Ok(DeviceChoice::Cuda(3)));
    assert!("cuda:x".parse::<DeviceChoice>().is_err());
    assert!("metal".parse::<DeviceChoice>().is_err());
    assert_eq!(DeviceChoice::Cuda(1).to_string(), "cuda:1");
}

#[test]
fn cpu_linear_is_the_host_matmul_plus_bias() {
    let dev = Device::Cpu;
    let w = WeightMatrix::from_f32(3, 2, &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    let w = dev.weight(w).expect("cpu weight");
    let b = dev.vector(vec![0.5, 0.0, -1.0]).expect("cpu vector");
    let x = Tensor::from_host(2, 2, vec![1.0, 1.0, 0.0, 2.0]).expect("shape");
    let y = dev
        .to_host(dev.linear(&x, &w, Some(&b)).expect("linear"))
        .expect("host");
    assert_eq!(y, vec![3.5, 7.0, 10.0, 4.5, 8.0, 11.0]);
}

#[test]
fn shape_errors_name_the_operand() {
    let dev = Device::Cpu;
    let w = dev
        .weight(WeightMatrix::from_f32(2, 2, &[0.0; 4]))
        .expect("weight");
    let x = Tensor::from_host(1, 3, vec![0.0; 3]).expect("shape");
    let err = dev
        .linear(&x, &w, None)
        .err()
        .expect("width mismatch")
        .to_string();
    assert!(
        err.contains("linear input width") && err.contains('3'),
        "{err}"
    );
    let err = dev
        .embed(&w, &[5], 1.0)
        .err()
        .expect("id out of range")
        .to_string();
    assert!(err.contains("token id"), "{err}");
}

#[cfg(not(feature = "cuda"))]
#[test]
fn cuda_is_refused_by_a_cpu_build() {
    let err = Device::open(DeviceChoice::Cuda(0))
        .expect_err("no cuda")
        .to_string();
    assert!(err.contains("--features cuda"), "{err}");
}

/// splitmix64 values in [-1, 1).
fn splitmix(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// A `rows × cols` tensor of `splitmix(seed)` values placed on `d` (through an embedding, the
/// one op that creates a tensor on any device).
fn placed_tensor(d: &Device, rows: usize, cols: usize, seed: u64) -> Tensor {
    let values = splitmix(seed, rows * cols)
        .iter()
        .map(|v| 2.0 * v)
        .collect::<Vec<_>>();
    let table = d
        .weight(WeightMatrix::from_f32(rows, cols, &values))
        .expect("weight");
    let ids: Vec<u32> = (0..rows as u32).collect();
    d.embed(&table, &ids, 1.0).expect("embed")
}

/// How [`attention_layer_steps`] runs a layer's attention.
#[derive(Clone, Copy, Debug, PartialEq)]
enum AttnPath {
    /// Norms, RoPE and `attention` (with its store), op by op.
    Separate,
    /// `attn_prologue` + `attend`.
    Prologue,
    /// `attend_prologue` (one launch for the decode steps on a GPU).
    Fused,
}

/// One layer's attention over six steps of two sequences on scattered blocks of 4 tokens
/// (a prefill of 7 and 10 tokens, a decode step of both, a chunk of 3 beside a decode row,
/// three more decode steps crossing a block boundary) through `path`. Returns every step's
/// attention output followed by both sequences' cached keys and values at the end, and every
/// step's rotated q and k (none for [`AttnPath::Fused`], which consumes them).
fn attention_layer_steps(
    d: &Device,
    path: AttnPath,
    norm: bool,
    dtype: KvDtype,
    (nh, nkv, hd): (usize, usize, usize),
) -> (Vec<f32>, Vec<f32>) {
    let shape = LayerKvShape {
        n_kv_heads: nkv,
        head_dim: hd,
    };
    let mut kv = d.kv_pool(&[shape, shape], 12, 4, dtype).expect("pool");
    let rope = Rope::new(hd, 1e6, 1.0, RopeStyle::Neox);
    let rot = d.rotary(rope, hd, RopeStyle::Neox, 64).expect("rotary");
    let head_w = |seed| splitmix(seed, hd).iter().map(|v| 1.0 + 0.5 * v).collect();
    let qn = d.vector(head_w(60)).expect("q_norm");
    let kn = d.vector(head_w(61)).expect("k_norm");
    let (ta, tb) = ([9u32, 1, 4, 3], [2u32, 0, 11, 6]);
    let p = AttnParams::scaled(nh, hd);
    let (mut out, mut qk) = (Vec::new(), Vec::new());
    let steps = [
        (7, 0, 10, 0),
        (1, 7, 1, 10),
        (3, 8, 1, 11),
        (1, 11, 1, 12),
        (1, 12, 1, 13),
        (1, 13, 1, 14),
    ];
    for (i, (la, pa, lb, pb)) in steps.into_iter().enumerate() {
        let seqs = [
            AttnSeq {
                row0: 0,
                len: la,
                pos0: pa,
                block_table: &ta,
            },
            AttnSeq {
                row0: la,
                len: lb,
                pos0: pb,
                block_table: &tb,
            },
        ];
        let step = d.step(&seqs, &kv, nh).expect("step");
        let (rows, seed) = (la + lb, 100 * i as u64);
        let mut q = placed_tensor(d, rows, nh * hd, seed + 1);
        let mut k = placed_tensor(d, rows, nkv * hd, seed + 2);
        let v = placed_tensor(d, rows, nkv * hd, seed + 3);
        let nm = norm.then_some(QkNorm {
            q: &qn,
            k: &kn,
            eps: 1e-6,
        });
        let o = match path {
            AttnPath::Fused => d
                .attend_prologue(
                    &rot,
                    nm,
                    Qkv::new(q, k, v).expect("qkv"),
                    &mut kv,
                    1,
                    &step,
                    &p,
                )
                .expect("attend_prologue"),
            AttnPath::Prologue => {
                d.attn_prologue(&rot, nm, &mut q, &mut k, &v, &mut kv, 1, &step, hd)
                    .expect("prologue");
                let o = d.attend(&kv, 1, &step, &q, &p).expect("attend");
                qk.extend(d.to_host(q).expect("q"));
                qk.extend(d.to_host(k).expect("k"));
                o
            }
            AttnPath::Separate => {
                if norm {
                    d.rms_norm_in_place(&mut q, &qn, 1e-6).expect("q norm");
                    d.rms_norm_in_place(&mut k, &kn, 1e-6).expect("k norm");
                }
                d.rope(&rot, &mut q, hd, &step).expect("rope q");
                d.rope(&rot, &mut k, hd, &step).expect("rope k");
                let o = d
                    .attention(&mut kv, 1, &step, &q, &k, &v, &p)
                    .expect("attention");
                qk.extend(d.to_host(q).expect("q"));
                qk.extend(d.to_host(k).expect("k"));
                o
            }
        };
        out.extend(d.to_host(o).expect("to host"));
    }
    let positions: Vec<usize> = (0..15).collect();
    for (table, n) in [(&ta, 14), (&tb, 15)] {
        for part in [KvPart::Keys, KvPart::Values] {
            let rows = d
                .kv_read_rows(&kv, 1, table, &positions[..n], part)
                .expect("cache rows");
            out.extend(rows);
        }
    }
    (out, qk)
}

/// The CPU arm of the fused attention step is the separate ops, to the bit: prefill, decode
/// and a mixed chunk, with and without head norms, f32 and f16 caches, GQA and MHA.
#[test]
fn cpu_attn_prologue_and_attend_equal_the_separate_ops() {
    for shape in [(4, 2, 16), (8, 2, 64), (4, 4, 128)] {
        for norm in [false, true] {
            for dtype in [KvDtype::F32, KvDtype::F16] {
                let what = format!("heads/kv/head_dim {shape:?} norm {norm} {dtype:?}");
                let cpu = |path| attention_layer_steps(&Device::Cpu, path, norm, dtype, shape);
                let (a, qa) = cpu(AttnPath::Prologue);
                let (b, qb) = cpu(AttnPath::Separate);
                let (c, _) = cpu(AttnPath::Fused);
                assert!(a.iter().all(|x| x.is_finite()), "{what}: non-finite output");
                assert_eq!((&a, &qa), (&b, &qb), "{what}: prologue + attend");
                assert_eq!(c, b, "{what}: attend_prologue");
            }
        }
    }
}

#[test]
fn attn_prologue_refuses_mismatched_shapes() {
    let d = Device::Cpu;
    let shape = LayerKvShape {
        n_kv_heads: 2,
        head_dim: 16,
    };
    let mut kv = d.kv_pool(&[shape], 4, 4, KvDtype::F32).expect("pool");
    let rot = d
        .rotary(
            Rope::new(16, 1e4, 1.0, RopeStyle::Neox),
            16,
            RopeStyle::Neox,
            8,
        )
        .expect("rotary");
    let table = [0u32];
    let seqs = [AttnSeq {
        row0: 0,
        len: 1,
        pos0: 0,
        block_table: &table,
    }];
    let step = d.step(&seqs, &kv, 4).expect("step");
    let mut q = placed_tensor(&d, 1, 64, 1);
    let v = placed_tensor(&d, 1, 32, 3);
    // A key row one head short of the cache's width.
    let mut k = placed_tensor(&d, 1, 16, 2);
    let err = d
        .attn_prologue(&rot, None, &mut q, &mut k, &v, &mut kv, 0, &step, 16)
        .expect_err("key width");
    assert!(err.to_string().contains("value width"), "{err}");
    let mut k = placed_tensor(&d, 1, 32, 2);
    // A norm weight for another head size.
    let w = d.vector(vec![1.0; 8]).expect("vector");
    let nm = QkNorm {
        q: &w,
        k: &w,
        eps: 1e-6,
    };
    let err = d
        .attn_prologue(&rot, Some(nm), &mut q, &mut k, &v, &mut kv, 0, &step, 16)
        .expect_err("norm length");
    assert!(err.to_string().contains("q_norm length"), "{err}");
    let err = d
        .attn_prologue(&rot, None, &mut q, &mut k, &v, &mut kv, 1, &step, 16)
        .expect_err("layer");
    assert!(err.to_string().contains("KV layer index"), "{err}");
}

#[cfg(feature = "cuda")]
mod gpu;
