#!/usr/bin/env python3
"""Checks mmq.cu (the int8 tensor-core matmul) on a machine without a GPU, by running its own code.

    python3 crates/afm-runtime/tests/mmq_host_emulation.py      (needs g++ with C++20, numpy, gguf)

The whole of mmq.cu is compiled with g++ under host stand-ins: every block runs as 128 or 256
std::threads (4- and 8-warp kernels, alternating over the cases), __syncthreads is a barrier of the block, and the warp-collective operations are
emulated per warp through a barrier of its 32 threads: warp_max/warp_sum, and mma.sync
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
import os
import re
import subprocess
import sys
import tempfile

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "../src/cuda/kernels/mmq.cu")
src = open(SRC).read()
os.chdir(tempfile.mkdtemp(prefix="mmq_emu_"))


def cut(text, sig):
    """`text` without the function whose signature contains `sig` (its body is replaced)."""
    i = text.rfind("\n", 0, text.index(sig)) + 1
    k = text.index("{", text.index(sig))
    depth = 0
    for m in range(k, len(text)):
        if text[m] == "{":
            depth += 1
        elif text[m] == "}":
            depth -= 1
            if depth == 0:
                return text[:i] + text[m + 1:]
    raise SystemExit("unbalanced " + sig)


body = cut(cut(src, "void mma_s8("), "void mmq_prefetch(")

prelude = r'''
#include <barrier>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>
#include <algorithm>
typedef unsigned char u8; typedef unsigned short u16; typedef unsigned int u32; typedef long long i64;
struct uint2 { u32 x, y; }; struct uint4 { u32 x, y, z, w; };
struct float2 { float x, y; }; struct float4 { float x, y, z, w; };
static inline uint2 make_uint2(u32 a, u32 b) { return {a, b}; }
static inline float2 make_float2(float a, float b) { return {a, b}; }
struct Dim { unsigned x, y, z; };
static thread_local Dim threadIdx;
static Dim blockIdx, blockDim;
#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(x)
#define __shared__ static
using std::min;
static inline float h2f(u16 h) { _Float16 f; memcpy(&f, &h, 2); return (float)f; }
static inline u16 ld16(const u8* p) { u16 v; memcpy(&v, p, 2); return v; }
static inline u32 ld32_a2(const u8* p) { return (u32)ld16(p) | ((u32)ld16(p + 2) << 16); }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline int __float2int_rn(float a) { return (int)nearbyintf(a); }
static inline void __trap() { abort(); }
static inline void pdl_begin() {}

static std::barrier<>* block_bar;
static std::barrier<>* warp_bar[8];
static inline void __syncthreads() { block_bar->arrive_and_wait(); }
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
static inline void mmq_prefetch(const u8*) {}
'''

driver = r'''
typedef void (*Kernel)(MmqMats, const signed char*, const float2*, int, int, int, int);
static const Kernel KERNELS[2][9] = {
    {nullptr, mmq_w4_1, mmq_w4_2, mmq_w4_3, mmq_w4_4, mmq_w4_5, mmq_w4_6, mmq_w4_7, mmq_w4_8},
    {nullptr, mmq_w8_1, mmq_w8_2, mmq_w8_3, mmq_w8_4, mmq_w8_5, mmq_w8_6, mmq_w8_7, mmq_w8_8}};

template <class F>
static void run_grid(unsigned blocks, unsigned threads, F f) {
    blockDim.x = threads;
    for (unsigned b = 0; b < blocks; b++) {
        blockIdx.x = b;
        std::barrier<> bb(threads);
        for (unsigned w = 0; w < threads / 32; w++) warp_bar[w] = new std::barrier<>(32);
        block_bar = &bb;
        std::vector<std::thread> ts;
        for (unsigned t = 0; t < threads; t++) ts.emplace_back([t, &f] { threadIdx.x = t; f(); });
        for (auto& t : ts) t.join();
        for (unsigned w = 0; w < threads / 32; w++) delete warp_bar[w];
    }
}

static char* rd(const char* p, size_t& len) {
    FILE* f = fopen(p, "rb"); if (!f) exit(2);
    fseek(f, 0, SEEK_END); len = ftell(f); fseek(f, 0, SEEK_SET);
    char* b = (char*)malloc(len); if (fread(b, 1, len, f) != len) exit(2); fclose(f); return b;
}

int main(int argc, char** argv) {
    // argv: cols n warps act, then per matrix: type rows file (x.bin: f32 [n][cols]).
    // act < 0: one to three matrices -> out<i>.bin f32 [n][rows_i]; act >= 0: gate and up
    // -> out0.bin = act(x gate^T) * (x up^T).
    const int cols = atoi(argv[1]), n = atoi(argv[2]), warps = atoi(argv[3]), act = atoi(argv[4]);
    const int nm = (argc - 5) / 3;
    size_t l;
    const float* x = (const float*)rd("x.bin", l);
    const u8* w[3] = {}; int ty[3] = {}, rs[3] = {};
    for (int i = 0; i < nm; i++) {
        ty[i] = atoi(argv[5 + 3 * i]); rs[i] = atoi(argv[6 + 3 * i]);
        w[i] = (const u8*)rd(argv[7 + 3 * i], l);
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
open("emu.cpp", "w").write(prelude + body + driver)
r = subprocess.run(["g++", "-O2", "-std=c++20", "-pthread", "-ffp-contract=off", "-o", "emu", "emu.cpp"],
                   capture_output=True, text=True)
if r.returncode:
    print(r.stderr[:6000])
    sys.exit(1)

BLOCK = {T.Q4_K: (256, 144), T.Q6_K: (256, 210), T.Q8_0: (32, 34)}
KIND = {T.Q4_K: 0, T.Q6_K: 1, T.Q8_0: 2}


def random_weight(rng, t, rows, cols):
    bw, bb = BLOCK[t]
    nblk = rows * cols // bw
    b = rng.integers(0, 256, size=(nblk, bb), dtype=np.uint8)
    sc = lambda: np.float16(0.002 + 0.01 * rng.random(nblk)).view(np.uint8).reshape(nblk, 2)
    if t == T.Q8_0:
        b[:, 0:2] = sc()
    elif t == T.Q4_K:
        b[:, 0:2] = sc()
        b[:, 2:4] = sc()
    else:
        b[:, 208:210] = sc()
    return b.reshape(rows, -1)


def quant8(x):
    """quantize_x_q8 in f32: q = rint(x * (127/amax)), d = amax/127, s = d * sum(q)."""
    xb = x.reshape(-1, 32).astype(np.float32)
    amax = np.abs(xb).max(axis=1)
    with np.errstate(divide="ignore"):
        idv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(xb * idv[:, None]).astype(np.int32)
    d = (amax / np.float32(127)).astype(np.float32)
    s = (d * q.sum(axis=1).astype(np.float32)).astype(np.float32)
    return q.astype(np.int8), d, s


def rel(a, b):
    return float(np.linalg.norm(a.astype(np.float64) - b) / np.linalg.norm(b))


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
        subprocess.run(["./emu", str(cols), str(n), str(warps), "-1", str(KIND[t]), str(rows), "w.bin"],
                       check=True)
        out = np.fromfile("out0.bin", dtype=np.float32).reshape(n, rows)
        q, d, s = quant8(x)
        np_ = (n + 7) // 8 * 8
        xq = np.fromfile("xq.bin", dtype=np.int8).reshape(np_, cols)
        ds = np.fromfile("ds.bin", dtype=np.float32).reshape(cols // 32, np_, 2)
        ok_q = (np.array_equal(xq[:n].reshape(-1, 32), q) and not xq[n:].any()
                and np.array_equal(ds[:, :n, 0].T.reshape(-1), d) and np.array_equal(ds[:, :n, 1].T.reshape(-1), s)
                and not ds[:, n:].any())
        xhat = (q.astype(np.float64).reshape(-1, 32) * d[:, None]).reshape(n, cols)
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
ACTS = [lambda g: g / (1 + np.exp(-g)),
        lambda g: 0.5 * g * (1 + np.tanh(0.7978846 * (g + 0.044715 * g ** 3)))]
for t, rows, cols, n, act, warps in [(T.Q4_K, 37, 1280, 33, 0, 4), (T.Q6_K, 21, 512, 64, 1, 8),
                                     (T.Q8_0, 45, 256, 17, 0, 8), (T.Q4_K, 19, 4096, 70, 0, 8)]:
    g, u = random_weight(rng, t, rows, cols), random_weight(rng, t, rows, cols)
    g.tofile("w.bin")
    u.tofile("u.bin")
    x = rng.standard_normal((n, cols)).astype(np.float32)
    x.tofile("x.bin")
    subprocess.run(["./emu", str(cols), str(n), str(warps), str(act), str(KIND[t]), str(rows), "w.bin",
                    str(KIND[t]), str(rows), "u.bin"], check=True)
    out = np.fromfile("out0.bin", dtype=np.float32).reshape(n, rows)
    q, d, s = quant8(x)
    xhat = (q.astype(np.float64).reshape(-1, 32) * d[:, None]).reshape(n, cols)
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
    xhat = (q.astype(np.float64).reshape(-1, 32) * d[:, None]).reshape(n, cols)
    for i, (t, rows) in enumerate(mats):
        w = random_weight(rng, t, rows, cols)
        w.tofile(f"m{i}.bin")
        args += [str(KIND[t]), str(rows), f"m{i}.bin"]
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
