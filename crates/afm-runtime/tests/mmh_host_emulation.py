#!/usr/bin/env python3
"""Checks mmh.cu (the 16-bit tensor-core matmul) on a machine without a GPU, by running its own code.

    python3 crates/afm-runtime/tests/mmh_host_emulation.py      (needs g++ with C++20 and numpy)

The whole of mmh.cu is compiled with g++ under host stand-ins (host_emulation.h for CUDA's and
common.cuh's, here the threads', the mma and cp.async): every block runs as 128 or 256
std::threads (4- and 8-warp kernels), __syncthreads is a barrier of the block, and mma.sync
m16n8k16 (bf16 and f16, f32 accumulate) is emulated per warp through a barrier of its 32 threads,
which gathers the lanes' registers into A (16x16), B (16x8) by the fragment layout of the PTX ISA
("Matrix Fragments for mma.m16n8k16 with floating point type": lane 4g+t holds A rows g, g+8 at
k 2t, 2t+1 and 2t+8, 2t+9, B column g at the same k, C rows g, g+8 at columns 2t, 2t+1; lower k in
the low half of a register), multiplies them and hands each lane its C elements. cp.async is
emulated by per-thread copy groups that land only at the cp.async.wait_group that needs them
(or, in the shuffled run, at once), into a dynamic shared memory of the size cuda/mmh.rs asks
for (poisoned with NaN per block; copies outside it or from outside x and the weights abort),
and cvt.rn.{bf16,f16}x2 by common.cuh's round-to-nearest-even. Only these, the mma and the L2
prefetch (checked to stay inside the weights) are replaced; the ring's pipeline, the rounding of
x, the column-to-slot assignment and swizzle, the tiling, the split-K partials and their sum (by
the last split in the kernel, and by mmh_reduce) run as written. Blocks run one at a time in a
shuffled order (split-K's last arriver varies) and every result is checked bit for bit against
the same launch in grid order and against the other way of summing the splits: the sum must
not depend on scheduling.
The driver launches mmh_<type>_w<4|8>_<NT> in chunks of <= 64 rows, as cuda/mmh.rs does (then
mmh_reduce where it sums the splits): one to three matrices, gate+up fused with SiLU / GELU
tanh, and accumulate (out += x W^T) on a given output; other outputs are poisoned with NaN (an
element never written fails).
Reference: the weights times x rounded to bf16 / f16 by numpy (round to nearest even), in f64.
Relative error should be float accumulation (~1e-7).
"""
import subprocess
import sys

import numpy as np

from host_emulation import ACTS, GRID, build, cut, rel, source

# The kernel's own code but cp.async (emulated below; the mma, common.cuh's mma_m16n8k16, too;
# the 16-bit packing is host_emulation.h's pack16x2).
body = cut(source("mmh.cu"), "void mmh_cp16(", "void mmh_cp_commit(", "void mmh_cp_wait(")
SMEM_DECL = "extern __shared__ __align__(16) unsigned char mmh_smem[];"
assert SMEM_DECL in body
body = body.replace(SMEM_DECL, "unsigned char* const mmh_smem = emu_smem;")

prelude = GRID + r'''
// The L2 prefetch does nothing here but must point into a weight matrix (whole 128-byte line).
static const u16* w_lo[3]; static const u16* w_hi[3];
static void prefetch_in_weights(const void* at) {
    const u16* p = (const u16*)at;
    for (int i = 0; i < 3; i++) if (w_lo[i] && p >= w_lo[i] && p + 64 <= w_hi[i]) return;
    fprintf(stderr, "prefetch outside the weights\n");
    abort();
}

// cp.async: each 16-byte copy is queued in the thread's open group (commit closes it) and lands
// only when a wait_group needs it (lazy: a read before its wait sees stale or poisoned bytes),
// or at once (eager: a copy into a stage still being read would change what is read). Sources
// must lie inside the weights or x, destinations inside the launch's dynamic shared memory.
alignas(16) static unsigned char emu_smem[232448];
static size_t emu_smem_bytes;
static bool eager;
static const float *x_lo, *x_hi;
struct Cp { void* d; const void* s; bool ok; };
static thread_local std::vector<Cp> cp_open;
static thread_local std::vector<std::vector<Cp>> cp_groups;
static void land(const Cp& c) {
    if (c.ok) memcpy(c.d, c.s, 16); else memset(c.d, 0, 16);
}
static void mmh_cp16(void* d, const void* s, bool ok) {
    const unsigned char* dp = (const unsigned char*)d;
    if (dp < emu_smem || dp + 16 > emu_smem + emu_smem_bytes || (size_t)(dp - emu_smem) % 16) {
        fprintf(stderr, "cp.async outside the dynamic shared memory\n");
        abort();
    }
    bool in = !ok;
    const char* sp = (const char*)s;
    if (sp >= (const char*)x_lo && sp + 16 <= (const char*)x_hi) in = true;
    for (int i = 0; i < 3; i++)
        if (w_lo[i] && sp >= (const char*)w_lo[i] && sp + 16 <= (const char*)w_hi[i]) in = true;
    if (!in) { fprintf(stderr, "cp.async from outside the weights and x\n"); abort(); }
    if (eager) land({d, s, ok}); else cp_open.push_back({d, s, ok});
}
static void mmh_cp_commit() { cp_groups.push_back(cp_open); cp_open.clear(); }
template <int N>
static void mmh_cp_wait() {   // cp.async.wait_group N
    while (cp_groups.size() > N) {
        for (const Cp& c : cp_groups.front()) land(c);
        cp_groups.erase(cp_groups.begin());
    }
}
static void cp_check_drained() {
    if (!cp_open.empty()) { fprintf(stderr, "cp.async copies never committed\n"); abort(); }
    for (auto& g : cp_groups)
        if (!g.empty()) { fprintf(stderr, "cp.async copies never waited for\n"); abort(); }
    cp_groups.clear();
}

static u32 lane_a[8][32][4], lane_b[8][32][2];

// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}, from the PTX ISA's fragment tables.
template <bool BF>
static void mma_m16n8k16(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
    lane_a[w][l][0] = a0; lane_a[w][l][1] = a1; lane_a[w][l][2] = a2; lane_a[w][l][3] = a3;
    lane_b[w][l][0] = b0; lane_b[w][l][1] = b1;
    warp_bar[w]->arrive_and_wait();
    auto v = [](u32 r, int half) { const u16 b = (u16)(r >> (16 * half)); return BF ? bf2f(b) : h2f(b); };
    float A[16][16], B[16][8];
    for (int L = 0; L < 32; L++) {
        const int g = L >> 2, t = L & 3;
        for (int j = 0; j < 2; j++) {
            A[g][2 * t + j] = v(lane_a[w][L][0], j);
            A[g + 8][2 * t + j] = v(lane_a[w][L][1], j);
            A[g][2 * t + 8 + j] = v(lane_a[w][L][2], j);
            A[g + 8][2 * t + 8 + j] = v(lane_a[w][L][3], j);
            B[2 * t + j][g] = v(lane_b[w][L][0], j);
            B[2 * t + 8 + j][g] = v(lane_b[w][L][1], j);
        }
    }
    warp_bar[w]->arrive_and_wait();
    const int g = l >> 2, t = l & 3;
    const int rc[4][2] = {{g, 2 * t}, {g, 2 * t + 1}, {g + 8, 2 * t}, {g + 8, 2 * t + 1}};
    for (int e = 0; e < 4; e++) {
        double s = 0;  // products of 16-bit values are exact in f32; the sum rounds once here
        for (int k = 0; k < 16; k++) s += (double)A[rc[e][0]][k] * B[k][rc[e][1]];
        c[e] = (float)((double)c[e] + s);
    }
}
'''

driver = r'''
typedef void (*Kernel)(MmhMats, const float*, float4*, int*, int, int, int, int, int, int, int);
#define K8(T, W) {nullptr, mmh_##T##_w##W##_1, mmh_##T##_w##W##_2, mmh_##T##_w##W##_3, \
    mmh_##T##_w##W##_4, mmh_##T##_w##W##_5, mmh_##T##_w##W##_6, mmh_##T##_w##W##_7, mmh_##T##_w##W##_8}
static const Kernel KERNELS[2][2][9] = {{K8(f16, 4), K8(f16, 8)}, {K8(bf16, 4), K8(bf16, 8)}};

// The grid's blocks one at a time, in grid order or shuffled by `seed`: shared memory NaN until
// a copy lands, and every thread's copies committed and waited for by its end.
template <class F>
static void run_mmh_grid(unsigned gx, unsigned gy, unsigned threads, unsigned seed, F f) {
    run_grid(gx, gy, threads, seed, f, [] { memset(emu_smem, 0xff, sizeof emu_smem); }, cp_check_drained);
}

int main(int argc, char** argv) {
    // argv: bf cols n warps splits fixup act accumulate seed eager, then per matrix: rows file
    // (x.bin: f32 [n][cols]; accumulate: init<i>.bin f32 [n][rows_i] is the output's start).
    // act < 0: one to three matrices -> out<i>.bin; act >= 0: gate and up -> out0.bin.
    const int bf = atoi(argv[1]), cols = atoi(argv[2]), n = atoi(argv[3]), warps = atoi(argv[4]);
    const int splits = atoi(argv[5]), fixup = atoi(argv[6]), act = atoi(argv[7]);
    const int accumulate = atoi(argv[8]);
    const unsigned seed = (unsigned)atoi(argv[9]);
    eager = atoi(argv[10]) != 0;
    emu_prefetch_check = prefetch_in_weights;
    const int nm = (argc - 11) / 2;
    size_t l;
    const float* x = (const float*)read_file("x.bin", l);
    x_lo = x;
    x_hi = x + l / 4;
    const u16* w[3] = {}; int rs[3] = {};
    for (int i = 0; i < nm; i++) {
        rs[i] = atoi(argv[11 + 2 * i]);
        w[i] = (const u16*)read_file(argv[12 + 2 * i], l);
        w_lo[i] = w[i];
        w_hi[i] = w[i] + l / 2;
    }
    const int nout = act >= 0 ? 1 : nm;
    std::vector<std::vector<float>> outs(3);
    for (int i = 0; i < nout; i++) {
        if (accumulate) {
            char name[32]; snprintf(name, sizeof name, "init%d.bin", i);
            const float* init = (const float*)read_file(name, l);
            outs[i].assign(init, init + (size_t)n * rs[i]);
        } else {
            outs[i].assign((size_t)n * rs[i], NAN);
        }
    }
    int blocks = 0;
    if (act >= 0) blocks = (rs[0] + 16 * warps - 1) / (16 * warps);
    else for (int i = 0; i < nm; i++) blocks += (rs[i] + 32 * warps - 1) / (32 * warps);
    std::vector<float4> part((size_t)blocks * splits * 16 * 32 * warps, float4{NAN, NAN, NAN, NAN});
    std::vector<int> done(blocks, 0);
    for (int c0 = 0; c0 < n; c0 += 64) {   // launches of <= 64 rows, as cuda/mmh.rs
        const int nb = std::min(64, n - c0), nt = (nb + 7) / 8;
        float* o[3];
        for (int i = 0; i < 3; i++) o[i] = i < nout ? outs[i].data() + (size_t)c0 * rs[i] : nullptr;
        const MmhMats m{w[0], w[1], w[2], o[0], o[1], o[2], rs[0], act >= 0 ? rs[0] : rs[1], rs[2]};
        const float* x0 = x + (size_t)c0 * cols;
        // cuda/mmh.rs's smem_bytes: 4 (8 warps) or 6 (4 warps) stages x (weights 32W rows x
        // 128 B + x 8NT rows x 256 B), then two 16-bit x buffers of 8NT rows x 192 B.
        emu_smem_bytes = (size_t)(warps == 8 ? 4 : 6) * (4096 * warps + 2048 * nt) + 2 * 1536 * nt;
        if (emu_smem_bytes > sizeof emu_smem) { fprintf(stderr, "smem too large\n"); return 4; }
        run_mmh_grid((unsigned)blocks, (unsigned)splits, 32 * warps, seed, [&] {
            KERNELS[bf][warps / 8][nt](m, x0, part.data(), done.data(), cols, nb, splits, fixup, 3, act,
                                       accumulate);
        });
        if (splits > 1 && !fixup) {   // then mmh_reduce, as cuda/mmh.rs launches it
            const unsigned total = (unsigned)(blocks * nt * 32 * warps);
            run_mmh_grid((total + 255) / 256, 1, 256, seed, [&] {
                mmh_reduce(m, part.data(), blocks, splits, nt, warps, nb, act, accumulate);
            });
        }
    }
    for (int d : done) if (d != 0) { fprintf(stderr, "split-K counter left at %d\n", d); return 3; }
    for (int i = 0; i < nout; i++) {
        char name[32]; snprintf(name, sizeof name, "out%d.bin", i);
        FILE* f = fopen(name, "wb"); fwrite(outs[i].data(), 4, outs[i].size(), f); fclose(f);
    }
}
'''
build(prelude + body + driver, "mmh_emu_")


def to16(a, bf):
    """f32 -> bf16 / f16 bits, round to nearest even."""
    a = np.asarray(a, dtype=np.float32)
    if not bf:
        return a.astype(np.float16).view(np.uint16)
    u = a.view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.astype(np.uint16)


def from16(b, bf):
    if not bf:
        return b.view(np.float16).astype(np.float64)
    return (b.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def emu(bf, cols, n, warps, splits, fixup, act, acc, mats, seed, eager=0):
    args = ["./emu", str(bf), str(cols), str(n), str(warps), str(splits), str(fixup), str(act), str(acc),
            str(seed), str(eager)]
    for i, (rows, _) in enumerate(mats):
        args += [str(rows), f"m{i}.bin"]
    subprocess.run(args, check=True)
    k = 1 if act >= 0 else len(mats)
    return [np.fromfile(f"out{i}.bin", dtype=np.float32).reshape(n, mats[i][0]) for i in range(k)]


rng = np.random.default_rng(16)
failed, worst = False, 0.0
# (bf, mats [(rows)], cols, n, warps, splits, act, accumulate): rows not multiples of the 16-row
# tile nor of a block's 32 W; one chunk (64 columns) and uneven chunk shares over the splits;
# batches across tile edges; 100: launches of 64 and 36.
CASES = [
    (1, [37], 64, 9, 4, 1, -1, 0),
    (1, [45], 320, 16, 8, 3, -1, 0),
    (0, [70], 512, 17, 4, 4, -1, 0),
    (0, [130], 192, 33, 8, 2, -1, 0),
    (1, [300], 1024, 64, 4, 5, -1, 0),
    (1, [19], 256, 100, 8, 2, -1, 0),
    (0, [21], 128, 1, 4, 2, -1, 0),
    (1, [70, 37, 19], 256, 40, 4, 3, -1, 0),   # Q/K/V in one launch
    (0, [45, 45, 130], 128, 64, 8, 1, -1, 0),
    (1, [37], 320, 33, 4, 2, -1, 1),           # accumulate
    (0, [70], 256, 64, 8, 1, -1, 1),
    (1, [37, 37], 256, 33, 4, 2, 0, 0),        # gate+up, SiLU
    (0, [70, 70], 192, 17, 8, 1, 1, 0),        # GELU tanh
    (1, [19, 19], 128, 64, 8, 3, 0, 1),        # gated + accumulate
    (1, [130], 768, 24, 8, 1, -1, 0),          # 12 chunks: the stage ring wraps three times
    (0, [37], 640, 9, 4, 1, -1, 1),
    (1, [70, 70], 512, 33, 4, 1, 0, 0),
]
for bf, rows_list, cols, n, warps, splits, act, acc in CASES:
    x = (rng.standard_normal((n, cols)) * 2).astype(np.float32)
    x[:, ::61] *= 8  # outlier channels, as hidden states
    x.tofile("x.bin")
    xr = from16(to16(x, bf), bf).reshape(n, cols)
    mats, want = [], []
    for i, rows in enumerate(rows_list):
        wb = to16(rng.uniform(-0.1, 0.1, (rows, cols)), bf)
        wb.tofile(f"m{i}.bin")
        mats.append((rows, wb))
        want.append(xr @ from16(wb, bf).T)
    if act >= 0:
        want = [ACTS[act](want[0]) * want[1]]
    inits = []
    for i, wv in enumerate(want):
        init = rng.standard_normal(wv.shape).astype(np.float32) if acc else None
        if acc:
            init.tofile(f"init{i}.bin")
            want[i] = wv + init.astype(np.float64)
    # Split-K both ways: the last split sums in the kernel (fixup), or mmh_reduce does; the same
    # bits either way (one order of summation).
    in_order = emu(bf, cols, n, warps, splits, 1, act, acc, mats, 0)
    shuffled = emu(bf, cols, n, warps, splits, 1, act, acc, mats, 7 + n, eager=1)
    reduced = emu(bf, cols, n, warps, splits, 0, act, acc, mats, 3 + n) if splits > 1 else in_order
    what = (f"{'bf16' if bf else 'f16 '} {'+'.join(map(str, rows_list)):>10}x{cols:<5} n={n:3} "
            f"{warps} warps {splits} splits act {act:2} acc {acc}")
    # shuffled: blocks in another order and every cp.async landing at once rather than at its wait.
    for i, (got, wv) in enumerate(zip(in_order, want)):
        e = rel(got, wv) if np.isfinite(got).all() else float("inf")
        same = np.array_equal(got.view(np.uint32), shuffled[i].view(np.uint32))
        same_r = np.array_equal(got.view(np.uint32), reduced[i].view(np.uint32))
        worst = max(worst, e)
        status = "ok" if e <= 1e-5 and same and same_r else "MISMATCH"
        failed |= status != "ok"
        print(f"{status:8} {what} out {i}: rel err {e:.2e}, shuffled blocks {'identical' if same else 'DIFFER'}"
              f", mmh_reduce {'identical' if same_r else 'DIFFERS'}")
print(f"mmh emulation vs f64 of 16-bit-rounded x: worst rel err {worst:.2e}")
if failed:
    sys.exit("mmh_host_emulation: FAILED")
