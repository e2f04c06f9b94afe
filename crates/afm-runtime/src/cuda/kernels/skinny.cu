// Skinny GEMM: out[n][m] (+)= x[n][k] · W[m][k]ᵀ for 16-bit weights and activations (bf16 or
// f16, f32 products and sums) and 9 to 64 activation rows: the decode steps of 9..64 streams.
// Hopper (sm_90a) only: TMA tile copies, mbarriers, thread block clusters and wgmma. The
// default there (AFM_SKINNY=0: cuBLAS; cuda/skinny.rs says why).
//
// One CTA takes BM = 32·WARPS weight rows and a 1/S slice of the columns, so it reads x's slice
// only (x traffic ≤ N/BM of the weights'); the S column slices of a tile run as one thread block
// cluster whose partial sums meet in distributed shared memory in a fixed order: no atomics, no
// workspace, and every output element's sum is the same whatever n is (a row's result does not
// depend on the rows beside it).
//
// Mainloop: one producer warp keeps a ring of `stages` stages of TMA tile copies in flight (its
// depth and the shared memory for it are the host's choice, cuda/skinny.rs; one
// cp.async.bulk.tensor per tile: the weights' BM×64 box and x's N×64 box, 128-byte swizzled:
// 16-byte chunk c of tile row r at chunk c ^ (r % 8), the layout wgmma reads), tracked by
// mbarriers; WARPS / 2 consumer warpgroups wait on a stage's "full" barrier, multiply (wgmma
// m64nNk16 from shared memory, warpgroup g: rows 64g..64g+63 times all N rows, N/2 f32 a
// thread), and free it on its "empty" barrier once those asynchronous MMAs are done. No
// block-wide barrier in the loop, so the loads run ahead of the math by the whole ring. Rows
// past the matrix or past n arrive as zeros (the tensor maps' bounds), and a copy still counts
// its whole box. The host encodes both tensor maps per call. The first stages' weights are
// requested before the PDL wait (weights never change), x's after it. (Session 14's mma.sync
// consumers, with ldmatrix, were not hidden behind the weight stream at 64 rows.)

#define SK_BK 64

struct __align__(64) TmaDesc {
    u64 v[16];
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define SK_WGMMA 1
// A wgmma operand descriptor of a K-major tile at shared address `at` in the 128-byte swizzle
// (TMA's SWIZZLE_128B): 8-row atoms of 128 bytes, 1,024 bytes apart (the stride offset); the
// leading offset is unused for K-major swizzled tiles. A k16 step inside the atom moves the
// start by 32 bytes: the hardware applies the swizzle to the address bits, hence the 1 KB-aligned
// ring.
__device__ __forceinline__ u64 wg_desc(u32 at) {
    return (u64)((at & 0x3FFFF) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}

// Keeps the compiler from moving accumulator reads or writes across the asynchronous MMAs.
template <int K>
__device__ __forceinline__ void wg_fence_acc(float (&d)[K]) {
#pragma unroll
    for (int i = 0; i < K; i++) asm volatile("" : "+f"(d[i])::"memory");
}

#define WG_F8(o)                                                                          \
    "+f"(d[o]), "+f"(d[o + 1]), "+f"(d[o + 2]), "+f"(d[o + 3]), "+f"(d[o + 4]), "+f"(d[o + 5]), \
        "+f"(d[o + 6]), "+f"(d[o + 7])
#define WG_MMA16(T)                                                                \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"                           \
                 "wgmma.mma_async.sync.aligned.m64n16k16.f32." T "." T " "                \
                 "{%0, %1, %2, %3, %4, %5, %6, %7}, "  \
                 "%8, %9, p, 1, 1, 0, 0;\n}\n"                                        \
                 : WG_F8(0)                                                  \
                 : "l"(da), "l"(db), "r"(1))
#define WG_MMA32(T)                                                                \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"                           \
                 "wgmma.mma_async.sync.aligned.m64n32k16.f32." T "." T " "                \
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "  \
                 "%16, %17, p, 1, 1, 0, 0;\n}\n"                                        \
                 : WG_F8(0), WG_F8(8)                                                  \
                 : "l"(da), "l"(db), "r"(1))
#define WG_MMA64(T)                                                                \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                           \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." T "." T " "                \
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "  \
                 "%32, %33, p, 1, 1, 0, 0;\n}\n"                                        \
                 : WG_F8(0), WG_F8(8), WG_F8(16), WG_F8(24)                                                  \
                 : "l"(da), "l"(db), "r"(1))

// d (64 weight rows × N activation rows, f32) += A (64 weight rows × k16) · B (N rows × k16)ᵀ,
// both K-major in shared memory (descriptors da, db). d's element 4c + e is weight row
// 16·(warp % 4) + lane / 4 (+8 for e ≥ 2) and activation row 8c + 2·(lane % 4) (+1 for odd e):
// mma.sync's m16n8 fragment, once per 8 activation rows.
template <int N, bool BF16>
__device__ __forceinline__ void wg_mma(float (&d)[N / 2], u64 da, u64 db) {
    if constexpr (N == 16) {
        if constexpr (BF16) WG_MMA16("bf16"); else WG_MMA16("f16");
    } else if constexpr (N == 32) {
        if constexpr (BF16) WG_MMA32("bf16"); else WG_MMA32("f16");
    } else {
        if constexpr (BF16) WG_MMA64("bf16"); else WG_MMA64("f16");
    }
}

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int PENDING>
__device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(PENDING) : "memory");
}

// Calls f(weight row, activation row, value) for each of this thread's accumulators: warpgroup
// g (warps 4g..4g+3) holds weight rows 64g..64g+63.
template <int N, class F>
__device__ __forceinline__ void sk_each(const float (&acc)[N / 2], const F& f) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int row0 = (warp >> 2) * 64 + (warp & 3) * 16 + g;
#pragma unroll
    for (int c = 0; c < N / 8; c++)
#pragma unroll
        for (int e = 0; e < 4; e++)
            f(row0 + (e >> 1) * 8, c * 8 + 2 * t + (e & 1), acc[4 * c + e]);
}

// Elements at..at+3 of the blocks' [N][BM] partials in stage memory, summed over the S column
// splits of the cluster in rank order (this block's own when S == 1).
__device__ __forceinline__ float4 sk_sum_splits(const float* red, int at, int S) {
    if (S == 1) return *(const float4*)(red + at);
    const u32 a = smem_addr(red) + at * 4;
    float4 sum = cluster_ld_f32x4(cluster_map(a, 0));
    for (int p = 1; p < S; p++) {
        const float4 v = cluster_ld_f32x4(cluster_map(a, p));
        sum.x += v.x, sum.y += v.y, sum.z += v.z, sum.w += v.w;
    }
    return sum;
}

// The products' store: out (+)= acc. Consumer warps are the first 2·WARPS (WARPS / 2
// warpgroups); the producer holds nothing. With split columns (gridDim.z > 1, a cluster along
// z) the partials go to this block's stage memory as [N][BM] f32 (every warp must be done with
// it), and rank r of the cluster sums elements [r·E/S, (r+1)·E/S) over ranks 0..S-1 in order.
// The gated epilogue: the block's rows are BM/2 gate rows then the same BM/2 up rows, and
// out16[c][m0 + j] = act(gate) · up, rounded to 16 bits, for the block's BM/2 outputs j.
// Every partial goes through stage memory as [N][BM] f32; with split columns rank r of the
// cluster finishes outputs [r·E/S, (r+1)·E/S) of the E = N·BM/2, summing ranks in order.
template <int WARPS, int N, bool BF16>
__device__ __forceinline__ void sk_epilogue_gated(const float (&acc)[N / 2], u16* out, int m0,
                                                  int wrows, int n, int ldc, int act) {
    constexpr int BM = WARPS * 32, H = BM / 2;
    extern __shared__ __align__(128) u16 sk_sm[];
    const bool holds = (threadIdx.x >> 5) < 2 * WARPS;
    const int S = gridDim.z, rank = blockIdx.z;
    __syncthreads();
    float* red = (float*)sk_sm;
    if (holds) sk_each<N>(acc, [&](int r, int c, float v) { red[c * BM + r] = v; });
    if (S > 1) cluster_sync();
    else __syncthreads();
    const int per = N * H / S;  // a multiple of 4: H is of 32, N of 16 and S at most 16
    for (int i = rank * per + threadIdx.x * 4; i < (rank + 1) * per; i += blockDim.x * 4) {
        const int c = i / H, j = i % H;
        if (c >= n) break;  // i only grows
        const int at = c * BM + j;
        const float4 g = sk_sum_splits(red, at, S), u = sk_sum_splits(red, at + H, S);
        const float gv[4] = {g.x, g.y, g.z, g.w}, uv[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int e = 0; e < 4; e++) {
            if (j + e < wrows) {
                const float o = (act == 0 ? silu_f(gv[e]) : gelu_tanh_f(gv[e])) * uv[e];
                out[(i64)c * ldc + m0 + j + e] = BF16 ? f2bf(o) : f2h(o);
            }
        }
    }
    if (S > 1) cluster_sync();  // every block's partials stay until the others have read them
}

template <int WARPS, int N>
__device__ __forceinline__ void sk_epilogue(const float (&acc)[N / 2], float* out, int m0,
                                            int wrows, int n, int ldc, int accumulate) {
    constexpr int BM = WARPS * 32;
    extern __shared__ __align__(128) u16 sk_sm[];
    const bool holds = (threadIdx.x >> 5) < 2 * WARPS;
    const int S = gridDim.z, rank = blockIdx.z;
    if (S == 1) {
        if (!holds) return;
        sk_each<N>(acc, [&](int r, int c, float v) {
            if (r < wrows && c < n) {
                float* o = out + (i64)c * ldc + m0 + r;
                *o = accumulate ? *o + v : v;
            }
        });
        return;
    }
    __syncthreads();
    float* red = (float*)sk_sm;
    if (holds) sk_each<N>(acc, [&](int r, int c, float v) { red[c * BM + r] = v; });
    cluster_sync();
    const int per = N * BM / S;  // a multiple of 4: BM is of 64 and S at most 16
    for (int i = rank * per + threadIdx.x * 4; i < (rank + 1) * per; i += blockDim.x * 4) {
        const int c = i / BM, r = i % BM;
        if (c >= n) break;  // i only grows
        const float4 sum = sk_sum_splits(red, i, S);
        const float sv[4] = {sum.x, sum.y, sum.z, sum.w};
#pragma unroll
        for (int e = 0; e < 4; e++) {
            if (r + e < wrows) {
                float* o = out + (i64)c * ldc + m0 + r + e;
                *o = accumulate ? *o + sv[e] : sv[e];
            }
        }
    }
    cluster_sync();  // every block's partials stay until the others have read them
}

// The box of tensor map `map` at (column c, row r) into shared dst, counted on barrier bar.
__device__ __forceinline__ void tma_tile(u32 dst, const TmaDesc* map, int c, int r, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3}], [%4];" ::"r"(dst),
        "l"(map), "r"(c), "r"(r), "r"(bar)
        : "memory");
}

// GATED: W rows come half from the gate map and half from the up map (`umap`), both at row
// blockIdx.x · BM/2, and the epilogue writes act(gate) · up in 16 bits (`m`: gate rows).
template <int WARPS, int N, bool BF16, bool GATED>
__device__ void skinny_impl(const TmaDesc* wmap, const TmaDesc* umap, const TmaDesc* xmap,
                            void* __restrict__ out, int m, int n, int ldc, int ks, int accumulate,
                            int act, int stages) {
    constexpr int BM = WARPS * 32, CW = 2 * WARPS;  // consumer warps: WARPS / 2 warpgroups
    const int STAGES = stages;  // the ring's depth: the host sized the shared memory for it
    constexpr int WST = BM * SK_BK, XST = N * SK_BK, ST = WST + XST;  // elements
    constexpr u32 STAGE_BYTES = ST * 2;
    extern __shared__ __align__(128) u16 sk_sm[];
    const u32 ring = (smem_addr(sk_sm) + 1023) & ~1023u;
    const u32 bars = ring + STAGES * STAGE_BYTES;  // full[STAGES], then empty[STAGES]
    constexpr int BOX = GATED ? BM / 2 : BM;  // weight rows per tensor-map box
    const int m0 = blockIdx.x * BOX, k0 = blockIdx.z * ks, steps = ks / SK_BK;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int wrows = min(BOX, m - m0);
    // A stage's weight tile: one box, or the gate box above the up box.
    auto weights = [&](u32 dst, int k, u32 full) {
        tma_tile(dst, wmap, k, m0, full);
        if (GATED) tma_tile(dst + BOX * SK_BK * 2, umap, k, m0, full);
    };

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; s++) {
            mbar_init(bars + 8 * s, 1);
            mbar_init(bars + 8 * (STAGES + s), CW);
        }
        mbar_init_fence();
        asm volatile("prefetch.tensormap [%0];" ::"l"(wmap) : "memory");
        if (GATED) asm volatile("prefetch.tensormap [%0];" ::"l"(umap) : "memory");
        asm volatile("prefetch.tensormap [%0];" ::"l"(xmap) : "memory");
    }
    __syncthreads();

    if (warp == CW && lane == 0) {  // the producer: one lane issues every copy
        const int first = min(STAGES, steps);
        // Weights never change: the first stages' weight tiles go out before the PDL wait.
        for (int s = 0; s < first; s++) {
            const u32 full = bars + 8 * s;
            mbar_expect_tx(full, STAGE_BYTES);
            weights(ring + s * STAGE_BYTES, k0 + s * SK_BK, full);
        }
        pdl_begin();  // x is the previous kernel's output
        for (int s = 0; s < first; s++)
            tma_tile(ring + s * STAGE_BYTES + WST * 2, xmap, k0 + s * SK_BK, 0, bars + 8 * s);
        // Past the first fill (first == STAGES) the ring's second round: slot 0, parity 0.
        for (int s = first, slot = 0, par = 0; s < steps; s++) {
            const u32 full = bars + 8 * slot, dst = ring + slot * STAGE_BYTES;
            mbar_wait(bars + 8 * (STAGES + slot), par);
            mbar_expect_tx(full, STAGE_BYTES);
            weights(dst, k0 + s * SK_BK, full);
            tma_tile(dst + WST * 2, xmap, k0 + s * SK_BK, 0, full);
            if (++slot == STAGES) slot = 0, par ^= 1;
        }
    } else {
        pdl_begin();
    }

    float acc[N / 2];
#pragma unroll
    for (int i = 0; i < N / 2; i++) acc[i] = 0.f;

    if (warp < CW) {
        // Warpgroup g multiplies weight rows 64g..64g+63 of each stage by all N activation
        // rows, four k16 steps a stage; a stage's slot is freed once the next stage's MMAs
        // are issued and its own have completed (one group in flight).
        const u32 a_off = (warp >> 2) * 64 * SK_BK * 2;
        // The ring's slot and round parity by counting, not `%` and `/` by the runtime depth:
        // +2.3% end to end at 64 streams of Qwen3-8B (session 23), so this loop's few
        // instructions a stage are on the step's critical path.
        for (int s = 0, slot = 0, par = 0, prev = 0; s < steps; s++) {
            mbar_wait(bars + 8 * slot, par);
            const u32 wb = ring + slot * STAGE_BYTES, xb = wb + WST * 2;
            wg_fence_acc(acc);
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < SK_BK / 16; kk++)
                wg_mma<N, BF16>(acc, wg_desc(wb + a_off + kk * 32), wg_desc(xb + kk * 32));
            wg_commit();
            wg_wait<1>();
            wg_fence_acc(acc);
            if (s > 0 && lane == 0) mbar_arrive(bars + 8 * (STAGES + prev));
            prev = slot;
            if (++slot == STAGES) slot = 0, par ^= 1;
        }
        wg_wait<0>();
        wg_fence_acc(acc);
    }
    if (GATED) sk_epilogue_gated<WARPS, N, BF16>(acc, (u16*)out, m0, wrows, n, ldc, act);
    else sk_epilogue<WARPS, N>(acc, (float*)out, m0, wrows, n, ldc, accumulate);
}
#endif

// Entry points skinny_{bf16,f16}_w{WARPS}_n{N} and, gated, skinnyg_* (cuda/skinny.rs lists
// them): 64·WARPS + 32 threads. Without sm_90a's wgmma (another architecture) they are empty;
// the host launches them on compute capability 9.0 only.
#if defined(SK_WGMMA)
#define SK_BODY(W, NN, B, G) \
    skinny_impl<W, NN, B, G>(&wmap, &umap, &xmap, out, m, n, ldc, ks, accumulate, act, stages);
#else
#define SK_BODY(W, NN, B, G)
#endif
#define SK_KERNEL(NAME, T, W, NN, B, G)                                                         \
    extern "C" __global__ void __launch_bounds__(W * 64 + 32) NAME##_##T##_w##W##_n##NN(       \
        const __grid_constant__ TmaDesc wmap, const __grid_constant__ TmaDesc umap,             \
        const __grid_constant__ TmaDesc xmap, void* __restrict__ out, int m, int n, int ldc,    \
        int ks, int accumulate, int act, int stages) {                                        \
        SK_BODY(W, NN, B, G)                                                                  \
    }
#define SK_NS(NAME, T, W, B, G) \
    SK_KERNEL(NAME, T, W, 16, B, G) SK_KERNEL(NAME, T, W, 32, B, G) SK_KERNEL(NAME, T, W, 64, B, G)
#define SK_WIDTHS(NAME, T, B, G) \
    SK_NS(NAME, T, 2, B, G) SK_NS(NAME, T, 4, B, G) SK_NS(NAME, T, 6, B, G) SK_NS(NAME, T, 8, B, G)
SK_WIDTHS(skinny, bf16, true, false)
SK_WIDTHS(skinny, f16, false, false)
SK_WIDTHS(skinnyg, bf16, true, true)
SK_WIDTHS(skinnyg, f16, false, true)
