// Skinny GEMM: out[n][m] (+)= x[n][k] · W[m][k]ᵀ for 16-bit weights and activations (bf16 or
// f16, f32 products and sums) and 9 to 64 activation rows: the decode steps of 9..64 streams.
//
// Why not cuBLAS: at 64 rows its Hopper kernels read the 8B's O, Q/K/V and down weights at
// 2.6–3.0 TB/s of the 4.26 TB/s copy rate (cuda_bench / lt_probe on the H200, session 14):
// their tiles re-read all of x per output tile and leave SMs idle (Q/K/V: 96 CTAs on 132 SMs).
// Here one CTA takes BM = 32·WARPS weight rows and a 1/S slice of the columns, so it reads
// x's slice only (x traffic ≤ 64/BM of the weights'), the grid is sized to the SMs (host:
// `skinny_plan`), and the S column slices of a tile run as one thread block cluster whose
// partial sums meet in distributed shared memory, in a fixed order: no atomics, no workspace,
// and every output element's sum is the same whatever n is (a row's result does not depend on
// the rows beside it).
//
// Pipeline: SK_STAGES stages of 64 columns (W tile BM×64 and x tile N×64, 128-byte rows with
// 16-byte chunks XOR-swizzled by row so ldmatrix is conflict-free) through cp.async; the first
// stages' weights are requested before the PDL wait (weights never change), x's after it.
// Warp w multiplies rows 32w..32w+31 by all N rows: mma.m16n8k16, 2 × N/8 tiles of f32.

#define SK_BK 64
#define SK_STAGES 4

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800

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

// Rows [0, rows) of a 64-column slice starting at src (row stride ld elements) into tile dst;
// rows at or past `valid` are zero-filled (nothing read).
template <int THREADS>
__device__ __forceinline__ void sk_stage(u16* dst, const u16* src, i64 ld, int rows, int valid) {
    for (int i = threadIdx.x; i < rows * 8; i += THREADS) {
        const int r = i >> 3, c = i & 7;
        const bool ok = r < valid;
        cp_async16(dst + sk_at(r, c), src + (ok ? (i64)r * ld : 0) + c * 8, ok);
    }
}

template <int WARPS, int N, bool BF16>
__device__ void skinny_impl(const u16* __restrict__ w, const u16* __restrict__ x,
                            float* __restrict__ out, int m, int k, int n, int ldc, int ks,
                            int accumulate) {
    constexpr int BM = WARPS * 32, THREADS = WARPS * 32, NT = N / 8;
    constexpr int WST = BM * SK_BK, XST = N * SK_BK;  // elements per stage
    extern __shared__ __align__(128) u16 sk_sm[];
    u16* ws = sk_sm;
    u16* xs = sk_sm + SK_STAGES * WST;
    const int m0 = blockIdx.x * BM, k0 = blockIdx.z * ks, steps = ks / SK_BK;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int wrows = min(BM, m - m0);
    const u16* wsrc = w + (i64)m0 * k + k0;
    const u16* xsrc = x + k0;

#pragma unroll
    for (int s = 0; s < SK_STAGES - 1; s++)
        if (s < steps) sk_stage<THREADS>(ws + s * WST, wsrc + s * SK_BK, k, BM, wrows);
    pdl_begin();  // x is the previous kernel's output
#pragma unroll
    for (int s = 0; s < SK_STAGES - 1; s++) {
        if (s < steps) sk_stage<THREADS>(xs + s * XST, xsrc + s * SK_BK, k, N, n);
        cp_async_commit();
    }

    float acc[2][NT][4];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0.f;

    for (int s = 0; s < steps; s++) {
        cp_async_wait<SK_STAGES - 2>();
        __syncthreads();  // stage s landed for every thread; stage s - 1's buffer is free
        const int nx = s + SK_STAGES - 1;
        if (nx < steps) {
            const int b = nx % SK_STAGES;
            sk_stage<THREADS>(ws + b * WST, wsrc + nx * SK_BK, k, BM, wrows);
            sk_stage<THREADS>(xs + b * XST, xsrc + nx * SK_BK, k, N, n);
        }
        cp_async_commit();
        const u16* wb = ws + (s % SK_STAGES) * WST;
        const u16* xb = xs + (s % SK_STAGES) * XST;
#pragma unroll
        for (int kk = 0; kk < SK_BK / 16; kk++) {
            u32 a[2][4];
#pragma unroll
            for (int mt = 0; mt < 2; mt++) {
                const int r = warp * 32 + mt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
                ldsm_x4(a[mt], smem_addr(wb + sk_at(r, kk * 2 + (lane >> 4))));
            }
#pragma unroll
            for (int nt = 0; nt < NT; nt += 2) {
                u32 b[4];
                const int r = nt * 8 + (lane & 7) + (lane >> 4) * 8;
                ldsm_x4(b, smem_addr(xb + sk_at(r, kk * 2 + ((lane >> 3) & 1))));
#pragma unroll
                for (int mt = 0; mt < 2; mt++) {
                    sk_mma<BF16>(acc[mt][nt], a[mt], b[0], b[1]);
                    sk_mma<BF16>(acc[mt][nt + 1], a[mt], b[2], b[3]);
                }
            }
        }
    }

    // Fragment element e of tile (mt, nt): weight row warp*32 + mt*16 + g (+8 for e >= 2),
    // activation row nt*8 + 2t (+1 for odd e).
    const int g = lane >> 2, t = lane & 3;
    if (gridDim.z == 1) {
#pragma unroll
        for (int mt = 0; mt < 2; mt++)
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int r = warp * 32 + mt * 16 + g + (e >> 1) * 8, c = nt * 8 + 2 * t + (e & 1);
                    if (r < wrows && c < n) {
                        float* o = out + (i64)c * ldc + m0 + r;
                        *o = accumulate ? *o + acc[mt][nt][e] : acc[mt][nt][e];
                    }
                }
        return;
    }

    // Split columns: partials as [N][BM] f32 in this block's (drained) stage memory, then rank
    // r of the cluster sums elements [r·E/S, (r+1)·E/S) over ranks 0..S-1 in order.
    cp_async_wait<0>();
    __syncthreads();
    float* red = (float*)sk_sm;
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int r = warp * 32 + mt * 16 + g + (e >> 1) * 8, c = nt * 8 + 2 * t + (e & 1);
                red[c * BM + r] = acc[mt][nt][e];
            }
    cluster_sync();
    const int S = gridDim.z, rank = blockIdx.z;
    const int per = N * BM / S;  // a multiple of 4: BM is of 64 and S at most 16
    const u32 base = smem_addr(red);
    for (int i = rank * per + threadIdx.x * 4; i < (rank + 1) * per; i += THREADS * 4) {
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

#endif

// Entry points skinny_{bf16,f16}_w{WARPS}_n{N} (cuda/skinny.rs lists them).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define SK_BODY(W, NN, B) skinny_impl<W, NN, B>(w, x, out, m, k, n, ldc, ks, accumulate);
#else
#define SK_BODY(W, NN, B)
#endif
#define SK_KERNEL(T, W, NN, B)                                                              \
    extern "C" __global__ void __launch_bounds__(W * 32) skinny_##T##_w##W##_n##NN(          \
        const u16* __restrict__ w, const u16* __restrict__ x, float* __restrict__ out, int m, \
        int k, int n, int ldc, int ks, int accumulate) {                                    \
        SK_BODY(W, NN, B)                                                                   \
    }
#define SK_WIDTHS(T, B) \
    SK_KERNEL(T, 2, 16, B) SK_KERNEL(T, 2, 32, B) SK_KERNEL(T, 2, 64, B) \
    SK_KERNEL(T, 4, 16, B) SK_KERNEL(T, 4, 32, B) SK_KERNEL(T, 4, 64, B) \
    SK_KERNEL(T, 6, 16, B) SK_KERNEL(T, 6, 32, B) SK_KERNEL(T, 6, 64, B) \
    SK_KERNEL(T, 8, 16, B) SK_KERNEL(T, 8, 32, B) SK_KERNEL(T, 8, 64, B)
SK_WIDTHS(bf16, true)
SK_WIDTHS(f16, false)
