//! Matmul throughput: GB/s of weight bytes streamed and GFLOP/s, per type, shape, batch and
//! thread count. Plain `std::time`; run with `cargo bench -p afm-runtime --bench matmul`.
//!
//! Two weight residencies are measured:
//! - `hot`: one matrix, reused call after call (it sits in L2/L3): kernel speed;
//! - `dram`: enough copies of the matrix to exceed the last-level cache, used in turn, as a
//!   decode step walks through a model's layers: memory bandwidth.
//!
//! `cpu%` is the process's CPU time over wall time: near 100·threads on an idle machine; far
//! below it, other work on the machine took the cores and the wall numbers understate.
//! `GB/cpu-s` divides the weight bytes by CPU time instead: the kernel's cost on a shared box.
//!
//! Args (optional): `quick` (shorter runs), and type names (`Q4_1 Q3_K`) instead of the
//! default set, or `models` for only the whole-model decode sweep.

use afm_runtime::quant::Isa;
use afm_runtime::threads::with_hot_workers as hot_workers;
use afm_runtime::{DType, WeightBytes, WeightMatrix};
use std::time::{Duration, Instant};

/// splitmix64, for deterministic random blocks.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

/// Byte offsets of the f16 scales in a block: kept finite so timings see real numbers.
fn f16_fields(dtype: DType) -> &'static [usize] {
    match dtype {
        DType::Q4_1 | DType::Q5_1 | DType::Q4K | DType::Q5K => &[0, 2],
        DType::Q4_0 | DType::Q5_0 | DType::Q8_0 => &[0],
        DType::Q2K => &[80, 82],
        DType::Q3K => &[108],
        DType::Q6K => &[208],
        DType::F32 | DType::F16 | DType::BF16 | DType::Mxfp4 => &[],
    }
}

fn random_matrix(rng: &mut Rng, dtype: DType, rows: usize, cols: usize) -> WeightMatrix {
    let len = dtype.row_bytes(cols).expect("block-aligned shape") * rows;
    let mut b = vec![0u8; len];
    for c in b.chunks_mut(8) {
        c.copy_from_slice(&rng.next().to_le_bytes()[..c.len()]);
    }
    match dtype {
        DType::F32 => {
            for c in b.chunks_exact_mut(4) {
                c.copy_from_slice(&((rng.next() % 2000) as f32 * 1e-4 - 0.1).to_le_bytes());
            }
        }
        DType::F16 | DType::BF16 => {
            for c in b.chunks_exact_mut(2) {
                c[1] &= 0x3f; // small finite values either way
            }
        }
        _ => {
            for block in b.chunks_exact_mut(dtype.block_bytes()) {
                for &off in f16_fields(dtype) {
                    let v = half::f16::from_f32((rng.next() % 1000) as f32 * 1e-5);
                    block[off..off + 2].copy_from_slice(&v.to_le_bytes());
                }
            }
        }
    }
    WeightMatrix::new(dtype, rows, cols, WeightBytes::from_vec(b)).expect("valid matrix")
}

/// The pool of `threads` workers, built once and kept: a pool dropped mid-run would take
/// its threads' CPU time out of `cpu_ns` while another measurement is under way.
fn pool(threads: usize) -> &'static rayon::ThreadPool {
    static POOLS: std::sync::OnceLock<[rayon::ThreadPool; 2]> = std::sync::OnceLock::new();
    let build = |n| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build()
            .expect("pool")
    };
    &POOLS.get_or_init(|| [build(1), build(2)])[threads - 1]
}

/// CPU time of every thread of this process so far, in ns (`/proc/self/task/*/schedstat`),
/// so a run on a shared machine can be told apart from a slow kernel.
fn cpu_ns() -> u64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

/// Wall and CPU seconds per call: repeat `f` until `budget` has passed, best of 5 rounds.
fn time_per_call(budget: Duration, mut f: impl FnMut()) -> (f64, f64) {
    f();
    let mut best = (f64::INFINITY, f64::INFINITY);
    for _ in 0..5 {
        let (start, cpu0) = (Instant::now(), cpu_ns());
        let mut calls = 0u32;
        while start.elapsed() < budget / 5 || calls == 0 {
            f();
            calls += 1;
        }
        let wall = start.elapsed().as_secs_f64() / calls as f64;
        let cpu = cpu_ns().saturating_sub(cpu0) as f64 * 1e-9 / calls as f64;
        if wall < best.0 {
            best = (wall, cpu);
        }
    }
    best
}

struct Row {
    dtype: DType,
    rows: usize,
    cols: usize,
    n: usize,
    threads: usize,
    residency: &'static str,
    secs: f64,
    cpu_secs: f64,
    bytes: usize,
}

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    let quick = args.iter().any(|a| a == "quick");
    let budget = Duration::from_millis(if quick { 150 } else { 600 });
    if args.iter().any(|a| a == "models") {
        model_decode(budget);
        return;
    }
    // `n=1,8,16`: the activation row counts to time (default 1 and 64).
    let ns: Vec<usize> = args
        .iter()
        .find_map(|a| a.strip_prefix("n="))
        .map_or(vec![1, 64], |v| {
            v.split(',').filter_map(|n| n.parse().ok()).collect()
        });
    let wanted: Vec<&String> = args
        .iter()
        .filter(|a| *a != "quick" && !a.starts_with("n="))
        .collect();
    let all = DType::ALL;
    // By default the types the target models use; name others on the command line.
    let default = [
        DType::Q4_1,
        DType::Q4K,
        DType::Q6K,
        DType::Q8_0,
        DType::Q5_0,
        DType::F16,
    ];
    let types: Vec<DType> = if wanted.is_empty() {
        default.to_vec()
    } else {
        all.into_iter()
            .filter(|t| wanted.iter().any(|w| w.as_str() == t.name()))
            .collect()
    };
    let shapes = [(576, 1536), (896, 4864)];
    println!(
        "isa {:?}, {} logical CPUs",
        Isa::best(),
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    println!(
        "{:<6} {:>10} {:>4} {:>3} {:<4} {:>10} {:>8} {:>9} {:>6} {:>10}",
        "type", "rows×cols", "n", "thr", "mem", "µs/call", "GB/s", "GFLOP/s", "cpu%", "GB/cpu-s"
    );
    let mut rng = Rng(1);
    for dtype in types {
        for (rows, cols) in shapes {
            let m = random_matrix(&mut rng, dtype, rows, cols);
            // Copies to exceed a 32 MiB last-level cache twice over.
            let copies = ((64usize << 20) / m.bytes().len()).max(2);
            let cold: Vec<WeightMatrix> = (0..copies)
                .map(|_| random_matrix(&mut rng, dtype, rows, cols))
                .collect();
            for &n in &ns {
                let x: Vec<f32> = (0..n * cols)
                    .map(|i| ((i * 7919) % 1000) as f32 * 1e-3 - 0.5)
                    .collect();
                let mut out = vec![0f32; n * rows];
                for threads in [1usize, 2] {
                    let pool = pool(threads);
                    let hot = pool.install(|| {
                        hot_workers(|| time_per_call(budget, || m.matmul(&x, n, &mut out)))
                    });
                    let row = |residency, (secs, cpu_secs)| Row {
                        dtype,
                        rows,
                        cols,
                        n,
                        threads,
                        residency,
                        secs,
                        cpu_secs,
                        bytes: m.bytes().len(),
                    };
                    print_row(&row("hot", hot));
                    if n == 1 {
                        let mut next = 0;
                        let dram = pool.install(|| {
                            hot_workers(|| {
                                time_per_call(budget, || {
                                    cold[next % copies].matmul(&x, n, &mut out);
                                    next += 1;
                                })
                            })
                        });
                        print_row(&row("dram", dram));
                    }
                }
            }
        }
    }
    if wanted.is_empty() {
        model_decode(budget);
    }
    dispatch_overhead(budget);
    stream_baseline(budget);
}

/// A matrix's storage type, rows and columns.
type Shape = (DType, usize, usize);

/// A model's decode matmuls: `layer(i)` lists layer i's matrices, then the output head.
struct Model {
    name: &'static str,
    layers: usize,
    layer: fn(usize) -> Vec<Shape>,
    head: Shape,
}

fn smollm2_layer(_: usize) -> Vec<Shape> {
    let (q, kv, ffn) = (
        (DType::Q4_1, 576, 576),
        (DType::Q4_1, 192, 576),
        (DType::Q4_1, 1536, 576),
    );
    vec![q, kv, kv, q, ffn, ffn, (DType::Q4_1, 576, 1536)]
}

/// Qwen2.5-0.5B Q4_K_M: 896 is no multiple of 256, so most tensors fall back to Q5_0;
/// attn_v and ffn_down alternate between a higher and a lower type across layers.
fn qwen05_layer(i: usize) -> Vec<Shape> {
    let v = if i.is_multiple_of(2) {
        DType::Q8_0
    } else {
        DType::Q5_0
    };
    let down = if i.is_multiple_of(2) {
        DType::Q6K
    } else {
        DType::Q4K
    };
    let (q, kv, ffn) = (
        (DType::Q5_0, 896, 896),
        (DType::Q5_0, 128, 896),
        (DType::Q5_0, 4864, 896),
    );
    vec![q, kv, (v, 128, 896), q, ffn, ffn, (down, 896, 4864)]
}

/// The matmuls of one decode step (n = 1) through a whole model's shapes and storage types,
/// run inside the pool as a forward pass would: an upper bound on tokens/s from the weight
/// kernels alone. Per layer: q, k, v, o, gate, up, down as (type, rows, cols); then the head.
fn model_decode(budget: Duration) {
    let models = [
        Model {
            name: "SmolLM2-135M Q4_1",
            layers: 30,
            layer: smollm2_layer,
            head: (DType::Q8_0, 49152, 576),
        },
        Model {
            name: "Qwen2.5-0.5B Q4_K_M",
            layers: 24,
            layer: qwen05_layer,
            head: (DType::Q8_0, 151936, 896),
        },
    ];
    let mut rng = Rng(17);
    for Model {
        name,
        layers,
        layer,
        head,
    } in models
    {
        let shapes: Vec<_> = (0..layers).flat_map(layer).chain([head]).collect();
        let mats: Vec<WeightMatrix> = shapes
            .iter()
            .map(|&(t, r, c)| random_matrix(&mut rng, t, r, c))
            .collect();
        let bytes: usize = mats.iter().map(|m| m.bytes().len()).sum();
        let x: Vec<f32> = (0..4864)
            .map(|i| ((i * 37) % 100) as f32 * 0.01 - 0.5)
            .collect();
        let mut out = vec![0f32; 151936];
        for threads in [1usize, 2] {
            let pool = pool(threads);
            let (secs, cpu) = pool.install(|| {
                hot_workers(|| {
                    time_per_call(budget * 3, || {
                        for m in &mats {
                            m.matmul(&x[..m.cols()], 1, &mut out[..m.rows()]);
                        }
                    })
                })
            });
            println!(
                "{name} decode matmuls, {threads} thread(s): {:.2} ms/token = {:.0} tok/s, \
                 {:.1} GB/s over {:.0} MB (cpu {:.0}%)",
                secs * 1e3,
                1.0 / secs,
                bytes as f64 / secs / 1e9,
                bytes as f64 / 1e6,
                100.0 * cpu / secs
            );
        }
    }
}

/// A small decode-sized matmul (SmolLM2's attn_k, 192×576 Q4_1) called from a thread outside
/// the pool, as a plain caller does, and from inside it (`threads::install`), as a forward
/// pass should: the difference is the cost of handing each matmul to the pool.
fn dispatch_overhead(budget: Duration) {
    let mut rng = Rng(9);
    let m = random_matrix(&mut rng, DType::Q4_1, 192, 576);
    let x = vec![0.25f32; 576];
    let mut out = vec![0f32; 192];
    for threads in [1, 2] {
        let pool = pool(threads);
        let (outside, oc) = time_per_call(budget, || pool.install(|| m.matmul(&x, 1, &mut out)));
        let (inside, ic) =
            pool.install(|| hot_workers(|| time_per_call(budget, || m.matmul(&x, 1, &mut out))));
        println!(
            "Q4_1 192×576 n=1, {threads} thread(s): {:.1} µs per call handed to the pool \
             ({:.1} µs CPU), {:.1} µs from inside it ({:.1} µs CPU)",
            outside * 1e6,
            oc * 1e6,
            inside * 1e6,
            ic * 1e6
        );
    }
}

fn print_row(r: &Row) {
    let gbs = r.bytes as f64 / r.secs / 1e9;
    let gflops = 2.0 * (r.rows * r.cols * r.n) as f64 / r.secs / 1e9;
    println!(
        "{:<6} {:>10} {:>4} {:>3} {:<4} {:>10.1} {:>8.1} {:>9.1} {:>6.0} {:>10.1}",
        r.dtype.name(),
        format!("{}×{}", r.rows, r.cols),
        r.n,
        r.threads,
        r.residency,
        r.secs * 1e6,
        gbs,
        gflops,
        100.0 * r.cpu_secs / r.secs,
        r.bytes as f64 / r.cpu_secs / 1e9
    );
}

/// What the memory system gives a plain read of 256 MiB (sum of u64s), for comparison.
fn stream_baseline(budget: Duration) {
    let data: Vec<u64> = (0..(256usize << 20) / 8).map(|i| i as u64).collect();
    for threads in [1usize, 2] {
        let pool = pool(threads);
        let (secs, _) = pool.install(|| {
            time_per_call(budget, || {
                use rayon::prelude::*;
                let s: u64 = data
                    .par_chunks(1 << 16)
                    .map(|c| {
                        // Four independent sums, so the loop waits on memory, not on adds.
                        let mut acc = [0u64; 4];
                        for q in c.chunks_exact(4) {
                            for k in 0..4 {
                                acc[k] = acc[k].wrapping_add(q[k]);
                            }
                        }
                        acc.iter().fold(0u64, |a, &v| a.wrapping_add(v))
                    })
                    .sum();
                std::hint::black_box(s);
            })
        });
        println!(
            "memory read baseline, {threads} thread(s): {:.1} GB/s",
            (data.len() * 8) as f64 / secs / 1e9
        );
    }
}
