// Matrix-vector products for decode and small batches: out[b][row] = x[b] . W[row] for N <= 8
// activation rows, one block of 128 threads per weight row, every weight byte read once and
// used for all N rows.
//
// Quantized weights are read in their GGML blocks. Activations are first quantized to int16 in
// blocks of 32 (scale xd, exact f32 sum xs), so a weight block's dot is integer dp2a work:
//   sum_e w_e x_e = sum_sub xd_sub * d * scale_sub * sum_int(q_e * xq_e)  - dmin * min_sub * xs_sub
// int16 keeps the activation error near 1e-5, far inside a 1e-3 budget, while the inner loop
// stays a few integer ops per 8 weights (memory-bound on an H200).
//
// Work unit of one thread (U = units per weight block):
//   Q4_K (144 B, U = 8): 16 qs bytes = 16 weights of sub-block 2p (low nibbles) and of 2p+1 (high)
//   Q6_K (210 B, U = 8): 8 columns l of half hh, in all 4 quarter-groups g = 32 weights
//   Q8_0 ( 34 B, U = 4): 8 int8 weights
//   bf16/f16 (U = cols/8 per row): 8 weights (one 16-byte load)

#define GEMV_THREADS 128

// Quantizes x (rows of `cols`, a multiple of 32) in blocks of 32: one warp per block.
extern "C" __global__ void quantize_x_i16(const float* x, short* xq, float* xd, float* xs,
                                          i64 nblocks) {
    const i64 blk = (blockIdx.x * (i64)blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (blk >= nblocks) return;
    const float v = x[blk * 32 + lane];
    const float amax = warp_max(fabsf(v));
    const float sum = warp_sum(v);
    const float inv = amax > 0.f ? 32767.0f / amax : 0.f;
    xq[blk * 32 + lane] = (short)__float2int_rn(v * inv);
    if (lane == 0) {
        xd[blk] = amax / 32767.0f;
        xs[blk] = sum;
    }
}

template <int N>
__device__ __forceinline__ void gemv_finish(float (&acc)[N], float* out, int rows, int row) {
    __shared__ float sh[N][GEMV_THREADS / 32];
    const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
#pragma unroll
    for (int b = 0; b < N; b++) {
        const float v = warp_sum(acc[b]);
        if (l == 0) sh[b][w] = v;
    }
    __syncthreads();
    if (threadIdx.x < N) {
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < GEMV_THREADS / 32; i++) s += sh[threadIdx.x][i];
        out[(i64)threadIdx.x * rows + row] = s;
    }
}

// Four int16 pairs against four signed bytes each: x[0..8) . w (two words).
__device__ __forceinline__ int dot8(int4 x, u32 wa, u32 wb) {
    int s = dp2a_lo(x.x, (int)wa, 0);
    s = dp2a_hi(x.y, (int)wa, s);
    s = dp2a_lo(x.z, (int)wb, s);
    return dp2a_hi(x.w, (int)wb, s);
}

template <int N>
__device__ void gemv_q4_k(const u8* W, const short* xq, const float* xd, const float* xs,
                          float* out, int rows, int cols) {
    const int row = blockIdx.x, nb = cols / 256, xbr = cols / 32;
    const u8* wr = W + (i64)row * nb * 144;
    float acc[N];
#pragma unroll
    for (int b = 0; b < N; b++) acc[b] = 0.f;
#pragma unroll 2
    for (int u = threadIdx.x; u < nb * 8; u += GEMV_THREADS) {
        const int blk = u >> 3, p = (u >> 1) & 3, h = u & 1;
        const u8* base = wr + blk * 144;
        const uint4 q = *(const uint4*)(base + 16 + 32 * p + 16 * h);
        const u32 dm = *(const u32*)base;
        const float d = h2f(dm & 0xffff), dmin = h2f(dm >> 16);
        const u8* s = base + 4;
        const int j0 = 2 * p, j1 = j0 + 1;
        int sc0, m0, sc1, m1;
        if (p < 2) {
            sc0 = s[j0] & 63; m0 = s[j0 + 4] & 63;
            sc1 = s[j1] & 63; m1 = s[j1 + 4] & 63;
        } else {
            sc0 = (s[j0 + 4] & 0xF) | ((s[j0 - 4] >> 6) << 4);
            m0 = (s[j0 + 4] >> 4) | ((s[j0] >> 6) << 4);
            sc1 = (s[j1 + 4] & 0xF) | ((s[j1 - 4] >> 6) << 4);
            m1 = (s[j1 + 4] >> 4) | ((s[j1] >> 6) << 4);
        }
        const u32 lo0 = q.x & 0x0F0F0F0F, lo1 = q.y & 0x0F0F0F0F;
        const u32 lo2 = q.z & 0x0F0F0F0F, lo3 = q.w & 0x0F0F0F0F;
        const u32 hi0 = (q.x >> 4) & 0x0F0F0F0F, hi1 = (q.y >> 4) & 0x0F0F0F0F;
        const u32 hi2 = (q.z >> 4) & 0x0F0F0F0F, hi3 = (q.w >> 4) & 0x0F0F0F0F;
        const int c0 = blk * 256 + 32 * j0 + 16 * h;
        const float d0 = d * (float)sc0, d1 = d * (float)sc1;
        const float mm0 = dmin * (float)m0, mm1 = dmin * (float)m1;
#pragma unroll
        for (int b = 0; b < N; b++) {
            const int4* xa = (const int4*)(xq + (i64)b * cols + c0);
            const int4* xb = (const int4*)(xq + (i64)b * cols + c0 + 32);
            const int s0 = dot8(xa[0], lo0, lo1) + dot8(xa[1], lo2, lo3);
            const int s1 = dot8(xb[0], hi0, hi1) + dot8(xb[1], hi2, hi3);
            const int jb = b * xbr + blk * 8 + j0;
            float a = xd[jb] * d0 * (float)s0 + xd[jb + 1] * d1 * (float)s1;
            // The min term needs the whole sub-block's sum: the h = 0 half adds it.
            if (h == 0) a -= mm0 * xs[jb] + mm1 * xs[jb + 1];
            acc[b] += a;
        }
    }
    gemv_finish<N>(acc, out, rows, row);
}

template <int N>
__device__ void gemv_q6_k(const u8* W, const short* xq, const float* xd, const float* xs,
                          float* out, int rows, int cols) {
    const int row = blockIdx.x, nb = cols / 256, xbr = cols / 32;
    const u8* wr = W + (i64)row * nb * 210;
    float acc[N];
#pragma unroll
    for (int b = 0; b < N; b++) acc[b] = 0.f;
#pragma unroll 2
    for (int u = threadIdx.x; u < nb * 8; u += GEMV_THREADS) {
        const int blk = u >> 3, hh = (u >> 2) & 1, lr = u & 3;
        const u8* base = wr + blk * 210;
        const u8* ql = base + 64 * hh + 8 * lr;
        const u8* qh = base + 128 + 32 * hh + 8 * lr;
        const u32 q0a = ld32_a2(ql), q0b = ld32_a2(ql + 4);
        const u32 q1a = ld32_a2(ql + 32), q1b = ld32_a2(ql + 36);
        const u32 ha = ld32_a2(qh), hb = ld32_a2(qh + 4);
        const float d = h2f(ld16(base + 208));
        const signed char* sc = (const signed char*)(base + 192 + 8 * hh + lr / 2);
#pragma unroll
        for (int g = 0; g < 4; g++) {
            const int shift = 4 * (g >> 1);
            const u32 wa = (g & 1) ? q1a : q0a, wb = (g & 1) ? q1b : q0b;
            u32 va = ((wa >> shift) & 0x0F0F0F0F) | (((ha >> (2 * g)) & 0x03030303) << 4);
            u32 vb = ((wb >> shift) & 0x0F0F0F0F) | (((hb >> (2 * g)) & 0x03030303) << 4);
            // Per byte v - 32 without borrows between bytes (v <= 63).
            va = ((va | 0x80808080) - 0x20202020) ^ 0x80808080;
            vb = ((vb | 0x80808080) - 0x20202020) ^ 0x80808080;
            const int col = blk * 256 + 128 * hh + 32 * g + 8 * lr;
            const float dg = d * (float)sc[2 * g];
#pragma unroll
            for (int b = 0; b < N; b++) {
                const int4 xv = *(const int4*)(xq + (i64)b * cols + col);
                acc[b] += xd[b * xbr + blk * 8 + 4 * hh + g] * dg * (float)dot8(xv, va, vb);
            }
        }
    }
    gemv_finish<N>(acc, out, rows, row);
}

template <int N>
__device__ void gemv_q8_0(const u8* W, const short* xq, const float* xd, const float* xs,
                          float* out, int rows, int cols) {
    const int row = blockIdx.x, nb = cols / 32, xbr = cols / 32;
    const u8* wr = W + (i64)row * nb * 34;
    float acc[N];
#pragma unroll
    for (int b = 0; b < N; b++) acc[b] = 0.f;
#pragma unroll 4
    for (int u = threadIdx.x; u < nb * 4; u += GEMV_THREADS) {
        const int blk = u >> 2, k = u & 3;
        const u8* base = wr + blk * 34;
        const float d = h2f(ld16(base));
        const u32 wa = ld32_a2(base + 2 + 8 * k), wb = ld32_a2(base + 6 + 8 * k);
        const int col = blk * 32 + 8 * k;
#pragma unroll
        for (int b = 0; b < N; b++) {
            const int4 xv = *(const int4*)(xq + (i64)b * cols + col);
            acc[b] += xd[b * xbr + blk] * d * (float)dot8(xv, wa, wb);
        }
    }
    gemv_finish<N>(acc, out, rows, row);
}

template <int N, bool BF16>
__device__ void gemv_half(const u16* W, const float* x, float* out, int rows, int cols) {
    const int row = blockIdx.x;
    const uint4* wr = (const uint4*)(W + (i64)row * cols);
    float acc[N];
#pragma unroll
    for (int b = 0; b < N; b++) acc[b] = 0.f;
#pragma unroll 2
    for (int u = threadIdx.x; u < cols / 8; u += GEMV_THREADS) {
        const uint4 q = wr[u];
        const u32 ws[4] = {q.x, q.y, q.z, q.w};
        float w[8];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            if (BF16) {
                w[2 * i] = __uint_as_float(ws[i] << 16);
                w[2 * i + 1] = __uint_as_float(ws[i] & 0xffff0000u);
            } else {
                w[2 * i] = h2f((u16)(ws[i] & 0xffff));
                w[2 * i + 1] = h2f((u16)(ws[i] >> 16));
            }
        }
#pragma unroll
        for (int b = 0; b < N; b++) {
            const float4* xv = (const float4*)(x + (i64)b * cols + 8 * u);
            const float4 a = xv[0], c = xv[1];
            acc[b] += w[0] * a.x + w[1] * a.y + w[2] * a.z + w[3] * a.w + w[4] * c.x +
                      w[5] * c.y + w[6] * c.z + w[7] * c.w;
        }
    }
    gemv_finish<N>(acc, out, rows, row);
}

#define GEMV_Q(T, N)                                                                           \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS)                                 \
        gemv_##T##_##N(const u8* W, const short* xq, const float* xd, const float* xs,         \
                       float* out, int rows, int cols) {                                       \
        gemv_##T<N>(W, xq, xd, xs, out, rows, cols);                                           \
    }
#define GEMV_H(NAME, BF, N)                                                                    \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS)                                 \
        gemv_##NAME##_##N(const u16* W, const float* x, float* out, int rows, int cols) {      \
        gemv_half<N, BF>(W, x, out, rows, cols);                                               \
    }
#define GEMV_ALL(N)                                                                            \
    GEMV_Q(q4_k, N) GEMV_Q(q6_k, N) GEMV_Q(q8_0, N) GEMV_H(bf16, true, N) GEMV_H(f16, false, N)

GEMV_ALL(1)
GEMV_ALL(2)
GEMV_ALL(3)
GEMV_ALL(4)
GEMV_ALL(5)
GEMV_ALL(6)
GEMV_ALL(7)
GEMV_ALL(8)
