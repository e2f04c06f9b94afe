// Runs crates/afm-runtime/src/cuda/kernels/attention_mma.cu on the CPU, one std::thread per
// CUDA thread, and checks it against a plain attention in double precision. For machines
// without a GPU: it exercises the kernel's own indexing (paged K/V addresses, ldmatrix
// addresses, fragment use, masks, online softmax, tile bounds) with the warp-level PTX
// (ldmatrix, mma.sync m16n8k16, shuffles, cp.async) replaced by definitions written from the
// PTX ISA's fragment tables, not from the kernel's own assumptions about them:
//   ldmatrix .x4: lanes 8i..8i+7 address the rows of matrix i; lane l receives, in register
//                 i, elements (l/4, 2(l%4)) and (l/4, 2(l%4)+1) of matrix i (transposed: rows
//                 2(l%4), 2(l%4)+1 of column l/4), lower column in the low half
//   mma A 16x16: a_r of lane l = row l/4 + 8(r%2), cols 2(l%4) + 8(r/2) + {0,1}
//   mma B 16x8:  b_r of lane l = rows (k) 2(l%4) + 8r + {0,1}, col (n) l/4
//   mma C/D:     c_e of lane l = row l/4 + 8(e/2), col 2(l%4) + e%2
// cp.async is a synchronous copy (so races on the double buffer are not modelled).
//
//   g++ -std=c++20 -O2 -pthread scripts/attention_mma_emulate.cpp -o /tmp/mma_emu && /tmp/mma_emu
// (`/tmp/mma_emu quick`: a subset, what scripts/test.sh runs)
//
// Prints the relative error of each case (‖kernel − reference‖ / ‖reference‖ over the rows
// the kernel serves), fails above 2e-3, and fails if the kernel writes any row outside them.

#include <barrier>
#include <functional>
#include <random>
#include <thread>
#include <vector>

// CUDA's and common.cuh's stand-ins; the threads, shuffles, ldmatrix and mma are below.
#include "../crates/afm-runtime/tests/host_emulation.h"

#define __shared__
#define __CUDA_ARCH__ 800

struct Dim3 {
    int x = 0, y = 0, z = 0;
};
static Dim3 blockIdx, blockDim, gridDim;
static thread_local Dim3 threadIdx;

// One CTA's shared memory (dynamic), its barrier, and each warp's exchange area.
alignas(16) u16 smem[1 << 17];
static std::barrier<>* cta_bar;
struct Warp {
    std::barrier<> bar{32};
    u32 w[32][10];
    float f[32][4];
};
static Warp warps[4];

static inline void __syncthreads() { cta_bar->arrive_and_wait(); }
static inline void __syncwarp() { warps[threadIdx.x >> 5].bar.arrive_and_wait(); }
static inline int lane_id() { return threadIdx.x & 31; }
static inline Warp& my_warp() { return warps[threadIdx.x >> 5]; }

static inline float __shfl_xor_sync(u32, float v, int m) {
    Warp& w = my_warp();
    const int l = lane_id();
    w.f[l][0] = v;
    w.bar.arrive_and_wait();
    const float r = w.f[l ^ m][0];
    w.bar.arrive_and_wait();
    return r;
}

static inline int __shfl_sync(u32, int v, int src) {
    Warp& w = my_warp();
    const int l = lane_id();
    w.w[l][9] = (u32)v;
    w.bar.arrive_and_wait();
    const int r = (int)w.w[src][9];
    w.bar.arrive_and_wait();
    return r;
}

static inline u32 smem_addr(const void* p) { return (u32)((const u8*)p - (const u8*)smem); }

static inline void cp_async16(void* dst, const void* src, bool ok) {
    if (ok) memcpy(dst, src, 16);
    else memset(dst, 0, 16);
}
static inline void cp_async_commit() {}
template <int N>
static inline void cp_async_wait() {}

static inline u16 sm_at(u32 byte_addr, int col) { return smem[byte_addr / 2 + col]; }

template <bool TRANS>
static inline void ldsm(u32 (&r)[4], u32 at) {
    Warp& w = my_warp();
    const int l = lane_id();
    w.w[l][0] = at;
    w.bar.arrive_and_wait();
    for (int i = 0; i < 4; i++) {
        u16 lo, hi;
        if (!TRANS) {  // row l/4 of matrix i, cols 2(l%4), +1
            const u32 row = w.w[8 * i + l / 4][0];
            lo = sm_at(row, 2 * (l % 4));
            hi = sm_at(row, 2 * (l % 4) + 1);
        } else {  // column l/4, rows 2(l%4), +1
            lo = sm_at(w.w[8 * i + 2 * (l % 4)][0], l / 4);
            hi = sm_at(w.w[8 * i + 2 * (l % 4) + 1][0], l / 4);
        }
        r[i] = (u32)lo | ((u32)hi << 16);
    }
    w.bar.arrive_and_wait();
}
static inline void ldsm_x4(u32 (&r)[4], u32 at) { ldsm<false>(r, at); }
static inline void ldsm_x4_t(u32 (&r)[4], u32 at) { ldsm<true>(r, at); }

static inline float half_of(u32 reg, int hi) { return h2f((u16)(hi ? reg >> 16 : reg & 0xffff)); }

static inline void mma16816(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    Warp& w = my_warp();
    const int l = lane_id();
    for (int i = 0; i < 4; i++) w.w[l][i] = a[i];
    w.w[l][4] = b0;
    w.w[l][5] = b1;
    w.bar.arrive_and_wait();
    mma16816_lane(l, c, [&](int ln, int i) { return w.w[ln][i]; }, half_of);
    w.bar.arrive_and_wait();
}

// The decode kernel's folded prologue (attn_dec_mma_pro_*) is not emulated: its per-head
// arithmetic is common.cuh's, checked on the GPU bit for bit against the prologue kernel
// (tests/cuda_attend_prologue.rs). Declarations so the file compiles; never called here.
struct DecPro {
    const float *k, *v, *qw, *kw, *cs;
    const int* pos;
    int dims, neox, max_pos, k_stride, v_stride, v4;
    float eps;
};
template <int MAXD>
void pro_weights(const float*, int, int, float4 (&)[(MAXD + 127) / 128]) { abort(); }
template <int MAXD>
void pro_rope_pairs(const float*, int, int, int, float2 (&)[MAXD / 64]) { abort(); }
template <int MAXD>
void pro_head(const float*, float*, const float*, const float4 (&)[(MAXD + 127) / 128], bool,
              int, float, bool, const float2 (&)[MAXD / 64], int, int, int) {
    abort();
}

#include "../crates/afm-runtime/src/cuda/kernels/attention_mma.cu"

typedef void (*Kernel)(const float*, const u16*, const u16*, const int*, const int*,
                       const int*, float*, float*, int*, const MmaArgs);

struct Case {
    const char* name;
    int n_heads, n_kv, d;
    int window;
    float softcap;
    std::vector<std::pair<int, int>> seqs;  // (cached positions, new rows)
    bool bs_shift = true;                   // block_size 16 by a shift, or by division
    int splits = 1;                         // key-range splits (split-K)
    bool decode = false;  // one row per sequence on attn_dec_mma_* (seqs' rows must be 1)
};

static bool run(const Case& c, std::mt19937& rng) {
    const int bs = 16, d = c.d, nkv = c.n_kv, nh = c.n_heads;
    Kernel kernel = d == 64 ? attn_mma_f16_64 : d == 128 ? attn_mma_f16_128 : attn_mma_f16_256;
    if (c.decode)
        kernel = d == 64 ? attn_dec_mma_f16_64 : d == 128 ? attn_dec_mma_f16_128 : attn_dec_mma_f16_256;
    const int threads = c.decode && d != 64 ? 64 : 128;  // ATTN_DEC_MMA's warps
    std::uniform_real_distribution<float> U(-1.f, 1.f);
    // Block tables over a shuffled pool, as the engine's cache hands them out.
    int need_total = 0, max_blocks = 1;
    for (auto [p, l] : c.seqs) {
        need_total += (p + l + bs - 1) / bs;
        max_blocks = max(max_blocks, (p + l + bs - 1) / bs);
    }
    const int num_blocks = need_total + 3;
    std::vector<int> ids(num_blocks);
    for (int i = 0; i < num_blocks; i++) ids[i] = i;
    std::shuffle(ids.begin(), ids.end(), rng);
    std::vector<int> tables(c.seqs.size() * max_blocks, 0), seqs;
    std::vector<int> tiles;
    int at = 0, rows = 0;
    for (size_t s = 0; s < c.seqs.size(); s++) {
        auto [p, l] = c.seqs[s];
        const int need = (p + l + bs - 1) / bs;
        for (int b = 0; b < need; b++) tables[s * max_blocks + b] = ids[at++];
        seqs.insert(seqs.end(), {rows, l, p, 0});
        if (c.decode) tiles.insert(tiles.end(), {(int)s, 0});
        else if (l >= 64)
            for (int q0 = ((l - 1) / 64) * 64; q0 >= 0; q0 -= 64) tiles.insert(tiles.end(), {(int)s, q0});
        rows += l;
    }
    // Cache contents (f16) for every position, and the step's queries.
    std::vector<u16> kc((size_t)num_blocks * nkv * bs * d), vc(kc.size());
    for (auto& x : kc) x = f2h(U(rng));
    for (auto& x : vc) x = f2h(U(rng));
    std::vector<float> q((size_t)rows * nh * d);
    for (auto& x : q) x = U(rng);
    std::vector<float> out(q.size(), NAN);
    const int group = nh / nkv;
    MmaArgs a{nh,    nkv,   bs, max_blocks, c.window, nh * d, nh * d, group,
              c.bs_shift ? 4 : -1, c.splits, 1.0f / sqrtf((float)d), c.softcap};

    const int n_tiles = (int)tiles.size() / 2;
    // Decode: a CTA per (KV head, sequence, split), the split partials per query head.
    const int gx = c.decode ? nkv : nh;
    std::vector<float> ws((size_t)n_tiles * nh * c.splits * (c.decode ? 1 : 64) * (d + 2), NAN);
    std::vector<int> done((size_t)n_tiles * gx, 0);
    gridDim = {gx, n_tiles, c.splits};
    for (int ty = 0; ty < n_tiles; ty++) {
        for (int hx = 0; hx < gx; hx++) {
          for (int z = 0; z < c.splits; z++) {
            blockIdx = {hx, ty, z};
            blockDim = {threads, 1, 1};
            std::barrier<> bar(threads);
            cta_bar = &bar;
            std::vector<std::thread> th;
            for (int t = 0; t < threads; t++)
                th.emplace_back([&, t] {
                    threadIdx = {t, 0, 0};
                    kernel(q.data(), kc.data(), vc.data(), tables.data(), seqs.data(),
                           tiles.data(), out.data(), ws.data(), done.data(), a);
                });
            for (auto& x : th) x.join();
          }
        }
    }
    bool counters = std::all_of(done.begin(), done.end(), [](int x) { return x == 0; });

    // Reference, in double, with q rounded to f16 as the kernel does.
    double num = 0, den = 0;
    bool stray = false;
    for (size_t s = 0; s < c.seqs.size(); s++) {
        auto [p0, l] = c.seqs[s];
        const int r0 = seqs[s * 4];
        for (int i = 0; i < l; i++) {
            const int pos = p0 + i, lo = c.window > 0 ? max(0, pos + 1 - c.window) : 0;
            for (int h = 0; h < nh; h++) {
                const float* o = &out[((size_t)(r0 + i) * nh + h) * d];
                if (l < 64 && !c.decode) {  // not the kernel's rows: must stay unwritten
                    for (int e = 0; e < d; e++) stray |= !std::isnan(o[e]);
                    continue;
                }
                const int kvh = h / group;
                std::vector<double> sc(pos + 1 - lo), acc(d, 0.0);
                double mx = -INFINITY;
                for (int j = lo; j <= pos; j++) {
                    const size_t base =
                        (((size_t)tables[s * max_blocks + j / bs] * nkv + kvh) * bs + j % bs) * d;
                    double dot = 0;
                    for (int e = 0; e < d; e++)
                        dot += (double)h2f(f2h(q[((size_t)(r0 + i) * nh + h) * d + e])) *
                               h2f(kc[base + e]);
                    double v = dot * a.scale;
                    if (c.softcap > 0) v = c.softcap * tanh(v / c.softcap);
                    sc[j - lo] = v;
                    mx = std::max(mx, v);
                }
                double sum = 0;
                for (int j = lo; j <= pos; j++) {
                    const double w = exp(sc[j - lo] - mx);
                    sum += w;
                    const size_t base =
                        (((size_t)tables[s * max_blocks + j / bs] * nkv + kvh) * bs + j % bs) * d;
                    for (int e = 0; e < d; e++) acc[e] += w * h2f(vc[base + e]);
                }
                for (int e = 0; e < d; e++) {
                    const double want = acc[e] / sum;
                    num += (o[e] - want) * (o[e] - want);
                    den += want * want;
                    if (!std::isfinite(o[e])) num = INFINITY;
                }
            }
        }
    }
    const double err = sqrt(num / std::max(den, 1e-30));
    const bool ok = err <= 2e-3 && !stray && counters;
    printf("%s %-28s heads %2d/%d d %3d window %4d softcap %4.1f splits %d: rel err %.2e%s%s\n",
           ok ? "ok  " : "FAIL", c.name, nh, nkv, d, c.window, c.softcap, c.splits, err,
           stray ? " (wrote rows it does not own)" : "",
           counters ? "" : " (split counters not back to 0)");
    return ok;
}

int main(int argc, char** argv) {
    std::mt19937 rng(7);
    std::vector<Case> cases;
    const int shapes[][3] = {{2, 2, 64}, {4, 2, 128}, {4, 1, 256}};
    for (auto& s : shapes) {
        cases.push_back({"one chunk of 100", s[0], s[1], s[2], 0, 0.f, {{0, 100}}});
        cases.push_back({"chunk at 150, with short", s[0], s[1], s[2], 0, 0.f,
                         {{150, 70}, {3, 5}, {0, 64}}});
        cases.push_back({"chunk at 700 (12+ key tiles)", s[0], s[1], s[2], 0, 0.f, {{700, 64}}});
        cases.push_back({"window 24", s[0], s[1], s[2], 24, 0.f, {{0, 130}}});
        cases.push_back({"window 80 at 100, softcap", s[0], s[1], s[2], 80, 30.f, {{100, 65}}});
        cases.push_back({"chunk at 150, block by div", s[0], s[1], s[2], 0, 0.f, {{150, 70}}, false});
        cases.push_back({"split-K 3, mixed batch", s[0], s[1], s[2], 0, 0.f,
                         {{700, 64}, {3, 5}, {0, 100}}, true, 3});
        cases.push_back({"split-K 16 > tiles, window", s[0], s[1], s[2], 150, 20.f,
                         {{300, 70}}, true, 16});
    }
    // Decode (one new token per sequence): groups 1 to 16, contexts from one key to several
    // tiles per warp, windows, softcap, splits (more than some sequences have tiles).
    const int dshapes[][3] = {{2, 2, 64}, {16, 8, 128}, {32, 8, 128}, {16, 1, 128}, {8, 2, 256}};
    for (auto& s : dshapes) {
        std::vector<std::pair<int, int>> ds = {{0, 1}, {15, 1}, {16, 1}, {200, 1}, {37, 1}, {700, 1}};
        Case dc{"decode", s[0], s[1], s[2], 0, 0.f, ds};
        dc.decode = true;
        cases.push_back(dc);
        dc.name = "decode, window 40, softcap";
        dc.window = 40;
        dc.softcap = 30.f;
        cases.push_back(dc);
        dc.name = "decode split 3, window 300";
        dc.window = 300;
        dc.softcap = 0.f;
        dc.splits = 3;
        cases.push_back(dc);
        dc.name = "decode split 16, by div";
        dc.window = 0;
        dc.splits = 16;
        dc.bs_shift = false;
        cases.push_back(dc);
    }
    int fails = 0;
    const bool quick = argc > 1;
    for (auto& c : cases) {
        // quick (CI): head_dim 64, and the decode cases of Qwen3-8B's heads (4 per KV head,
        // head_dim 128: the 2-warp decode kernel).
        if (quick && c.d != 64 && !(c.decode && c.n_heads == 32)) continue;
        fails += !run(c, rng);
    }
    printf(fails ? "%d case(s) failed\n" : "all cases pass\n", fails);
    return fails ? 1 : 0;
}
