// Per-row and element-wise ops of a transformer layer on f32 activations and embedding
// lookups. Formulas follow afm_runtime::ops and quant:: dequantize_row; where the
// CPU result is bit-exact (RoPE, dequantization) each product and FMA is spelled out
// (__fmul_rn, __fmaf_rn) as the CPU forms it, so the compiler cannot contract differently.

// RMSNorm: x += res (when res is given, written back), then out = x / rms(x) * w.
// Latency-bound at decode (one row, a few KB), so every load of a row is issued before any
// store: a thread holds its part of x, res and w in registers from the sum to the scale, and
// the row is read once. With `v4` (the host checked d % 4 == 0 and 16-byte alignment) a unit
// is a float4, else one float. out may be x (in place); res and w alias neither.
#define NORM_FLOATS 16  // floats per thread held in registers (more: the row goes in chunks)

template <int V>
__device__ __forceinline__ void norm_ld(const float* p, float (&u)[V]) {
    if constexpr (V == 4) {
        const float4 f = *(const float4*)p;
        u[0] = f.x; u[1] = f.y; u[2] = f.z; u[3] = f.w;
    } else {
        u[0] = *p;
    }
}

template <int V>
__device__ __forceinline__ void norm_st(float* p, const float (&u)[V]) {
    if constexpr (V == 4) *(float4*)p = make_float4(u[0], u[1], u[2], u[3]);
    else *p = u[0];
}

// x += res over units [base + t, base + t + n, ...] (at most NU of them), written back when res
// is given; returns the thread's sum of squares. Loads first, then stores: they cannot alias.
template <int V>
__device__ __forceinline__ float norm_chunk(float* x, const float* __restrict__ res, int units,
                                            int base, int t, int n, float (&xv)[NORM_FLOATS / V][V]) {
    constexpr int NU = NORM_FLOATS / V;
    float rv[NU][V];
#pragma unroll
    for (int k = 0; k < NU; k++) {
        const int i = base + t + k * n;
        if (i < units) {
            norm_ld<V>(x + (i64)i * V, xv[k]);
            if (res) norm_ld<V>(res + (i64)i * V, rv[k]);
        }
    }
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < NU; k++) {
        const int i = base + t + k * n;
        if (i < units) {
            if (res) {
#pragma unroll
                for (int e = 0; e < V; e++) xv[k][e] += rv[k][e];
                norm_st<V>(x + (i64)i * V, xv[k]);
            }
#pragma unroll
            for (int e = 0; e < V; e++) ss = fmaf(xv[k][e], xv[k][e], ss);
        }
    }
    return ss;
}

// Stores V values of a row at unit i of `out`: f32 (OUT 0), or rounded to bf16 (OUT 1) or f16
// (OUT 2) as f32_to_bf16 / f32_to_f16 round, for a 16-bit GEMM that reads the normalized row
// (one launch instead of a norm and a conversion).
template <int V, int OUT>
__device__ __forceinline__ void norm_out(void* out, int i, const float (&o)[V]) {
    if constexpr (OUT == 0) {
        norm_st<V>((float*)out + (i64)i * V, o);
    } else {
        u16 h[V];
#pragma unroll
        for (int e = 0; e < V; e++) h[e] = OUT == 1 ? f2bf(o[e]) : f2h(o[e]);
        u16* p = (u16*)out + (i64)i * V;
        if constexpr (V == 4) *(uint2*)p = make_uint2(h[0] | (u32)h[1] << 16, h[2] | (u32)h[3] << 16);
        else *p = h[0];
    }
}

// out = xv * (inv * w) over the same units as norm_chunk.
template <int V, int OUT>
__device__ __forceinline__ void norm_scale(void* out, const float* __restrict__ w, int units,
                                           int base, int t, int n, float inv,
                                           const float (&xv)[NORM_FLOATS / V][V]) {
    constexpr int NU = NORM_FLOATS / V;
    float wv[NU][V];
#pragma unroll
    for (int k = 0; k < NU; k++) {
        const int i = base + t + k * n;
        if (i < units) norm_ld<V>(w + i * V, wv[k]);
    }
#pragma unroll
    for (int k = 0; k < NU; k++) {
        const int i = base + t + k * n;
        if (i < units) {
            float o[V];
#pragma unroll
            for (int e = 0; e < V; e++) o[e] = xv[k][e] * (inv * wv[k][e]);
            norm_out<V, OUT>(out, i, o);
        }
    }
}

// One row by thread t of n (a warp when sh is null, else the whole block, sh holding 32).
template <int V, int OUT = 0>
__device__ __forceinline__ void norm_row(float* x, const float* __restrict__ res,
                                         const float* __restrict__ w, void* out, int d,
                                         float eps, int t, int n, float* sh) {
    constexpr int NU = NORM_FLOATS / V;
    const int units = d / V, step = NU * n;
    float xv[NU][V];
    float ss = 0.f;
    for (int base = 0; base < units; base += step) ss += norm_chunk<V>(x, res, units, base, t, n, xv);
    ss = sh ? block_sum(ss, sh) : warp_sum(ss);
    const float inv = 1.0f / sqrtf(ss / (float)d + eps);
    if (units <= step) {  // the whole row is still in registers
        norm_scale<V, OUT>(out, w, units, 0, t, n, inv, xv);
        return;
    }
    for (int base = 0; base < units; base += step) {  // wider rows: read x (now summed) again
#pragma unroll
        for (int k = 0; k < NU; k++) {
            const int i = base + t + k * n;
            if (i < units) norm_ld<V>(x + (i64)i * V, xv[k]);
        }
        norm_scale<V, OUT>(out, w, units, base, t, n, inv, xv);
    }
}

// One warp per row (rows of up to 512 floats: 16 per lane, one pass).
extern "C" __global__ void rms_norm_warp(float* x, const float* res, const float* w, float* out,
                                         int rows, int d, float eps, int v4) { pdl_begin();
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= rows) return;
    const i64 o = (i64)row * d;
    const float* r = res ? res + o : nullptr;
    if (v4) norm_row<4>(x + o, r, w, out + o, d, eps, lane, 32, nullptr);
    else norm_row<1>(x + o, r, w, out + o, d, eps, lane, 32, nullptr);
}

// One block per row, for wide rows (the host sizes the block to the row).
extern "C" __global__ void __launch_bounds__(1024) rms_norm_block(float* x, const float* res, const float* w, float* out,
                                          int rows, int d, float eps, int v4) { pdl_begin();
    __shared__ float sh[32];
    const i64 o = (i64)blockIdx.x * d;
    const float* r = res ? res + o : nullptr;
    if (v4) norm_row<4>(x + o, r, w, out + o, d, eps, threadIdx.x, blockDim.x, sh);
    else norm_row<1>(x + o, r, w, out + o, d, eps, threadIdx.x, blockDim.x, sh);
}

// rms_norm_warp / rms_norm_block with the output rounded to 16 bits (ty 1 bf16, 2 f16): the
// input of the 16-bit cuBLAS GEMMs past the GEMV's rows, normalized and converted in one launch.
template <int OUT>
__device__ __forceinline__ void norm_row_h(float* x, const float* w, u16* out, int d, float eps,
                                           int t, int n, float* sh, int v4) {
    if (v4) norm_row<4, OUT>(x, nullptr, w, out, d, eps, t, n, sh);
    else norm_row<1, OUT>(x, nullptr, w, out, d, eps, t, n, sh);
}

extern "C" __global__ void rms_norm_warp_h(float* x, const float* w, u16* out, int rows, int d,
                                           float eps, int v4, int ty) { pdl_begin();
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= rows) return;
    const i64 o = (i64)row * d;
    if (ty == 1) norm_row_h<1>(x + o, w, out + o, d, eps, lane, 32, nullptr, v4);
    else norm_row_h<2>(x + o, w, out + o, d, eps, lane, 32, nullptr, v4);
}

extern "C" __global__ void __launch_bounds__(1024) rms_norm_block_h(float* x, const float* w,
        u16* out, int rows, int d, float eps, int v4, int ty) { pdl_begin();
    __shared__ float sh[32];
    const i64 o = (i64)blockIdx.x * d;
    if (ty == 1) norm_row_h<1>(x + o, w, out + o, d, eps, threadIdx.x, blockDim.x, sh, v4);
    else norm_row_h<2>(x + o, w, out + o, d, eps, threadIdx.x, blockDim.x, sh, v4);
}

// Rotates pairs of the first `dims` dimensions of every head in place. `cs` is the
// [max_pos][dims/2][cos, sin] table; `row_stride` is the distance between tokens in floats.
extern "C" __global__ void rope(float* x, const int* pos, const float* cs, int n_tokens,
                                int n_heads, int head_dim, int row_stride, int dims, int neox,
                                int max_pos) { pdl_begin();
    const int half = dims / 2;
    const i64 idx = blockIdx.x * (i64)blockDim.x + threadIdx.x;
    if (idx >= (i64)n_tokens * n_heads * half) return;
    const int i = idx % half;
    const int hd = (idx / half) % n_heads;
    const int t = idx / ((i64)half * n_heads);
    const int p = pos[t];
    if (p < 0 || p >= max_pos) return;
    const float c = cs[((i64)p * half + i) * 2], s = cs[((i64)p * half + i) * 2 + 1];
    float* h = x + (i64)t * row_stride + (i64)hd * head_dim;
    const int a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
    const float x0 = h[a], x1 = h[b];
    h[a] = __fmaf_rn(x0, c, -__fmul_rn(x1, s));
    h[b] = __fmaf_rn(x0, s, __fmul_rn(x1, c));
}

// out[r][c] = act(gate[r*stride + c]) * up[r*stride + c]; act 0 = SiLU, 1 = GELU (tanh).
// With v4 (the host checked ff and stride % 4 == 0, 16-byte alignment and n * ff / 4 < 2^31)
// a thread takes 4 columns in float4s, with 32-bit index arithmetic.
extern "C" __global__ void gated_act(const float* __restrict__ gate, const float* __restrict__ up,
                                     float* __restrict__ out, int n, int ff, int stride, int act,
                                     int v4) { pdl_begin();
    const i64 idx = blockIdx.x * (i64)blockDim.x + threadIdx.x;
    if (v4) {
        const u32 f4 = (u32)ff / 4, total = (u32)n * f4;
        if (idx >= (i64)total) return;
        const u32 r = (u32)idx / f4, c4 = (u32)idx - r * f4;
        const i64 at = (i64)r * stride + 4 * c4;
        const float4 g = *(const float4*)(gate + at), u = *(const float4*)(up + at);
        float4 o;
        o.x = (act == 0 ? silu_f(g.x) : gelu_tanh_f(g.x)) * u.x;
        o.y = (act == 0 ? silu_f(g.y) : gelu_tanh_f(g.y)) * u.y;
        o.z = (act == 0 ? silu_f(g.z) : gelu_tanh_f(g.z)) * u.z;
        o.w = (act == 0 ? silu_f(g.w) : gelu_tanh_f(g.w)) * u.w;
        *(float4*)(out + (i64)r * ff + 4 * c4) = o;
        return;
    }
    if (idx >= (i64)n * ff) return;
    const i64 r = idx / ff, c = idx % ff;
    const float g = gate[r * stride + c], u = up[r * stride + c];
    out[idx] = (act == 0 ? silu_f(g) : gelu_tanh_f(g)) * u;
}

// gated_act with the output rounded to 16 bits (ty 1 bf16, 2 f16), as f32_to_bf16 / f32_to_f16
// round it: the down projection's input for cuBLAS, without a conversion launch. Row r of gate
// and up starts at r * stride (stride ff: [n][ff]; 2 ff: one GEMM's [gate | up] rows); out is
// [n][ff]; v4 as gated_act's (the host checked ff and stride % 4 and alignment).
template <int OUT>
__device__ __forceinline__ void gated_act_h_impl(const float* __restrict__ gate,
                                                 const float* __restrict__ up, u16* __restrict__ out,
                                                 int n, int ff, int stride, int act, int v4) {
    const i64 idx = blockIdx.x * (i64)blockDim.x + threadIdx.x;
    const int w = v4 ? 4 : 1;
    if (idx * w >= (i64)n * ff) return;
    const i64 r = idx * w / ff, at = r * stride + (idx * w - r * ff);
    float o[4];
    for (int e = 0; e < w; e++) {
        const float g = gate[at + e], u = up[at + e];
        o[e] = (act == 0 ? silu_f(g) : gelu_tanh_f(g)) * u;
    }
    u16 h[4];
    for (int e = 0; e < w; e++) h[e] = OUT == 1 ? f2bf(o[e]) : f2h(o[e]);
    if (v4) *(uint2*)(out + idx * 4) = make_uint2(h[0] | (u32)h[1] << 16, h[2] | (u32)h[3] << 16);
    else out[idx] = h[0];
}

extern "C" __global__ void gated_act_h(const float* __restrict__ gate, const float* __restrict__ up,
                                       u16* __restrict__ out, int n, int ff, int stride, int act,
                                       int v4, int ty) { pdl_begin();
    if (ty == 1) gated_act_h_impl<1>(gate, up, out, n, ff, stride, act, v4);
    else gated_act_h_impl<2>(gate, up, out, n, ff, stride, act, v4);
}

// The columns of src [n][c0 + c1 + c2] (one GEMM over Q/K/V's joined rows) into o0 [n][c0],
// o1 [n][c1] and o2 [n][c2] (c2 may be 0). With v4 (the host checked every width % 4 and 16-byte
// alignment) a thread copies a float4, which never straddles two outputs.
extern "C" __global__ void split3_f32(const float* __restrict__ src, float* __restrict__ o0,
                                      float* __restrict__ o1, float* __restrict__ o2, int n,
                                      int c0, int c1, int c2, int v4) { pdl_begin();
    const int total = c0 + c1 + c2, w = v4 ? 4 : 1;
    const i64 idx = (blockIdx.x * (i64)blockDim.x + threadIdx.x) * w;
    if (idx >= (i64)n * total) return;
    const i64 r = idx / total;
    int c = (int)(idx - r * total);
    float* o;
    if (c < c0) {
        o = o0 + r * c0 + c;
    } else if ((c -= c0) < c1) {
        o = o1 + r * c1 + c;
    } else {
        o = o2 + r * c2 + (c - c1);
    }
    if (v4) *(float4*)o = *(const float4*)(src + idx);
    else *o = src[idx];
}

extern "C" __global__ void add_f32(float* x, const float* y, i64 n) { pdl_begin();
    const i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x;
    if (i < n) x[i] += y[i];
}

extern "C" __global__ void softcap_f32(float* x, i64 n, float cap) { pdl_begin();
    const i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x;
    if (i < n) x[i] = cap * tanhf(x[i] / cap);
}

extern "C" __global__ void f32_to_bf16(const float* x, u16* y, i64 n) { pdl_begin();
    const i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x;
    if (i < n) y[i] = f2bf(x[i]);
}

extern "C" __global__ void f32_to_f16(const float* x, u16* y, i64 n) { pdl_begin();
    const i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x;
    if (i < n) y[i] = f2h(x[i]);
}

// Element e of one row in each storage type, bit-exact with the CPU decoders.
__device__ __forceinline__ float dq_f32(const u8* r, int e) { return ((const float*)r)[e]; }
__device__ __forceinline__ float dq_f16(const u8* r, int e) { return h2f(((const u16*)r)[e]); }
__device__ __forceinline__ float dq_bf16(const u8* r, int e) { return bf2f(((const u16*)r)[e]); }

__device__ __forceinline__ float dq_q8_0(const u8* r, int e) {
    const u8* b = r + (e / 32) * 34;
    return __fmul_rn((float)(signed char)b[2 + e % 32], h2f(ld16(b)));
}

__device__ __forceinline__ float dq_q4_k(const u8* r, int e) {
    const u8* b = r + (e / 256) * 144;
    const int k = e % 256, j = k / 32;
    const float d = h2f(ld16(b)), dmin = h2f(ld16(b + 2));
    const u8* s = b + 4;
    int sc, m;
    if (j < 4) {
        sc = s[j] & 63;
        m = s[j + 4] & 63;
    } else {
        sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
    const int q = (b[16 + 32 * (k / 64) + k % 32] >> (4 * ((k / 32) % 2))) & 0xF;
    return __fsub_rn(__fmul_rn(__fmul_rn(d, (float)sc), (float)q), __fmul_rn(dmin, (float)m));
}

__device__ __forceinline__ float dq_q6_k(const u8* r, int e) {
    const u8* b = r + (e / 256) * 210;
    const int k = e % 256, h = k / 128, g = (k % 128) / 32, l = k % 32;
    const int low = (b[64 * h + 32 * (g % 2) + l] >> (4 * (g / 2))) & 0xF;
    const int high = (b[128 + 32 * h + l] >> (2 * g)) & 3;
    const int q = (low | (high << 4)) - 32;
    const float d = h2f(ld16(b + 208));
    return __fmul_rn(__fmul_rn(d, (float)(signed char)b[192 + k / 16]), (float)q);
}

// Embedding rows: out[t] = table[ids[t]] as f32; ids outside the vocabulary give zeros (the
// host validates ids, this only keeps a bad one from reading out of bounds).
#define EMBED(NAME, DQ)                                                                        \
    extern "C" __global__ void NAME(const u8* table, const int* ids, float* out, int n,        \
                                    int dim, i64 row_bytes, int vocab) { pdl_begin();                       \
        const int t = blockIdx.x;                                                              \
        if (t >= n) return;                                                                    \
        const int id = ids[t];                                                                 \
        float* o = out + (i64)t * dim;                                                         \
        if (id < 0 || id >= vocab) {                                                           \
            for (int e = threadIdx.x; e < dim; e += blockDim.x) o[e] = 0.f;                    \
            return;                                                                            \
        }                                                                                      \
        const u8* r = table + (i64)id * row_bytes;                                             \
        for (int e = threadIdx.x; e < dim; e += blockDim.x) o[e] = DQ(r, e);                   \
    }

EMBED(embed_f32, dq_f32)
EMBED(embed_f16, dq_f16)
EMBED(embed_bf16, dq_bf16)
EMBED(embed_q8_0, dq_q8_0)
EMBED(embed_q4_k, dq_q4_k)
EMBED(embed_q6_k, dq_q6_k)
