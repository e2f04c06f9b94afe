// Skinny GEMM: out[n][m] (+)= x[n][k] · W[m][k]ᵀ for 16-bit weights and activations (bf16 or
// f16, f32 products and sums) and 9 to 64 activation rows: the decode steps of 9..64 streams.
// Hopper (sm_90) only: TMA tile copies, mbarriers and thread block clusters. Opt-in
// (AFM_SKINNY=1, cuda/skinny.rs says why).
//
// One CTA takes BM = 32·WARPS weight rows and a 1/S slice of the columns, so it reads x's slice
// only (x traffic ≤ N/BM of the weights'); the S column slices of a tile run as one thread block
// cluster whose partial sums meet in distributed shared memory in a fixed order: no atomics, no
// workspace, and every output element's sum is the same whatever n is (a row's result does not
// depend on the rows beside it).
//
// Mainloop: one producer warp keeps up to 8 stages of TMA tile copies in flight (one
// cp.async.bulk.tensor per tile: the weights' BM×64 box and x's N×64 box, 128-byte swizzled:
// 16-byte chunk c of tile row r at chunk c ^ (r % 8), so ldmatrix is conflict-free), tracked
// by mbarriers; the WARPS consumer warps wait on a stage's "full" barrier, multiply
// (mma.m16n8k16, warp w: rows 32w..32w+31 times all N rows, 2 × N/8 tiles of f32), and free it
// on its "empty" barrier. No block-wide barrier in the loop, so the loads run ahead of the math
// by the whole ring. Rows past the matrix or past n arrive as zeros (the tensor maps' bounds),
// and a copy still counts its whole box. The host encodes both tensor maps per call. The first
// stages' weights are requested before the PDL wait (weights never change), x's after it.

#define SK_BK 64
#define SKW_SMEM_MAX (227 * 1024)
#define SKW_RESERVED 2048  // 1 KB to align the ring to 1 KB (the swizzle's period), barriers

struct __align__(64) TmaDesc {
    u64 v[16];
};

__host__ __device__ constexpr int skw_stages(int bm, int n) {
    return (SKW_SMEM_MAX - SKW_RESERVED) / ((bm + n) * SK_BK * 2) < 8
               ? (SKW_SMEM_MAX - SKW_RESERVED) / ((bm + n) * SK_BK * 2)
               : 8;
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
template <bool BF16>
__device__ __forceinline__ void sk_mma(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    if (BF16) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
            "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
            "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}

// Element offset of 16-byte chunk c of row r in a 64-column tile.
__device__ __forceinline__ int sk_at(int r, int c) { return r * SK_BK + ((c ^ (r & 7)) << 3); }

// The products' store: out (+)= acc. acc's element e of tile (mt, nt) is weight row
// warp*32 + mt*16 + g (+8 for e >= 2), activation row nt*8 + 2t (+1 for odd e). Warps at or past
// WARPS (a producer) hold nothing. With split columns (gridDim.z > 1, a cluster along z) the
// partials go to this block's stage memory as [N][BM] f32 (every warp must be done with it),
// and rank r of the cluster sums elements [r·E/S, (r+1)·E/S) over ranks 0..S-1 in order.
// Calls f(weight row, activation row, value) for each of this warp's accumulators.
template <int N, class F>
__device__ __forceinline__ void sk_each(const float (&acc)[2][N / 8][4], const F& f) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int nt = 0; nt < N / 8; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                f(warp * 32 + mt * 16 + g + (e >> 1) * 8, nt * 8 + 2 * t + (e & 1), acc[mt][nt][e]);
}

template <int WARPS, int N>
__device__ __forceinline__ void sk_epilogue(const float (&acc)[2][N / 8][4], float* out, int m0,
                                            int wrows, int n, int ldc, int accumulate) {
    constexpr int BM = WARPS * 32;
    extern __shared__ __align__(128) u16 sk_sm[];
    const bool holds = (threadIdx.x >> 5) < WARPS;
    if (gridDim.z == 1) {
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
    const int S = gridDim.z, rank = blockIdx.z;
    const int per = N * BM / S;  // a multiple of 4: BM is of 64 and S at most 16
    const u32 base = smem_addr(red);
    for (int i = rank * per + threadIdx.x * 4; i < (rank + 1) * per; i += blockDim.x * 4) {
        const int c = i / BM, r = i % BM;
        if (c >= n) break;  // i only grows
        float4 sum = cluster_ld_f32x4(cluster_map(base + i * 4, 0));
        for (int p = 1; p < S; p++) {
            const float4 v = cluster_ld_f32x4(cluster_map(base + i * 4, p));
            sum.x += v.x;
            sum.y += v.y;
            sum.z += v.z;
            sum.w += v.w;
        }
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

template <int WARPS, int N, bool BF16>
__device__ void skinny_impl(const TmaDesc* wmap, const TmaDesc* xmap, float* __restrict__ out,
                            int m, int n, int ldc, int ks, int accumulate) {
    constexpr int BM = WARPS * 32, NT = N / 8;
    constexpr int STAGES = skw_stages(BM, N);
    constexpr int WST = BM * SK_BK, XST = N * SK_BK, ST = WST + XST;  // elements
    constexpr u32 STAGE_BYTES = ST * 2;
    extern __shared__ __align__(128) u16 sk_sm[];
    const u32 ring = (smem_addr(sk_sm) + 1023) & ~1023u;
    const u32 bars = ring + STAGES * STAGE_BYTES;  // full[STAGES], then empty[STAGES]
    const int m0 = blockIdx.x * BM, k0 = blockIdx.z * ks, steps = ks / SK_BK;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int wrows = min(BM, m - m0);

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; s++) {
            mbar_init(bars + 8 * s, 1);
            mbar_init(bars + 8 * (STAGES + s), WARPS);
        }
        mbar_init_fence();
        asm volatile("prefetch.tensormap [%0];" ::"l"(wmap) : "memory");
        asm volatile("prefetch.tensormap [%0];" ::"l"(xmap) : "memory");
    }
    __syncthreads();

    if (warp == WARPS && lane == 0) {  // the producer: one lane issues every copy
        const int first = min(STAGES, steps);
        // Weights never change: the first stages' weight tiles go out before the PDL wait.
        for (int s = 0; s < first; s++) {
            const u32 full = bars + 8 * s;
            mbar_expect_tx(full, STAGE_BYTES);
            tma_tile(ring + s * STAGE_BYTES, wmap, k0 + s * SK_BK, m0, full);
        }
        pdl_begin();  // x is the previous kernel's output
        for (int s = 0; s < first; s++)
            tma_tile(ring + s * STAGE_BYTES + WST * 2, xmap, k0 + s * SK_BK, 0, bars + 8 * s);
        for (int s = first; s < steps; s++) {
            const int slot = s % STAGES;
            const u32 full = bars + 8 * slot, dst = ring + slot * STAGE_BYTES;
            mbar_wait(bars + 8 * (STAGES + slot), ((s / STAGES) & 1) ^ 1);
            mbar_expect_tx(full, STAGE_BYTES);
            tma_tile(dst, wmap, k0 + s * SK_BK, m0, full);
            tma_tile(dst + WST * 2, xmap, k0 + s * SK_BK, 0, full);
        }
    } else {
        pdl_begin();
    }

    float acc[2][NT][4];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0.f;

    if (warp < WARPS) {
        for (int s = 0; s < steps; s++) {
            const int slot = s % STAGES;
            mbar_wait(bars + 8 * slot, (s / STAGES) & 1);
            const u32 wb = ring + slot * STAGE_BYTES, xb = wb + WST * 2;
#pragma unroll
            for (int kk = 0; kk < SK_BK / 16; kk++) {
                u32 a[2][4];
#pragma unroll
                for (int mt = 0; mt < 2; mt++) {
                    const int r = warp * 32 + mt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
                    ldsm_x4(a[mt], wb + sk_at(r, kk * 2 + (lane >> 4)) * 2);
                }
#pragma unroll
                for (int nt = 0; nt < NT; nt += 2) {
                    u32 b[4];
                    const int r = nt * 8 + (lane & 7) + (lane >> 4) * 8;
                    ldsm_x4(b, xb + sk_at(r, kk * 2 + ((lane >> 3) & 1)) * 2);
#pragma unroll
                    for (int mt = 0; mt < 2; mt++) {
                        sk_mma<BF16>(acc[mt][nt], a[mt], b[0], b[1]);
                        sk_mma<BF16>(acc[mt][nt + 1], a[mt], b[2], b[3]);
                    }
                }
            }
            __syncwarp();
            if (lane == 0) mbar_arrive(bars + 8 * (STAGES + slot));
        }
    }
    sk_epilogue<WARPS, N>(acc, out, m0, wrows, n, ldc, accumulate);
}
#endif

// Entry points skinny_{bf16,f16}_w{WARPS}_n{N} (cuda/skinny.rs lists them).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define SK_BODY(W, NN, B) skinny_impl<W, NN, B>(&wmap, &xmap, out, m, n, ldc, ks, accumulate);
#else
#define SK_BODY(W, NN, B)
#endif
#define SK_KERNEL(T, W, NN, B)                                                                \
    extern "C" __global__ void __launch_bounds__(W * 32 + 32) skinny_##T##_w##W##_n##NN(       \
        const __grid_constant__ TmaDesc wmap, const __grid_constant__ TmaDesc xmap,             \
        float* __restrict__ out, int m, int n, int ldc, int ks, int accumulate) {              \
        SK_BODY(W, NN, B)                                                                     \
    }
#define SK_WIDTHS(T, B) \
    SK_KERNEL(T, 2, 16, B) SK_KERNEL(T, 2, 32, B) SK_KERNEL(T, 2, 64, B) \
    SK_KERNEL(T, 4, 16, B) SK_KERNEL(T, 4, 32, B) SK_KERNEL(T, 4, 64, B) \
    SK_KERNEL(T, 6, 16, B) SK_KERNEL(T, 6, 32, B) SK_KERNEL(T, 6, 64, B) \
    SK_KERNEL(T, 8, 16, B) SK_KERNEL(T, 8, 32, B) SK_KERNEL(T, 8, 64, B)
SK_WIDTHS(bf16, true)
SK_WIDTHS(f16, false)
