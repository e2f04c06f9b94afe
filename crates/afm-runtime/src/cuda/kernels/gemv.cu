// Matrix-vector products for decode and small batches: out[b][row] = x[b] . W[row] for N <= 8
// activation rows, and whole quantized matrices to f16 for the cuBLAS path above that.
// A block of 128 threads owns a few weight rows; each thread decodes its unit of all of them
// into registers, then every activation load serves all those rows, so each weight byte is read
// once and activations are re-read cols/rows-per-block times, not cols.
//
// - bf16/f16 weights (gemv_*, gemv3_* for Q/K/V, gemvg_* for gate+up): f32 activations,
//   R rows per block (GEMV_ROWS = 4; the one-row kernels also with 1, 2 and 8: "_r1", ...),
//   a unit is 8 weights (one 16-byte load).
// - Q4_K/Q6_K/Q8_0 weights (gemv8*, section "Quantized weights" below): read in their GGML
//   blocks against activations quantized to int8 blocks of 32 (quantize_x_q8), so a weight
//   block's dot is integer work, 4 products a dp4a instruction:
//     sum_e w_e x_e = sum_sub xd_sub * d * scale_sub * sum_int(q_e * xq_e) - dmin * min_sub * xs_sub
//   The activation rounding is the CPU matmul's (llama.cpp's): ~4e-3 relative error on uniform
//   data, ~1e-2 with outlier channels. A unit is 32 weights of one row:
//     Q4_K (144 B, 8 units): 16 qs bytes = 16 weights of sub-block 2p (low nibbles), 16 of 2p+1
//     Q6_K (210 B, 8 units): 8 columns of half hh in each of the 4 quarter-groups
//     Q8_0 ( 34 B, 1 unit):  the whole block

#define GEMV_THREADS 128
// Weight rows per block (R) of the 16-bit kernels, unless a name says otherwise: each activation
// load serves all of them. At one activation row there are also R = 8, 2 and 1 (GEMV_R_ALL
// below): fewer, longer blocks re-read x (and a folded norm's weight and sum of squares) less
// often; more, shorter ones spread a one-wave grid more evenly over the SMs. A row's sums do
// not depend on R (the same thread owns the same units of it, the same reductions follow), so
// every R gives the same bits.
#define GEMV_ROWS 4

// Sums each (row, batch) accumulator over the block and writes out[b][row0 + r], times inv[b]
// (1/rms of activation row b, in shared memory) when the norm was folded in, and added to what
// out holds with ACC (a residual add folded into the projection). ACC is a template parameter:
// as a run-time flag it changed ptxas's register allocation of the whole kernel (106 instead of
// 128 registers at 8 rows) and Qwen3-8B at 8 streams decoded 15% slower.
template <int N, int R, bool ACC>
__device__ __forceinline__ void gemv_finish(float (&acc)[R][N], float* out, int rows, int row0,
                                            const float* inv) {
    __shared__ float sh[R * N][GEMV_THREADS / 32];
    const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < R; r++) {
#pragma unroll
        for (int b = 0; b < N; b++) {
            const float v = warp_sum(acc[r][b]);
            if (l == 0) sh[r * N + b][w] = v;
        }
    }
    __syncthreads();
    if (threadIdx.x < R * N) {
        const int r = threadIdx.x / N, b = threadIdx.x % N;
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < GEMV_THREADS / 32; i++) s += sh[threadIdx.x][i];
        if (inv) s *= inv[b];
        if (row0 + r < rows) {
            float* o = out + (i64)b * rows + row0 + r;
            *o = ACC ? *o + s : s;
        }
    }
}

// 1/rms of each activation row, as rms_norm computes it (1/sqrt(sum x^2 / d + eps)), from the
// threads' partial sums of squares (the block's threads cover every column), into inv[N] in
// shared memory for every thread.
template <int N>
__device__ __forceinline__ void gemv_inv_rms(const float (&ss)[N], int cols, float eps,
                                             float* inv) {
    __shared__ float sh[N][GEMV_THREADS / 32];
    const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
#pragma unroll
    for (int b = 0; b < N; b++) {
        const float v = warp_sum(ss[b]);
        if (l == 0) sh[b][w] = v;
    }
    __syncthreads();
    if (threadIdx.x < N) {
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < GEMV_THREADS / 32; i++) s += sh[threadIdx.x][i];
        inv[threadIdx.x] = 1.0f / sqrtf(s / (float)cols + eps);
    }
    __syncthreads();
}

#define GEMV_ZERO(acc)                                                                         \
    float acc[R][N];                                                                           \
    _Pragma("unroll") for (int r = 0; r < R; r++)                                              \
        _Pragma("unroll") for (int b = 0; b < N; b++) acc[r][b] = 0.f;

// Accumulates R rows of a 16-bit matrix from row0 against N activation rows. With a
// norm weight `nw` (NORM > 0) x is RMSNorm's input: the products take x * nw, so the caller's
// inv * acc is W . (x * inv * nw), the normalized row's product (up to rounding order), and with
// NORM == 2 ss[b] gathers this thread's share of sum x^2 for inv.
// `pre` holds the thread's first unit (gemv_preload, issued before the PDL wait).
// UN units of each row per step: all their weight loads are issued before the first product
// (more bytes in flight per thread without more rows per block); the units are still taken in
// order, u, u + GEMV_THREADS, ..., so every UN gives the same sums, bit for bit.
template <int N, int R, int UN, bool BF16, int NORM, bool PRE>
__device__ __forceinline__ void gemv_half_acc(const u16* W, const float* x, const float* nw,
                                              int rows, int cols, int row0,
                                              const uint4 (&pre)[R], float (&acc)[R][N],
                                              float (&ss)[N]) {
    const int units = cols / 8;
    for (int u0 = threadIdx.x; u0 < units; u0 += UN * GEMV_THREADS) {
        uint4 q[UN][R];
#pragma unroll
        for (int j = 0; j < UN; j++) {
            // Past the row's end the last unit again, its products dropped below: no predicate
            // or branch for the compiler to sink the loads behind.
            const int u = min(u0 + j * GEMV_THREADS, units - 1);
#pragma unroll
            for (int r = 0; r < R; r++)
                q[j][r] = PRE && u == threadIdx.x
                              ? pre[r]
                              : ((const uint4*)(W + (i64)min(row0 + r, rows - 1) * cols))[u];
        }
#pragma unroll
        for (int j = 0; j < UN; j++) {
            const bool in = j == 0 || u0 + j * GEMV_THREADS < units;
            const int u = min(u0 + j * GEMV_THREADS, units - 1);
            float w[R][8];
#pragma unroll
            for (int r = 0; r < R; r++) {
                const u32 ws[4] = {q[j][r].x, q[j][r].y, q[j][r].z, q[j][r].w};
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    if (BF16) {
                        w[r][2 * i] = __uint_as_float(ws[i] << 16);
                        w[r][2 * i + 1] = __uint_as_float(ws[i] & 0xffff0000u);
                    } else {
                        w[r][2 * i] = h2f((u16)(ws[i] & 0xffff));
                        w[r][2 * i + 1] = h2f((u16)(ws[i] >> 16));
                    }
                }
            }
            float4 ga = make_float4(1.f, 1.f, 1.f, 1.f), gc = ga;
            if (NORM) {
                ga = ((const float4*)(nw + 8 * u))[0];
                gc = ((const float4*)(nw + 8 * u))[1];
            }
#pragma unroll
            for (int b = 0; b < N; b++) {
                const float4* xv = (const float4*)(x + (i64)b * cols + 8 * u);
                float4 a = xv[0], c = xv[1];
                if (NORM == 2) {
                    const float s2 = a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w + c.x * c.x +
                                     c.y * c.y + c.z * c.z + c.w * c.w;
                    ss[b] = in ? ss[b] + s2 : ss[b];
                }
                if (NORM) {
                    a = make_float4(a.x * ga.x, a.y * ga.y, a.z * ga.z, a.w * ga.w);
                    c = make_float4(c.x * gc.x, c.y * gc.y, c.z * gc.z, c.w * gc.w);
                }
#pragma unroll
                for (int r = 0; r < R; r++) {
                    const float d = w[r][0] * a.x + w[r][1] * a.y + w[r][2] * a.z +
                                    w[r][3] * a.w + w[r][4] * c.x + w[r][5] * c.y +
                                    w[r][6] * c.z + w[r][7] * c.w;
                    acc[r][b] = in ? acc[r][b] + d : acc[r][b];
                }
            }
        }
    }
}

// The thread's first unit of rows row0.. of W into registers. The "p" kernels issue it before
// their PDL wait (weights are never written by a kernel), meant to overlap its DRAM latency
// with the kernel before (at batch 1 a Qwen3-0.6B projection is ~1 us of weight reads in a
// ~5 us launch); measured slower, they are opt-in.
template <int R>
__device__ __forceinline__ void gemv_preload(const u16* W, int rows, int cols, int row0,
                                             uint4 (&pre)[R]) {
    const int u = threadIdx.x;
#pragma unroll
    for (int r = 0; r < R; r++)
        if (u < cols / 8) pre[r] = ((const uint4*)(W + (i64)min(row0 + r, rows - 1) * cols))[u];
}

// R rows of out from row0: out = x . W^T, or with NORM rms_norm(x, nw, eps) . W^T; added to
// out with ACC; UN units of each row in flight per thread (gemv_half_acc).
template <int N, int R, int UN, bool BF16, bool NORM, bool ACC, bool PRE>
__device__ void gemv_half_rows(const u16* W, const float* x, const float* nw, float eps,
                               float* out, int rows, int cols, int row0, const uint4 (&pre)[R]) {
    GEMV_ZERO(acc)
    float ss[N] = {};
    if (NORM) {
        __shared__ float inv[N];
        gemv_half_acc<N, R, UN, BF16, 2, PRE>(W, x, nw, rows, cols, row0, pre, acc, ss);
        gemv_inv_rms<N>(ss, cols, eps, inv);
        gemv_finish<N, R, ACC>(acc, out, rows, row0, inv);
    } else {
        gemv_half_acc<N, R, UN, BF16, 0, PRE>(W, x, nw, rows, cols, row0, pre, acc, ss);
        gemv_finish<N, R, ACC>(acc, out, rows, row0, nullptr);
    }
}

// Up to three 16-bit matrices against the same activations in one launch (Q, K and V): the
// first ceil(r0/R) blocks serve W0, the next ceil(r1/R) W1, the rest W2. With NORM, of
// rms_norm(x, nw, eps) (each block sums the squares of x itself).
struct Gemv3Pick {
    const u16* W;
    float* out;
    int rows, row0;
};

template <int R>
__device__ __forceinline__ Gemv3Pick gemv3_pick(const u16* W0, const u16* W1, const u16* W2,
                                                float* o0, float* o1, float* o2, int r0, int r1,
                                                int r2) {
    const int b0 = (r0 + R - 1) / R, b1 = (r1 + R - 1) / R;
    int b = blockIdx.x;
    if (b < b0) return {W0, o0, r0, b * R};
    if ((b -= b0) < b1) return {W1, o1, r1, b * R};
    return {W2, o2, r2, (b - b1) * R};
}

// The sum of one (row, batch) accumulator over a group of `gw` warps starting at warp `w0`,
// in the group's thread `tig` = r * N + b: warp sums into shared memory, then one thread per
// (row, batch) adds its group's warps in order.
template <int N, int R>
__device__ __forceinline__ float group_reduce(float (&acc)[R][N], int tig, int gw, int w0) {
    __shared__ float sh[R * N][GEMV_THREADS / 32];
    const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
    __syncthreads();  // a previous reduction's readers are done with sh
#pragma unroll
    for (int r = 0; r < R; r++) {
#pragma unroll
        for (int b = 0; b < N; b++) {
            const float v = warp_sum(acc[r][b]);
            if (l == 0) sh[r * N + b][w] = v;
        }
    }
    __syncthreads();
    float s = 0.f;
    if (tig < R * N) {
        for (int i = 0; i < gw; i++) s += sh[tig][w0 + i];
    }
    return s;
}

// The sum of one (row, batch) accumulator over the block, in thread r * N + b.
template <int N, int R>
__device__ __forceinline__ float gemv_reduce(float (&acc)[R][N]) {
    return group_reduce<N, R>(acc, threadIdx.x, GEMV_THREADS / 32, 0);
}

__device__ __forceinline__ float gemv_silu(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float gemv_gelu_tanh(float x) {
    const float C = 0.7978846f;  // sqrt(2/pi), as elementwise.cu's gated_act
    return 0.5f * x * (1.0f + tanhf(C * (x + 0.044715f * x * x * x)));
}

// out[b][row] = act(gate row . x[b]) * (up row . x[b]): the gated MLP's first half in one
// launch, with the same sums and activation as gemv + gated_act (act 0 = SiLU, 1 = GELU tanh);
// with NORM, of rms_norm(x, nw, eps) as gemv_half_rows.
template <int N, int R, bool BF16, bool NORM, bool PRE>
__device__ void gemv_gated_half(const u16* G, const u16* U, const float* x, const float* nw,
                                float eps, float* out, int rows, int cols, int act,
                                const uint4 (&pg)[R], const uint4 (&pu)[R]) {
    const int row0 = blockIdx.x * R;
    __shared__ float inv[N];
    GEMV_ZERO(ag)
    GEMV_ZERO(au)
    float ss[N] = {};
    if (NORM) {
        gemv_half_acc<N, R, 1, BF16, 2, PRE>(G, x, nw, rows, cols, row0, pg, ag, ss);
        gemv_half_acc<N, R, 1, BF16, 1, PRE>(U, x, nw, rows, cols, row0, pu, au, ss);
        gemv_inv_rms<N>(ss, cols, eps, inv);
    } else {
        gemv_half_acc<N, R, 1, BF16, 0, PRE>(G, x, nw, rows, cols, row0, pg, ag, ss);
        gemv_half_acc<N, R, 1, BF16, 0, PRE>(U, x, nw, rows, cols, row0, pu, au, ss);
    }
    float g = gemv_reduce<N, R>(ag);
    float u = gemv_reduce<N, R>(au);
    if (threadIdx.x < R * N) {
        const int r = threadIdx.x / N, b = threadIdx.x % N;
        if (NORM) {
            g *= inv[b];
            u *= inv[b];
        }
        if (row0 + r < rows)
            out[(i64)b * rows + row0 + r] = (act == 0 ? gemv_silu(g) : gemv_gelu_tanh(g)) * u;
    }
}

// ---- Weights into L2 before the PDL wait (AFM_GEMV_L2PF) ----
//
// cuda/context.rs's module_source puts `#define AFM_GEMV_L2PF 1` in front of this module when
// its switch is on; without it GEMV_L2PF expands to nothing and the kernels are what they were.
// A kernel's blocks can be resident, waiting in pdl_begin, while the kernel before still runs
// (cuda/mod.rs launch_raw), and before a one-row GEMV that kernel is often latency-bound (the
// decode attention before O: DRAM nearly idle for 5-9 us). So each block first asks for weights
// to be brought into L2, then waits; the loads after the wait find them there. Weights are
// never written by a kernel, so fetching them ahead of the wait is safe. A prefetch writes no
// register and no memory (asm volatile without outputs) and nothing later depends on it: every
// product, sum and store, and their order, is the same with it as without, so are the bits.
// Only when the bytes arrive changes.
//
// What is fetched. Where the whole grid's weights fit in L2PF_BYTES (32 MiB of the H200's
// 50 MB L2: Qwen3-0.6B's every projection but lm_head, Qwen3-8B's O at exactly 32 MiB), all of
// them: block b its own R rows, and for b < S = ceil(G / L2PF_FANOUT) (G = gridDim.x) also
// those of blocks b + S, b + 2S, b + 3S, so the first S blocks to become resident cover the
// whole matrix even where the rest of the grid becomes resident only after the kernel before
// ends (re-fetching a line already in L2 costs little). Bigger grids (Qwen3-8B's Q/K/V at
// 48 MiB, gate+up, down, lm_head) take the fraction L2PF_PART_BYTES / total of each of the
// block's own rows, from the row's start (what its first steps read), without fan-out: other
// blocks' rows would wait in L2 for a later wave while the first wave streams more than L2
// holds past them, and DRAM would read them twice. L2PF_PART_BYTES = 16 MiB, half of the
// whole-grid limit: before these the kernel is a bandwidth-bound GEMV (down before Q/K/V, O
// before gate+up) whose last 10-35 MB still stream through L2 while the prefetched lines
// wait, and its tail of a few us fetches no more than ~15 MB anyway.
//
// L2PF_FANOUT = 4, from residency: the first S = ceil(G / 4) blocks must be resident while the
// kernel before runs. Blocks here are 128 threads (GEMV_THREADS); the one-row kernels take
// 32 registers at R = 1 and 2 (bounded), 40-56 at R = 4, 76-102 at R = 8 and 4u2 (ptxas 13.2
// via NVRTC, sm_90). Before O comes the decode attention: at short contexts 2 blocks per SM
// (attention.rs DECODE_TARGET_BLOCKS_PER_SM_SHORT) of 128 threads, 78-96 registers and ~36 KB
// of shared memory, which leaves about 40K of an SM's 64K registers: ~3 GEMV blocks per SM at
// 4u2 (86 registers), 4 at R = 8, 9 at R = 2. Qwen3-8B's O (32 MiB, the largest grid that
// fits) is 1024 blocks at 4u2 (the shape picked there), 512 at R = 8, 2048 at R = 2, so S is
// 1.9, 1.0 and 3.9 per SM of 132: within what fits, with 1.5-4x to spare. F = 2 would need 3.9
// blocks per SM at 4u2, more than fit. More fan-out costs the first blocks one prefetch per
// extra step and gains nothing once S blocks are resident.
//
// How. On sm_90 and later one cp.async.bulk.prefetch.L2 per contiguous range (a block's rows
// of one matrix are one range), each issued by one thread; with AFM_GEMV_L2PF_LINES (an A/B
// switch, also from module_source), or before sm_90 (no PDL there, so nothing to overlap
// anyway), prefetch.global.L2 per 128-byte line spread over the block's threads.
#ifndef AFM_GEMV_L2PF
#define AFM_GEMV_L2PF 0
#endif
#ifndef AFM_GEMV_L2PF_LINES
#define AFM_GEMV_L2PF_LINES 0
#endif
#define L2PF_BYTES (32ll << 20)
#define L2PF_PART_BYTES (16u << 20)
#define L2PF_FANOUT 4

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && !AFM_GEMV_L2PF_LINES
#define L2PF_BULK 1
#else
#define L2PF_BULK 0
#endif

// Bytes [p, p + n) toward L2 (n below 4 GiB). With L2PF_BULK one bulk prefetch by the calling
// thread alone; where p and n need not be multiples of 16 (A16 false: quantized rows of 34-
// and 210-byte blocks), of p and p + n rounded down to 16 bytes, and the line of the last
// byte where the end is not aligned (16-bit rows skip that arithmetic: registers). Else line
// by line over the block's threads (every thread calls).
template <bool A16>
__device__ __forceinline__ void l2pf_range(const void* p, i64 n) {
    if (n <= 0) return;
#if L2PF_BULK
    const u64 end = (u64)p + n, a = A16 ? (u64)p : (u64)p & ~15ull, e = A16 ? end : end & ~15ull;
    if (e > a)
        asm volatile(
            "{\n\t.reg .u64 g;\n\tcvta.to.global.u64 g, %0;\n\t"
            "cp.async.bulk.prefetch.L2.global [g], %1;\n\t}" ::"l"(a),
            "r"((u32)(e - a)));
    if (!A16 && e < end) prefetch_l2((const void*)(end - 1));
#else
    const u8* e = (const u8*)p + n;
    for (const u8* q = (const u8*)((u64)p & ~127ull) + 128 * threadIdx.x; q < e;
         q += 128 * GEMV_THREADS)
        prefetch_l2(q);
#endif
}

// Weight bytes [off, off + n) of w0, and of w1 where set (gate+up's up).
struct L2pfSpan {
    const u8 *w0, *w1;
    i64 off, n;
};

// For a grid whose weights fit in L2PF_BYTES, block b reading span(b): this block's span and,
// for the first S = ceil(G / L2PF_FANOUT) blocks, those of blocks + S, + 2S, + 3S. In bulk
// thread 2k + m issues step k's matrix m (no loop); line by line every thread walks them all.
template <bool A16, class Span>
__device__ __forceinline__ void l2pf_fanout(Span span) {
    const int g = gridDim.x, s = (g + L2PF_FANOUT - 1) / L2PF_FANOUT;
    const int steps = (int)blockIdx.x < s ? L2PF_FANOUT : 1;
#if L2PF_BULK
    const int k = threadIdx.x >> 1, b = blockIdx.x + k * s;
    if (k >= steps || b >= g) return;
    const L2pfSpan c = span(b);
    const u8* w = threadIdx.x & 1 ? c.w1 : c.w0;
    if (w) l2pf_range<A16>(w + c.off, c.n);
#else
    for (int k = 0; k < steps; k++) {
        const int b = blockIdx.x + k * s;
        if (b >= g) break;
        const L2pfSpan c = span(b);
        l2pf_range<A16>(c.w0 + c.off, c.n);
        if (c.w1) l2pf_range<A16>(c.w1 + c.off, c.n);
    }
#endif
}

// The 16-bit rows block b reads: row0 .. row0 + n of w0, and of w1 where set.
struct L2pfRows {
    const u16 *w0, *w1;
    int row0, n;
};

// The prefetches above for a grid that reads `nrows` rows of `cols` 16-bit values (all its
// matrices together), block b reading at(b).
template <class At>
__device__ __forceinline__ void gemv_l2pf(At at, int nrows, int cols) {
    const i64 rb = 2 * (i64)cols;
    if (nrows * rb <= L2PF_BYTES) {
        l2pf_fanout<true>([&](int b) {
            const L2pfRows c = at(b);
            return L2pfSpan{(const u8*)c.w0, (const u8*)c.w1, c.row0 * rb, c.n * rb};
        });
        return;
    }
    // L2PF_PART_BYTES / nrows of each of the block's own rows in whole lines, at least one
    // (a 32-bit division: a 64-bit one is a long software routine at every block's start).
    const i64 f = (L2PF_PART_BYTES / (u32)nrows) & ~127u;
    const i64 part = f < 128 ? 128 : f < rb ? f : rb;
    const L2pfRows c = at(blockIdx.x);
#if L2PF_BULK
    const int r = threadIdx.x >> 1;
    const u16* w = threadIdx.x & 1 ? c.w1 : c.w0;
    if (r < c.n && w) l2pf_range<true>(w + (i64)(c.row0 + r) * cols, part);
#else
    for (int r = 0; r < c.n; r++) {
        l2pf_range<true>(c.w0 + (i64)(c.row0 + r) * cols, part);
        if (c.w1) l2pf_range<true>(c.w1 + (i64)(c.row0 + r) * cols, part);
    }
#endif
}

// One matrix (GEMV_H), Q/K/V (GEMV_3), gate and up (GEMV_G). Called, not inlined: inlined,
// ptxas shared address arithmetic between them and the main loop, and kernels bounded to 32
// registers spilled inside it (gemva_bf16_1_r2: 40 bytes); called, every one-row kernel keeps
// its registers and loop (ptxas 13.2, sm_90; SASS compared), for a call before the wait.
template <int R>
__device__ __noinline__ void gemv_l2pf_one(const u16* W, int rows, int cols) {
    gemv_l2pf(
        [&](int b) {
            return L2pfRows{W, nullptr, b * R, min(R, rows - b * R)};
        },
        rows, cols);
}

template <int R>
__device__ __noinline__ void gemv_l2pf_three(const u16* W0, const u16* W1, const u16* W2,
                                             int r0, int r1, int r2, int cols) {
    // Block b's matrix and rows, as gemv3_pick (which reads blockIdx.x itself: left as it was,
    // so the kernels without AFM_GEMV_L2PF compile to the same code).
    gemv_l2pf(
        [&](int b) {
            const int b0 = (r0 + R - 1) / R, b1 = (r1 + R - 1) / R;
            const u16* w = b < b0 ? W0 : b < b0 + b1 ? W1 : W2;
            const int rows = b < b0 ? r0 : b < b0 + b1 ? r1 : r2;
            const int row0 = (b < b0 ? b : b < b0 + b1 ? b - b0 : b - b0 - b1) * R;
            return L2pfRows{w, nullptr, row0, min(R, rows - row0)};
        },
        r0 + r1 + r2, cols);
}

template <int R>
__device__ __noinline__ void gemv_l2pf_gated(const u16* G, const u16* U, int rows, int cols) {
    gemv_l2pf(
        [&](int b) {
            return L2pfRows{G, U, b * R, min(R, rows - b * R)};
        },
        2 * rows, cols);
}

#if AFM_GEMV_L2PF
#define GEMV_L2PF(call) call;
#else
#define GEMV_L2PF(call)
#endif

// gemv_*: out = x . W^T; gemva_*: out += x . W^T. The "p" kernels (gemvp_*, gemvap_*, ...:
// one activation row) load their first weights (gemv_preload) before the PDL wait; the others
// read them after it. The "p" kernels measured slower (cuda/matmul.rs PRELOAD_MAX_COLS) and
// run only with AFM_GEMV_PRELOAD=1.
#define GEMV_PRE(PRE, R, W, rows, cols, row0, pre)                                             \
    uint4 pre[R];                                                                              \
    if (PRE) gemv_preload<R>(W, rows, cols, row0, pre);
// Kernel names: KNAME_NAME_N then SFX: empty at R = GEMV_ROWS, "_r1", "_r2", "_r8" at the
// other R, "_r2u2", "_r4u2" with two units in flight (UN = 2).
// Launch bounds: at R = 8 with an explicit minimum of one block per SM. Without it ptxas (12.9,
// sm_90, from NVRTC 13.2's PTX) interleaved the R weight loads with the products of rows already
// loaded, so few of a thread's 16-byte loads were in flight (R = 4 with the folded norm: 3 of
// 8). With it every load of a unit is issued before the first product (78-102 registers at
// R = 8; none spill).
// R = 1, 2, 4 keep the default (their few loads are all in flight already), except for one
// matrix at R = 1 and 2 (GEMV_H, GEMV_BOUNDS_R_UN): at most 32 registers there, so 16 blocks
// fit on an SM and Qwen3-8B's O and down at R = 2 (2048 blocks, 15.5 per SM) run in one wave.
// Unbounded they took 34-44 (10-12 blocks per SM); the norm and gate+up kernels spill at 32.
#define GEMV_BOUNDS_1 __launch_bounds__(GEMV_THREADS)
#define GEMV_BOUNDS_2 __launch_bounds__(GEMV_THREADS)
#define GEMV_BOUNDS_4 __launch_bounds__(GEMV_THREADS)
#define GEMV_BOUNDS_8 __launch_bounds__(GEMV_THREADS, 1)
#define GEMV_BOUNDS_1_1 __launch_bounds__(GEMV_THREADS, 16)
#define GEMV_BOUNDS_2_1 __launch_bounds__(GEMV_THREADS, 16)
#define GEMV_BOUNDS_4_1 GEMV_BOUNDS_4
#define GEMV_BOUNDS_8_1 GEMV_BOUNDS_8
// Two units in flight (GEMV_U2) as R = 8: all 2R weight loads issue before the first product
// (ptxas 12.9: R = 2 60 registers, R = 4 86). At 86, 5 blocks fit on an SM, so Qwen3-8B's O and
// down (1024 blocks at R = 4) take 1.55 waves; bounded to 64 registers (8 blocks per SM) R = 4
// spilled and split its loads in two.
#define GEMV_BOUNDS_2_2 __launch_bounds__(GEMV_THREADS, 1)
#define GEMV_BOUNDS_4_2 __launch_bounds__(GEMV_THREADS, 1)
#define GEMV_H(NAME, BF, N, R, UN, SFX, KNAME, ACC, PRE)                                       \
    extern "C" __global__ void GEMV_BOUNDS_##R##_##UN KNAME##_##NAME##_##N##SFX(               \
        const u16* W, const float* x, float* out, int rows, int cols) {                        \
        const int row0 = blockIdx.x * R;                                                       \
        GEMV_L2PF(gemv_l2pf_one<R>(W, rows, cols))                                             \
        GEMV_PRE(PRE, R, W, rows, cols, row0, pre)                                             \
        pdl_begin();                                                                           \
        gemv_half_rows<N, R, UN, BF, false, ACC, PRE>(W, x, nullptr, 0.f, out, rows, cols,     \
                                                      row0, pre);                              \
    }
// gemv3_*: Q/K/V; gemv3n_*: the same of rms_norm(x, nw, eps) (nw and eps unused in gemv3_*).
#define GEMV_3(NAME, BF, N, R, SFX, KNAME, NORM, PRE)                                          \
    extern "C" __global__ void GEMV_BOUNDS_##R KNAME##_##NAME##_##N##SFX(                       \
        const u16* W0, const u16* W1, const u16* W2, const float* x, const float* nw,          \
        float eps, float* o0, float* o1, float* o2, int r0, int r1, int r2, int cols) {        \
        const Gemv3Pick m = gemv3_pick<R>(W0, W1, W2, o0, o1, o2, r0, r1, r2);                 \
        GEMV_L2PF(gemv_l2pf_three<R>(W0, W1, W2, r0, r1, r2, cols))                            \
        GEMV_PRE(PRE, R, m.W, m.rows, cols, m.row0, pre)                                       \
        pdl_begin();                                                                           \
        gemv_half_rows<N, R, 1, BF, NORM, false, PRE>(m.W, x, nw, eps, m.out, m.rows, cols,    \
                                                      m.row0, pre);                            \
    }
// gemvg_*: gate + up; gemvgn_*: the same of rms_norm(x, nw, eps).
#define GEMV_G(NAME, BF, N, R, SFX, KNAME, NORM, PRE)                                          \
    extern "C" __global__ void GEMV_BOUNDS_##R KNAME##_##NAME##_##N##SFX(                       \
        const u16* G, const u16* U, const float* x, const float* nw, float eps, float* out,    \
        int rows, int cols, int act) {                                                         \
        GEMV_L2PF(gemv_l2pf_gated<R>(G, U, rows, cols))                                        \
        GEMV_PRE(PRE, R, G, rows, cols, blockIdx.x * R, pg)                                    \
        GEMV_PRE(PRE, R, U, rows, cols, blockIdx.x * R, pu)                                    \
        pdl_begin();                                                                           \
        gemv_gated_half<N, R, BF, NORM, PRE>(G, U, x, nw, eps, out, rows, cols, act, pg, pu);  \
    }
#define GEMV_ALL(N)                                                                            \
    GEMV_H(bf16, true, N, 4, 1, , gemv, false, false)                                          \
    GEMV_H(f16, false, N, 4, 1, , gemv, false, false)                                          \
    GEMV_H(bf16, true, N, 4, 1, , gemva, true, false)                                          \
    GEMV_H(f16, false, N, 4, 1, , gemva, true, false)                                          \
    GEMV_3(bf16, true, N, 4, , gemv3, false, false)                                            \
    GEMV_3(f16, false, N, 4, , gemv3, false, false)                                            \
    GEMV_G(bf16, true, N, 4, , gemvg, false, false)                                            \
    GEMV_G(f16, false, N, 4, , gemvg, false, false)
// The norm folded in at one activation row only (cuda/matmul.rs NORM_FOLD_MAX_ROWS): at 8 rows
// the extra products made the step slower than a separate norm launch.
#define GEMV_NORM_ALL(R, SFX)                                                                  \
    GEMV_3(bf16, true, 1, R, SFX, gemv3n, true, false)                                         \
    GEMV_3(f16, false, 1, R, SFX, gemv3n, true, false)                                         \
    GEMV_G(bf16, true, 1, R, SFX, gemvgn, true, false)                                         \
    GEMV_G(f16, false, 1, R, SFX, gemvgn, true, false)
GEMV_NORM_ALL(4, )
// One activation row at R = 1, 2 and 8 rows per block (cuda/matmul.rs `half_rows` picks R by
// grid size, or AFM_GEMV_R forces it): gemv_bf16_1_r8, gemv3n_f16_1_r2, ... (R = 16 measured
// slower on every H200 shape, session 8, and was dropped). Smaller R: more, shorter blocks, so
// a one-wave grid (Qwen3-8B's O and down: 1024 blocks at R = 4 on 132 SMs) ends less unevenly.
#define GEMV_R_ALL(R)                                                                          \
    GEMV_H(bf16, true, 1, R, 1, _r##R, gemv, false, false)                                     \
    GEMV_H(f16, false, 1, R, 1, _r##R, gemv, false, false)                                     \
    GEMV_H(bf16, true, 1, R, 1, _r##R, gemva, true, false)                                     \
    GEMV_H(f16, false, 1, R, 1, _r##R, gemva, true, false)                                     \
    GEMV_3(bf16, true, 1, R, _r##R, gemv3, false, false)                                       \
    GEMV_3(f16, false, 1, R, _r##R, gemv3, false, false)                                       \
    GEMV_G(bf16, true, 1, R, _r##R, gemvg, false, false)                                       \
    GEMV_G(f16, false, 1, R, _r##R, gemvg, false, false)                                       \
    GEMV_NORM_ALL(R, _r##R)
GEMV_R_ALL(1)
GEMV_R_ALL(2)
GEMV_R_ALL(8)
// One matrix (O, down, lm_head) with two units of each row in flight per thread: in a grid that
// fits in one wave the bytes in flight per SM are rows x units per step x 16 B whatever R is,
// so only more units per step raise them (down's 12,288-column rows take 12 steps at UN = 1).
// Not more threads per block or blocks per row: either would change which products a thread
// sums, so the bits would differ from the other R.
#define GEMV_U2(R)                                                                             \
    GEMV_H(bf16, true, 1, R, 2, _r##R##u2, gemv, false, false)                                 \
    GEMV_H(f16, false, 1, R, 2, _r##R##u2, gemv, false, false)                                 \
    GEMV_H(bf16, true, 1, R, 2, _r##R##u2, gemva, true, false)                                 \
    GEMV_H(f16, false, 1, R, 2, _r##R##u2, gemva, true, false)
GEMV_U2(2)
GEMV_U2(4)
// The same at one row, R = 4, with the first weights loaded before the PDL wait.
GEMV_H(bf16, true, 1, 4, 1, , gemvp, false, true) GEMV_H(f16, false, 1, 4, 1, , gemvp, false, true)
GEMV_H(bf16, true, 1, 4, 1, , gemvap, true, true) GEMV_H(f16, false, 1, 4, 1, , gemvap, true, true)
GEMV_3(bf16, true, 1, 4, , gemv3p, false, true) GEMV_3(f16, false, 1, 4, , gemv3p, false, true)
GEMV_G(bf16, true, 1, 4, , gemvgp, false, true) GEMV_G(f16, false, 1, 4, , gemvgp, false, true)
GEMV_3(bf16, true, 1, 4, , gemv3np, true, true) GEMV_3(f16, false, 1, 4, , gemv3np, true, true)
GEMV_G(bf16, true, 1, 4, , gemvgnp, true, true) GEMV_G(f16, false, 1, 4, , gemvgnp, true, true)

GEMV_ALL(1)
GEMV_ALL(2)
GEMV_ALL(3)
GEMV_ALL(4)
GEMV_ALL(5)
GEMV_ALL(6)
GEMV_ALL(7)
GEMV_ALL(8)

// ---- Quantized weights: int8 activations and dp4a ----
//
// Activations are int8 blocks of 32 (common.cuh's q8_quantize):
//
//   xq: i8 [n][cols]    xd, xs: f32 [n][cols / 32] (d and d * sum(q) per block of 32)
//
// A block of 128 threads is split into `groups` (1, 2 or 4) thread groups; each group owns R
// consecutive weight rows (4, or 1 where 4 would leave too few warps: the gemv8r1 kernels)
// and walks their 32-weight units (cols / 32 per row), so narrow matrices (Qwen3-0.6B: 1024
// columns, 32 units) keep every warp busy. Per unit a thread loads the unit of all its rows
// into registers, then every activation load serves all of them.

__device__ __forceinline__ int dp4a(int a, int b, int c) {
    int d;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

__device__ __forceinline__ int dot16(int4 x, int w0, int w1, int w2, int w3) {
    return dp4a(x.w, w3, dp4a(x.z, w2, dp4a(x.y, w1, dp4a(x.x, w0, 0))));
}

// Lane `lane`'s value v of 32-block `blk` to int8 (one warp per block, every lane present).
__device__ __forceinline__ void q8_block(float v, i64 blk, int lane, signed char* xq, float* xd,
                                         float* xs) {
    float d, s;
    xq[blk * 32 + lane] = (signed char)q8_quantize(v, d, s);
    if (lane == 0) {
        xd[blk] = d;
        xs[blk] = s;
    }
}

// Quantizes x (rows of `cols`, a multiple of 32) to int8 blocks of 32: one warp per block.
extern "C" __global__ void quantize_x_q8(const float* x, signed char* xq, float* xd, float* xs,
                                         i64 nblocks) {
    pdl_begin();
    const i64 blk = (blockIdx.x * (i64)blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (blk >= nblocks) return;  // whole warps: the grid is a multiple of 32 threads
    q8_block(x[blk * 32 + lane], blk, lane, xq, xd, xs);
}

// quantize_x_q8 of rms_norm(x, nw, eps), one block per row: the block sums the row's squares,
// then its warps quantize the row's 32-blocks of x * (inv * nw), the value rms_norm stores.
extern "C" __global__ void norm_quantize_x_q8(const float* x, const float* nw, float eps,
                                              signed char* xq, float* xd, float* xs, int cols) {
    pdl_begin();
    __shared__ float sh[32];
    const float* xr = x + (i64)blockIdx.x * cols;
    float ss = 0.f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) ss += xr[c] * xr[c];
    ss = block_sum(ss, sh);
    const float inv = 1.0f / sqrtf(ss / (float)cols + eps);
    const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    const i64 blk0 = (i64)blockIdx.x * (cols / 32);
    for (int k = threadIdx.x >> 5; k < cols / 32; k += warps) {
        const int c = 32 * k + lane;
        q8_block(xr[c] * (inv * nw[c]), blk0 + k, lane, xq, xd, xs);
    }
}

// A thread's place: its index in its group, the group's size in threads and warps, and the
// group's first weight row.
struct Q8Group {
    int tig, tg, gw, w0, row0;  // w0: the group's first warp
};

// `groups` is 1, 2 or 4 (GEMV_THREADS = 128 = 2^7): shifts, not divisions.
__device__ __forceinline__ Q8Group q8_group(int groups, int rows_per_group, int blk) {
    const int gshift = groups >> 1;  // log2(groups) for 1, 2, 4
    const int grp = threadIdx.x >> (7 - gshift);
    Q8Group g;
    g.tg = GEMV_THREADS >> gshift;
    g.tig = threadIdx.x & (g.tg - 1);
    g.gw = g.tg >> 5;
    g.w0 = grp * g.gw;
    g.row0 = (blk * groups + grp) * rows_per_group;
    return g;
}

// Scales of Q4_K sub-blocks 2p and 2p+1 (GGML's get_scale_min_k4) times d and dmin, from the
// block's 16-byte header (d, dmin, scales[12]) held in registers. Branch-free, since the lanes
// of a warp hold different p.
__device__ __forceinline__ void q4k_scales_hd(uint4 hd, int p, float& d0, float& d1, float& m0,
                                              float& m1) {
    const int k = 16 * (p & 1);
    // 16-bit words p & 1 of scales[0..4), [4..8) and [8..12).
    const u32 a = (hd.y >> k) & 0xffff, b = (hd.z >> k) & 0xffff, c = (hd.w >> k) & 0xffff;
    const u32 sc = p < 2 ? a & 0x3f3f : (c & 0x0f0f) | ((a & 0xc0c0) >> 2);
    const u32 mn = p < 2 ? b & 0x3f3f : ((c >> 4) & 0x0f0f) | ((b & 0xc0c0) >> 2);
    const float d = h2f(hd.x & 0xffff), dmin = h2f(hd.x >> 16);
    d0 = __fmul_rn(d, (float)(sc & 0xff)); d1 = __fmul_rn(d, (float)(sc >> 8));
    m0 = __fmul_rn(dmin, (float)(mn & 0xff)); m1 = __fmul_rn(dmin, (float)(mn >> 8));
}

// The same from the block in memory (16-byte aligned: 144-byte blocks in 16-byte aligned rows).
__device__ __forceinline__ void q4k_scales(const u8* base, int p, float& d0, float& d1,
                                           float& m0, float& m1) {
    q4k_scales_hd(*(const uint4*)base, p, d0, d1, m0, m1);
}

// One Q6_K work unit (half hh, columns 8lr..8lr+8 of each quarter-group g): v[2g], v[2g+1] are
// the 8 signed 6-bit weights (q - 32, one per byte) of group g, dg[g] their scale d * sc.
__device__ __forceinline__ void q6k_unit(const u8* base, int hh, int lr, u32 (&v)[8],
                                         float (&dg)[4]) {
    const u8* ql = base + 64 * hh + 8 * lr;
    const u8* qh = base + 128 + 32 * hh + 8 * lr;
    const u32 q0a = ld32_a2(ql), q0b = ld32_a2(ql + 4);
    const u32 q1a = ld32_a2(ql + 32), q1b = ld32_a2(ql + 36);
    const u32 ha = ld32_a2(qh), hb = ld32_a2(qh + 4);
    const float d = h2f(ld16(base + 208));
    const signed char* scp = (const signed char*)(base + 192 + 8 * hh + lr / 2);
#pragma unroll
    for (int g = 0; g < 4; g++) {
        const int shift = 4 * (g >> 1);
        const u32 wa = (g & 1) ? q1a : q0a, wb = (g & 1) ? q1b : q0b;
        u32 va = ((wa >> shift) & 0x0F0F0F0F) | (((ha >> (2 * g)) & 0x03030303) << 4);
        u32 vb = ((wb >> shift) & 0x0F0F0F0F) | (((hb >> (2 * g)) & 0x03030303) << 4);
        // Per byte v - 32 without borrows between bytes (v <= 63).
        v[2 * g] = ((va | 0x80808080) - 0x20202020) ^ 0x80808080;
        v[2 * g + 1] = ((vb | 0x80808080) - 0x20202020) ^ 0x80808080;
        dg[g] = d * (float)scp[2 * g];
    }
}

// Q4_K unit: 16 qs bytes = 16 weights of sub-block 2p (low nibbles)
// and 16 of sub-block 2p+1 (high), at columns 64p + 16h and 32 further on.
template <int N, int R>
__device__ __forceinline__ void acc8_q4_k(const u8* W, const signed char* xq, const float* xd,
                                          const float* xs, int rows, int cols, const Q8Group& g,
                                          float (&acc)[R][N]) {
    const int nb = cols / 256, xbr = cols / 32;
    const i64 rbytes = (i64)nb * 144;
    for (int u = g.tig; u < nb * 8; u += g.tg) {
        const int blk = u >> 3, p = (u >> 1) & 3, h = u & 1;
        int lo[R][4], hi[R][4];
        float d0[R], d1[R], m0[R], m1[R];
#pragma unroll
        for (int r = 0; r < R; r++) {
            const u8* base = W + min(g.row0 + r, rows - 1) * rbytes + blk * 144;
            const uint4 hd = *(const uint4*)base;
            const uint4 q = *(const uint4*)(base + 16 + 32 * p + 16 * h);
            q4k_scales_hd(hd, p, d0[r], d1[r], m0[r], m1[r]);
            const u32 w4[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
            for (int i = 0; i < 4; i++) {
                lo[r][i] = (int)(w4[i] & 0x0F0F0F0F);
                hi[r][i] = (int)((w4[i] >> 4) & 0x0F0F0F0F);
            }
        }
        const int c0 = blk * 256 + 64 * p + 16 * h;
#pragma unroll
        for (int b = 0; b < N; b++) {
            const signed char* xb = xq + (i64)b * cols + c0;
            const int4 a = *(const int4*)xb, e = *(const int4*)(xb + 32);
            const int jb = b * xbr + blk * 8 + 2 * p;
            const float xd0 = xd[jb], xd1 = xd[jb + 1];
            // The min term needs the whole sub-block's sum: the h = 0 half adds it.
            const float xs0 = h == 0 ? xs[jb] : 0.f, xs1 = h == 0 ? xs[jb + 1] : 0.f;
#pragma unroll
            for (int r = 0; r < R; r++) {
                const int i0 = dot16(a, lo[r][0], lo[r][1], lo[r][2], lo[r][3]);
                const int i1 = dot16(e, hi[r][0], hi[r][1], hi[r][2], hi[r][3]);
                acc[r][b] += xd0 * d0[r] * (float)i0 + xd1 * d1[r] * (float)i1 -
                             (m0[r] * xs0 + m1[r] * xs1);
            }
        }
    }
}

// Q6_K unit: 8 columns of half hh in each of the 4 quarter-groups.
template <int N, int R>
__device__ __forceinline__ void acc8_q6_k(const u8* W, const signed char* xq, const float* xd,
                                          const float* xs, int rows, int cols, const Q8Group& g,
                                          float (&acc)[R][N]) {
    const int nb = cols / 256, xbr = cols / 32;
    const i64 rbytes = (i64)nb * 210;
    for (int u = g.tig; u < nb * 8; u += g.tg) {
        const int blk = u >> 3, hh = (u >> 2) & 1, lr = u & 3;
        u32 v[R][8];
        float dg[R][4];
#pragma unroll
        for (int r = 0; r < R; r++)
            q6k_unit(W + min(g.row0 + r, rows - 1) * rbytes + blk * 210, hh, lr, v[r], dg[r]);
#pragma unroll
        for (int b = 0; b < N; b++) {
#pragma unroll
            for (int q = 0; q < 4; q++) {
                const int col = blk * 256 + 128 * hh + 32 * q + 8 * lr;
                const int2 xv = *(const int2*)(xq + (i64)b * cols + col);
                const float x_d = xd[b * xbr + blk * 8 + 4 * hh + q];
#pragma unroll
                for (int r = 0; r < R; r++) {
                    const int i = dp4a(xv.y, (int)v[r][2 * q + 1], dp4a(xv.x, (int)v[r][2 * q], 0));
                    acc[r][b] += x_d * dg[r][q] * (float)i;
                }
            }
        }
    }
}

// Q8_0 unit: one whole 34-byte block (32 weights; 2-byte aligned, so 16-bit loads).
template <int N, int R>
__device__ __forceinline__ void acc8_q8_0(const u8* W, const signed char* xq, const float* xd,
                                          const float* xs, int rows, int cols, const Q8Group& g,
                                          float (&acc)[R][N]) {
    const int nb = cols / 32, xbr = cols / 32;
    const i64 rbytes = (i64)nb * 34;
    for (int u = g.tig; u < nb; u += g.tg) {
        int w[R][8];
        float d[R];
#pragma unroll
        for (int r = 0; r < R; r++) {
            const u8* base = W + min(g.row0 + r, rows - 1) * rbytes + u * 34;
            d[r] = h2f(ld16(base));
#pragma unroll
            for (int i = 0; i < 8; i++) w[r][i] = (int)ld32_a2(base + 2 + 4 * i);
        }
#pragma unroll
        for (int b = 0; b < N; b++) {
            const int4* xb = (const int4*)(xq + (i64)b * cols + u * 32);
            const int4 a = xb[0], e = xb[1];
            const float x_d = xd[b * xbr + u];
#pragma unroll
            for (int r = 0; r < R; r++) {
                const int i = dot16(e, w[r][4], w[r][5], w[r][6], w[r][7]) +
                              dot16(a, w[r][0], w[r][1], w[r][2], w[r][3]);
                acc[r][b] += x_d * d[r] * (float)i;
            }
        }
    }
}

// L2 prefetches of the bytes of a thread's first unit in each of its rows, issued before the
// PDL wait (the one exception to "the wait comes first"): no kernel writes weights, and a
// prefetch brings nothing into registers, so this only overlaps the weights' DRAM latency with
// the tail of the kernel before (for most decode matrices the first units are all of them).
template <int R>
__device__ __forceinline__ void pf8_q4_k(const u8* W, int rows, int cols, const Q8Group& g) {
    const int u = g.tig, nb = cols / 256;
    if (u >= nb * 8) return;
    const int blk = u >> 3, p = (u >> 1) & 3, h = u & 1;
#pragma unroll
    for (int r = 0; r < R; r++) {
        const u8* base = W + min(g.row0 + r, rows - 1) * ((i64)nb * 144) + blk * 144;
        prefetch_l2(base);
        prefetch_l2(base + 16 + 32 * p + 16 * h);
    }
}

template <int R>
__device__ __forceinline__ void pf8_q6_k(const u8* W, int rows, int cols, const Q8Group& g) {
    const int u = g.tig, nb = cols / 256;
    if (u >= nb * 8) return;
    const int blk = u >> 3, hh = (u >> 2) & 1, lr = u & 3;
#pragma unroll
    for (int r = 0; r < R; r++) {
        const u8* base = W + min(g.row0 + r, rows - 1) * ((i64)nb * 210) + blk * 210;
        prefetch_l2(base + 64 * hh + 8 * lr);
        prefetch_l2(base + 64 * hh + 8 * lr + 32);
        prefetch_l2(base + 128 + 32 * hh + 8 * lr);
        prefetch_l2(base + 192);
        prefetch_l2(base + 208);
    }
}

template <int R>
__device__ __forceinline__ void pf8_q8_0(const u8* W, int rows, int cols, const Q8Group& g) {
    const int u = g.tig, nb = cols / 32;
    if (u >= nb) return;
#pragma unroll
    for (int r = 0; r < R; r++) {
        const u8* base = W + min(g.row0 + r, rows - 1) * ((i64)nb * 34) + u * 34;
        prefetch_l2(base);
        prefetch_l2(base + 33);
    }
}

// The sum of one (row, batch) accumulator over the thread group, in its thread r * N + b.
template <int N, int R>
__device__ __forceinline__ float gemv8_reduce(float (&acc)[R][N], const Q8Group& g) {
    return group_reduce<N, R>(acc, g.tig, g.gw, g.w0);
}

// Thread r * N + b of each group writes out[b][row0 + r] (adds to it with `accumulate`).
template <int N, int R>
__device__ __forceinline__ void gemv8_store(float v, float* out, int rows, const Q8Group& g,
                                            int accumulate) {
    if (g.tig < R * N) {
        const int r = g.tig / N, b = g.tig % N;
        if (g.row0 + r < rows) {
            float* o = out + (i64)b * rows + g.row0 + r;
            *o = accumulate ? *o + v : v;
        }
    }
}

// Weight type codes of the int8 kernels (cuda/matmul.rs `q8_type`).
#define Q8_Q4_K 0
#define Q8_Q6_K 1
#define Q8_Q8_0 2

// The weight type is a run-time argument, uniform over a block (one branch), so one kernel
// serves every type and Q/K/V of mixed types (as Q4_K_M files have) share one launch.
template <int N, int R>
__device__ __forceinline__ void acc8(int type, const u8* W, const signed char* xq,
                                     const float* xd, const float* xs, int rows, int cols,
                                     const Q8Group& g, float (&acc)[R][N]) {
    if (type == Q8_Q4_K) acc8_q4_k<N, R>(W, xq, xd, xs, rows, cols, g, acc);
    else if (type == Q8_Q6_K) acc8_q6_k<N, R>(W, xq, xd, xs, rows, cols, g, acc);
    else acc8_q8_0<N, R>(W, xq, xd, xs, rows, cols, g, acc);
}

template <int R>
__device__ __forceinline__ void pf8(int type, const u8* W, int rows, int cols, const Q8Group& g) {
    if (type == Q8_Q4_K) pf8_q4_k<R>(W, rows, cols, g);
    else if (type == Q8_Q6_K) pf8_q6_k<R>(W, rows, cols, g);
    else pf8_q8_0<R>(W, rows, cols, g);
}

// Up to three matrices of one width against the same activations, out_i = x . W_i^T: the
// first ceil(r0 / (R * groups)) blocks serve W0, the next ceil(r1 / ...) W1, the rest W2
// (r1 = r2 = 0 for one matrix). Fields, not arrays: a kernel parameter indexed at run time
// would be copied to the stack.
struct Q8Mats {
    const u8 *w0, *w1, *w2;
    float *o0, *o1, *o2;
    int t0, t1, t2, r0, r1, r2;
    int accumulate;  // out_i += x . W_i^T (a residual add folded in)
};

// The matrix block `blk` serves; `blk` becomes the block's index within that matrix's blocks.
struct Q8Pick {
    const u8* w;
    float* out;
    int type, rows;
};

__device__ __forceinline__ Q8Pick q8_pick(const Q8Mats& m, int rows_per_block, int& blk) {
    const int b0 = (m.r0 + rows_per_block - 1) / rows_per_block;
    const int b1 = (m.r1 + rows_per_block - 1) / rows_per_block;
    Q8Pick p;
    if (blk < b0) {
        p.w = m.w0; p.out = m.o0; p.type = m.t0; p.rows = m.r0;
    } else if (blk < b0 + b1) {
        blk -= b0;
        p.w = m.w1; p.out = m.o1; p.type = m.t1; p.rows = m.r1;
    } else {
        blk -= b0 + b1;
        p.w = m.w2; p.out = m.o2; p.type = m.t2; p.rows = m.r2;
    }
    return p;
}

// The int8 GEMVs' weights into L2 before the PDL wait, with AFM_GEMV_L2PF (see "Weights into
// L2" above) and `prefetch`: a grid whose matrices fit in L2PF_BYTES (Qwen3-8B Q8_0: Q/K/V
// 25.5 MiB, O 17 MiB; Q4_K: also a Q4_K down, 27 MiB) whole, fanned out as there (blocks of 128
// threads, 56 registers at four rows per group and 32 at one: at most 1024 blocks at R = 4
// and 2112 at R = 1 below 4 blocks per SM (matmul.rs Q8_MIN_BLOCKS_PER_SM), so S is 1.9 and
// 4 per SM, where ~5 and ~9 fit beside two attention blocks); a larger one as without it,
// each thread the first unit of its rows (pf8). Inlined, unlike the 16-bit ones: a call would
// copy the Q8Mats argument to the stack (104 bytes), and inline nothing spills.
__device__ __forceinline__ i64 q8_row_bytes(int type, int cols) {
    if (type == Q8_Q4_K) return (i64)(cols / 256) * 144;
    if (type == Q8_Q6_K) return (i64)(cols / 256) * 210;
    return (i64)(cols / 32) * 34;
}

template <int R>
__device__ __forceinline__ void gemv8_l2pf(const Q8Mats& m, const Q8Pick& p, int cols,
                                           int groups, const Q8Group& g) {
    const i64 total = m.r0 * q8_row_bytes(m.t0, cols) + m.r1 * q8_row_bytes(m.t1, cols) +
                      m.r2 * q8_row_bytes(m.t2, cols);
    if (total > L2PF_BYTES) {
        pf8<R>(p.type, p.w, p.rows, cols, g);
        return;
    }
    l2pf_fanout<false>([&](int b) {
        const Q8Pick t = q8_pick(m, R * groups, b);  // b: the block's index in its matrix
        const i64 rb = q8_row_bytes(t.type, cols);
        const int row0 = b * R * groups;
        return L2pfSpan{t.w, nullptr, row0 * rb, min(R * groups, t.rows - row0) * rb};
    });
}

template <int R>
__device__ __forceinline__ void gemv8g_l2pf(const u8* G, const u8* U, int type, int rows,
                                            int cols, int groups, const Q8Group& g) {
    const i64 rb = q8_row_bytes(type, cols);
    if (2 * rows * rb > L2PF_BYTES) {
        pf8<R>(type, G, rows, cols, g);
        pf8<R>(type, U, rows, cols, g);
        return;
    }
    l2pf_fanout<false>([&](int b) {
        const int row0 = b * R * groups;
        return L2pfSpan{G, U, row0 * rb, min(R * groups, rows - row0) * rb};
    });
}

// `on` with AFM_GEMV_L2PF, else `off` (the kernels as they were).
#if AFM_GEMV_L2PF
#define GEMV8_PF(on, off) on;
#else
#define GEMV8_PF(on, off) off
#endif

#define GEMV8(N, R, NAME)                                                                      \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS) NAME##_##N(                     \
        Q8Mats m, const signed char* xq, const float* xd, const float* xs, int cols,           \
        int groups, int prefetch) {                                                            \
        int blk = blockIdx.x;                                                                  \
        const Q8Pick p = q8_pick(m, R * groups, blk);                                          \
        const Q8Group g = q8_group(groups, R, blk);                                            \
        if (prefetch)                                                                          \
            GEMV8_PF(gemv8_l2pf<R>(m, p, cols, groups, g),                                     \
                     pf8<R>(p.type, p.w, p.rows, cols, g);)                                    \
        pdl_begin();                                                                           \
        float acc[R][N] = {};                                                                  \
        acc8<N, R>(p.type, p.w, xq, xd, xs, p.rows, cols, g, acc);                             \
        gemv8_store<N, R>(gemv8_reduce<N, R>(acc, g), p.out, p.rows, g, m.accumulate);                       \
    }
// out[b][row] = act(gate row . x[b]) * (up row . x[b]) for gate and up of one type, with the
// sums of a gemv8 launch (act 0 = SiLU, 1 = GELU tanh).
#define GEMV8G(N, R, NAME)                                                                     \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS) NAME##_##N(                     \
        const u8* G, const u8* U, int type, const signed char* xq, const float* xd,            \
        const float* xs, float* out, int rows, int cols, int groups, int prefetch, int act) {  \
        const Q8Group g = q8_group(groups, R, blockIdx.x);                                     \
        if (prefetch) {                                                                        \
            GEMV8_PF(gemv8g_l2pf<R>(G, U, type, rows, cols, groups, g),                        \
                     pf8<R>(type, G, rows, cols, g); pf8<R>(type, U, rows, cols, g);)          \
        }                                                                                      \
        pdl_begin();                                                                           \
        float ag[R][N] = {};                                                                   \
        acc8<N, R>(type, G, xq, xd, xs, rows, cols, g, ag);                                    \
        float au[R][N] = {};                                                                   \
        acc8<N, R>(type, U, xq, xd, xs, rows, cols, g, au);                                    \
        const float sg = gemv8_reduce<N, R>(ag, g);                                            \
        const float su = gemv8_reduce<N, R>(au, g);                                            \
        gemv8_store<N, R>((act == 0 ? gemv_silu(sg) : gemv_gelu_tanh(sg)) * su, out, rows, g, 0); \
    }
// Four rows per thread group (gemv8_N, gemv8g_N), and one (gemv8r1_N, gemv8gr1_N: more warps
// for small matrices).
#define GEMV8_ALL(N)                                                                           \
    GEMV8(N, 4, gemv8) GEMV8G(N, 4, gemv8g) GEMV8(N, 1, gemv8r1) GEMV8G(N, 1, gemv8gr1)

GEMV8_ALL(1)
GEMV8_ALL(2)
GEMV8_ALL(3)
GEMV8_ALL(4)
GEMV8_ALL(5)
GEMV8_ALL(6)
GEMV8_ALL(7)
GEMV8_ALL(8)

// Whole quantized matrices to f16 (prefill goes through cuBLAS): one thread per GEMV work unit,
// 16-byte stores. Values are the CPU dequantization's, rounded once to f16.
__device__ __forceinline__ u32 pack2(float a, float b) {
    return (u32)f2h(a) | ((u32)f2h(b) << 16);
}

extern "C" __global__ void dequant_f16_q4_k(const u8* w, u16* out, int rows, int cols,
                                            i64 row_bytes) { pdl_begin();
    const int units = cols / 256 * 8;
    const i64 idx = blockIdx.x * (i64)blockDim.x + threadIdx.x;
    if (idx >= (i64)rows * units) return;
    const i64 r = idx / units;
    const int u = idx % units, blk = u >> 3, p = (u >> 1) & 3, h = u & 1;
    const u8* base = w + r * row_bytes + blk * 144;
    float d0, d1, m0, m1;
    q4k_scales(base, p, d0, d1, m0, m1);
    const uint4 q = *(const uint4*)(base + 16 + 32 * p + 16 * h);
    const u32 qw[4] = {q.x, q.y, q.z, q.w};
    u32 lo[8], hi[8];
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const u32 b0 = (qw[i / 2] >> (16 * (i & 1))) & 0xff, b1 = (qw[i / 2] >> (16 * (i & 1) + 8)) & 0xff;
        lo[i] = pack2(__fsub_rn(__fmul_rn(d0, (float)(b0 & 15)), m0),
                      __fsub_rn(__fmul_rn(d0, (float)(b1 & 15)), m0));
        hi[i] = pack2(__fsub_rn(__fmul_rn(d1, (float)(b0 >> 4)), m1),
                      __fsub_rn(__fmul_rn(d1, (float)(b1 >> 4)), m1));
    }
    uint4* o = (uint4*)(out + r * cols + blk * 256 + 64 * p + 16 * h);
    o[0] = make_uint4(lo[0], lo[1], lo[2], lo[3]);
    o[1] = make_uint4(lo[4], lo[5], lo[6], lo[7]);
    o[4] = make_uint4(hi[0], hi[1], hi[2], hi[3]);  // 32 values further on
    o[5] = make_uint4(hi[4], hi[5], hi[6], hi[7]);
}

extern "C" __global__ void dequant_f16_q6_k(const u8* w, u16* out, int rows, int cols,
                                            i64 row_bytes) { pdl_begin();
    const int units = cols / 256 * 8;
    const i64 idx = blockIdx.x * (i64)blockDim.x + threadIdx.x;
    if (idx >= (i64)rows * units) return;
    const i64 r = idx / units;
    const int u = idx % units, blk = u >> 3, hh = (u >> 2) & 1, lr = u & 3;
    const u8* base = w + r * row_bytes + blk * 210;
    const u8* ql = base + 64 * hh + 8 * lr;
    const u8* qh = base + 128 + 32 * hh + 8 * lr;
    const signed char* sc = (const signed char*)(base + 192 + 8 * hh + lr / 2);
    const float d = h2f(ld16(base + 208));
#pragma unroll
    for (int g = 0; g < 4; g++) {
        const float dg = __fmul_rn(d, (float)sc[2 * g]);
        u32 v[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            float f[2];
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int l = 2 * i + e;
                const int low = (ql[32 * (g & 1) + l] >> (4 * (g >> 1))) & 0xF;
                const int high = (qh[l] >> (2 * g)) & 3;
                f[e] = __fmul_rn(dg, (float)((low | (high << 4)) - 32));
            }
            v[i] = pack2(f[0], f[1]);
        }
        *(uint4*)(out + r * cols + blk * 256 + 128 * hh + 32 * g + 8 * lr) =
            make_uint4(v[0], v[1], v[2], v[3]);
    }
}

extern "C" __global__ void dequant_f16_q8_0(const u8* w, u16* out, int rows, int cols,
                                            i64 row_bytes) { pdl_begin();
    const int nb = cols / 32;
    const i64 idx = blockIdx.x * (i64)blockDim.x + threadIdx.x;
    if (idx >= (i64)rows * nb) return;
    const i64 r = idx / nb;
    const int blk = idx % nb;
    const u8* base = w + r * row_bytes + blk * 34;
    const float d = h2f(ld16(base));
    uint4* o = (uint4*)(out + r * cols + blk * 32);
#pragma unroll
    for (int k = 0; k < 4; k++) {
        u32 v[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int e = 8 * k + 2 * i;
            v[i] = pack2(__fmul_rn((float)(signed char)base[2 + e], d),
                         __fmul_rn((float)(signed char)base[3 + e], d));
        }
        o[k] = make_uint4(v[0], v[1], v[2], v[3]);
    }
}
