// Prefill attention on tensor cores (FlashAttention-2 style) over the paged f16 KV cache, and
// (at the end, "Decode on tensor cores") decode steps of many sequences on the same pieces.
//
// Same cache layout and step metadata as attention.cu:
//   k, v: [num_blocks][n_kv_heads][block_size][D] f16; position p of a sequence lives in block
//         table[p / block_size], slot p % block_size
//   seqs [n_seqs][row0, len, pos0, 0], tiles [n_tiles][seq, first query of the tile]
//
// One CTA (4 warps) = one query head x 64 query rows of one sequence; warp w owns rows
// 16w..16w+15. It walks the keys the tile's rows can see in tiles of BN keys, copied from the
// paged cache to shared memory by cp.async, double-buffered (tile i+1 loads while i computes):
//   S = Q K^T        mma m16n8k16 (Q and K f16, S f32), Q rounded from f32 once
//   online softmax   per row in f32 registers: m (max), l (sum), O rescaled by e^(m_old - m)
//   O += P V         same mma, P rounded to f16 (the CPU rounds its weights to f16 too)
// Causal mask: the query at position p sees keys 0..=p (and p-window+1.. with a window); the
// key range stops at the tile's last position, so no tile lies wholly past the diagonal, and
// a warp skips (computes nothing for) key tiles none of its 16 rows can see.
// Split-K (n_splits > 1, when a step has too few CTAs to fill the device: a short chunk
// after a long context): blockIdx.z takes a contiguous share of the key tiles and writes its
// unnormalized O, m and l per row to `ws`; the last of the splits of a (tile, head) to finish
// merges them into `out` and sets its `done` counter back to 0, as attention.cu's split-K.
// Query heads of one KV head run in separate CTAs: packing them into one CTA's 64 rows would
// halve its positions, so K/V traffic per multiply stays the same; L2 serves the repeats.
//
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type";
// lane = 4 * group + tig, group = lane >> 2, tig = lane & 3; f16 pairs: lower column in the
// low half of the 32-bit register):
//   A 16x16 (row-major)   a0: (group, 2tig..+1)  a1: (group+8, 2tig..+1)
//                         a2: (group, 2tig+8..+9) a3: (group+8, 2tig+8..+9)
//   B 16x8 (k x n, "col") b0: (k 2tig..+1, n group)  b1: (k 2tig+8..+9, n group)
//   C/D 16x8 f32          c0, c1: (group, 2tig, 2tig+1)  c2, c3: (group+8, 2tig, 2tig+1)
// ldmatrix .x4: lanes 8i..8i+7 give the row addresses of 8x8 matrix i; register i of every
// lane receives matrix i's (row lane>>2, cols 2(lane&3), +1), or with .trans its
// (rows 2(lane&3), +1; col lane>>2). So:
//   A from Q [row][d]:  lane -> row (lane & 15), col 8 (lane >> 4): regs = a0..a3
//   B from K [key][d]:  lane -> key (lane & 7) + 8 (lane >> 4), col 8 ((lane >> 3) & 1):
//                       regs = b0, b1 of keys n0..n0+7, then b0, b1 of keys n0+8..n0+15
//   B from V [key][d] (.trans): lane -> key (lane & 15), col 8 (lane >> 4):
//                       regs = b0, b1 of dims d0..d0+7, then b0, b1 of dims d0+8..d0+15
//   P as A: the S accumulators of key tiles 2kk, 2kk+1 are a0..a3 of key chunk kk as they are.
//
// mma.m16n8k16, ldmatrix and cp.async need sm_80; below that the entry points are empty and
// cuda/attention.rs never launches them.

struct MmaArgs {
    int n_heads, n_kv_heads, block_size, max_blocks;
    int window, q_stride, out_stride, group;
    int bs_shift;  // log2(block_size) when it is a power of two, else -1
    int n_splits;  // key-range splits (grid z), at most MMA_MAX_SPLITS
    float scale, softcap;
    // Decode: also each output in bf16 here (same layout as out; null: none), the input of a
    // 16-bit O product (AFM_ATTN_HALF, cuda/handover.rs), so it needs no conversion launch.
    u16* out16;
};
// cuda/attention_mma.rs's MmaArgs mirrors this layout.
static_assert(sizeof(MmaArgs) == 56, "MmaArgs");

#define MMA_BM 64          // query rows per CTA: 4 warps x 16
#define MMA_MAX_SPLITS 16  // split weights of a merge: [MMA_BM][MMA_MAX_SPLITS] f32 in Q's space

__device__ __forceinline__ u32 pack_h2(float lo, float hi) {
    return (u32)f2h(lo) | ((u32)f2h(hi) << 16);
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800

// The PTX below is all the kernel's warp-level machinery; scripts/attention_mma_emulate.cpp
// compiles this file on the CPU with its own definitions of these helpers instead (one thread
// per lane), to check the indexing without a GPU.
#ifndef AFM_HOST_EMULATION
// c += A (16x16) B (16x8), f16 in, f32 accumulate.
__device__ __forceinline__ void mma16816(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
#endif  // AFM_HOST_EMULATION

// S (16 rows x BN keys of this warp) = Q K^T from shared memory at byte addresses aq, ak
// (row strides LD halves); row wr0 is the warp's first.
template <int D, int BN, int LD>
__device__ __forceinline__ void qk_tile(float (&sc)[BN / 8][4], u32 aq, u32 ak, int wr0,
                                        int lane) {
#pragma unroll
    for (int n = 0; n < BN / 8; n++) sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) {
        u32 qa[4];
        ldsm_x4(qa, aq + 2 * ((wr0 + (lane & 15)) * LD + kk * 16 + (lane >> 4) * 8));
#pragma unroll
        for (int np = 0; np < BN / 16; np++) {
            u32 kb[4];
            ldsm_x4(kb, ak + 2 * ((np * 16 + (lane & 7) + ((lane >> 4) << 3)) * LD + kk * 16 +
                                  ((lane >> 3) & 1) * 8));
            mma16816(sc[2 * np], qa, kb[0], kb[1]);
            mma16816(sc[2 * np + 1], qa, kb[2], kb[3]);
        }
    }
}

// The online-softmax step of one key tile (first key j0) for this lane's two rows, at
// positions pos[0] (c0, c1) and pos[1] (c2, c3): scale, softcap, mask (when `masked`), new
// maxima m, O and l rescaled, and the probabilities as f16 pairs in A-fragment order.
template <int BN, int DT>
__device__ __forceinline__ void softmax_tile(float (&sc)[BN / 8][4], float (&o)[DT][4],
                                             float (&m)[2], float (&l)[2], u32 (&pk)[BN / 8][2],
                                             const MmaArgs& a, int j0, bool masked, int tig,
                                             const int (&pos)[2]) {
    constexpr int NT = BN / 8;
    float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
    for (int n = 0; n < NT; n++) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
            float v = sc[n][e] * a.scale;
            if (a.softcap > 0.f) v = a.softcap * tanhf(v / a.softcap);
            if (masked) {
                const int j = j0 + n * 8 + 2 * tig + (e & 1), p = pos[e >> 1];
                if (j > p || (a.window > 0 && j <= p - a.window)) v = NEG_INF;
            }
            sc[n][e] = v;
            mx[e >> 1] = fmaxf(mx[e >> 1], v);
        }
    }
    float base[2], corr[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        // the 4 lanes of a group hold the 4 column pairs of its rows
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(FULL_MASK, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(FULL_MASK, mx[r], 2));
        const float mn = fmaxf(m[r], mx[r]);
        base[r] = mn == NEG_INF ? 0.f : mn;  // a row with nothing visible yet
        corr[r] = __expf(m[r] - base[r]);
        m[r] = mn;
    }
    float rs[2] = {0.f, 0.f};
#pragma unroll
    for (int n = 0; n < NT; n++) {
        const float p0 = __expf(sc[n][0] - base[0]), p1 = __expf(sc[n][1] - base[0]);
        const float p2 = __expf(sc[n][2] - base[1]), p3 = __expf(sc[n][3] - base[1]);
        rs[0] += p0 + p1;
        rs[1] += p2 + p3;
        pk[n][0] = pack_h2(p0, p1);
        pk[n][1] = pack_h2(p2, p3);
    }
    l[0] = l[0] * corr[0] + rs[0];
    l[1] = l[1] * corr[1] + rs[1];
#pragma unroll
    for (int d = 0; d < DT; d++) {
        o[d][0] *= corr[0];
        o[d][1] *= corr[0];
        o[d][2] *= corr[1];
        o[d][3] *= corr[1];
    }
}

// O += P V: P from softmax_tile, V [BN][D] in shared memory at byte address av.
template <int D, int BN, int LD>
__device__ __forceinline__ void pv_tile(float (&o)[D / 8][4], const u32 (&pk)[BN / 8][2],
                                        u32 av, int lane) {
#pragma unroll
    for (int kk = 0; kk < BN / 16; kk++) {
        const u32 pa[4] = {pk[2 * kk][0], pk[2 * kk][1], pk[2 * kk + 1][0], pk[2 * kk + 1][1]};
#pragma unroll
        for (int dp = 0; dp < D / 16; dp++) {
            u32 vb[4];
            ldsm_x4_t(vb, av + 2 * ((kk * 16 + (lane & 15)) * LD + dp * 16 + (lane >> 4) * 8));
            mma16816(o[2 * dp], pa, vb[0], vb[1]);
            mma16816(o[2 * dp + 1], pa, vb[2], vb[3]);
        }
    }
}

// This lane's part of rows ra and rb (those below nq): O scaled by sa, sb, at `pa`, `pb`
// (each already offset to the lane's first column); column pairs 8 apart.
template <int DT>
__device__ __forceinline__ void store_rows(const float (&o)[DT][4], float* pa, float* pb,
                                           bool a_ok, bool b_ok, float sa, float sb) {
#pragma unroll
    for (int d = 0; d < DT; d++) {
        if (a_ok) {
            pa[d * 8] = o[d][0] * sa;
            pa[d * 8 + 1] = o[d][1] * sa;
        }
        if (b_ok) {
            pb[d * 8] = o[d][2] * sb;
            pb[d * 8 + 1] = o[d][3] * sb;
        }
    }
}

// Split-K, after every CTA of the (tile, head) has stored its partials at w0
// ([split][wr][O (D) | m | l], wr rows per split: MMA_BM for prefill tiles): the last to arrive
// merges them into out's rows (nq of them, `out` at the first, rows `stride` apart; row r of
// the decode kernel's at `out + r * D`, `stride` = D). `sw` and `flag`: free shared memory.
template <int D>
__device__ void merge_mma_splits(const float* w0, int* done, float* out, i64 stride, int nq,
                                 int n_splits, float* sw, int* flag, int wr,
                                 u16* out16 = nullptr) {
    constexpr int W = D + 2;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        *flag = atomicAdd(done, 1) == n_splits - 1;
        if (*flag) *done = 0;  // every split has counted: ready for the next launch
    }
    __syncthreads();
    if (!*flag) return;
    __threadfence();
    // Per row, each split's weight e^(m_z - M) / L, then each element is one weighted sum.
    // Partials are read past L1 (__ldcg): other CTAs wrote them.
    for (int r = threadIdx.x; r < nq; r += blockDim.x) {
        float M = NEG_INF;
        for (int z = 0; z < n_splits; z++) M = fmaxf(M, __ldcg(w0 + (z * wr + r) * W + D));
        float L = 0.f;
        for (int z = 0; z < n_splits; z++) {
            const float mz = __ldcg(w0 + (z * wr + r) * W + D);
            const float e = mz == NEG_INF ? 0.f : __expf(mz - M);  // a split that saw no key
            sw[r * MMA_MAX_SPLITS + z] = e;
            L += __ldcg(w0 + (z * wr + r) * W + D + 1) * e;
        }
        for (int z = 0; z < n_splits; z++) sw[r * MMA_MAX_SPLITS + z] /= L;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < nq * D; e += blockDim.x) {
        const int r = e / D, d = e % D;
        float acc = 0.f;
        for (int z = 0; z < n_splits; z++)
            acc += __ldcg(w0 + (z * wr + r) * W + d) * sw[r * MMA_MAX_SPLITS + z];
        out[r * stride + d] = acc;
        if (out16) out16[r * stride + d] = f2bf(acc);
    }
}

// Shared memory (dynamic, rows LD = D + 8 halves apart so the 8 rows of an ldmatrix fall in
// different banks):  Q [64][LD] | K [2][BN][LD] | V [2][BN][LD]
template <int D, int BN>
__device__ void attn_mma_impl(const float* __restrict__ q, const u16* __restrict__ kc,
                              const u16* __restrict__ vc, const int* __restrict__ tables,
                              const int* __restrict__ seqs, const int* __restrict__ tiles,
                              float* __restrict__ out, float* __restrict__ ws,
                              int* __restrict__ done, const MmaArgs a) {
    constexpr int LD = D + 8, NT = BN / 8, DT = D / 8, CH = D / 8;
    extern __shared__ __align__(16) u16 smem[];
    u16* sq = smem;
    u16* sk = sq + MMA_BM * LD;
    u16* sv = sk + 2 * BN * LD;

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int grp = lane >> 2, tig = lane & 3;
    const int h = blockIdx.x, kvh = h / a.group;
    const int s = tiles[blockIdx.y * 2], q_off = tiles[blockIdx.y * 2 + 1];
    const int row0 = seqs[s * 4], len = seqs[s * 4 + 1], pos0 = seqs[s * 4 + 2];
    const int nq = min(MMA_BM, len - q_off);
    if (nq <= 0) return;  // whole CTA: no barrier is skipped by part of it
    const int p_first = pos0 + q_off, p_last = p_first + nq - 1;
    const int k_lo = a.window > 0 ? max(0, p_first + 1 - a.window) : 0;
    const int k_hi = p_last + 1;  // keys past the tile's last position are never needed
    const int* table = tables + (i64)s * a.max_blocks;

    // Queries, rounded to f16 as the SIMT kernel and the CPU do; rows past nq are zero.
    for (int e = tid; e < MMA_BM * D / 2; e += blockDim.x) {
        const int r = e / (D / 2), c = (e % (D / 2)) * 2;
        u32 v = 0;
        if (r < nq) {
            const float* qp = q + (i64)(row0 + q_off + r) * a.q_stride + h * D + c;
            v = pack_h2(qp[0], qp[1]);
        }
        *(u32*)(sq + r * LD + c) = v;
    }

    // Keys/values j0..j0+BN-1 into buffer b, 16-byte chunks; keys at or past k_hi are zero
    // (their probability is 0, and 0 * garbage could be NaN).
    auto load_kv = [&](int j0, int b) {
        u16* dk = sk + b * BN * LD;
        u16* dv = sv + b * BN * LD;
        for (int e = tid; e < BN * CH; e += blockDim.x) {
            const int r = e / CH, c = (e % CH) * 8, j = j0 + r;
            const bool ok = j < k_hi;
            i64 off = 0;
            if (ok) {
                // a shift where it can: a division per chunk is a visible share of the loads
                const int bi = a.bs_shift >= 0 ? j >> a.bs_shift : j / a.block_size;
                const i64 blk = table[bi];
                off = ((blk * a.n_kv_heads + kvh) * a.block_size + (j - bi * a.block_size)) * D + c;
            }
            cp_async16(dk + r * LD + c, kc + off, ok);
            cp_async16(dv + r * LD + c, vc + off, ok);
        }
        cp_async_commit();
    };

    // This warp's rows; rows past nq act as the last valid row (finite, never written).
    const int wr0 = warp * 16;
    const bool warp_live = wr0 < nq;
    const int w_first = p_first + wr0, w_last = p_first + min(wr0 + 15, nq - 1);
    const int pos[2] = {p_first + min(wr0 + grp, nq - 1), p_first + min(wr0 + grp + 8, nq - 1)};

    float o[DT][4];
#pragma unroll
    for (int d = 0; d < DT; d++) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};

    // This split's key tiles: [t0, t1) of the n_all tiles from k_lo (all of them unsplit).
    const int n_all = (k_hi - k_lo + BN - 1) / BN;
    const int per = (n_all + a.n_splits - 1) / a.n_splits;
    const int t0 = blockIdx.z * per, t1 = min(n_all, t0 + per);
    if (t0 < t1) load_kv(k_lo + t0 * BN, 0);
    for (int it = t0; it < t1; it++) {
        const int j0 = k_lo + it * BN, buf = (it - t0) & 1;
        if (it + 1 < t1) {
            load_kv(j0 + BN, buf ^ 1);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();  // tile `it` (and Q, the first time) visible to every warp

        const bool skip = !warp_live || j0 > w_last ||
                          (a.window > 0 && j0 + BN - 1 <= w_first - a.window);
        if (!skip) {
            float sc[NT][4];
            u32 pk[NT][2];
            qk_tile<D, BN, LD>(sc, smem_addr(sq), smem_addr(sk + buf * BN * LD), wr0, lane);
            const bool masked =
                j0 + BN - 1 > w_first || (a.window > 0 && j0 <= w_last - a.window);
            softmax_tile<BN, DT>(sc, o, m, l, pk, a, j0, masked, tig, pos);
            pv_tile<D, BN, LD>(o, pk, smem_addr(sv + buf * BN * LD), lane);
        }
        __syncthreads();  // every warp is done with this buffer before it is refilled
    }

#pragma unroll
    for (int r = 0; r < 2; r++) {
        l[r] += __shfl_xor_sync(FULL_MASK, l[r], 1);
        l[r] += __shfl_xor_sync(FULL_MASK, l[r], 2);
    }
    const int ra = wr0 + grp, rb = ra + 8;
    if (a.n_splits == 1) {
        if (!warp_live) return;
        float* oa = out + (i64)(row0 + q_off + ra) * a.out_stride + h * D + 2 * tig;
        float* ob = out + (i64)(row0 + q_off + rb) * a.out_stride + h * D + 2 * tig;
        store_rows<DT>(o, oa, ob, ra < nq, rb < nq, 1.f / l[0], 1.f / l[1]);
        return;
    }

    // Split-K: this split's partials, [MMA_BM rows][O (D) | m | l] per (tile, head, split).
    constexpr int W = D + 2;
    const i64 pair = (i64)blockIdx.y * gridDim.x + h;
    float* w0 = ws + pair * a.n_splits * (MMA_BM * W);
    float* wp = w0 + (i64)blockIdx.z * (MMA_BM * W);
    if (warp_live) {
        store_rows<DT>(o, wp + ra * W + 2 * tig, wp + rb * W + 2 * tig, ra < nq, rb < nq, 1.f,
                       1.f);
        if (tig == 0 && ra < nq) { wp[ra * W + D] = m[0]; wp[ra * W + D + 1] = l[0]; }
        if (tig == 0 && rb < nq) { wp[rb * W + D] = m[1]; wp[rb * W + D + 1] = l[1]; }
    }
    // Q's and K's space are free since the loop's last barrier: the split weights and the
    // flag go there (no static shared memory, which would add to the opt-in-sized dynamic).
    merge_mma_splits<D>(w0, done + pair, out + (i64)(row0 + q_off) * a.out_stride + h * D,
                        a.out_stride, nq, a.n_splits, (float*)smem, (int*)sk, MMA_BM);
}


// ---- Decode on tensor cores: one query row per sequence, many sequences ----
// One CTA (NW warps) = one sequence x one KV head x one split of its keys. The G query heads
// of the KV head (G = group, at most 16) are the rows of one m16n8k16 tile, rows G..15 zero:
// tensor cores have throughput to spare, and one tile's ldmatrix and mma replace the SIMT
// kernel's per-key shuffles. Warp w walks key tiles w, w + NW, ... of the split (DEC_BN keys
// each) through its own ring of STG buffers (STG - 1 tiles in flight while one computes), so
// no CTA barrier runs inside the loop; each warp keeps its own online softmax (qk_tile,
// softmax_tile, pv_tile as the prefill kernel), then the warps merge through shared memory,
// and splits (n_splits > 1) merge as the prefill kernel's.
// Latency is what bounds a decode step's attention, so:
//  - a tile's copy reads the block table once per key (lanes 0..15, in parallel) and passes
//    each row's cache offset by shuffle, not once per 16-byte chunk;
//  - each warp's first STG - 1 tiles are issued before the PDL wait, but for the tile holding
//    the new key `pos`: the kernel just before (attn_prologue, kv_write) writes that row and
//    the queries; no kernel before it writes any other cache row (see attention.cu's decode
//    kernel, "issued before the PDL wait", for why this is safe), and the host wrote the
//    step's tables and metadata.
// Shared memory (dynamic): Q [16][LD] | per warp: STG x (K [DEC_BN][LD], V [DEC_BN][LD]).
#define DEC_BN 16

// PRO (attn_dec_mma_pro_*): the kernel also does the attention prologue of its row, as
// attention.cu's attn_dec_pro_* (the same per-head arithmetic, pro_head, so the same bits):
// after the PDL wait each warp normalizes and rotates query heads warp, warp + NW, ... into
// Q's rows; the CTA of the split holding the new key `pos` normalizes and rotates the KV
// head's key, stores it and the value row in their cache slot, and puts both into the tile
// buffer of `pos` from shared memory (the tile's copy skips that row), so no CTA reads the
// slot back. Queries and keys are read raw and never written back.
// PRO needs no more shared memory: until its loop, a warp's last ring buffer holds no tile
// (the first fill takes the others), so it is the warp's scratch for pro_head; the new key's
// rows wait in the registers of the warp whose tile holds `pos`, as f16 pairs.
template <int D, int NW, int STG, bool PRO = false>
__device__ void attn_dec_mma_impl(const float* __restrict__ q, const u16* __restrict__ kc,
                                  const u16* __restrict__ vc, const int* __restrict__ tables,
                                  const int* __restrict__ seqs, const int* __restrict__ tiles,
                                  float* __restrict__ out, float* __restrict__ ws,
                                  int* __restrict__ done, const MmaArgs a, const DecPro pr) {
    constexpr int LD = D + 8, DT = D / 8, CH = D / 8, BN = DEC_BN, W = D + 2;
    constexpr int TILE = 2 * BN * LD;  // halves of one buffer (K then V)
    static_assert(32 % CH == 0 || CH % 32 == 0, "chunks per row");
    extern __shared__ __align__(16) u16 smem[];
    u16* sq = smem;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int grp = lane >> 2, tig = lane & 3;
    u16* ring = smem + 16 * LD + warp * STG * TILE;
    const int kvh = blockIdx.x, G = a.group;
    const int s = tiles[blockIdx.y * 2];
    const int row0 = seqs[s * 4], len = seqs[s * 4 + 1], pos = seqs[s * 4 + 2];
    if (len == 0) return;  // padding of a CUDA-graph batch: the whole CTA, before any wait
    const int k_lo = a.window > 0 ? max(0, pos + 1 - a.window) : 0, k_hi = pos + 1;
    const int* table = tables + (i64)s * a.max_blocks;

    // Keys j0..j0+BN-1 into this warp's buffer b (no commit); keys past `pos` are zero
    // (their probability is 0, and 0 * garbage could be NaN). Tiles start at k_lo, so every
    // key of a tile is inside a window. Lane r < BN finds key j0 + r's cache row.
    auto load = [&](int j0, int b) {
        u16* dk = ring + b * TILE;
        u16* dv = dk + BN * LD;
        int crow = 0;  // (block * n_kv_heads + kvh) * block_size + slot: the row's index
        if (lane < BN && j0 + lane < k_hi) {
            const int j = j0 + lane;
            const int bi = a.bs_shift >= 0 ? j >> a.bs_shift : j / a.block_size;
            crow = (table[bi] * a.n_kv_heads + kvh) * a.block_size + (j - bi * a.block_size);
        }
#pragma unroll
        for (int i = 0; i < BN * CH / 32; i++) {
            const int e = lane + 32 * i, r = e / CH, c = (e % CH) * 8;
            const int row = __shfl_sync(FULL_MASK, crow, r);
            const bool ok = j0 + r < k_hi;
            if (PRO && j0 + r == pos) continue;  // put_new's row
            const i64 off = (i64)row * D + c;
            cp_async16(dk + r * LD + c, kc + off, ok);
            cp_async16(dv + r * LD + c, vc + off, ok);
        }
    };

    // This split's key tiles [t0, t1); this warp's every NW-th from t0 + warp.
    const int n_all = (k_hi - k_lo + BN - 1) / BN;
    const int per = (n_all + a.n_splits - 1) / a.n_splits;
    const int t0 = blockIdx.z * per, t1 = min(n_all, t0 + per);
    const int tw = t0 + warp;
    // PRO: the split holding `pos` (its last tile) writes the new key, and of its warps the
    // one whose tile that is (kw_owner); nk, nv its K and V rows, elements lane + 32 i.
    const int t_new = (pos - k_lo) / BN;
    const bool writer = PRO && t0 <= t_new && t_new < t1;
    const bool kw_owner = writer && (t_new - t0) % NW == warp;
    float* scratch = (float*)(ring + (STG - 1) * TILE);
    u16 nk[PRO ? D / 32 : 1], nv[PRO ? D / 32 : 1];
    // The new key's row into buffer b of the tile at j0 (PRO, the owner's tile of `pos`).
    auto put_new = [&](int j0, int b) {
        u16* rk = ring + b * TILE + (pos - j0) * LD;
#pragma unroll
        for (int i = 0; i < (PRO ? D / 32 : 0); i++) {
            rk[lane + 32 * i] = nk[i];
            rk[BN * LD + lane + 32 * i] = nv[i];
        }
    };
    auto fill = [&](int t, int b) {
        const int j0 = k_lo + t * BN;
        load(j0, b);
        if (kw_owner && t == t_new) put_new(j0, b);
    };
    // The ring's first fill: one cp.async group per tile, empty past t1. Before the wait
    // while the tile ends before `pos`; from the first that does not, after it.
    int pre = 0;
    for (; pre < STG - 1; pre++) {
        const int t = tw + pre * NW, j0 = k_lo + t * BN;
        if (t < t1 && j0 + BN - 1 >= pos) break;
        if (t < t1) load(j0, pre);
        cp_async_commit();
    }
    // PRO, before the wait too: the norm weights and rotary pairs (nothing in a step writes
    // them).
    constexpr int PD = D < 128 ? 128 : D;  // pro_* register arrays: at least one float4
    float4 wq[(PD + 127) / 128], wk[(PD + 127) / 128];
    float2 cpre[PD / 64];
    bool rot = false;
    if constexpr (PRO) {
        const int ppos = pr.pos[row0];
        rot = ppos >= 0 && ppos < pr.max_pos;
        if (pr.qw && (pr.v4 & 1)) pro_weights<PD>(pr.qw, D, lane, wq);
        if (kw_owner && pr.kw && (pr.v4 & 2)) pro_weights<PD>(pr.kw, D, lane, wk);
        if (rot) pro_rope_pairs<PD>(pr.cs, ppos, pr.dims / 2, lane, cpre);
    }
    pdl_begin();
    if constexpr (PRO) {
        // The new key's K and V rows (the owner warp; one per sequence and KV head), kept as
        // f16 and stored in their cache slot, before any tile holding `pos` loads.
        if (kw_owner) {
            const float* kx = pr.k + (i64)row0 * pr.k_stride + kvh * D;
            const float* vx = pr.v + (i64)row0 * pr.v_stride + kvh * D;
            const int bi = a.bs_shift >= 0 ? pos >> a.bs_shift : pos / a.block_size;
            const i64 at = ((i64)(table[bi] * a.n_kv_heads + kvh) * a.block_size +
                            (pos - bi * a.block_size)) * D;
            pro_head<PD>(kx, scratch, pr.kw, wk, (pr.v4 >> 1) & 1, D, pr.eps, rot, cpre,
                         pr.dims / 2, pr.neox, lane);
            // The cache is written through the pointers the kernel reads it by (by cp.async
            // only, and never this row: put_new).
            u16* kw16 = (u16*)(const void*)kc;
            u16* vw16 = (u16*)(const void*)vc;
#pragma unroll
            for (int i = 0; i < D / 32; i++) {
                nk[i] = f2h(scratch[lane + 32 * i]);
                nv[i] = f2h(vx[lane + 32 * i]);
                kw16[at + lane + 32 * i] = nk[i];
                vw16[at + lane + 32 * i] = nv[i];
            }
            __syncwarp();  // scratch read before the query heads reuse it
        }
    }
    for (int k = pre; k < STG - 1; k++) {
        const int t = tw + k * NW;
        if (t < t1) fill(t, k);
        cp_async_commit();
    }

    // The query heads, rounded to f16 as the SIMT kernel and the CPU do; rows past G zero.
    if constexpr (PRO) {
        for (int r = warp; r < 16; r += NW) {
            if (r < G) {
                const float* x = q + (i64)row0 * a.q_stride + (kvh * G + r) * D;
                pro_head<PD>(x, scratch, pr.qw, wq, pr.v4 & 1, D, pr.eps, rot, cpre,
                             pr.dims / 2, pr.neox, lane);
                for (int i = lane; i < D; i += 32) sq[r * LD + i] = f2h(scratch[i]);
                __syncwarp();  // scratch read before the next head overwrites it
            } else {
                for (int i = lane; i < D; i += 32) sq[r * LD + i] = 0;
            }
        }
    } else {
        for (int e = tid; e < 16 * D / 2; e += blockDim.x) {
            const int r = e / (D / 2), c = (e % (D / 2)) * 2;
            u32 v = 0;
            if (r < G) {
                const float* qp = q + (i64)row0 * a.q_stride + (kvh * G + r) * D + c;
                v = pack_h2(qp[0], qp[1]);
            }
            *(u32*)(sq + r * LD + c) = v;
        }
    }
    __syncthreads();  // Q visible to every warp

    float o[DT][4];
#pragma unroll
    for (int d = 0; d < DT; d++) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
    const int pp[2] = {pos, pos};
    for (int i = 0, t = tw; t < t1; t += NW, i++) {
        // Tile i + STG - 1 into the buffer tile i - 1 used (free since the loop's end).
        const int tn = t + (STG - 1) * NW;
        if (tn < t1) fill(tn, (i + STG - 1) % STG);
        cp_async_commit();
        cp_async_wait<STG - 1>();  // tile i's group
        __syncwarp();  // its chunks, copied by every lane, visible to the warp
        const int j0 = k_lo + t * BN;
        const u16* bk = ring + (i % STG) * TILE;
        float sc[BN / 8][4];
        u32 pk[BN / 8][2];
        qk_tile<D, BN, LD>(sc, smem_addr(sq), smem_addr(bk), 0, lane);
        softmax_tile<BN, DT>(sc, o, m, l, pk, a, j0, j0 + BN - 1 > pos, tig, pp);
        pv_tile<D, BN, LD>(o, pk, smem_addr(bk + BN * LD), lane);
        __syncwarp();  // every lane is done with this buffer before it is refilled
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        l[r] += __shfl_xor_sync(FULL_MASK, l[r], 1);
        l[r] += __shfl_xor_sync(FULL_MASK, l[r], 2);
    }

    // The warps' partials [NW][16][O | m | l] over the rings (every warp is past its loop;
    // its cp.async groups past t1 were empty).
    cp_async_wait<0>();
    __syncthreads();
    float* part = (float*)(smem + 16 * LD);
    {
        float* pw = part + warp * 16 * W;
        const int ra = grp, rb = grp + 8;
        store_rows<DT>(o, pw + ra * W + 2 * tig, pw + rb * W + 2 * tig, ra < G, rb < G, 1.f, 1.f);
        if (tig == 0 && ra < G) { pw[ra * W + D] = m[0]; pw[ra * W + D + 1] = l[0]; }
        if (tig == 0 && rb < G) { pw[rb * W + D] = m[1]; pw[rb * W + D + 1] = l[1]; }
    }
    __syncthreads();
    // Each thread one (head, dim) at a time: the warps' weights e^(m_w - M), M their maximum
    // (a warp that saw no key has m = -inf and weight 0; so has a whole split without keys).
    const bool split = a.n_splits > 1;
    const i64 pair = (i64)blockIdx.y * gridDim.x + kvh;
    float* w0 = ws + pair * a.n_splits * (G * W);
    float* wp = w0 + (i64)blockIdx.z * (G * W);
    for (int e = tid; e < G * D; e += blockDim.x) {
        const int r = e / D, c = e % D;
        float M = NEG_INF;
#pragma unroll
        for (int w = 0; w < NW; w++) M = fmaxf(M, part[(w * 16 + r) * W + D]);
        float L = 0.f, acc = 0.f;
#pragma unroll
        for (int w = 0; w < NW; w++) {
            const float* pw = part + (w * 16 + r) * W;
            const float ew = pw[D] == NEG_INF ? 0.f : __expf(pw[D] - M);
            L += pw[D + 1] * ew;
            acc += pw[c] * ew;
        }
        if (!split) {
            const i64 at = (i64)row0 * a.out_stride + (kvh * G + r) * D + c;
            out[at] = acc / L;
            if (a.out16) a.out16[at] = f2bf(acc / L);
        } else {
            wp[r * W + c] = acc;
            if (c == 0) { wp[r * W + D] = M; wp[r * W + D + 1] = L; }
        }
    }
    if (!split) return;
    // The split weights and the flag over Q's space and the first ring (free since the
    // barrier in the merge, which every thread reaches).
    const i64 first = (i64)row0 * a.out_stride + kvh * G * D;
    merge_mma_splits<D>(w0, done + pair, out + first, D, G, a.n_splits, (float*)(smem + 16 * LD),
                        (int*)smem, G, a.out16 ? a.out16 + first : nullptr);
}

#define ATTN_MMA(D, BN)                                                                        \
    extern "C" __global__ void __launch_bounds__(128) attn_mma_f16_##D(                        \
        const float* q, const u16* kc, const u16* vc, const int* tables, const int* seqs,      \
        const int* tiles, float* out, float* ws, int* done, const MmaArgs a) {                 \
        pdl_begin();                                                                           \
        attn_mma_impl<D, BN>(q, kc, vc, tables, seqs, tiles, out, ws, done, a);                \
    }
#define ATTN_DEC_MMA(D, NW, STG)                                                               \
    extern "C" __global__ void __launch_bounds__(NW * 32) attn_dec_mma_f16_##D(                \
        const float* q, const u16* kc, const u16* vc, const int* tables, const int* seqs,      \
        const int* tiles, float* out, float* ws, int* done, const MmaArgs a) {                 \
        attn_dec_mma_impl<D, NW, STG>(q, kc, vc, tables, seqs, tiles, out, ws, done, a, {});   \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(NW * 32) attn_dec_mma_pro_f16_##D(            \
        const float* q, const u16* kc, const u16* vc, const int* tables, const int* seqs,      \
        const int* tiles, float* out, float* ws, int* done, const MmaArgs a,                   \
        const DecPro pr) {                                                                     \
        attn_dec_mma_impl<D, NW, STG, true>(q, kc, vc, tables, seqs, tiles, out, ws, done, a,  \
                                            pr);                                               \
    }

#else  // below sm_80: the entry points exist (the module lists them) but are never launched

#define ATTN_MMA(D, BN)                                                                        \
    extern "C" __global__ void attn_mma_f16_##D(const float*, const u16*, const u16*,          \
                                                const int*, const int*, const int*, float*,    \
                                                float*, int*, const MmaArgs) {}
#define ATTN_DEC_MMA(D, NW, STG)                                                               \
    extern "C" __global__ void attn_dec_mma_f16_##D(const float*, const u16*, const u16*,      \
                                                    const int*, const int*, const int*,        \
                                                    float*, float*, int*, const MmaArgs) {}    \
    extern "C" __global__ void attn_dec_mma_pro_f16_##D(                                       \
        const float*, const u16*, const u16*, const int*, const int*, const int*, float*,      \
        float*, int*, const MmaArgs, const DecPro) {}

#endif

// Keys per tile: 64, or 32 at head_dim 256 to bound the registers (O alone is 128 per lane).
ATTN_MMA(64, 64)
ATTN_MMA(128, 64)
ATTN_MMA(256, 32)
// Decode: warps per CTA and ring buffers per warp (the host's dec_warps, dec_stages): shared
// memory for 4 CTAs of 2 warps per SM at head_dim 128 (55 KB each: 64 streams x 8 KV heads
// is one wave on 132 SMs), 3 of 4 warps at 64, 2 of 2 warps at 256 (76 KB). Measured slower at
// head_dim 128 (Qwen3-8B, 64 streams, session 23): 4 warps a CTA (-3.5%), 4 ring buffers a
// warp (-6%), both (-12%): fewer CTAs fit, so the step's CTAs take two waves.
ATTN_DEC_MMA(64, 4, 3)
ATTN_DEC_MMA(128, 2, 3)
ATTN_DEC_MMA(256, 2, 2)
