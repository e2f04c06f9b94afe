//! Set-up shared by the GPU test binaries (`cuda_ops`, `cuda_attention_mma`): the one device
//! context, reproducible random data, error measures, and attention scenarios run on the CPU
//! and the device over the same KV cache contents.
// Each test binary uses a part of this module.
#![allow(dead_code)]

use std::sync::{Mutex, MutexGuard, OnceLock};

use afm_runtime::attention::{paged_attention, AttnParams, AttnSeq};
use afm_runtime::cuda::{self, AttnBatch, AttnKernel, CudaContext, CudaSlice, DeviceKvCache};
use afm_runtime::kv_store::{KvCache, KvDtype, LayerKvShape};

pub fn ctx() -> MutexGuard<'static, CudaContext> {
    static CTX: OnceLock<Mutex<CudaContext>> = OnceLock::new();
    CTX.get_or_init(|| {
        let ordinal = std::env::var("AFM_CUDA_DEVICE")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let c = CudaContext::new(ordinal).unwrap_or_else(|e| panic!("CUDA context: {e}"));
        eprintln!("device: {:?}", c.info());
        Mutex::new(c)
    })
    .lock()
    .unwrap_or_else(|e| e.into_inner())
}

/// splitmix64: reproducible data without a dependency.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }
    /// Uniform in [-a, a).
    pub fn sym(&mut self, a: f32) -> f32 {
        (2.0 * self.unit() - 1.0) * a
    }
    pub fn vec(&mut self, n: usize, a: f32) -> Vec<f32> {
        (0..n).map(|_| self.sym(a)).collect()
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            v.swap(i, self.below(i + 1));
        }
    }
}

pub fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len(), "length");
    let (mut num, mut den) = (0f64, 0f64);
    for (&g, &w) in got.iter().zip(want) {
        assert!(
            g.is_finite(),
            "non-finite output {g} (unwritten or overflow)"
        );
        num += (g as f64 - w as f64).powi(2);
        den += (w as f64).powi(2);
    }
    (num / den.max(1e-30)).sqrt()
}

pub fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f64) {
    let e = rel_err(got, want);
    eprintln!("{what}: rel err {e:.2e}");
    assert!(e <= tol, "{what}: relative error {e:.3e} > {tol:.0e}");
}

pub fn poisoned(c: &CudaContext, n: usize) -> CudaSlice<f32> {
    c.upload(&vec![f32::NAN; n]).unwrap()
}

/// One attention scenario: the CPU cache and the device cache get the same K/V (history
/// through one batch, the step's new tokens through another), then both attend
/// ([`run_attention`]).
pub struct AttnCase {
    pub n_heads: usize,
    pub n_kv: usize,
    pub d: usize,
    pub dtype: KvDtype,
    pub window: Option<usize>,
    pub softcap: Option<f32>,
    /// (cached positions before the step, new tokens in the step) per sequence.
    pub seqs: Vec<(usize, usize)>,
    pub splits: Option<usize>,
}

/// Runs `case` on the CPU (the reference) and on the device once per kernel choice in
/// `kernels`, all on the same caches and queries: the CPU output and each device output (or
/// the device's error).
pub fn run_attention(
    c: &mut CudaContext,
    rng: &mut Rng,
    case: &AttnCase,
    kernels: &[AttnKernel],
) -> (Vec<f32>, Vec<cuda::Result<Vec<f32>>>) {
    let (bs, d, nkv) = (16, case.d, case.n_kv);
    let shape = LayerKvShape {
        n_kv_heads: nkv,
        head_dim: d,
    };
    let need: Vec<usize> = case
        .seqs
        .iter()
        .map(|&(p, l)| (p + l).div_ceil(bs))
        .collect();
    let num_blocks = need.iter().sum::<usize>() + 7;
    let mut ids: Vec<u32> = (0..num_blocks as u32).collect();
    rng.shuffle(&mut ids); // scattered tables
    let mut tables = Vec::new();
    let mut at = 0;
    for &n in &need {
        tables.push(ids[at..at + n].to_vec());
        at += n;
    }
    let mut cpu = KvCache::new(&[shape], num_blocks, bs, case.dtype);
    let mut dev = DeviceKvCache::new(c, &[shape], num_blocks, bs, case.dtype).unwrap();
    let width = nkv * d;
    let mut write = |c: &mut CudaContext, rows: Vec<(usize, usize, usize)>| {
        // rows: (sequence, first position, count)
        let mut seqs = Vec::new();
        let mut row0 = 0;
        for &(s, p0, n) in &rows {
            seqs.push(AttnSeq {
                row0,
                len: n,
                pos0: p0,
                block_table: &tables[s],
            });
            row0 += n;
        }
        if row0 == 0 {
            return;
        }
        let (k, v) = (rng.vec(row0 * width, 1.0), rng.vec(row0 * width, 1.0));
        for sq in &seqs {
            for i in 0..sq.len {
                let r = (sq.row0 + i) * width;
                let (kr, vr) = (&k[r..r + width], &v[r..r + width]);
                cpu.layers[0].write(sq.block_table, sq.pos0 + i, kr, vr);
            }
        }
        let batch = AttnBatch::new(c, &dev, &seqs, case.n_heads).unwrap();
        let (kd, vd) = (c.upload(&k).unwrap(), c.upload(&v).unwrap());
        c.kv_write(&mut dev, 0, &batch, &kd, width, &vd, width)
            .unwrap();
    };
    let hist = case
        .seqs
        .iter()
        .enumerate()
        .map(|(s, &(p, _))| (s, 0, p))
        .collect();
    write(c, hist);
    let step = case
        .seqs
        .iter()
        .enumerate()
        .map(|(s, &(p, l))| (s, p, l))
        .collect();
    write(c, step);

    // The device cache holds exactly what the CPU cache holds.
    for (s, t) in tables.iter().enumerate().take(2) {
        let (kd, vd) = dev.layers[0]
            .read_block(c, &dev, t[0] as usize, nkv - 1)
            .unwrap();
        let mut kc = vec![0f32; bs * d];
        let mut vc = vec![0f32; bs * d];
        cpu.layers[0].read_keys(t[0], nkv - 1, 0, &mut kc);
        cpu.layers[0].read_values(t[0], nkv - 1, 0, &mut vc);
        let n = (case.seqs[s].0 + case.seqs[s].1).min(bs) * d;
        assert_eq!(
            (&kd[..n], &vd[..n]),
            (&kc[..n], &vc[..n]),
            "stored K/V differ"
        );
    }

    let mut seqs = Vec::new();
    let mut row0 = 0;
    for (s, &(p, l)) in case.seqs.iter().enumerate() {
        seqs.push(AttnSeq {
            row0,
            len: l,
            pos0: p,
            block_table: &tables[s],
        });
        row0 += l;
    }
    let qw = case.n_heads * d;
    let q = rng.vec(row0 * qw, 1.0);
    let params = AttnParams {
        n_heads: case.n_heads,
        head_dim: d,
        scale: 1.0 / (d as f32).sqrt(),
        window: case.window,
        softcap: case.softcap,
    };
    let mut want = vec![0f32; row0 * qw];
    paged_attention(&q, &cpu.layers[0], &seqs, &params, &mut want);
    let batch = AttnBatch::new(c, &dev, &seqs, case.n_heads).unwrap();
    let qd = c.upload(&q).unwrap();
    let got = kernels
        .iter()
        .map(|&k| {
            let mut out = poisoned(c, row0 * qw);
            c.paged_attention_with(
                k,
                &dev,
                0,
                &batch,
                &qd,
                qw,
                &params,
                &mut out,
                qw,
                case.splits,
            )?;
            c.download(&out)
        })
        .collect();
    (want, got)
}
