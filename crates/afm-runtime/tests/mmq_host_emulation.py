#!/usr/bin/env python3
"""Checks mmq.cu (the int8 tensor-core matmul) on a machine without a GPU, by running its own code.

    python3 crates/afm-runtime/tests/mmq_host_emulation.py      (needs g++ with C++20, numpy, gguf)

The whole of mmq.cu, after common.cuh's q8_quantize, is compiled with g++ under host stand-ins
(host_emulation.h for CUDA's and common.cuh's, here the threads'): every block runs as 128 or
256 std::threads (4- and 8-warp kernels, alternating over the cases), __syncthreads is a
barrier of the block, and the warp-collective operations are emulated per warp through a barrier of its 32 threads: warp_max/warp_sum, and mma.sync
m16n8k32 s8, which gathers the 32 lanes' registers into A (16x32), B (32x8) by the fragment
layout of the PTX ISA ("Matrix Fragments for mma.m16n8k32": lane 4g+t holds A rows g, g+8 at
k 4t..4t+3 and 16+4t..16+4t+3, B column g at the same k, C rows g, g+8 at columns 2t, 2t+1),
multiplies them in int32 and hands each lane its C elements. Only mma_s8 and the L2 prefetch are
replaced; the decoding, the tiling, the permuted k order and the reduction run as written.
The driver quantizes with mmq_quantize and launches mmq_w<4|8>_<NT> in chunks of <= 64 rows, as
cuda/mmq.rs does, plain and for gate+up fused with SiLU / GELU tanh, and poisons the output with
NaN (a row never written fails); and Q/K/V of three types in one launch.
Reference: gguf-py's dequantization (not afm's) times the activations rounded to int8 as
quantize_x_q8 does, in f64. Relative error should be float rounding (~1e-7).
"""
import subprocess
import sys

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from host_emulation import (ACTS, GRID, build, cut, extract, int8_values, quant8, random_weight, rel, source,
                            type_code)

# The kernel's own code but mma_s8 (emulated below), after common.cuh's quantizer.
body = extract(source("common.cuh"), "int q8_quantize(") + cut(source("mmq.cu"), "void mma_s8(")

prelude = GRID + r'''
static inline void __trap() { abort(); }
static u32 lane_a[8][32][4], lane_b[8][32][2];
static float lane_f[8][32];

// A warp-wide reduction: every lane posts, all read the 32 values in lane order, then wait
// again so the slots may be reused.
template <class F>
static float warp_all(float v, F f) {
    const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
    lane_f[w][l] = v;
    warp_bar[w]->arrive_and_wait();
    float r = lane_f[w][0];
    for (int i = 1; i < 32; i++) r = f(r, lane_f[w][i]);
    warp_bar[w]->arrive_and_wait();
    return r;
}
static inline float warp_max(float v) { return warp_all(v, [](float a, float b) { return std::max(a, b); }); }
static inline float warp_sum(float v) { return warp_all(v, [](float a, float b) { return a + b; }); }

static inline int sbyte(u32 r, int j) { return (int)(signed char)(r >> (8 * j)); }
// mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32, from the PTX ISA's fragment tables.
static void mma_s8(int (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
    lane_a[w][l][0] = a0; lane_a[w][l][1] = a1; lane_a[w][l][2] = a2; lane_a[w][l][3] = a3;
    lane_b[w][l][0] = b0; lane_b[w][l][1] = b1;
    warp_bar[w]->arrive_and_wait();
    int A[16][32], B[32][8];
    for (int L = 0; L < 32; L++) {
        const int g = L >> 2, t = L & 3;
        for (int j = 0; j < 4; j++) {
            A[g][4 * t + j] = sbyte(lane_a[w][L][0], j);
            A[g + 8][4 * t + j] = sbyte(lane_a[w][L][1], j);
            A[g][16 + 4 * t + j] = sbyte(lane_a[w][L][2], j);
            A[g + 8][16 + 4 * t + j] = sbyte(lane_a[w][L][3], j);
            B[4 * t + j][g] = sbyte(lane_b[w][L][0], j);
            B[16 + 4 * t + j][g] = sbyte(lane_b[w][L][1], j);
        }
    }
    warp_bar[w]->arrive_and_wait();
    const int g = l >> 2, t = l & 3;
    const int rc[4][2] = {{g, 2 * t}, {g, 2 * t + 1}, {g + 8, 2 * t}, {g + 8, 2 * t + 1}};
    for (int e = 0; e < 4; e++) {
        int s = 0;
        for (int k = 0; k < 32; k++) s += A[rc[e][0]][k] * B[k][rc[e][1]];
        c[e] += s;
    }
}
'''

driver = r'''
typedef void (*Kernel)(MmqMats, const signed char*, const float2*, int, int, int, int);
static const Kernel KERNELS[2][9] = {
    {nullptr, mmq_w4_1, mmq_w4_2, mmq_w4_3, mmq_w4_4, mmq_w4_5, mmq_w4_6, mmq_w4_7, mmq_w4_8},
    {nullptr, mmq_w8_1, mmq_w8_2, mmq_w8_3, mmq_w8_4, mmq_w8_5, mmq_w8_6, mmq_w8_7, mmq_w8_8}};

int main(int argc, char** argv) {
    // argv: cols n warps act, then per matrix: type rows file (x.bin: f32 [n][cols]).
    // act < 0: one to three matrices -> out<i>.bin f32 [n][rows_i]; act >= 0: gate and up
    // -> out0.bin = act(x gate^T) * (x up^T).
    const int cols = atoi(argv[1]), n = atoi(argv[2]), warps = atoi(argv[3]), act = atoi(argv[4]);
    const int nm = (argc - 5) / 3;
    size_t l;
    const float* x = (const float*)read_file("x.bin", l);
    const u8* w[3] = {}; int ty[3] = {}, rs[3] = {};
    for (int i = 0; i < nm; i++) {
        ty[i] = atoi(argv[5 + 3 * i]); rs[i] = atoi(argv[6 + 3 * i]);
        w[i] = (const u8*)read_file(argv[7 + 3 * i], l);
    }
    const int nout = act >= 0 ? 1 : nm;
    if (act >= 0) rs[1] = 0;
    std::vector<std::vector<float>> outs(3);
    for (int i = 0; i < nout; i++) outs[i].assign((size_t)n * rs[i], NAN);
    const int np = (n + 7) / 8 * 8, nkb = cols / 32;
    std::vector<signed char> xq((size_t)np * cols, 99);
    std::vector<float2> ds((size_t)nkb * np, float2{NAN, NAN});
    const size_t qthreads = (size_t)np * nkb * 32;
    run_grid((unsigned)((qthreads + 255) / 256), 256, [&] { mmq_quantize(x, xq.data(), ds.data(), n, np, cols); });
    int blocks = 0;
    if (act >= 0) blocks = (rs[0] + 15) / 16;
    else for (int i = 0; i < nm; i++) blocks += (rs[i] + 31) / 32;
    for (int c0 = 0; c0 < n; c0 += 64) {   // launches of <= 64 rows, as cuda/mmq.rs
        const int nb = std::min(64, n - c0), nt = (nb + 7) / 8;
        float* o[3];
        for (int i = 0; i < 3; i++) o[i] = i < nout ? outs[i].data() + (size_t)c0 * rs[i] : nullptr;
        const MmqMats m{w[0], w[1], w[2], o[0], o[1], o[2], ty[0], ty[1], ty[2], rs[0], rs[1], rs[2]};
        const signed char* q0 = xq.data() + (size_t)c0 * cols;
        const float2* d0 = ds.data() + c0;
        run_grid((unsigned)blocks, 32 * warps, [&] { KERNELS[warps / 8][nt](m, q0, d0, cols, nb, np, act); });
    }
    for (int i = 0; i < nout; i++) {
        char name[32]; snprintf(name, sizeof name, "out%d.bin", i);
        FILE* f = fopen(name, "wb"); fwrite(outs[i].data(), 4, outs[i].size(), f); fclose(f);
    }
    FILE* f = fopen("xq.bin", "wb"); fwrite(xq.data(), 1, xq.size(), f); fclose(f);
    f = fopen("ds.bin", "wb"); fwrite(ds.data(), 8, ds.size(), f); fclose(f);
}
'''
build(prelude + body + driver, "mmq_emu_")

rng = np.random.default_rng(9)
worst, cases, failed, results = 0.0, 0, False, []
# (type, rows, cols, batches): row counts that are not multiples of the 32-row tile; widths with
# fewer super-blocks than warps (256), an uneven share (1280: 5) and Q8_0 blocks not a whole
# super-block (96); batches across tile edges; 72, 100 and 130: two or three launches.
CASES = [
    (T.Q4_K, 37, 256, [17, 32]),
    (T.Q4_K, 45, 1280, [1, 33, 64]),
    (T.Q4_K, 19, 4096, [24, 72]),
    (T.Q6_K, 37, 256, [17, 33]),
    (T.Q6_K, 45, 1280, [8, 64]),
    (T.Q6_K, 13, 2048, [130]),
    (T.Q8_0, 37, 96, [17, 64]),
    (T.Q8_0, 45, 1280, [32, 33]),
    (T.Q8_0, 50, 512, [100]),
]
for t, rows, cols, batches in CASES:
    w = random_weight(rng, t, rows, cols)
    w.tofile("w.bin")
    wd = dequantize(w, t).astype(np.float64).reshape(rows, cols)
    for n in batches:
        x = rng.standard_normal((n, cols)).astype(np.float32)
        x[:, ::61] *= 8  # outlier channels, as hidden states
        x.tofile("x.bin")
        warps = 4 if len(results) % 2 == 0 else 8  # both kernel sets over the cases
        results.append(warps)
        subprocess.run(["./emu", str(cols), str(n), str(warps), "-1", str(type_code(t)), str(rows), "w.bin"],
                       check=True)
        out = np.fromfile("out0.bin", dtype=np.float32).reshape(n, rows)
        q, d, s = quant8(x)
        np_ = (n + 7) // 8 * 8
        xq = np.fromfile("xq.bin", dtype=np.int8).reshape(np_, cols)
        ds = np.fromfile("ds.bin", dtype=np.float32).reshape(cols // 32, np_, 2)
        ok_q = (np.array_equal(xq[:n].reshape(-1, 32), q) and not xq[n:].any()
                and np.array_equal(ds[:, :n, 0].T.reshape(-1), d) and np.array_equal(ds[:, :n, 1].T.reshape(-1), s)
                and not ds[:, n:].any())
        xhat = int8_values(q, d, (n, cols))
        if not np.isfinite(out).all():
            print(f"UNWRITTEN {t.name} {rows}x{cols} n={n}")
            failed = True
            continue
        e = rel(out, xhat @ wd.T)
        worst, cases = max(worst, e), cases + 1
        status = "ok" if e <= 1e-5 and ok_q else "MISMATCH"
        failed |= status != "ok"
        print(f"{status:8} {t.name:5} {rows:3}x{cols:<5} n={n:3} {warps} warps: rel err {e:.2e}, "
              f"quantization {'equal' if ok_q else 'DIFFERS'}")
print(f"mmq emulation vs gguf-py dequant x int8-rounded x: worst rel err {worst:.2e} over {cases} products")

# gate+up fused with the activation (act 0 = SiLU, 1 = GELU tanh): 16 rows of each per block
for t, rows, cols, n, act, warps in [(T.Q4_K, 37, 1280, 33, 0, 4), (T.Q6_K, 21, 512, 64, 1, 8),
                                     (T.Q8_0, 45, 256, 17, 0, 8), (T.Q4_K, 19, 4096, 70, 0, 8)]:
    g, u = random_weight(rng, t, rows, cols), random_weight(rng, t, rows, cols)
    g.tofile("w.bin")
    u.tofile("u.bin")
    x = rng.standard_normal((n, cols)).astype(np.float32)
    x.tofile("x.bin")
    subprocess.run(["./emu", str(cols), str(n), str(warps), str(act), str(type_code(t)), str(rows), "w.bin",
                    str(type_code(t)), str(rows), "u.bin"], check=True)
    out = np.fromfile("out0.bin", dtype=np.float32).reshape(n, rows)
    q, d, s = quant8(x)
    xhat = int8_values(q, d, (n, cols))
    gd = dequantize(g, t).astype(np.float64).reshape(rows, cols)
    ud = dequantize(u, t).astype(np.float64).reshape(rows, cols)
    want = ACTS[act](xhat @ gd.T) * (xhat @ ud.T)
    e = rel(out, want) if np.isfinite(out).all() else float("inf")
    status = "ok" if e <= 1e-5 else "MISMATCH"
    failed |= status != "ok"
    print(f"{status:8} gated act {act} {t.name:5} {rows:3}x{cols:<5} n={n:3} {warps} warps: rel err {e:.2e}")

# Q/K/V of mixed types in one launch: blocks pick their matrix (rows 70, 37, 19: partial tiles)
for cols, n, warps in [(1024, 33, 4), (4096, 17, 8)]:
    mats = [(T.Q4_K, 70), (T.Q6_K, 37), (T.Q8_0, 19)]
    args = ["./emu", str(cols), str(n), str(warps), "-1"]
    want = []
    x = rng.standard_normal((n, cols)).astype(np.float32)
    x.tofile("x.bin")
    q, d, s = quant8(x)
    xhat = int8_values(q, d, (n, cols))
    for i, (t, rows) in enumerate(mats):
        w = random_weight(rng, t, rows, cols)
        w.tofile(f"m{i}.bin")
        args += [str(type_code(t)), str(rows), f"m{i}.bin"]
        want.append(xhat @ dequantize(w, t).astype(np.float64).reshape(rows, cols).T)
    subprocess.run(args, check=True)
    for i, (t, rows) in enumerate(mats):
        out = np.fromfile(f"out{i}.bin", dtype=np.float32).reshape(n, rows)
        e = rel(out, want[i]) if np.isfinite(out).all() else float("inf")
        status = "ok" if e <= 1e-5 else "MISMATCH"
        failed |= status != "ok"
        print(f"{status:8} q/k/v #{i} {t.name:5} {rows:3}x{cols:<5} n={n:3} {warps} warps: rel err {e:.2e}")
if failed:
    sys.exit("mmq_host_emulation: FAILED")
