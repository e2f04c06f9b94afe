// Shared by every afm CUDA module: fixed-width types, f16/bf16 by bit arithmetic and PTX
// (so NVRTC needs no CUDA headers), warp/block reductions and the int16×int8 dot product.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

#define NEG_INF __int_as_float(0xff800000)
#define FULL_MASK 0xffffffffu

__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 f2h(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// The gated MLPs' activations (elementwise.cu's gated_act*, skinny.cu's gated epilogue).
__device__ __forceinline__ float silu_f(float x) { return x / (1.0f + expf(-x)); }

__device__ __forceinline__ float gelu_tanh_f(float x) {
    const float C = 0.7978846f;  // sqrt(2/pi)
    return 0.5f * x * (1.0f + tanhf(C * (x + 0.044715f * x * x * x)));
}

__device__ __forceinline__ float bf2f(u16 b) { return __uint_as_float(((u32)b) << 16); }

// Round to nearest even, NaN kept quiet: the same bits as half::bf16::from_f32.
__device__ __forceinline__ u16 f2bf(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (u16)(u >> 16);
}

// c += A . B, one mma.m16n8k16 (f32 accumulate): A's registers a0..a3 and B's b0, b1 in the PTX
// ISA's fragment layout. BF: bf16 inputs, else f16. Before sm_80 there is no bf16 mma (its
// callers, mmh.cu and decode_fused.cu, are never launched there). tests/mmh_host_emulation.py
// and scripts/decode_fused_emulate.cpp emulate it.
template <bool BF>
__device__ __forceinline__ void mma_m16n8k16(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3,
                                             u32 b0, u32 b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    if (BF) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
            "{%8,%9}, {%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    } else {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
            "{%8,%9}, {%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
#else
    __trap();
#endif
}

// Two values as one register of 16-bit values (a in the low half), each rounded to nearest
// even as f2bf / f2h round every finite value: one cvt (its first source goes to the upper
// half). tests/host_emulation.h has the host's.
template <bool BF>
__device__ __forceinline__ u32 pack16x2(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    u32 r;
    if (BF)
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(b), "f"(a));
    else
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(b), "f"(a));
    return r;
#else
    const u16 lo = BF ? f2bf(a) : f2h(a), hi = BF ? f2bf(b) : f2h(b);
    return (u32)lo | ((u32)hi << 16);
#endif
}

// Little-endian loads from GGML blocks, which are only 2-byte aligned (Q8_0, Q6_K).
__device__ __forceinline__ u16 ld16(const u8* p) { return *(const u16*)p; }
__device__ __forceinline__ u32 ld32_a2(const u8* p) {
    return (u32)ld16(p) | ((u32)ld16(p + 2) << 16);
}

// v reduced over the warp by `op` (every lane present); every lane gets the result.
template <class T, class Op>
__device__ __forceinline__ T warp_reduce(T v, Op op) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

// v reduced over the whole block (blockDim.x a multiple of 32) by `op`, with `id` its identity
// for the missing warps; every thread gets it. `sh` holds 32.
template <class T, class Op>
__device__ __forceinline__ T block_reduce(T v, T* sh, T id, Op op) {
    v = warp_reduce(v, op);
    const int w = threadIdx.x >> 5, l = threadIdx.x & 31, nw = blockDim.x >> 5;
    __syncthreads();
    if (l == 0) sh[w] = v;
    __syncthreads();
    v = l < nw ? sh[l] : id;
    return warp_reduce(v, op);
}

struct OpAdd {
    template <class T> __device__ __forceinline__ T operator()(T a, T b) const { return a + b; }
};
struct OpMaxF {
    __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct OpMinI {
    __device__ __forceinline__ int operator()(int a, int b) const { return min(a, b); }
};

__device__ __forceinline__ float warp_sum(float v) { return warp_reduce(v, OpAdd()); }
__device__ __forceinline__ float warp_max(float v) { return warp_reduce(v, OpMaxF()); }

// Sum over the whole block; every thread gets it. `sh` holds 32.
__device__ float block_sum(float v, float* sh) { return block_reduce(v, sh, 0.f, OpAdd()); }

// Maximum over the whole block; every thread gets it. `sh` holds 32.
__device__ float block_max(float v, float* sh) { return block_reduce(v, sh, NEG_INF, OpMaxF()); }

__device__ int block_sum_int(int v, int* sh) { return block_reduce(v, sh, 0, OpAdd()); }

__device__ int block_min_int(int v, int* sh) {
    return block_reduce(v, sh, 0x7fffffff, OpMinI());
}

// Largest value and its lowest index over the warp (ties go to the lower index); every lane
// gets them.
__device__ __forceinline__ void warp_argmax(float& v, int& i) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(FULL_MASK, v, o);
        int oi = __shfl_xor_sync(FULL_MASK, i, o);
        if (ov > v || (ov == v && oi < i)) { v = ov; i = oi; }
    }
}

// Largest value and its lowest index over the block (ties go to the lower index).
__device__ void block_argmax(float& v, int& i, float* shv, int* shi) {
    warp_argmax(v, i);
    const int w = threadIdx.x >> 5, l = threadIdx.x & 31, nw = blockDim.x >> 5;
    __syncthreads();
    if (l == 0) { shv[w] = v; shi[w] = i; }
    __syncthreads();
    v = l < nw ? shv[l] : NEG_INF;
    i = l < nw ? shi[l] : 0x7fffffff;
    warp_argmax(v, i);
}

// Activations for the quantized weights' kernels (gemv.cu's int8 GEMV, mmq.cu), in blocks of 32
// as the CPU's Q8 blocks are: q = round half to even of x * (127 / amax), so the integers equal
// the CPU's (quant/activations.rs); the scale d = amax / 127 stays f32 (no storage reason to
// round it to f16 here). The block sum is s = d * sum(q), not the exact sum of x: then a K-quant
// block's result is exactly dequantized weights . dequantized activations (as with llama.cpp's
// Q8_K bsums), whereas with the exact sum the offset term (dmin * m, about half the weight
// range) would meet unrounded x while the scale term meets rounded x, and the error would grow
// with |d * sc * q| instead of with |w|.
//
// One warp per block of 32, every lane present with its value v: returns the lane's q, and
// sets the block's d and s (in every lane; callers store them from one).
__device__ __forceinline__ int q8_quantize(float v, float& d, float& s) {
    const float amax = warp_max(fabsf(v));
    const float id = amax > 0.f ? __fdiv_rn(127.0f, amax) : 0.f;
    const int q = __float2int_rn(__fmul_rn(v, id));
    const float sum = warp_sum((float)q);  // integers below 2^24: exact
    d = __fdiv_rn(amax, 127.0f);
    s = __fmul_rn(d, sum);
    return q;
}

// Asks for the 128-byte line at p to be brought into L2 (no register is written).
__device__ __forceinline__ void prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// ---- Thread block clusters (sm_90 on; the host launches clusters only there) ----
// cluster_sync: every thread of every running block of the cluster arrives, then waits for
// the rest: the shared-memory stores before it are visible to the cluster's loads after it. A
// block that has exited counts as arrived (PTX `exit`). Its two halves, cluster_arrive and
// cluster_wait, serve a block that arrives early and waits (or not) later.
__device__ __forceinline__ void cluster_arrive() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_sync() {
    cluster_arrive();
    cluster_wait();
}
// v into the shared memory of another block of the cluster (`a`, from cluster_map), counted
// as 4 bytes of the transaction of the mbarrier at `bar` (also cluster_map'ed) there.
__device__ __forceinline__ void cluster_st_async_f32(u32 a, float v, u32 bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [%0], %1, [%2];"
                 ::"r"(a), "f"(v), "r"(bar) : "memory");
#endif
}
// The shared-memory address `a` (of this block) in the block of cluster rank `rank`.
__device__ __forceinline__ u32 cluster_map(u32 a, u32 rank) {
    u32 r = a;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(rank));
#endif
    return r;
}
__device__ __forceinline__ float4 cluster_ld_f32x4(u32 a) {
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(a) : "memory");
#endif
    return v;
}
// ---- Shared-memory staging and tensor-core fragments (sm_80 on: attention_mma.cu,
// skinny.cu). scripts/attention_mma_emulate.cpp brings its own (AFM_HOST_EMULATION). ----
#if !defined(AFM_HOST_EMULATION) && (!defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800)
__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// 16 bytes global -> shared, or 16 zero bytes when !ok (nothing is read then).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool ok) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :: "r"(smem_addr(dst)), "l"(src), "r"(ok ? 16 : 0) : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
}

// `at`: a shared-memory address (smem_addr), 16-byte aligned.
__device__ __forceinline__ void ldsm_x4(u32 (&r)[4], u32 at) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(at));
}
__device__ __forceinline__ void ldsm_x4_t(u32 (&r)[4], u32 at) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(at));
}
#endif

// Programmatic dependent launch (cuda/mod.rs `launch_raw`): every kernel first waits for the
// grids before it and their memory (so it never reads a buffer they write, nor overwrites one
// they read, early), then lets the next kernel begin launching while this one runs.
// Hopper and later only (no-ops when the launch did not ask for it).
__device__ __forceinline__ void pdl_begin() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;");
#endif
}

// ---- The attention prologue of one head, for the kernels that fold it in (attention.cu's
// attn_prologue_* and attn_dec_pro_*, attention_mma.cu's attn_dec_mma_pro_*) ----

// The prologue inputs of the fused kernels (attn_dec_pro_*, attn_dec_mma_pro_*): q holds each
// row's raw query heads; k and v its raw key and value rows; qw and kw the per-head norm
// weights (null: no norms); pos the rows' positions and cs the rotary table (PrologueArgs'
// fields).
struct DecPro {
    const float *k, *v, *qw, *kw, *cs;
    const int* pos;
    int dims, neox, max_pos, k_stride, v_stride, v4;
    float eps;
};

// A lane's part of one head's norm weights (float4 path) and of its rotary pairs: the loads
// that may go before the PDL wait. MAXD bounds the head size (sizes the register arrays).
template <int MAXD>
__device__ __forceinline__ void pro_weights(const float* w, int D, int lane,
                                            float4 (&wv)[(MAXD + 127) / 128]) {
#pragma unroll
    for (int k = 0; k < (MAXD + 127) / 128; k++)
        if (lane + 32 * k < D / 4) wv[k] = ((const float4*)w)[lane + 32 * k];
}
template <int MAXD>
__device__ __forceinline__ void pro_rope_pairs(const float* cs, int p, int half, int lane,
                                               float2 (&cpre)[MAXD / 64]) {
#pragma unroll
    for (int k = 0; k < MAXD / 64; k++)
        if (lane + 32 * k < half) cpre[k] = ((const float2*)cs)[(i64)p * half + lane + 32 * k];
}

// One warp's prologue of one head: x (D values) RMS-normed into sb by w when given
// (rms_norm_warp's float4 path when v4, else its scalar path, so the same bits), else copied,
// then rotated in sb by the pairs cpre when rot. Ends with the warp synchronized.
template <int MAXD>
__device__ __forceinline__ void pro_head(const float* x, float* sb, const float* w,
                                         const float4 (&wv)[(MAXD + 127) / 128], bool v4, int D,
                                         float eps, bool rot, const float2 (&cpre)[MAXD / 64],
                                         int half, int neox, int lane) {
    if (w && v4) {
        float4 xv[(MAXD + 127) / 128];
        const int units = D / 4;
#pragma unroll
        for (int k = 0; k < (MAXD + 127) / 128; k++)
            if (lane + 32 * k < units) xv[k] = ((const float4*)x)[lane + 32 * k];
        float ss = 0.f;
#pragma unroll
        for (int k = 0; k < (MAXD + 127) / 128; k++) {
            if (lane + 32 * k < units) {
                ss = fmaf(xv[k].x, xv[k].x, ss);
                ss = fmaf(xv[k].y, xv[k].y, ss);
                ss = fmaf(xv[k].z, xv[k].z, ss);
                ss = fmaf(xv[k].w, xv[k].w, ss);
            }
        }
        ss = warp_sum(ss);
        const float inv = 1.0f / sqrtf(ss / (float)D + eps);
#pragma unroll
        for (int k = 0; k < (MAXD + 127) / 128; k++) {
            const int i = lane + 32 * k;
            if (i < units) {
                sb[4 * i] = xv[k].x * (inv * wv[k].x);
                sb[4 * i + 1] = xv[k].y * (inv * wv[k].y);
                sb[4 * i + 2] = xv[k].z * (inv * wv[k].z);
                sb[4 * i + 3] = xv[k].w * (inv * wv[k].w);
            }
        }
    } else if (w) {
        float xv[MAXD / 32];
#pragma unroll
        for (int k = 0; k < MAXD / 32; k++)
            if (lane + 32 * k < D) xv[k] = x[lane + 32 * k];
        float ss = 0.f;
#pragma unroll
        for (int k = 0; k < MAXD / 32; k++)
            if (lane + 32 * k < D) ss = fmaf(xv[k], xv[k], ss);
        ss = warp_sum(ss);
        const float inv = 1.0f / sqrtf(ss / (float)D + eps);
#pragma unroll
        for (int k = 0; k < MAXD / 32; k++) {
            const int i = lane + 32 * k;
            if (i < D) sb[i] = xv[k] * (inv * w[i]);
        }
    } else {
        for (int i = lane; i < D; i += 32) sb[i] = x[i];
    }
    __syncwarp();
    if (rot) {
#pragma unroll
        for (int k = 0; k < MAXD / 64; k++) {
            const int i = lane + 32 * k;
            if (i >= half) break;
            const float c = cpre[k].x, sn = cpre[k].y;
            const int ia = neox ? i : 2 * i, ib = neox ? i + half : 2 * i + 1;
            const float x0 = sb[ia], x1 = sb[ib];
            sb[ia] = __fmaf_rn(x0, c, -__fmul_rn(x1, sn));
            sb[ib] = __fmaf_rn(x0, sn, __fmul_rn(x1, c));
        }
    }
    __syncwarp();
}

// mbarriers (sm_90: the parity wait and transaction counts); `bar` is a shared address. Below
// sm_90 they trap: only Hopper kernels (skinny.cu, decode_fused.cu) call them.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// Makes this thread's mbarrier inits visible to the cluster (other blocks arrive on them).
__device__ __forceinline__ void mbar_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    asm volatile(
        "{\n\t.reg .pred p;\n"
        "WAIT_%=:\n\t"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n\t"
        "@!p bra WAIT_%=;\n}" ::"r"(bar),
        "r"(parity)
        : "memory");
}
// Whether the phase of `parity` has completed, without waiting.
__device__ __forceinline__ u32 mbar_test(u32 bar, u32 parity) {
    u32 ok;
    asm volatile(
        "{\n\t.reg .pred p;\n\t"
        "mbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
        "selp.u32 %0, 1, 0, p;\n}"
        : "=r"(ok)
        : "r"(bar), "r"(parity)
        : "memory");
    return ok;
}
#else
__device__ __forceinline__ u32 mbar_test(u32, u32) { __trap(); return 0; }
__device__ __forceinline__ void mbar_init(u32, u32) { __trap(); }
__device__ __forceinline__ void mbar_expect_tx(u32, u32) { __trap(); }
__device__ __forceinline__ void mbar_arrive(u32) { __trap(); }
__device__ __forceinline__ void mbar_init_fence() { __trap(); }
__device__ __forceinline__ void mbar_wait(u32, u32) { __trap(); }
#endif
