// Paged attention over the KV cache, for decode and prefill alike, plus the KV write.
//
// Cache layout per layer (same as afm_runtime::kv_store):
//   k, v: [num_blocks][n_kv_heads][block_size][D]   token at position p of a sequence lives in
//         block table[p / block_size], slot p % block_size
//
// One block of 128 threads serves one KV head (GH of its query heads), one query tile and one
// split of the key range. It is 16 lane groups of 8 lanes; each lane holds D/8 dimensions of a
// query and of its output, so a key's score is a 3-step shuffle within the group:
//   group g -> (query qi, head hi, key partition pi),  QB * GH * P = 16
//   decode  (QB = 1):       P = 16/GH partitions share the keys of one query
//   prefill (QB = 16/GH):   every group walks all keys of its own query (P = 1)
// Each group keeps an online softmax (max m, sum l, acc); partitions merge in shared memory.
// With n_splits > 1 (long contexts, few blocks), blocks write (acc, m, l) per split and the
// last block of each (head chunk, tile) to finish combines them: the "split-K" flash-decoding
// path, in one launch. `done` counts finished splits per (head chunk, tile); the merging block
// sets its counter back to 0, so the counters are zero again for the next launch (CUDA graph
// replays included) without a memset.

struct AttnArgs {
    int n_heads, n_kv_heads, block_size, max_blocks;
    int window, n_splits, qb, q_stride;
    int out_stride, group, hchunks, min_keys;
    float scale, softcap;
    // attn_decode_impl only: 1 when the launch made each (head chunk, tile)'s splits one thread
    // block cluster (grid z = cluster z = n_splits), so they merge through distributed shared
    // memory instead of `ws` and `done`.
    int cluster;
};

// W consecutive 32-bit words from 4*W-byte aligned memory, in the widest loads that fit.
template <int W>
__device__ __forceinline__ void load_words(const u32* p, u32 (&w)[W]) {
    if constexpr (W % 4 == 0) {
#pragma unroll
        for (int i = 0; i < W / 4; i++) {
            const uint4 v = ((const uint4*)p)[i];
            w[4 * i] = v.x; w[4 * i + 1] = v.y; w[4 * i + 2] = v.z; w[4 * i + 3] = v.w;
        }
    } else if constexpr (W % 2 == 0) {
#pragma unroll
        for (int i = 0; i < W / 2; i++) {
            const uint2 v = ((const uint2*)p)[i];
            w[2 * i] = v.x; w[2 * i + 1] = v.y;
        }
    } else {
#pragma unroll
        for (int i = 0; i < W; i++) w[i] = p[i];
    }
}

template <bool HALF, int W>
__device__ __forceinline__ float word_elem(const u32 (&w)[W], int i) {
    if constexpr (HALF) return h2f((u16)((i & 1) ? (w[i >> 1] >> 16) : (w[i >> 1] & 0xffff)));
    else return __uint_as_float(w[i]);
}

#define MAX_SPLITS 128

// Combines the n_splits partials of one (row, head) at `w` (each [acc D | m | l]):
// out = sum_s acc_s e^(m_s - M) / sum_s l_s e^(m_s - M). Every thread of the block calls it
// (it has barriers). The split weights go to shared memory once, then each thread sums one
// dimension over the splits. Partials are read past L1 (__ldcg): other blocks wrote them.
__device__ void merge_splits(const float* w, float* out, int n_splits, int D, float* sw,
                             float* sh) {
    float m = NEG_INF;
    for (int sp = threadIdx.x; sp < n_splits; sp += blockDim.x)
        m = fmaxf(m, __ldcg(w + sp * (D + 2) + D));
    const float M = block_max(m, sh);
    float l = 0.f;
    for (int sp = threadIdx.x; sp < n_splits; sp += blockDim.x) {
        const float mm = __ldcg(w + sp * (D + 2) + D);
        const float e = mm == NEG_INF ? 0.f : __expf(mm - M);
        sw[sp] = e;
        l += __ldcg(w + sp * (D + 2) + D + 1) * e;
    }
    const float L = block_sum(l, sh);  // its barriers also publish sw
    for (int dd = threadIdx.x; dd < D; dd += blockDim.x) {
        float O = 0.f;
#pragma unroll 4
        for (int sp = 0; sp < n_splits; sp++) O += __ldcg(w + sp * (D + 2) + dd) * sw[sp];
        out[dd] = O / L;
    }
}

template <bool HALF, int D, int GH>
__device__ void attn_impl(const float* __restrict__ q, const u32* __restrict__ kc,
                          const u32* __restrict__ vc, const int* __restrict__ tables,
                          const int* __restrict__ seqs, const int* __restrict__ tiles,
                          float* __restrict__ out, float* __restrict__ ws, int* __restrict__ done,
                          const AttnArgs a) {
    constexpr int NG = 16, DL = D / 8;
    constexpr int W = HALF ? DL / 2 : DL;           // 32-bit words per lane per row
    constexpr int KC = W * 4 <= 32 ? 4 : (W * 4 <= 64 ? 2 : 1);  // keys per step
    constexpr int ELEM = HALF ? 2 : 4;
    __shared__ float sm_m[NG], sm_l[NG];
    __shared__ float sm_acc[NG][D];

    const int g = threadIdx.x >> 3, li = threadIdx.x & 7;
    const u32 gmask = 0xffu << (threadIdx.x & 24);
    const int qb = a.qb, P = NG / (qb * GH);
    const int qi = g / (GH * P), rem = g % (GH * P), hi = rem % GH, pi = rem / GH;
    const int kvh = blockIdx.x / a.hchunks;
    const int h0 = kvh * a.group + (blockIdx.x % a.hchunks) * GH;
    const int s = tiles[blockIdx.y * 2], q_off = tiles[blockIdx.y * 2 + 1];
    const int row0 = seqs[s * 4], len = seqs[s * 4 + 1], pos0 = seqs[s * 4 + 2];
    const int nq = min(qb, len - q_off);
    const bool active = qi < nq;
    const int pos = pos0 + q_off + qi;
    const int* table = tables + (i64)s * a.max_blocks;

    int k0 = 0, k1 = 0;
    if (active) {
        const int first = a.window > 0 ? max(0, pos + 1 - a.window) : 0;
        const int chunk = (pos + 1 - first + a.n_splits - 1) / a.n_splits;
        k0 = first + blockIdx.z * chunk;
        k1 = min(k0 + chunk, pos + 1);
    }

    float qv[DL];
#pragma unroll
    for (int i = 0; i < DL; i++) qv[i] = 0.f;
    if (active) {
        const float* qp = q + (i64)(row0 + q_off + qi) * a.q_stride + (h0 + hi) * D + li * DL;
#pragma unroll
        for (int i = 0; i < DL; i++) qv[i] = HALF ? h2f(f2h(qp[i])) : qp[i];  // as the CPU does
    }
    float m = NEG_INF, l = 0.f, acc[DL];
#pragma unroll
    for (int i = 0; i < DL; i++) acc[i] = 0.f;

    const i64 head_words = (i64)a.block_size * D * ELEM / 4;
    const i64 kv_base = kvh * head_words;
    const int row_words = D * ELEM / 4;
    for (int j0 = k0 + pi; j0 < k1; j0 += P * KC) {
        u32 kw[KC][W], vw[KC][W];
#pragma unroll
        for (int t = 0; t < KC; t++) {
            const int j = j0 + t * P;
            if (j < k1) {
                const i64 blk = table[j / a.block_size];
                const i64 off = blk * a.n_kv_heads * head_words + kv_base +
                                (i64)(j % a.block_size) * row_words + li * W;
                load_words<W>(kc + off, kw[t]);
                load_words<W>(vc + off, vw[t]);
            }
        }
        float sc[KC];
        float mc = NEG_INF;
#pragma unroll
        for (int t = 0; t < KC; t++) {
            float dot = 0.f;
#pragma unroll
            for (int i = 0; i < DL; i++) dot += qv[i] * word_elem<HALF, W>(kw[t], i);
            dot += __shfl_xor_sync(gmask, dot, 4);
            dot += __shfl_xor_sync(gmask, dot, 2);
            dot += __shfl_xor_sync(gmask, dot, 1);
            float sv = dot * a.scale;
            if (a.softcap > 0.f) sv = a.softcap * tanhf(sv / a.softcap);
            sc[t] = (j0 + t * P < k1) ? sv : NEG_INF;
            mc = fmaxf(mc, sc[t]);
        }
        const float mn = fmaxf(m, mc);
        const float corr = __expf(m - mn);
        l *= corr;
#pragma unroll
        for (int i = 0; i < DL; i++) acc[i] *= corr;
#pragma unroll
        for (int t = 0; t < KC; t++) {
            if (j0 + t * P < k1) {
                const float p = __expf(sc[t] - mn);
                l += p;
#pragma unroll
                for (int i = 0; i < DL; i++) acc[i] += p * word_elem<HALF, W>(vw[t], i);
            }
        }
        m = mn;
    }

    if (li == 0) { sm_m[g] = m; sm_l[g] = l; }
#pragma unroll
    for (int i = 0; i < DL; i++) sm_acc[g][li * DL + i] = acc[i];
    __syncthreads();

    // Merge the P partitions of each (query, head) pair.
    for (int e = threadIdx.x; e < qb * GH * D; e += blockDim.x) {
        const int pair = e / D, dd = e % D, pq = pair / GH, ph = pair % GH;
        if (pq >= nq) continue;
        float M = NEG_INF;
        for (int p = 0; p < P; p++) M = fmaxf(M, sm_m[pq * GH * P + p * GH + ph]);
        float L = 0.f, O = 0.f;
        if (M != NEG_INF) {
            for (int p = 0; p < P; p++) {
                const int gi = pq * GH * P + p * GH + ph;
                const float wgt = __expf(sm_m[gi] - M);
                L += sm_l[gi] * wgt;
                O += sm_acc[gi][dd] * wgt;
            }
        }
        const int r = row0 + q_off + pq, hh = h0 + ph;
        if (a.n_splits == 1) {
            out[(i64)r * a.out_stride + hh * D + dd] = O / L;
        } else {
            float* wp = ws + (((i64)r * a.n_heads + hh) * a.n_splits + blockIdx.z) * (D + 2);
            wp[dd] = O;
            if (dd == 0) { wp[D] = M; wp[D + 1] = L; }
        }
    }
    if (a.n_splits == 1) return;

    // Split-K: publish this split's partials; the last split of this (head chunk, tile) to
    // arrive merges them all (threadFenceReduction's pattern).
    __shared__ int last;
    __shared__ float sw[MAX_SPLITS], sh[32];
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        int* c = done + (i64)blockIdx.y * gridDim.x + blockIdx.x;
        last = atomicAdd(c, 1) == a.n_splits - 1;
        if (last) *c = 0;  // every split has counted: ready for the next launch
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (int pair = 0; pair < qb * GH; pair++) {
        const int pq = pair / GH, ph = pair % GH;
        if (pq >= nq) continue;  // the same for every thread: the barriers inside stay matched
        const int r = row0 + q_off + pq, hh = h0 + ph;
        merge_splits(ws + ((i64)r * a.n_heads + hh) * a.n_splits * (D + 2),
                     out + (i64)r * a.out_stride + hh * D, a.n_splits, D, sw, sh);
    }
}

#define ATTN(HALF, NAME, D, GH)                                                                \
    extern "C" __global__ void __launch_bounds__(128) attn_##NAME##_##D##_##GH(                \
        const float* q, const u32* kc, const u32* vc, const int* tables, const int* seqs,      \
        const int* tiles, float* out, float* ws, int* done, const AttnArgs a) { pdl_begin();               \
        attn_impl<HALF, D, GH>(q, kc, vc, tables, seqs, tiles, out, ws, done, a);              \
    }
#define ATTN_D(D) ATTN(false, f32, D, 1) ATTN(false, f32, D, 2) ATTN(true, f16, D, 1) ATTN(true, f16, D, 2)
#define ATTN_D4(D) ATTN_D(D) ATTN(false, f32, D, 4) ATTN(true, f16, D, 4)

ATTN_D4(16)
ATTN_D4(32)
ATTN_D4(64)
ATTN_D4(128)
ATTN_D(256)
// Gemma 4's global layers; one query head per block keeps the 64 values per lane in registers.
ATTN(false, f32, 512, 1) ATTN(true, f16, 512, 1)

// The attention prologue of one layer in one launch: per-head RMSNorm of q and k (when qw and
// kw are given), RoPE on both, and the step's K and V stored in their cache slots. Each value
// gets the arithmetic of the separate kernels (rms_norm_warp, rope, kv_write), so outputs do
// not move. Grid (rows, ceil((n_heads + n_kv_heads) / PRO_WARPS)): warp w of block y takes
// head y * PRO_WARPS + w of q's heads followed by k's, normalizes it into shared memory,
// rotates it there and writes it back (and k's to the cache); the blocks of a row also share
// the copy of its V.
struct PrologueArgs {
    int n_heads, n_kv_heads, D, dims;
    int neox, max_pos, block_size, max_blocks;
    int q_stride, k_stride, v_stride;
    float eps;
    int v4;  // float4 loads (bit 0 for q, bit 1 for k): D % 4 == 0, the heads and weights aligned
};

#define PRO_WARPS 8
#define PRO_MAX_D 512

template <bool HALF>
__device__ __forceinline__ void store_kv(void* c, i64 at, float x) {
    if (HALF) ((u16*)c)[at] = f2h(x);
    else ((float*)c)[at] = x;
}

// pro_weights, pro_rope_pairs and pro_head (one warp's prologue of one head): common.cuh, as
// attention_mma.cu's decode kernel folds the prologue in too.

template <bool HALF>
__device__ void attn_prologue_impl(float* q, float* k, const float* v, void* kc, void* vc,
                                   const float* qw, const float* kw, const int* pos,
                                   const float* cs, const int* tables, const int* seqs,
                                   const int* row_seq, const PrologueArgs a) {
    __shared__ float buf[PRO_WARPS][PRO_MAX_D];
    // Before the PDL wait, everything no kernel of the step writes: the step's tables and
    // positions (uploaded before its first launch), the norm weights and the rotary table. The
    // chain of dependent loads (row -> sequence -> block) then overlaps the kernel before, and
    // after the wait only q, k and v remain to be read.
    const int t = blockIdx.x, s = row_seq[t], D = a.D;
    const bool store = seqs[s * 4 + 1] != 0;  // padding of a CUDA-graph batch stores nothing
    i64 blk = 0;
    int slot = 0;
    if (store) {
        const int p = seqs[s * 4 + 2] + t - seqs[s * 4];
        blk = tables[(i64)s * a.max_blocks + p / a.block_size];
        slot = p % a.block_size;
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int head = blockIdx.y * PRO_WARPS + warp;
    const bool is_q = head < a.n_heads;
    const float* w = is_q ? qw : kw;
    const bool v4 = (a.v4 >> (is_q ? 0 : 1)) & 1;
    float4 wv[PRO_MAX_D / 128];
    if (w && v4) pro_weights<PRO_MAX_D>(w, D, lane, wv);
    const int p = pos[t], half = a.dims / 2;
    const bool rot = p >= 0 && p < a.max_pos;
    float2 cpre[PRO_MAX_D / 64];  // (cos, sin) of pairs lane, lane + 32, ...
    if (rot) pro_rope_pairs<PRO_MAX_D>(cs, p, half, lane, cpre);
    pdl_begin();
    if (store) {
        const int nv = a.n_kv_heads * D;
        for (int e = blockIdx.y * blockDim.x + threadIdx.x; e < nv; e += gridDim.y * blockDim.x) {
            const int hh = e / D, dd = e % D;
            store_kv<HALF>(vc, ((blk * a.n_kv_heads + hh) * a.block_size + slot) * D + dd,
                           v[(i64)t * a.v_stride + e]);
        }
    }

    if (head >= a.n_heads + a.n_kv_heads) return;  // whole warps: no block barrier follows
    const int hh = is_q ? head : head - a.n_heads;
    float* x = is_q ? q + (i64)t * a.q_stride + hh * D : k + (i64)t * a.k_stride + hh * D;
    float* sb = buf[warp];
    pro_head<PRO_MAX_D>(x, sb, w, wv, v4, D, a.eps, rot, cpre, half, a.neox, lane);
    const i64 dst = ((blk * a.n_kv_heads + hh) * a.block_size + slot) * D;
    for (int i = lane; i < D; i += 32) {
        const float y = sb[i];
        x[i] = y;
        if (!is_q && store) store_kv<HALF>(kc, dst + i, y);
    }
}

#define ATTN_PROLOGUE(NAME, HALF)                                                              \
    extern "C" __global__ void __launch_bounds__(PRO_WARPS * 32)                               \
        NAME(float* q, float* k, const float* v, void* kc, void* vc, const float* qw,          \
             const float* kw, const int* pos, const float* cs, const int* tables,              \
             const int* seqs, const int* row_seq, const PrologueArgs a) {                       \
        attn_prologue_impl<HALF>(q, k, v, kc, vc, qw, kw, pos, cs, tables, seqs, row_seq, a); \
    }
ATTN_PROLOGUE(attn_prologue_f32, false)
ATTN_PROLOGUE(attn_prologue_f16, true)

// ---- Decode: one query row per sequence (AttnBatch qb = 1) ----
//
// Grid and lane groups as attn_impl (16 groups of 8 lanes; group g = head g % GH, key
// partition g / GH), tuned for latency, which is what a decode step's attention is bound by:
//  - the split's block-table entries go to shared memory once, read before the PDL wait (the
//    host writes the metadata; no kernel before this one does);
//  - K and V stream through shared memory by cp.async in stages of DEC_KEYS keys, 4 (2 for
//    512-byte rows) in the ring, so the next keys load while the current ones are computed,
//    and the block's GH heads share each row read from global memory; the ring's first fill
//    is issued before the PDL wait too, all but the new key's row (why that is safe: at the
//    issue), so the old keys load while the kernel before finishes;
//  - a split takes at least `min_keys` keys (twice that past 16 · min_keys), in whole stages:
//    a short context uses only the splits it needs (`used`); the others exit at once. A tile with one split used writes its
//    output directly; otherwise, where the host launched each tile's splits as one thread
//    block cluster (a.cluster, sm_90 on, at most DEC_CLUSTER_MAX splits), every split but the
//    last pushes its partial into the last one's shared memory and exits, and the last merges
//    them (dec_cluster_merge: no global round trip, no barrier after the keys); else the
//    last split to finish merges the `used` partials from `ws` in one pass, each thread over
//    its own output elements (no barriers). Both merges give the same bits.
// A lane holds units (16 bytes, less for short rows) li, li + 8, ... of a row, so the 8 lanes
// of a group read 8 consecutive units of shared memory.
//
// attn_dec_pro_* (PRO) fold attn_prologue_f16 in: every block normalizes and rotates its GH
// query heads itself (pro_head, the prologue's per-warp arithmetic: the same bits; redundant
// across splits, and cheap) while its first stages stream; the blocks of the last used split,
// the only ones whose keys include the new token's `pos`, also normalize and rotate the KV
// head's key and put it and the value row straight into their stage (put_new) instead of
// reading them back, and the first of them (head chunk 0: one block per row and KV head)
// stores both in the cache slot. No block reads slot `pos` from the cache. The raw q and k
// are never written back.

#define DEC_KEYS 16
#define DEC_TAB 512  // block-table entries kept in shared memory (more: read from global)

__device__ __forceinline__ u32 dec_smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// 16 bytes global -> shared, asynchronously where the device can (sm_80 on).
__device__ __forceinline__ void dec_cp16(void* dst, const void* src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dec_smem_addr(dst)), "l"(src)
                 : "memory");
#else
    *(uint4*)dst = *(const uint4*)src;
#endif
}
__device__ __forceinline__ void dec_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void dec_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}

// A lane's W words of one row in shared memory: units li + 8k of U bytes each.
template <int U, int W>
__device__ __forceinline__ void dec_row(const u8* row, int li, u32 (&w)[W]) {
    constexpr int WU = U / 4;  // words per unit
#pragma unroll
    for (int k = 0; k < W / WU; k++) {
        const u8* p = row + (li + 8 * k) * U;
        if constexpr (U == 16) {
            const uint4 v = *(const uint4*)p;
            w[4 * k] = v.x; w[4 * k + 1] = v.y; w[4 * k + 2] = v.z; w[4 * k + 3] = v.w;
        } else if constexpr (U == 8) {
            const uint2 v = *(const uint2*)p;
            w[2 * k] = v.x; w[2 * k + 1] = v.y;
        } else {
            w[k] = *(const u32*)p;
        }
    }
}

// The cluster's merge of a decode tile's `used` split partials (O of [GH][D], then M and L of
// [GH]; the split is the block's cluster rank) into out[GH * D], by the last used split (the
// merger: the writer of the new key under PRO, so the one whose own keys finish last). Every
// other used split pushes its partial into the merger's shared memory (`recv`, slot = its
// rank, DecRecv's layout) with st.async, each store counted on the merger's mbarrier `bar`
// (cluster_st_async_f32), and exits; the merger expects the pushers' bytes on `bar`, waits for
// them and merges: each element the same online softmax over the splits in split order as the
// last-block merge of attn_decode_impl, so the same bits. Before: two cluster barriers (the
// partials stayed in each block until all had read them), each block waiting for the last
// split, ~2 us of a Qwen3-0.6B layer's 8 us of attention (bench/RESULTS.md session 17).
#define DEC_CLUSTER_MAX 16
template <int D, int GH>
struct DecRecv {
    static constexpr int SLOT = GH * D + 2 * GH;  // floats a pusher sends: O, M, L
    static constexpr u32 BYTES = SLOT * 4;
};
template <int D, int GH>
__device__ __forceinline__ void dec_cluster_merge(const float* part, const float* recv, u32 bar,
                                                  float* out, int used) {
    typedef DecRecv<D, GH> R;
    if (threadIdx.x == 0) mbar_expect_tx(bar, (used - 1) * R::BYTES);
    __syncthreads();  // the merger's own partial (part) is complete
    mbar_wait(bar, 0);
    for (int e = threadIdx.x; e < GH * D; e += blockDim.x) {
        const int ph = e / D;
        float M = NEG_INF, L = 0.f, O = 0.f;
#pragma unroll
        for (int k = 0; k < DEC_CLUSTER_MAX; k++) {
            if (k >= used) break;
            const float* w = k < used - 1 ? recv + k * R::SLOT : part;
            const float os = w[e], ms = w[GH * D + ph], ls = w[GH * D + GH + ph];
            const float mn = fmaxf(M, ms);
            const float x = __expf(M - mn), y = __expf(ms - mn);
            L = __fmaf_rn(L, x, __fmul_rn(ls, y));
            O = __fmaf_rn(O, x, __fmul_rn(os, y));
            M = mn;
        }
        out[e] = O / L;
    }
}

// DecPro (the fused kernels' prologue inputs): common.cuh.

// PRO: the kernel also does attn_prologue_impl's work for its row (see "Fused prologue" below).
template <bool HALF, int D, int GH, bool PRO = false, int KEYS = DEC_KEYS>
__device__ void attn_decode_impl(const float* __restrict__ q, const u32* __restrict__ kc,
                                 const u32* __restrict__ vc, const int* __restrict__ tables,
                                 const int* __restrict__ seqs, const int* __restrict__ tiles,
                                 float* __restrict__ out, float* __restrict__ ws,
                                 int* __restrict__ done, const AttnArgs a, const DecPro pr) {
    constexpr int NG = 16, DL = D / 8, ELEM = HALF ? 2 : 4;
    constexpr int ROW = D * ELEM;                        // bytes of one K or V row
    constexpr int U = ROW / 8 < 16 ? ROW / 8 : 16;       // bytes per lane unit
    constexpr int EPU = U / ELEM;                        // elements per unit
    constexpr int W = DL * ELEM / 4;                     // words per lane per row
    constexpr int STAGES = ROW <= 256 ? 4 : 2;
    constexpr int SBYTES = KEYS * ROW;               // K (or V) bytes of one stage
    constexpr int P = NG / GH, KC = KEYS / P;        // key partitions, keys per group
    constexpr int PPR = ROW / 16;                        // 16-byte pieces per row
    static_assert(ROW >= 32 && ROW <= 512 && KEYS % P == 0, "decode kernel shape");
    static_assert(2 * KEYS * PPR % 128 == 0, "whole pieces per thread (blockDim.x is 128)");
    // The stages while keys stream, then (aliased) the groups' partial outputs.
    __shared__ __align__(16) u8 smem[STAGES * 2 * SBYTES];
    __shared__ float sm_m[NG], sm_l[NG];
    __shared__ int sm_tab[DEC_TAB];
    __shared__ int last;
    // PRO: the block's GH query heads, then (the writer's) key head, normed and rotated, and
    // its value row.
    __shared__ __align__(16) float sm_pro[PRO ? (GH + 2) * D : 1];

    const int tid = threadIdx.x, g = tid >> 3, li = tid & 7;
    const u32 gmask = 0xffu << (tid & 24);
    const int hi = g % GH, pi = g / GH;
    const int kvh = blockIdx.x / a.hchunks;
    const int h0 = kvh * a.group + (blockIdx.x % a.hchunks) * GH;
    const int bs = a.block_size;

    // Before the PDL wait: the metadata (see above), then the ring's first fill (below).
    const int s = tiles[blockIdx.y * 2];
    const int row0 = seqs[s * 4], len = seqs[s * 4 + 1], pos = seqs[s * 4 + 2];
    if (len == 0) return;  // padding of a CUDA-graph batch (exiting needs no PDL wait)
    const int first = a.window > 0 ? max(0, pos + 1 - a.window) : 0;
    const int n = pos + 1 - first;
    // At least min_keys keys per split, twice that past 16 · min_keys (DecodePlan::max_splits).
    const int floor_keys = n <= 16 * a.min_keys ? a.min_keys : 2 * a.min_keys;
    int chunk = max((n + a.n_splits - 1) / a.n_splits, floor_keys);
    chunk = (chunk + KEYS - 1) / KEYS * KEYS;
    const int used = (n + chunk - 1) / chunk;
    if ((int)blockIdx.z >= used) return;  // past the context: no keys
    // The cluster merge (dec_cluster_merge): the merger's receive barrier, made before any
    // block of the cluster can push to it (every used block arrives on the cluster barrier
    // here, the pushers wait on it before their first push; blocks that exited count as
    // arrived).
    const bool cl = a.cluster && used > 1, merger = (int)blockIdx.z == used - 1;
    __shared__ __align__(8) u64 recv_bar;
    extern __shared__ __align__(16) float dec_recv[];  // the merger's: DecRecv slots
    if (cl) {
        if (merger && tid == 0) {
            mbar_init(dec_smem_addr(&recv_bar), 1);
            mbar_init_fence();
        }
        cluster_arrive();
    }
    const int k0 = first + blockIdx.z * chunk, k1 = min(k0 + chunk, pos + 1);
    const int nst = (k1 - k0 + KEYS - 1) / KEYS;
    const int* table = tables + (i64)s * a.max_blocks;
    const int b0 = k0 / bs, nb = (k1 - 1) / bs - b0 + 1;
    const bool tab_sm = nb <= DEC_TAB;
    if (tab_sm)
        for (int i = tid; i < nb; i += blockDim.x) sm_tab[i] = table[b0 + i];

    // Fused prologue (PRO), before the wait: the norm weights and rotary pairs. Warp w takes
    // head w of the block's GH query heads; the blocks of the split holding the new key (the
    // last used: `writer`) also take the KV head's key: warp GH % 4 (warp 0 after its query
    // head when GH is 4). Head chunk 0's stores K and V in the cache (`store`).
    const int warp = tid >> 5, lane = tid & 31;
    const bool writer = PRO && blockIdx.z == used - 1;
    const bool store = writer && blockIdx.x % a.hchunks == 0;
    const int kwarp = GH % 4;
    constexpr int PD = D < 128 ? 128 : D;  // pro_* register arrays: at least one float4
    float4 wq[(PD + 127) / 128], wk[(PD + 127) / 128];
    float2 cpre[PD / 64];
    int ppos = 0;
    bool rot = false;
    if constexpr (PRO) {
        ppos = pr.pos[row0];
        rot = ppos >= 0 && ppos < pr.max_pos;
        if (warp < GH && pr.qw && (pr.v4 & 1)) pro_weights<PD>(pr.qw, D, lane, wq);
        if (writer && warp == kwarp && pr.kw && (pr.v4 & 2)) pro_weights<PD>(pr.kw, D, lane, wk);
        if (rot) pro_rope_pairs<PD>(pr.cs, ppos, pr.dims / 2, lane, cpre);
    }
    __syncthreads();  // sm_tab

    const i64 head_bytes = (i64)bs * ROW;
    const u8* kb8 = (const u8*)kc + kvh * head_bytes;
    const u8* vb8 = (const u8*)vc + kvh * head_bytes;
    const i64 blk_bytes = a.n_kv_heads * head_bytes;
    // Stage st (keys k0 + st * KEYS ...) into buffer b, but for key `skip`: thread tid copies
    // 16-byte pieces tid, tid + 128, ... of the stage's K rows then V rows. One division per
    // stage; a piece's cache block is the stage's first plus the slots it runs past.
    auto issue = [&](int st, int b, int skip) {
        u8* dk = smem + b * 2 * SBYTES;
        const int kb = k0 + st * KEYS, kbd = kb / bs, kbm = kb - kbd * bs;
#pragma unroll
        for (int p = tid; p < 2 * KEYS * PPR; p += 128) {
            const bool isv = p >= KEYS * PPR;
            const int pp = isv ? p - KEYS * PPR : p;
            const int r = pp / PPR, c = pp % PPR;
            if (kb + r >= k1 || kb + r == skip) continue;
            int slot = kbm + r, bi = kbd;
            while (slot >= bs) { slot -= bs; bi++; }
            const i64 blk = tab_sm ? sm_tab[bi - b0] : table[bi];
            const i64 off = blk * blk_bytes + (i64)slot * ROW + c * 16;
            dec_cp16(dk + isv * SBYTES + r * ROW + c * 16, (isv ? vb8 : kb8) + off);
        }
    };
    // The new key `pos` is in the last stage of the last used split (k1 = pos + 1 there).
    const int st_new = nst - 1, r_new = pos - (k0 + st_new * KEYS);
    const bool has_new = blockIdx.z == used - 1;

    // ---- The first STAGES stages (the whole ring) are issued before the PDL wait, but for
    // the new key's row. Safe: every kernel starts with pdl_begin (griddepcontrol.wait, THEN
    // launch_dependents), so this block runs only once the kernel before it has passed its
    // wait, i.e. once every kernel before THAT one has completed and its stores are in L2
    // (cp.async.cg reads L2); and the kernel right before a decode attention (a projection,
    // bias or norm kernel; attn_prologue or kv_write before attn_dec) writes no cache row but
    // each decode row's new key `pos`, which is never read here: attn_dec_pro puts it from
    // registers (put_new), attn_dec copies it after the wait (`late`). The rows < pos were
    // stored in earlier steps, and no step rewrites them (partial blocks are private to their
    // sequence, full ones immutable). What would break it: a kernel that writes other cache
    // rows and lets its dependents launch before it ends (compute/cuda/kv_rows.rs's
    // kv_rows_write_* only wait, so they do not), or a kernel before the attention all of
    // whose blocks return before their wait (the grid before it might then still run). Without PDL (AFM_PDL=0, before sm_90) the wait is a
    // no-op and the kernel starts after the one before has completed.
    // Group accounting: one cp.async group per stage, in order; the new key's stage's group
    // (attn_dec, when that stage is in the ring) is committed after the wait with that row.
    const bool late = !PRO && has_new && st_new < STAGES;
#pragma unroll
    for (int st = 0; st < STAGES; st++) {
        if (st < nst) issue(st, st, pos);
        if (!late || st < st_new) dec_commit();
    }
    pdl_begin();
    if (late) {
        // The row the kernel before (attn_prologue, kv_write) stored: pieces tid of K then V.
        const int sb = pos / bs;
        const i64 blk = tab_sm ? sm_tab[sb - b0] : table[sb];
        const i64 at = blk * blk_bytes + (i64)(pos - sb * bs) * ROW;
        u8* row = smem + st_new * 2 * SBYTES + r_new * ROW;
        for (int p = tid; p < 2 * PPR; p += 128) {
            const bool isv = p >= PPR;
            const int c = isv ? p - PPR : p;
            dec_cp16(row + isv * SBYTES + c * 16, (isv ? vb8 : kb8) + at + c * 16);
        }
#pragma unroll
        for (int st = 0; st < STAGES; st++)
            if (st >= st_new) dec_commit();
    }
    // PRO, the writer: the new key's K and V rows (sm_pro's, rounded as the cache stores them)
    // straight into row `pos` of buffer b. So no block reads back through global memory what
    // one of them stored there (cp.async after st.global would need a GPU-scope fence to be
    // sure of reading the store from L2, and another block's store would need more). Call
    // after the barrier that publishes sm_pro and frees buffer b; the loop's barrier before
    // the stage is read publishes the row.
    auto put_new = [&](int b) {
        u8* row = smem + b * 2 * SBYTES + r_new * ROW;
        for (int p = tid; p < 2 * PPR; p += 128) {
            const bool isv = p >= PPR;
            const int c = isv ? p - PPR : p;
            const float* x = sm_pro + (GH + isv) * D + c * 8;
            u32 w[4];
#pragma unroll
            for (int i = 0; i < 4; i++) w[i] = (u32)f2h(x[2 * i]) | ((u32)f2h(x[2 * i + 1]) << 16);
            *(uint4*)(row + isv * SBYTES + c * 16) = make_uint4(w[0], w[1], w[2], w[3]);
        }
    };

    float qv[DL];
    if constexpr (PRO) {
        // ---- Fused prologue: attn_prologue_impl's arithmetic per head (pro_head), so q, the
        // stored K and V, and thus the output, are its bits. The keys stream meanwhile (all
        // but the new one, which put_new adds).
        const int half = pr.dims / 2;
        // The writer's value row first: its loads then fly with the query (or key) head's,
        // one round trip after the wait instead of two (the writer is the split the others
        // wait for).
        constexpr int VR = (D + 127) / 128;
        float vr[VR];
        const float* vx = pr.v + (i64)row0 * pr.v_stride + kvh * D;
        if (writer) {
#pragma unroll
            for (int j = 0; j < VR; j++) vr[j] = tid + 128 * j < D ? vx[tid + 128 * j] : 0.f;
        }
        if (warp < GH) {
            const float* x = q + (i64)row0 * a.q_stride + (h0 + warp) * D;
            pro_head<PD>(x, sm_pro + warp * D, pr.qw, wq, pr.v4 & 1, D, pr.eps, rot, cpre, half,
                         pr.neox, lane);
        }
        if (writer) {
            const float* kx = pr.k + (i64)row0 * pr.k_stride + kvh * D;
            const int sb = pos / bs;
            const i64 blk = tab_sm ? sm_tab[sb - b0] : table[sb];
            const i64 at = ((blk * a.n_kv_heads + kvh) * bs + (pos - sb * bs)) * D;
            // The cache is written through the pointers the kernel reads it by (by cp.async
            // only, and never this row: put_new).
            u16* kw16 = (u16*)(const void*)kc;
            u16* vw16 = (u16*)(const void*)vc;
            if (warp == kwarp) {
                float* sk = sm_pro + GH * D;
                pro_head<PD>(kx, sk, pr.kw, wk, (pr.v4 >> 1) & 1, D, pr.eps, rot, cpre, half,
                             pr.neox, lane);
                if (store)
                    for (int i = lane; i < D; i += 32) kw16[at + i] = f2h(sk[i]);
            }
            float* sv = sm_pro + (GH + 1) * D;
#pragma unroll
            for (int j = 0; j < VR; j++) {
                const int i = tid + 128 * j;
                if (i < D) {
                    sv[i] = vr[j];
                    if (store) vw16[at + i] = f2h(vr[j]);
                }
            }
        }
        __syncthreads();  // sm_pro complete
        // A buffer of the ring's first fill: its other rows may still be landing (disjoint).
        if (writer && st_new < STAGES) put_new(st_new);
        const float* qs = sm_pro + hi * D;
#pragma unroll
        for (int i = 0; i < DL; i++) qv[i] = h2f(f2h(qs[(li + 8 * (i / EPU)) * EPU + i % EPU]));
    } else {
        const float* qp = q + (i64)row0 * a.q_stride + (h0 + hi) * D;
#pragma unroll
        for (int i = 0; i < DL; i++) {
            const float x = qp[(li + 8 * (i / EPU)) * EPU + i % EPU];
            qv[i] = HALF ? h2f(f2h(x)) : x;  // as the CPU does
        }
    }

    float m = NEG_INF, l = 0.f, acc[DL];
#pragma unroll
    for (int i = 0; i < DL; i++) acc[i] = 0.f;
    for (int st = 0; st < nst; st++) {
        // Stage st's group is done: STAGES groups before the loop, then one per pass from 1.
        if (st == 0) dec_wait<STAGES - 1>();
        else dec_wait<STAGES - 2>();
        __syncthreads();  // stage st landed for all; stage st - 1's buffer is free again
        if (st > 0) {
            if (st + STAGES - 1 < nst) {
                // After the wait: attn_dec reads the new key's row here too.
                issue(st + STAGES - 1, (st + STAGES - 1) % STAGES, PRO ? pos : -1);
                if (writer && st + STAGES - 1 == st_new) put_new(st_new % STAGES);
            }
            dec_commit();
        }
        const u8* bk = smem + (st % STAGES) * 2 * SBYTES;
        const int kb = k0 + st * KEYS;
        float sc[KC];
        float mc = NEG_INF;
#pragma unroll
        for (int t = 0; t < KC; t++) {
            u32 kw[W];
            dec_row<U, W>(bk + (pi * KC + t) * ROW, li, kw);
            float dot = 0.f;
#pragma unroll
            for (int i = 0; i < DL; i++) dot += qv[i] * word_elem<HALF, W>(kw, i);
            dot += __shfl_xor_sync(gmask, dot, 4);
            dot += __shfl_xor_sync(gmask, dot, 2);
            dot += __shfl_xor_sync(gmask, dot, 1);
            float sv = dot * a.scale;
            if (a.softcap > 0.f) sv = a.softcap * tanhf(sv / a.softcap);
            sc[t] = kb + pi * KC + t < k1 ? sv : NEG_INF;
            mc = fmaxf(mc, sc[t]);
        }
        if (mc == NEG_INF) continue;  // no keys for this group in this stage
        const float mn = fmaxf(m, mc);
        if (mn > m) {  // rescale only when the maximum moves (rarely, after the first keys)
            const float corr = __expf(m - mn);
            l *= corr;
#pragma unroll
            for (int i = 0; i < DL; i++) acc[i] *= corr;
        }
#pragma unroll
        for (int t = 0; t < KC; t++) {
            if (sc[t] != NEG_INF) {
                const float p = __expf(sc[t] - mn);
                u32 vw[W];
                dec_row<U, W>(bk + SBYTES + (pi * KC + t) * ROW, li, vw);
                l += p;
#pragma unroll
                for (int i = 0; i < DL; i++) acc[i] += p * word_elem<HALF, W>(vw, i);
            }
        }
        m = mn;
    }
    dec_wait<0>();
    __syncthreads();  // every group is done with the stages: their memory takes the partials

    float* sm_acc = (float*)smem;  // [NG][D]
    // With clusters, this split's partial for the other blocks to read: O of [GH][D], then M
    // and L of [GH].
    float* sm_part = sm_acc + NG * D;
    static_assert((NG * D + GH * D + 2 * GH) * 4 <= STAGES * 2 * SBYTES, "partial in stages");
    if (li == 0) { sm_m[g] = m; sm_l[g] = l; }
#pragma unroll
    for (int i = 0; i < DL; i++) sm_acc[g * D + (li + 8 * (i / EPU)) * EPU + i % EPU] = acc[i];
    __syncthreads();

    // A pusher's slot in the merger (cluster_map'ed) and the merger's barrier; the cluster
    // barrier first: the merger has begun and made its barrier.
    const bool push = cl && !merger;
    u32 rslot = 0, rbar = 0;
    if (push) {
        cluster_wait();
        const u32 rank = used - 1;
        rslot = cluster_map(dec_smem_addr(dec_recv), rank) + blockIdx.z * DecRecv<D, GH>::BYTES;
        rbar = cluster_map(dec_smem_addr(&recv_bar), rank);
    }
    // Merge the P partitions of each head: into the output, or this split's partial.
    for (int e = tid; e < GH * D; e += blockDim.x) {
        const int ph = e / D, dd = e % D;
        float M = NEG_INF;
#pragma unroll
        for (int p = 0; p < P; p++) M = fmaxf(M, sm_m[p * GH + ph]);
        float L = 0.f, O = 0.f;
#pragma unroll
        for (int p = 0; p < P; p++) {
            const int gi = p * GH + ph;
            const float wgt = sm_m[gi] == NEG_INF ? 0.f : __expf(sm_m[gi] - M);
            L += sm_l[gi] * wgt;
            O += sm_acc[gi * D + dd] * wgt;
        }
        if (used == 1) {
            out[(i64)row0 * a.out_stride + (h0 + ph) * D + dd] = O / L;
        } else if (push) {
            cluster_st_async_f32(rslot + 4 * e, O, rbar);
            if (dd == 0) {
                cluster_st_async_f32(rslot + 4 * (GH * D + ph), M, rbar);
                cluster_st_async_f32(rslot + 4 * (GH * D + GH + ph), L, rbar);
            }
        } else if (cl) {
            sm_part[e] = O;
            if (dd == 0) { sm_part[GH * D + ph] = M; sm_part[GH * D + GH + ph] = L; }
        } else {
            float* wp = ws + (((i64)row0 * a.n_heads + h0 + ph) * a.n_splits + blockIdx.z) * (D + 2);
            wp[dd] = O;
            if (dd == 0) { wp[D] = M; wp[D + 1] = L; }
        }
    }
    if (used == 1 || push) return;
    if (cl) {
        dec_cluster_merge<D, GH>(sm_part, dec_recv, dec_smem_addr(&recv_bar),
                                 out + (i64)row0 * a.out_stride + h0 * D, used);
        return;
    }

    // The last of the `used` splits to finish merges them (threadFenceReduction's pattern);
    // it sets the counter back to 0 for the next launch.
    __threadfence();
    __syncthreads();
    if (tid == 0) {
        int* c = done + (i64)blockIdx.y * gridDim.x + blockIdx.x;
        last = atomicAdd(c, 1) == used - 1;
        if (last) *c = 0;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    // Each thread combines its EPT output elements over the splits in split order, as one
    // online softmax: the same operations in the same order for every element as a plain loop
    // over the splits (so the same bits), but with the loads taken out of its dependent chain:
    // the splits' (m, l) once per head into shared memory (the stages' memory, free again),
    // each element's partial outputs CH splits at a time into registers, clamped to the last
    // split so no load waits on a branch. One or two L2 round trips instead of one per split
    // and element.
    constexpr int EPT = (GH * D + 127) / 128, CH = 16 / EPT;  // 16 partials in registers
    static_assert(2 * GH * MAX_SPLITS * 4 <= STAGES * 2 * SBYTES, "split (m, l) in the stages");
    float* sm_ml = (float*)smem;  // m of [GH][used], then l of [GH][used]
    const float* wrow = ws + ((i64)row0 * a.n_heads + h0) * a.n_splits * (D + 2);
    auto load_os = [&](int s0, float (&os)[EPT][CH]) {
#pragma unroll
        for (int j = 0; j < EPT; j++) {
            const int e = min(tid + 128 * j, GH * D - 1), ph = e / D, dd = e % D;
#pragma unroll
            for (int k = 0; k < CH; k++) {
                const int sp = min(s0 + k, used - 1);
                os[j][k] = __ldcg(wrow + ((i64)ph * a.n_splits + sp) * (D + 2) + dd);
            }
        }
    };
    float os[EPT][CH];
    load_os(0, os);
    for (int i = tid; i < GH * used; i += blockDim.x) {
        const int ph = i / used, sp = i % used;
        const float* w = wrow + ((i64)ph * a.n_splits + sp) * (D + 2);
        sm_ml[i] = __ldcg(w + D);
        sm_ml[GH * used + i] = __ldcg(w + D + 1);
    }
    __syncthreads();
    float M[EPT], L[EPT], O[EPT];
#pragma unroll
    for (int j = 0; j < EPT; j++) { M[j] = NEG_INF; L[j] = 0.f; O[j] = 0.f; }
    for (int s0 = 0; s0 < used; s0 += CH) {
        if (s0 > 0) load_os(s0, os);
#pragma unroll
        for (int k = 0; k < CH; k++) {
            if (s0 + k >= used) break;
#pragma unroll
            for (int j = 0; j < EPT; j++) {
                const int ph = min(tid + 128 * j, GH * D - 1) / D, at = ph * used + s0 + k;
                const float ms = sm_ml[at], ls = sm_ml[GH * used + at];
                const float mn = fmaxf(M[j], ms);
                const float x = __expf(M[j] - mn), y = __expf(ms - mn);
                L[j] = __fmaf_rn(L[j], x, __fmul_rn(ls, y));
                O[j] = __fmaf_rn(O[j], x, __fmul_rn(os[j][k], y));
                M[j] = mn;
            }
        }
    }
#pragma unroll
    for (int j = 0; j < EPT; j++) {
        const int e = tid + 128 * j;
        if (e < GH * D)
            out[(i64)row0 * a.out_stride + (h0 + e / D) * D + e % D] = O[j] / L[j];
    }
}

#define ATTN_DEC(HALF, NAME, D, GH)                                                            \
    extern "C" __global__ void __launch_bounds__(128) attn_dec_##NAME##_##D##_##GH(            \
        const float* q, const u32* kc, const u32* vc, const int* tables, const int* seqs,      \
        const int* tiles, float* out, float* ws, int* done, const AttnArgs a) {                \
        attn_decode_impl<HALF, D, GH>(q, kc, vc, tables, seqs, tiles, out, ws, done, a,        \
                                      DecPro{});                                               \
    }
// f16 caches (the engine's for every non-f32 checkpoint) of the common head sizes; the rest
// take attn_impl, which keeps NVRTC's and the driver's compile time down.
ATTN_DEC(true, f16, 64, 1) ATTN_DEC(true, f16, 64, 2) ATTN_DEC(true, f16, 64, 4)
ATTN_DEC(true, f16, 128, 1) ATTN_DEC(true, f16, 128, 2) ATTN_DEC(true, f16, 128, 4)
ATTN_DEC(true, f16, 256, 1) ATTN_DEC(true, f16, 256, 2)

// The decode kernel with the attention prologue folded in (CudaContext::attend_prologue): one
// launch instead of attn_prologue_f16 + attn_dec_f16 when a step is all decode rows.
#define ATTN_DEC_PRO(D, GH)                                                                    \
    extern "C" __global__ void __launch_bounds__(128) attn_dec_pro_f16_##D##_##GH(             \
        const float* q, const u32* kc, const u32* vc, const int* tables, const int* seqs,      \
        const int* tiles, float* out, float* ws, int* done, const AttnArgs a,                  \
        const DecPro pr) {                                                                     \
        attn_decode_impl<true, D, GH, true>(q, kc, vc, tables, seqs, tiles, out, ws, done, a,  \
                                            pr);                                               \
    }
ATTN_DEC_PRO(64, 1) ATTN_DEC_PRO(64, 2) ATTN_DEC_PRO(64, 4)
ATTN_DEC_PRO(128, 1) ATTN_DEC_PRO(128, 2) ATTN_DEC_PRO(128, 4)
ATTN_DEC_PRO(256, 1) ATTN_DEC_PRO(256, 2)

// Stores each new token's K and V rows ([n_kv_heads * D] at k + t*k_stride) into its slot.
template <bool HALF>
__device__ void kv_write_impl(const float* __restrict__ k, const float* __restrict__ v,
                              void* __restrict__ kc, void* __restrict__ vc, const int* tables, const int* seqs, const int* row_seq,
                              int n_kv_heads, int D, int block_size, int max_blocks, int k_stride,
                              int v_stride) {
    const int t = blockIdx.x, s = row_seq[t];
    if (seqs[s * 4 + 1] == 0) return;  // padding of a CUDA-graph batch
    const int pos = seqs[s * 4 + 2] + t - seqs[s * 4];
    const i64 blk = tables[(i64)s * max_blocks + pos / block_size];
    const int slot = pos % block_size;
    for (int e = threadIdx.x; e < n_kv_heads * D; e += blockDim.x) {
        const int hh = e / D, dd = e % D;
        const i64 dst = ((blk * n_kv_heads + hh) * block_size + slot) * D + dd;
        const float kx = k[(i64)t * k_stride + e], vx = v[(i64)t * v_stride + e];
        if (HALF) {
            ((u16*)kc)[dst] = f2h(kx);
            ((u16*)vc)[dst] = f2h(vx);
        } else {
            ((float*)kc)[dst] = kx;
            ((float*)vc)[dst] = vx;
        }
    }
}

#define KV_WRITE(NAME, HALF)                                                                   \
    extern "C" __global__ void NAME(const float* k, const float* v, void* kc, void* vc,        \
                                    const int* tables, const int* seqs, const int* row_seq,    \
                                    int n_kv_heads, int D, int block_size, int max_blocks,     \
                                    int k_stride, int v_stride) { pdl_begin();                              \
        kv_write_impl<HALF>(k, v, kc, vc, tables, seqs, row_seq, n_kv_heads, D, block_size,    \
                            max_blocks, k_stride, v_stride);                                   \
    }
KV_WRITE(kv_write_f32, false)
KV_WRITE(kv_write_f16, true)
