// Quantized weights times 1..64 activation rows on integer tensor cores (MMQ): out[n][row] =
// x[n] . W[row] for W in Q4_K, Q6_K or Q8_0, against activations quantized to int8 blocks of 32
// exactly as gemv.cu's quantize_x_q8 does (same integers, same f32 scales d and sums d * sum(q)),
// so the result is the int8 GEMV's to float rounding:
//   sum_e w_e x_e = sum_32-blocks xd * d * scale * sum_int(q_e * xq_e) - dmin * min * xs   (Q4_K)
// with the integer sums from mma.sync m16n8k32 s8 (one 32-wide block per instruction).
//
// Operands. A = 16 weight rows x 32 k (row-major), B = 32 k x 8 activation rows (column-major:
// each activation row's 32 k contiguous, as x is stored), C = 16 weight rows x 8 activation rows.
// Fragment layout of mma.m16n8k32 .s8 (PTX ISA, "Matrix Fragments for mma.m16n8k32"), lane =
// 4 g + t (g = groupID = lane >> 2, t = threadID_in_group = lane % 4), byte j of a register is
// element j (low first):
//   A: a0 = row g,   k 4t..4t+3      a1 = row g+8, k 4t..4t+3
//      a2 = row g,   k 16+4t..+3     a3 = row g+8, k 16+4t..+3
//   B: b0 = col g,   k 4t..4t+3      b1 = col g,   k 16+4t..+3
//   C: c0, c1 = row g, cols 2t, 2t+1    c2, c3 = row g+8, cols 2t, 2t+1
// A dot product does not depend on the order of k, so A and B take the same permutation of the
// block's 32 positions: logical k 4t+j is stored value 8t+j, logical 16+4t+j is value 8t+4+j.
// Then lane t's A and B registers are the stored bytes 8t..8t+7 of their row (one 8-byte load
// each), and in Q6_K (one scale per 16 values) lanes t < 2 hold the first 16 values of a block
// and lanes t >= 2 the second 16.
//
// Tiling. A block of 4 or 8 warps owns two 16-row weight tiles (32 consecutive rows, or for
// gate+up 16 rows of each, so act(gate) * up is formed in registers) and every activation row
// (NT tiles of 8); the warps split the columns (warp w takes super-blocks w, w + warps, ... of
// 256, or 32-blocks for Q8_0) and their partial tiles are summed in shared memory in a fixed
// order. Each thread builds its A fragments from the packed blocks in global memory (unpacking
// 4/6-bit values to int8 in registers), so every weight byte is read once per call;
// activations and their scales are re-read by each block from L2.
//
//   xq: i8  [np][cols]           rows n..np zero (np = n rounded up to 8)
//   ds: f32 [cols / 32][np][2]   (d, d * sum(q)) per block of 32, activation rows adjacent

// Weight type codes (cuda/mmq.rs `mmq_type`).
#define MMQ_Q4_K 0
#define MMQ_Q6_K 1
#define MMQ_Q8_0 2

// x as int8 blocks of 32 in the layout above (common.cuh's q8_quantize, as gemv.cu's
// quantize_x_q8; one warp per block), rows n..np zero.
extern "C" __global__ void mmq_quantize(const float* x, signed char* xq, float2* ds, int n,
                                        int np, int cols) {
    pdl_begin();
    const int nkb = cols >> 5;
    const i64 blk = (blockIdx.x * (i64)blockDim.x + threadIdx.x) >> 5;  // [row][kb] order
    const int lane = threadIdx.x & 31;
    if (blk >= (i64)np * nkb) return;  // whole warps: the grid is a multiple of 32 threads
    const int row = (int)(blk / nkb), kb = (int)(blk % nkb);
    const float v = row < n ? x[blk * 32 + lane] : 0.f;
    float d, s;
    xq[blk * 32 + lane] = (signed char)q8_quantize(v, d, s);
    if (lane == 0) ds[(i64)kb * np + row] = make_float2(d, s);
}

// c += A . B on the tensor cores (registers as in the layout above). Before sm_80 there is no
// int8 mma: cuda/mmq.rs never launches these kernels there, and a launch would trap.
__device__ __forceinline__ void mma_s8(int (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0,
                                       u32 b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
    __trap();
#endif
}

// Up to three matrices of one width against the same activations (Q, K, V), out_i = x . W_i^T:
// the first ceil(r0 / 32) blocks serve W0, the next ceil(r1 / 32) W1, the rest W2 (rows 0 for
// absent ones). For gate+up (act >= 0) w0 is the gate, w1 the up matrix (type t0, rows r0,
// output o0), and every block serves 16 rows of both. Fields, not arrays: a kernel parameter
// indexed at run time would be copied to the stack.
struct MmqMats {
    const u8 *w0, *w1, *w2;
    float *o0, *o1, *o2;
    int t0, t1, t2, r0, r1, r2;
    int accumulate;  // out_i += x . W_i^T (a residual add folded in; not with gate+up)
};

// A thread's place: lane parts g and t, its warp, and its block's two 16-row weight tiles
// (matrix and first row of each): rows 32b.. and 32b+16.. of one matrix, or for gate+up rows
// 16b.. of the gate and of the up matrix, so one thread holds both factors of its outputs.
struct MmqLane {
    int g, t, warp;
    const u8* w[2];
    int row0[2];
    int type, rows;  // of the block's matrix
    float* out;
};

__device__ __forceinline__ MmqLane mmq_lane(const MmqMats& m, int act) {
    MmqLane l;
    const int lane = threadIdx.x & 31;
    l.g = lane >> 2;
    l.t = lane & 3;
    l.warp = threadIdx.x >> 5;
    int b = blockIdx.x;
    if (act >= 0) {
        l.w[0] = m.w0;
        l.w[1] = m.w1;
        l.row0[0] = l.row0[1] = 16 * b;
        l.type = m.t0; l.rows = m.r0; l.out = m.o0;
        return l;
    }
    const int b0 = (m.r0 + 31) >> 5, b1 = (m.r1 + 31) >> 5;
    const u8* w;
    if (b < b0) {
        w = m.w0; l.type = m.t0; l.rows = m.r0; l.out = m.o0;
    } else if (b < b0 + b1) {
        b -= b0;
        w = m.w1; l.type = m.t1; l.rows = m.r1; l.out = m.o1;
    } else {
        b -= b0 + b1;
        w = m.w2; l.type = m.t2; l.rows = m.r2; l.out = m.o2;
    }
    l.w[0] = l.w[1] = w;
    l.row0[0] = 32 * b;
    l.row0[1] = 32 * b + 16;
    return l;
}

// Byte i of a Q4_K block's 12 scale bytes, from its 16-byte header (d, dmin, scales) in
// registers.
__device__ __forceinline__ u32 q4k_sbyte(uint4 hd, int i) {
    const u32 w = i < 4 ? hd.y : (i < 8 ? hd.z : hd.w);
    return (w >> (8 * (i & 3))) & 0xff;
}

// d * scale and dmin * min of Q4_K sub-block j (GGML's get_scale_min_k4).
__device__ __forceinline__ void q4k_scale_min(uint4 hd, int j, float& dsc, float& dmn) {
    u32 sc, m;
    if (j < 4) {
        sc = q4k_sbyte(hd, j) & 63;
        m = q4k_sbyte(hd, j + 4) & 63;
    } else {
        sc = (q4k_sbyte(hd, j + 4) & 0xF) | ((q4k_sbyte(hd, j - 4) >> 6) << 4);
        m = (q4k_sbyte(hd, j + 4) >> 4) | ((q4k_sbyte(hd, j) >> 6) << 4);
    }
    dsc = __fmul_rn(h2f(hd.x & 0xffff), (float)sc);
    dmn = __fmul_rn(h2f(hd.x >> 16), (float)m);
}

// The activation side of 32-block kb for n-tile nt: lane (g, t)'s B registers (stored bytes
// 8t..8t+7 of activation row 8 nt + g) and (d, s) of activation rows 8 nt + 2t and 8 nt + 2t + 1.
__device__ __forceinline__ void mmq_acts(const signed char* xq, const float2* ds, int cols,
                                         int np, int kb, int nt, const MmqLane& l, uint2& b,
                                         float4& s) {
    b = *(const uint2*)(xq + (i64)(8 * nt + l.g) * cols + 32 * kb + 8 * l.t);
    s = *(const float4*)(ds + (i64)kb * np + 8 * nt + 2 * l.t);
}

// One mma per (n-tile, weight tile) for 32-block kb of the activations, against the A
// registers `a`; fold(mt, c, s, o) adds the integer sums c, scaled, to accumulator tile o (s:
// mmq_acts's d and d * sum(q) of the lane's two activation rows).
template <int MT, int NT, class Fold>
__device__ __forceinline__ void mmq_mma_tiles(const signed char* xq, const float2* ds, int cols,
                                              int np, int kb, const MmqLane& l,
                                              const u32 (&a)[MT][4], float (&acc)[MT][NT][4],
                                              Fold fold) {
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        uint2 b;
        float4 s;
        mmq_acts(xq, ds, cols, np, kb, nt, l, b, s);
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            int c[4] = {0, 0, 0, 0};
            mma_s8(c, a[mt][0], a[mt][1], a[mt][2], a[mt][3], b.x, b.y);
            fold(mt, c, s, acc[mt][nt]);
        }
    }
}

// Q4_K: per super-block of 256, lane t's 8 bytes at qs[32p + 8t] hold stored values 8t..8t+7 of
// sub-block 2p (low nibbles) and of sub-block 2p+1 (high nibbles).
template <int MT, int NT, int WARPS>
__device__ __forceinline__ void mmq_q4_k(const signed char* xq, const float2* ds,
                                         int rows, int cols, int np, const MmqLane& l,
                                         float (&acc)[MT][NT][4]) {
    const int nsb = cols >> 8;
    const i64 rbytes = (i64)nsb * 144;
    for (int sb = l.warp; sb < nsb; sb += WARPS) {
        uint4 hd[MT][2];
        uint2 qs[MT][2][4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int r = min(l.row0[mt] + 8 * h + l.g, rows - 1);
                const u8* base = l.w[mt] + r * rbytes + sb * 144;
                if (l.t == 0 && sb + WARPS < nsb) {
                    prefetch_l2(base + WARPS * 144);
                    prefetch_l2(base + WARPS * 144 + 143);
                }
                hd[mt][h] = *(const uint4*)base;
#pragma unroll
                for (int p = 0; p < 4; p++) qs[mt][h][p] = *(const uint2*)(base + 16 + 32 * p + 8 * l.t);
            }
        }
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const int p = j >> 1, sh = 4 * (j & 1), kb = 8 * sb + j;
            u32 a[MT][4];
            float dsc[MT][2], dmn[MT][2];
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                a[mt][0] = (qs[mt][0][p].x >> sh) & 0x0F0F0F0F;
                a[mt][1] = (qs[mt][1][p].x >> sh) & 0x0F0F0F0F;
                a[mt][2] = (qs[mt][0][p].y >> sh) & 0x0F0F0F0F;
                a[mt][3] = (qs[mt][1][p].y >> sh) & 0x0F0F0F0F;
                q4k_scale_min(hd[mt][0], j, dsc[mt][0], dmn[mt][0]);
                q4k_scale_min(hd[mt][1], j, dsc[mt][1], dmn[mt][1]);
            }
            mmq_mma_tiles<MT, NT>(xq, ds, cols, np, kb, l, a, acc,
                                  [&](int mt, const int (&c)[4], float4 s, float* o) {
                                      o[0] += dsc[mt][0] * s.x * (float)c[0] - dmn[mt][0] * s.y;
                                      o[1] += dsc[mt][0] * s.z * (float)c[1] - dmn[mt][0] * s.w;
                                      o[2] += dsc[mt][1] * s.x * (float)c[2] - dmn[mt][1] * s.y;
                                      o[3] += dsc[mt][1] * s.z * (float)c[3] - dmn[mt][1] * s.w;
                                  });
        }
    }
}

// 8 bytes from a 2-byte aligned address (Q6_K and Q8_0 blocks).
__device__ __forceinline__ uint2 ld64_a2(const u8* p) {
    return make_uint2(ld32_a2(p), ld32_a2(p + 4));
}

// Per byte v - 32 without borrows between bytes (v <= 63), as gemv.cu's q6k_unit.
__device__ __forceinline__ u32 q6k_bias(u32 v) {
    return ((v | 0x80808080) - 0x20202020) ^ 0x80808080;
}

// Q6_K: in half hh of a super-block, 32-block q (0..3) holds values l = 0..31 with low bits
// (ql[64hh + 32(q & 1) + l] >> 4(q >> 1)) & 15, high bits (qh[32hh + l] >> 2q) & 3, and scales
// sc[8hh + 2q] (l < 16) and sc[8hh + 2q + 1]. Lane t's stored values are l = 8t..8t+7, so one
// scale per lane: two mma per block, each with the other half's lanes zeroed, and the integer
// sums combined with their scales before the one float multiply.
template <int MT, int NT, int WARPS>
__device__ __forceinline__ void mmq_q6_k(const signed char* xq, const float2* ds,
                                         int rows, int cols, int np, const MmqLane& l,
                                         float (&acc)[MT][NT][4]) {
    const int nsb = cols >> 8;
    const i64 rbytes = (i64)nsb * 210;
    const bool lo16 = l.t < 2;
    for (int sb = l.warp; sb < nsb; sb += WARPS) {
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            uint2 ql0[MT][2], ql1[MT][2], qh[MT][2];
            u32 sc[MT][2][2];  // scale bytes 8hh..8hh+7 of rows g and g+8
            float d[MT][2];
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int r = min(l.row0[mt] + 8 * h + l.g, rows - 1);
                    const u8* base = l.w[mt] + r * rbytes + sb * 210;
                    if (hh == 0 && l.t == 0 && sb + WARPS < nsb) {
                        prefetch_l2(base + WARPS * 210);
                        prefetch_l2(base + WARPS * 210 + 128);
                        prefetch_l2(base + WARPS * 210 + 209);
                    }
                    ql0[mt][h] = ld64_a2(base + 64 * hh + 8 * l.t);
                    ql1[mt][h] = ld64_a2(base + 64 * hh + 32 + 8 * l.t);
                    qh[mt][h] = ld64_a2(base + 128 + 32 * hh + 8 * l.t);
                    sc[mt][h][0] = ld32_a2(base + 192 + 8 * hh);
                    sc[mt][h][1] = ld32_a2(base + 196 + 8 * hh);
                    d[mt][h] = h2f(ld16(base + 208));
                }
            }
#pragma unroll
            for (int q = 0; q < 4; q++) {
                const int kb = 8 * sb + 4 * hh + q, sh = 4 * (q >> 1);
                u32 a[MT][4];
                int s0[MT][2], s1[MT][2];
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        const uint2 w = (q & 1) ? ql1[mt][h] : ql0[mt][h];
                        const u32 vx = ((w.x >> sh) & 0x0F0F0F0F) |
                                       (((qh[mt][h].x >> (2 * q)) & 0x03030303) << 4);
                        const u32 vy = ((w.y >> sh) & 0x0F0F0F0F) |
                                       (((qh[mt][h].y >> (2 * q)) & 0x03030303) << 4);
                        a[mt][h] = q6k_bias(vx);      // a0 (row g), a1 (row g+8)
                        a[mt][2 + h] = q6k_bias(vy);  // a2, a3
                        // Scale bytes 2q and 2q+1 of the eight, sign-extended.
                        const u32 sw = sc[mt][h][q >> 1] >> (16 * (q & 1));
                        s0[mt][h] = (int)(signed char)(sw & 0xff);
                        s1[mt][h] = (int)(signed char)((sw >> 8) & 0xff);
                    }
                }
#pragma unroll
                for (int nt = 0; nt < NT; nt++) {
                    uint2 b;
                    float4 s;
                    mmq_acts(xq, ds, cols, np, kb, nt, l, b, s);
                    const u32 b0 = lo16 ? b.x : 0u, b1 = lo16 ? b.y : 0u;
                    const u32 e0 = lo16 ? 0u : b.x, e1 = lo16 ? 0u : b.y;
#pragma unroll
                    for (int mt = 0; mt < MT; mt++) {
                        int c0[4] = {0, 0, 0, 0}, c1[4] = {0, 0, 0, 0};
                        // Zeroing B's lanes selects the half as well as zeroing A's would.
                        mma_s8(c0, a[mt][0], a[mt][1], a[mt][2], a[mt][3], b0, b1);
                        mma_s8(c1, a[mt][0], a[mt][1], a[mt][2], a[mt][3], e0, e1);
                        float* o = acc[mt][nt];
                        o[0] += d[mt][0] * s.x * (float)(s0[mt][0] * c0[0] + s1[mt][0] * c1[0]);
                        o[1] += d[mt][0] * s.z * (float)(s0[mt][0] * c0[1] + s1[mt][0] * c1[1]);
                        o[2] += d[mt][1] * s.x * (float)(s0[mt][1] * c0[2] + s1[mt][1] * c1[2]);
                        o[3] += d[mt][1] * s.z * (float)(s0[mt][1] * c0[3] + s1[mt][1] * c1[3]);
                    }
                }
            }
        }
    }
}

// Q8_0: one 34-byte block (f16 d, 32 int8) per 32 columns; warps take blocks w, w+4, ...
template <int MT, int NT, int WARPS>
__device__ __forceinline__ void mmq_q8_0(const signed char* xq, const float2* ds,
                                         int rows, int cols, int np, const MmqLane& l,
                                         float (&acc)[MT][NT][4]) {
    const int nkb = cols >> 5;
    const i64 rbytes = (i64)nkb * 34;
#pragma unroll 2
    for (int kb = l.warp; kb < nkb; kb += WARPS) {
        u32 a[MT][4];
        float d[MT][2];
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int r = min(l.row0[mt] + 8 * h + l.g, rows - 1);
                const u8* base = l.w[mt] + r * rbytes + kb * 34;
                if (l.t == 0 && kb + 2 * WARPS < nkb) prefetch_l2(base + 2 * WARPS * 34);
                const uint2 w = ld64_a2(base + 2 + 8 * l.t);
                a[mt][h] = w.x;
                a[mt][2 + h] = w.y;
                d[mt][h] = h2f(ld16(base));
            }
        }
        mmq_mma_tiles<MT, NT>(xq, ds, cols, np, kb, l, a, acc,
                              [&](int mt, const int (&c)[4], float4 s, float* o) {
                                  o[0] += d[mt][0] * s.x * (float)c[0];
                                  o[1] += d[mt][0] * s.z * (float)c[1];
                                  o[2] += d[mt][1] * s.x * (float)c[2];
                                  o[3] += d[mt][1] * s.z * (float)c[3];
                              });
    }
}

__device__ __forceinline__ float mmq_act(float x, int act) {
    if (act == 0) return x / (1.0f + expf(-x));  // SiLU, as gemv.cu's gemv_silu
    const float C = 0.7978846f;                  // GELU tanh: sqrt(2/pi), as gemv_gelu_tanh
    return 0.5f * x * (1.0f + tanhf(C * (x + 0.044715f * x * x * x)));
}

// Element k = (mt * NT + nt) * 4 + e of the accumulator tiles (k a constant once unrolled).
template <int NT>
__device__ __forceinline__ float& mmq_acc(float (&acc)[2][NT][4], int k) {
    return acc[k / (4 * NT)][k / 4 % NT][k % 4];
}

// Sums the warps' partial tiles in a fixed order and stores them. With 8 warps, warps 4..7 first
// hand theirs to warps 0..3 (w + 4 to w). Then warp w (< 4) finishes accumulator element w of
// every (mt, nt), summing warps 0..3 in order (element e: row g + 8 (e >> 1), activation row
// 2t + (e & 1)), and writes it (adds it to out with `accumulate`), or for gate+up (act >= 0)
// act(gate) * up from the two tiles. 32 KB of shared memory at MT * NT = 16.
template <int NT, int WARPS>
__device__ __forceinline__ void mmq_store(float (&acc)[2][NT][4], float* out, int rows, int n,
                                          int act, int accumulate, const MmqLane& l) {
    static_assert(WARPS == 4 || WARPS == 8, "4 or 8 warps");
    __shared__ float red[4][2 * NT * 4][32];
    const int lane = threadIdx.x & 31;
    // red's second index k is accumulator element (mt * NT + nt) * 4 + e.
    if (WARPS == 8) {
        if (l.warp >= 4) {
#pragma unroll
            for (int k = 0; k < 8 * NT; k++) red[l.warp - 4][k][lane] = mmq_acc(acc, k);
        }
        __syncthreads();
        if (l.warp < 4) {
#pragma unroll
            for (int k = 0; k < 8 * NT; k++) mmq_acc(acc, k) += red[l.warp][k][lane];
        }
        __syncthreads();
    }
    if (l.warp < 4) {
#pragma unroll
        for (int k = 0; k < 8 * NT; k++) red[l.warp][k][lane] = mmq_acc(acc, k);
    }
    __syncthreads();
    if (l.warp >= 4) return;
    const int e = l.warp;  // 4 finishing warps, 4 accumulator elements per (mt, nt)
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        float v[2];
#pragma unroll
        for (int mt = 0; mt < 2; mt++) {
            const int i = (mt * NT + nt) * 4 + e;
            v[mt] = ((red[0][i][lane] + red[1][i][lane]) + red[2][i][lane]) + red[3][i][lane];
        }
        const int col = 8 * nt + 2 * l.t + (e & 1);
        if (col >= n) continue;
        if (act >= 0) {
            const int row = l.row0[0] + l.g + 8 * (e >> 1);
            if (row < rows) out[(i64)col * rows + row] = mmq_act(v[0], act) * v[1];
        } else {
#pragma unroll
            for (int mt = 0; mt < 2; mt++) {
                const int row = l.row0[mt] + l.g + 8 * (e >> 1);
                if (row < rows) {
                    float* o = out + (i64)col * rows + row;
                    *o = accumulate ? *o + v[mt] : v[mt];
                }
            }
        }
    }
}

// One launch: the block's matrix type (uniform over the block, one branch) picks the weight
// decoder; act < 0: out_i = x . W_i^T, else out = act(x . gate^T) * (x . up^T) (act 0 = SiLU,
// 1 = GELU tanh).
template <int NT, int WARPS>
__device__ __forceinline__ void mmq(const MmqMats& m, const signed char* xq, const float2* ds,
                                    int cols, int n, int np, int act) {
    const MmqLane l = mmq_lane(m, act);
    const int type = l.type, rows = l.rows;
    float acc[2][NT][4] = {};
    if (type == MMQ_Q4_K) mmq_q4_k<2, NT, WARPS>(xq, ds, rows, cols, np, l, acc);
    else if (type == MMQ_Q6_K) mmq_q6_k<2, NT, WARPS>(xq, ds, rows, cols, np, l, acc);
    else mmq_q8_0<2, NT, WARPS>(xq, ds, rows, cols, np, l, acc);
    mmq_store<NT, WARPS>(acc, l.out, rows, n, act, m.accumulate, l);
}

// mmq_w<WARPS>_<NT>: activation rows 8 (NT - 1) + 1 ..= 8 NT, two 16-row weight tiles per block
// (32 rows of one of up to three matrices; or 16 rows of gate and of up), the columns split over 4 or 8 warps
// (8: twice the warps in flight per block, for wide matrices; cuda/mmq.rs picks). Up to 64 rows
// only, as matmul.rs's path choice: with kernels of one 16-row tile for 65..128 rows (NT 9..16
// at the same 64 accumulator registers) NVRTC took 25 s for the 4-warp kernels instead of 4 s
// (scripts/nvrtc_check.py on the shared 2-core build machine), a start-up cost for every server.
#define MMQ(WARPS, NT)                                                                         \
    extern "C" __global__ void __launch_bounds__(32 * WARPS) mmq_w##WARPS##_##NT(              \
        MmqMats m, const signed char* xq, const float2* ds, int cols, int n, int np, int act) { \
        pdl_begin();                                                                           \
        mmq<NT, WARPS>(m, xq, ds, cols, n, np, act);                                           \
    }
#define MMQ_BOTH(NT) MMQ(4, NT) MMQ(8, NT)

MMQ_BOTH(1)
MMQ_BOTH(2)
MMQ_BOTH(3)
MMQ_BOTH(4)
MMQ_BOTH(5)
MMQ_BOTH(6)
MMQ_BOTH(7)
MMQ_BOTH(8)
