#!/usr/bin/env python3
"""Checks gemv.cu's int8 GEMV (gemv8*) on a machine without a GPU, by running its own code.

    python3 crates/afm-runtime/tests/gemv_int8_host_emulation.py  (needs g++ with C++20, numpy, gguf)

The kernel's device functions (q8_group, q8_pick, acc8 and the per-type acc8_* / Q4_K, Q6_K
decoding) are cut from gemv.cu and compiled with g++ under host stand-ins (host_emulation.h:
f16 and GGML loads; dp4a here); a driver runs the GEMV8 kernel body for every block and thread, in launches of <= 8
activation rows as cuda/matmul.rs does, for one and for three mixed-type matrices, 1 and 4 rows
per thread group, and writes each output once (a second write or an unwritten output fails).
The warp/block reduction is replaced by a plain sum per thread group.
Reference: gguf-py's dequantization (not afm's) times the activations rounded to int8 as
quantize_x_q8 does, in f64. Prints the worst relative error (float rounding: ~3e-7), then what
the activation rounding alone costs against exact activations (int8/int16, blocks of 32/256).
"""
import re
import subprocess
import sys

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from host_emulation import build, extract, int8_values, quant8, random_weight, rel, source, type_code

src = source("gemv.cu")

parts = [re.search(r"#define GEMV_THREADS.*\n", src).group(0),
         re.search(r"#define GEMV_ROWS.*\n", src).group(0)]
parts += re.findall(r"#define Q8_Q\w+ \d\n", src)
for sig in ["void q4k_scales_hd", "void q6k_unit", "int dot16", "struct Q8Group", "Q8Group q8_group",
            "void acc8_q4_k", "void acc8_q6_k", "void acc8_q8_0", "void acc8(", "struct Q8Mats",
            "struct Q8Pick", "Q8Pick q8_pick"]:
    parts.append(extract(src, sig))

prelude = r'''
#include <vector>
struct Dim { unsigned x; }; static Dim threadIdx, blockIdx;
static inline int dp4a(int a, int b, int c) {
    for (int i = 0; i < 4; i++) c += (int)(signed char)(a >> (8 * i)) * (int)(signed char)(b >> (8 * i));
    return c;
}
'''
driver = r'''
static int groups_for(int cols) { int u = cols / 32; return u <= 32 ? 4 : u <= 64 ? 2 : 1; }
// The GEMV8 kernel body, every block and thread simulated; the reduction as sums per group.
template <int N, int R>
void run(const Q8Mats& m, int nmats, const signed char* xq, const float* xd, const float* xs, int cols) {
    const int groups = groups_for(cols), per = R * groups;
    int grid = 0;
    const int rs[3] = {m.r0, m.r1, m.r2};
    for (int i = 0; i < 3; i++) grid += (rs[i] + per - 1) / per;
    for (int b = 0; b < grid; b++) {
        std::vector<float> fpart(groups * R * N, 0.f);
        int blk = b;
        const Q8Pick p = q8_pick(m, R * groups, blk);
        for (unsigned t = 0; t < GEMV_THREADS; t++) {
            threadIdx.x = t;
            const Q8Group g = q8_group(groups, R, blk);
            float acc[R][N] = {};
            acc8<N, R>(p.type, p.w, xq, xd, xs, p.rows, cols, g, acc);
            const int grp = g.w0 / g.gw;
            for (int r = 0; r < R; r++) for (int k = 0; k < N; k++) fpart[(grp * R + r) * N + k] += acc[r][k];
        }
        for (unsigned t = 0; t < GEMV_THREADS; t++) {
            threadIdx.x = t;
            const Q8Group g = q8_group(groups, R, blk);
            if (g.tig < R * N) {
                const int r = g.tig / N, k = g.tig % N, grp = g.w0 / g.gw;
                if (g.row0 + r < p.rows) {
                    float* o = &p.out[(i64)k * p.rows + g.row0 + r];
                    if (!std::isnan(*o)) { fprintf(stderr, "row written twice\\n"); exit(3); }
                    *o = fpart[(grp * R + r) * N + k];
                }
            }
        }
    }
}
int main(int argc, char** argv) {
    // argv: cols n R  then per matrix: type rows wfile
    int cols = atoi(argv[1]), n = atoi(argv[2]), R = atoi(argv[3]);
    const int nm = (argc - 4) / 3;
    size_t l;
    const signed char* xq = (const signed char*)read_file("xq.bin", l);
    const float* xd = (const float*)read_file("xd.bin", l);
    const float* xs = (const float*)read_file("xs.bin", l);
    const u8* ws[3]; int ts[3], rs[3]; std::vector<std::vector<float>> outs(3);
    for (int i = 0; i < 3; i++) {
        const int k = i < nm ? i : 0;
        ts[i] = atoi(argv[4 + 3 * k]); rs[i] = i < nm ? atoi(argv[5 + 3 * k]) : 0;
        ws[i] = (const u8*)read_file(argv[6 + 3 * k], l);
        outs[i].assign((size_t)n * rs[i], NAN);
    }
    for (int c0 = 0; c0 < n; c0 += 8) {   // launches of <= 8 rows, as matmul.rs
        const int nb = std::min(8, n - c0);
        Q8Mats m{ws[0], ws[1], ws[2], outs[0].data() + (size_t)c0 * rs[0], outs[1].data() + (size_t)c0 * rs[1],
                 outs[2].data() + (size_t)c0 * rs[2], ts[0], ts[1], ts[2], rs[0], rs[1], rs[2]};
        const signed char* q0 = xq + (size_t)c0 * cols; const float* d0 = xd + (size_t)c0 * cols / 32;
        const float* s0 = xs + (size_t)c0 * cols / 32;
        switch (nb * 10 + R) {
#define C(N) case N * 10 + 1: run<N, 1>(m, nm, q0, d0, s0, cols); break; case N * 10 + 4: run<N, 4>(m, nm, q0, d0, s0, cols); break;
            C(1) C(2) C(3) C(4) C(5) C(6) C(7) C(8)
        }
    }
    for (int i = 0; i < nm; i++) {
        char name[32]; snprintf(name, sizeof name, "out%d.bin", i);
        FILE* f = fopen(name, "wb"); fwrite(outs[i].data(), 4, outs[i].size(), f); fclose(f);
    }
}
'''
build(prelude + "".join(parts) + driver, "gemv_int8_emu_")

def rounded(x, levels, block):
    xb = x.reshape(-1, block).astype(np.float64)
    amax = np.abs(xb).max(axis=1, keepdims=True)
    amax[amax == 0] = 1
    return (np.rint(xb * (levels / amax)) * (amax / levels)).reshape(x.shape)

def acts(rng, n, cols, kind):
    if kind == "uniform":
        return rng.uniform(-1, 1, (n, cols)).astype(np.float32)
    x = rng.standard_normal((n, cols)).astype(np.float32)   # outlier channels, as hidden states
    x[:, ::61] *= 8
    return x

rng = np.random.default_rng(7)
worst, cases = 0.0, 0
shapes = [(37, 256), (70, 1024), (45, 2048), (23, 2816), (19, 4096), (13, 12288)]
TYPES = [T.Q8_0, T.Q4_K, T.Q6_K]
for si, (rows, cols) in enumerate(shapes):
    # three matrices of one width: every type, row counts rows, rows + 5, rows // 2 + 1
    mats = []
    for k, t in enumerate(TYPES[si % 3:] + TYPES[:si % 3]):
        r = [rows, rows + 5, rows // 2 + 1][k]
        w = random_weight(rng, t, r, cols)
        w.tofile(f"w{k}.bin")
        mats.append((t, r, dequantize(w, t).astype(np.float64).reshape(r, cols)))
    for n in [1, 3, 8, 13, 16]:
        x = acts(rng, n, cols, "outliers" if n % 2 else "uniform")
        q, d, s = quant8(x)
        q.tofile("xq.bin"); d.tofile("xd.bin"); s.tofile("xs.bin")
        xhat = int8_values(q, d, (n, cols))
        for R in (1, 4):
            for nm in (1, 3):
                args = ["./emu", str(cols), str(n), str(R)]
                for k in range(nm):
                    args += [str(type_code(mats[k][0])), str(mats[k][1]), f"w{k}.bin"]
                subprocess.run(args, check=True)
                for k in range(nm):
                    t, r, wd = mats[k]
                    out = np.fromfile(f"out{k}.bin", dtype=np.float32).reshape(n, r)
                    assert np.isfinite(out).all(), "unwritten output"
                    e = rel(out, xhat @ wd.T)
                    worst, cases = max(worst, e), cases + 1
                    if e > 1e-5:
                        print(f"MISMATCH {t.name} {r}x{cols} n={n} R={R} mats={nm}: {e:.3e}")
print(f"kernel emulation vs gguf-py dequant x int8-rounded x: worst rel err {worst:.2e} over {cases} matrix products")
if worst > 1e-5:
    sys.exit("gemv_int8_host_emulation: FAILED")

# activation rounding error alone (what int8 costs), f64, realistic and uniform data
for kind in ["uniform", "outliers"]:
    for t in [T.Q4_K, T.Q6_K, T.Q8_0]:
        rows, cols = 256, 4096
        w = random_weight(rng, t, rows, cols)
        wd = dequantize(w, t).astype(np.float64).reshape(rows, cols)
        x = acts(rng, 8, cols, kind).astype(np.float64)
        exact = x @ wd.T
        e8 = rel(rounded(x, 127, 32) @ wd.T, exact)
        e16 = rel(rounded(x, 32767, 32) @ wd.T, exact)
        e8k = rel(rounded(x, 127, 256) @ wd.T, exact)
        print(f"{kind:8} {t.name:5} ({'uniform in +-1' if kind == 'uniform' else 'normal, every 61st column x8'}): int8/32 {e8:.2e}  int16/32 {e16:.2e}  int8/256 (CPU Q8_K) {e8k:.2e}")
