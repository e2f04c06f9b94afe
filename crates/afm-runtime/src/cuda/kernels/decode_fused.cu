// One decode step of a llama-family model (Llama, Qwen 2, Qwen 3) for ONE sequence and ONE new
// token in one persistent launch: every layer's phases run back to back, separated by a grid
// barrier instead of a kernel boundary, so the ~8 launch floors per layer are gone.
//
//   per layer (5 barriers):
//     QKV   every CTA: rstd(x) and h = x * rstd * input_norm in shared memory; rows of Wq|Wk|Wv
//           (+ bias) over all warps of the grid                     -> q, k, v (f32 scratch)
//     ATTN  items (kv head, chunk of <= 4 query heads, key split): the item's q heads normed
//           (q_norm) + rotated + rounded to f16 as attn_prologue and attention do; the split
//           holding the new token also norms/rotates k and stores k and v into the paged f16
//           cache (attn_prologue's slots); online softmax over the split's keys; splits merged
//           by the last one to finish (a counter per item group)     -> att
//     O     rows of Wo over warps: x[r] += Wo[r] . att
//     GU    rstd(x), h = x * rstd * post_norm; act[i] = silu(Wg[i] . h) * (Wu[i] . h)
//     DOWN  x[r] += Wd[r] . act
//
// Each GEMV phase streams its weights per warp with two steps of 16-byte loads in registers and
// the lines FD_AHEAD steps ahead prefetched into L2 (fd_stream_run); its first step is loaded
// (and the next ones prefetched) while the barrier ahead of it waits (fd_stream_prime: weights
// never change), so DRAM latency overlaps the barrier.
//
// x stays the residual stream (f32 [hidden]); the final norm and lm_head run after this kernel.
// Arithmetic follows the unfused kernels (gemv_half: bf16/f16 weights times f32 activations,
// f32 sums; elementwise.cu's RMSNorm formula; attn_prologue's head norm and RoPE; f16 K/V and
// f16-rounded q as attention.cu), in a different summation order (~1e-6 relative).
//
// AFM_FUSED_PROFILE=1 passes `prof` (else null): barrier timestamps, decode_fused_profile below.
//
// Grid barrier: a u64 counter that only grows (reset-free across launches and graph replays):
// each CTA adds 1 and waits until the counter reaches the next multiple of gridDim.x. It traps
// after FD_SPIN_NS of waiting, so a bug fails the launch instead of hanging the device. All
// CTAs must be resident at once: the host launches at most SMs x occupancy CTAs (see
// cuda/decode_fused.rs for why that suffices without a cooperative launch).
//
// Data written by other CTAs inside the launch (x, q, k, v, att, act, partials, the new cache
// rows) is read with ld.global.cg (L2, never a stale L1 line); weights, norms and tables, which
// no one writes during the launch, through the read-only path.

#define FD_WARPS 8
#define FD_THREADS (FD_WARPS * 32)
#define FD_GH 4           // query heads per attention item
#define FD_KPG 4          // keys per lane group in flight in attention
// Fewest keys per attention split: one round of the key loop (every group's FD_KPG keys), so
// a split costs one trip to memory, and short contexts skip the merge (one split up to 128).
#define FD_MIN_KEYS (FD_WARPS * 4 * FD_KPG)
#define FD_UNITS 6        // 16-byte weight loads per lane per stream step (two steps in flight; 8 spills at D 128)
#define FD_AHEAD 4        // stream steps ahead of the one loaded whose lines are prefetched into L2
#ifndef FD_SPIN_NS
#define FD_SPIN_NS 2000000000ull  // a barrier waiting longer traps
#endif
// The profile buffer (u64): [0] CTA 0's start, [1] the last CTA's end, [2..FD_PROF_SLOTS) the
// report's running sums, then 3 per barrier (layer * 5 + phase): CTA 0 arrives, CTA 0 leaves,
// the last CTA arrives.
#define FD_PROF_SLOTS 32
#define FD_HEAD 64        // floats of block scratch before the phases' shared buffers

// Per-layer device addresses (0 = absent), as cuda/decode_fused.rs packs them.
enum {
    L_WQ, L_WK, L_WV, L_WO, L_WG, L_WU, L_WD,
    L_IN_NORM, L_POST_NORM, L_Q_NORM, L_K_NORM, L_BQ, L_BK, L_BV,
    L_KC, L_VC, L_FIELDS
};

struct FusedArgs {
    int n_layers, hidden, inter, n_heads;
    int n_kv_heads, block_size, max_blocks, rope_dims;
    int neox, max_pos, act, max_splits;
    float eps, qk_eps, scale, pad;
};

// Device primitives; scripts/decode_fused_emulate.cpp supplies them (AFM_HOST_EMULATION) to
// run this file on the CPU.
#ifndef AFM_HOST_EMULATION
__device__ __forceinline__ u64 fd_now() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ u64 fd_load_acquire(const u64* p) {
    u64 v;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
#else
    v = *(const volatile u64*)p;
#endif
    return v;
}

// The dynamic shared memory: FD_HEAD floats of block scratch (a reduction buffer and the
// merge flag), then the phases' buffers.
__device__ __forceinline__ float* fd_smem() {
    extern __shared__ __align__(16) float fd_sm[];
    return fd_sm;
}

__device__ __forceinline__ void fd_pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");  // the embedding (PDL launch)
#endif
}

// Adds to a counter with release semantics (no value comes back).
__device__ __forceinline__ void fd_red_release(u64* p, u64 v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
    asm volatile("red.release.gpu.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
#else
    __threadfence();
    atomicAdd((unsigned long long*)p, (unsigned long long)v);
#endif
}
#endif

// The grid barrier (CUTLASS's generic barrier pattern): the block's writes are ordered before
// thread 0's release add by __syncthreads; thread 0 polls with acquire loads until all CTAs
// have added, then releases the block. `target` is this barrier's count: the counter's value
// at the launch's start (a multiple of gridDim.x, see fd_bar_base) plus gridDim.x per barrier.
// With a profile buffer (AFM_FUSED_PROFILE=1), barrier `slot` records CTA 0's arrival and exit
// and the grid's last arrival (FdProf).
//
// `pre` (the next phase's weight loads and prefetches: no block barrier inside) runs after
// thread 0's arrival, so its release fence does not wait for the warp's own outstanding loads,
// and before the wait. (One unconditional call: a conditional one keeps the weight buffer's old
// value live across attention.)
template <class F>
__device__ __forceinline__ void fd_grid_sync(u64* bar, u64& target, u64* prof, int slot,
                                             const F& pre) {
    __syncthreads();
    u64* ps = prof ? prof + FD_PROF_SLOTS + 3 * slot : nullptr;
    if (threadIdx.x == 0) {
        target += gridDim.x;
        if (ps) {
            const u64 t = fd_now();
            atomicMax((unsigned long long*)ps + 2, (unsigned long long)t);
            if (blockIdx.x == 0) ps[0] = t;
        }
        fd_red_release(bar, 1);
    }
    pre();
    if (threadIdx.x == 0) {
        // The clock is read every 64th poll only: a poll then costs one L2 round trip.
        const u64 t0 = fd_now();
        for (u32 i = 1; fd_load_acquire(bar) < target; i++) {
            if ((i & 63) == 0 && fd_now() - t0 > FD_SPIN_NS) __trap();  // a missing CTA: fail
        }
        if (ps && blockIdx.x == 0) ps[1] = fd_now();
    }
    __syncthreads();
}

// The counter's value when this launch began. Every earlier launch has finished (stream order,
// after the PDL wait) and left a multiple of gridDim.x; of this launch's first barrier at most
// gridDim.x - 1 other CTAs can have added (none passes it before this one arrives).
__device__ __forceinline__ u64 fd_bar_base(const u64* bar) {
    const u64 g = gridDim.x;
    return fd_load_acquire(bar) / g * g;
}

template <bool BF16>
__device__ __forceinline__ void fd_unpack(const uint4 q, float (&w)[8]) {
    const u32 ws[4] = {q.x, q.y, q.z, q.w};
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
}

// ---- Weight streaming ----
// A GEMV phase is one stream of 16-byte weight loads per warp: its tasks t = gw, gw + nw, ..
// (R rows each, `cols` wide), each cut into steps of FD_UNITS / R units per lane per row (lane l
// reads units l, l + 32, ..). Two steps are in flight while one is used (double buffering over
// the task boundaries too), and a phase's first step is issued before the barrier that precedes
// it (fd_stream_prime), so its DRAM latency overlaps the barrier and the input's reload.
struct FdStream {
    int cols, gw, nw, spt, total;  // steps per task, steps of this warp
};

template <int R>
__device__ __forceinline__ FdStream fd_stream(int tasks, int cols, int gw, int nw) {
    constexpr int CH = FD_UNITS / R;
    FdStream s;
    s.cols = cols;
    s.gw = gw;
    s.nw = nw;
    s.spt = ((cols / 8 + 31) / 32 + CH - 1) / CH;
    s.total = gw < tasks ? (tasks - gw + nw - 1) / nw * s.spt : 0;
    return s;
}

// Step `step`'s lines into L2 (no registers held: deeper than the two steps in registers).
template <int R, class P>
__device__ __forceinline__ void fd_prefetch_step(const P& p, const FdStream& s, int step) {
    constexpr int CH = FD_UNITS / R;
    const int i = step / s.spt, b = step - i * s.spt, units = s.cols / 8, lane = threadIdx.x & 31;
    const u16* rows[R];
    p.rows(s.gw + i * s.nw, rows);
#pragma unroll
    for (int c = 0; c < CH; c++) {
        const int u = (b * CH + c) * 32 + lane;
        if (u < units && (lane & 7) == 0) {  // one lane per 128-byte line
#pragma unroll
            for (int r = 0; r < R; r++) prefetch_l2((const uint4*)rows[r] + u);
        }
    }
}

// Step `step` into buf, and step + FD_AHEAD into L2.
template <int R, class P>
__device__ __forceinline__ void fd_load_step(const P& p, const FdStream& s, int step,
                                             uint4 (&buf)[FD_UNITS]) {
    constexpr int CH = FD_UNITS / R;
    const int i = step / s.spt, b = step - i * s.spt, units = s.cols / 8, lane = threadIdx.x & 31;
    const u16* rows[R];
    p.rows(s.gw + i * s.nw, rows);
#pragma unroll
    for (int c = 0; c < CH; c++) {
        const int u = (b * CH + c) * 32 + lane;
#pragma unroll
        for (int r = 0; r < R; r++)
            buf[r * CH + c] = u < units ? __ldg((const uint4*)rows[r] + u) : make_uint4(0, 0, 0, 0);
    }
    if (step + FD_AHEAD < s.total) fd_prefetch_step<R>(p, s, step + FD_AHEAD);
}

// Adds step `step`'s dots to acc; after a task's last step, the warp's sums go to p.emit.
template <int R, bool BF16, class P>
__device__ __forceinline__ void fd_use_step(const P& p, const FdStream& s, int step,
                                            const uint4 (&buf)[FD_UNITS], const float* xs,
                                            float (&acc)[R]) {
    constexpr int CH = FD_UNITS / R;
    const int i = step / s.spt, b = step - i * s.spt, units = s.cols / 8, lane = threadIdx.x & 31;
#pragma unroll
    for (int c = 0; c < CH; c++) {
        const int u = (b * CH + c) * 32 + lane;
        if (u < units) {
            const float4 xa = ((const float4*)xs)[2 * u], xb = ((const float4*)xs)[2 * u + 1];
#pragma unroll
            for (int r = 0; r < R; r++) {
                float w[8];
                fd_unpack<BF16>(buf[r * CH + c], w);
                acc[r] += w[0] * xa.x + w[1] * xa.y + w[2] * xa.z + w[3] * xa.w + w[4] * xb.x +
                          w[5] * xb.y + w[6] * xb.z + w[7] * xb.w;
            }
        }
    }
    if (b == s.spt - 1) {
        float sums[R];
#pragma unroll
        for (int r = 0; r < R; r++) {
            sums[r] = warp_sum(acc[r]);
            acc[r] = 0.f;
        }
        if (lane == 0) p.emit(s.gw + i * s.nw, sums);
    }
}

// The stream's first step into buf (before the phase's barrier: weights never change).
template <int R, class P>
__device__ __forceinline__ void fd_stream_prime(const P& p, const FdStream& s,
                                                uint4 (&buf)[FD_UNITS]) {
    if (s.total > 0) {
        for (int st = 1; st < FD_AHEAD && st < s.total; st++) fd_prefetch_step<R>(p, s, st);
        fd_load_step<R>(p, s, 0, buf);
    } else {  // written on every path, so buf's old value is dead (not kept across attention)
#pragma unroll
        for (int i = 0; i < FD_UNITS; i++) buf[i] = make_uint4(0, 0, 0, 0);
    }
}

// The whole stream, its first step already in a (fd_stream_prime); xs: the input, shared.
template <int R, bool BF16, class P>
__device__ __forceinline__ void fd_stream_run(const P& p, const FdStream& s, const float* xs,
                                              uint4 (&a)[FD_UNITS]) {
    uint4 b[FD_UNITS];
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; r++) acc[r] = 0.f;
    for (int st = 0; st < s.total; st += 2) {  // warp-uniform
        if (st + 1 < s.total) fd_load_step<R>(p, s, st + 1, b);
        fd_use_step<R, BF16>(p, s, st, a, xs, acc);
        if (st + 2 < s.total) fd_load_step<R>(p, s, st + 2, a);
        if (st + 1 < s.total) fd_use_step<R, BF16>(p, s, st + 1, b, xs, acc);
    }
}

// xs = x (n floats, written by other CTAs), then __syncthreads.
__device__ __forceinline__ void fd_load_vec(const float* x, int n, float* xs) {
    for (int i = threadIdx.x; i < n / 4; i += FD_THREADS)
        ((float4*)xs)[i] = __ldcg((const float4*)x + i);
    __syncthreads();
}

// xs = x / rms(x) * w (RMSNorm of the residual, elementwise.cu's formula), then __syncthreads.
__device__ __forceinline__ void fd_load_normed(const float* x, const float* w, int d, float eps,
                                               float* xs, float* red) {
    constexpr int NV = 4;  // float4s per thread held in registers: rows up to 4096 in one pass
    const int n4 = d / 4;
    if (n4 <= NV * FD_THREADS) {  // x and w loaded together, before the reduction
        float4 xv[NV], wv[NV];
        float ss = 0.f;
#pragma unroll
        for (int k = 0; k < NV; k++) {
            const int i = threadIdx.x + k * FD_THREADS;
            if (i < n4) {
                xv[k] = __ldcg((const float4*)x + i);
                wv[k] = __ldg((const float4*)w + i);
            }
        }
#pragma unroll
        for (int k = 0; k < NV; k++) {
            if (threadIdx.x + k * FD_THREADS < n4) {
                ss = fmaf(xv[k].x, xv[k].x, ss);
                ss = fmaf(xv[k].y, xv[k].y, ss);
                ss = fmaf(xv[k].z, xv[k].z, ss);
                ss = fmaf(xv[k].w, xv[k].w, ss);
            }
        }
        ss = block_sum(ss, red);
        const float inv = 1.0f / sqrtf(ss / (float)d + eps);
#pragma unroll
        for (int k = 0; k < NV; k++) {
            const int i = threadIdx.x + k * FD_THREADS;
            if (i < n4) {
                float4 v = xv[k];
                v.x = v.x * (inv * wv[k].x);
                v.y = v.y * (inv * wv[k].y);
                v.z = v.z * (inv * wv[k].z);
                v.w = v.w * (inv * wv[k].w);
                ((float4*)xs)[i] = v;
            }
        }
        __syncthreads();
        return;
    }
    float ss = 0.f;
    for (int i = threadIdx.x; i < n4; i += FD_THREADS) {
        const float4 v = __ldcg((const float4*)x + i);
        ((float4*)xs)[i] = v;
        ss = fmaf(v.x, v.x, ss);
        ss = fmaf(v.y, v.y, ss);
        ss = fmaf(v.z, v.z, ss);
        ss = fmaf(v.w, v.w, ss);
    }
    ss = block_sum(ss, red);
    const float inv = 1.0f / sqrtf(ss / (float)d + eps);
    for (int i = threadIdx.x; i < n4; i += FD_THREADS) {
        float4 v = ((float4*)xs)[i];
        const float4 ww = __ldg((const float4*)w + i);
        v.x = v.x * (inv * ww.x);
        v.y = v.y * (inv * ww.y);
        v.z = v.z * (inv * ww.z);
        v.w = v.w * (inv * ww.w);
        ((float4*)xs)[i] = v;
    }
    __syncthreads();
}

// `bytes` at v into L2, 128-byte lines spread over every thread of the grid (all CTAs call it).
__device__ __forceinline__ void fd_prefetch_vec(const void* v, int bytes) {
    if (!v) return;
    const int lines = (bytes + 127) / 128;
    for (int i = threadIdx.x * gridDim.x + blockIdx.x; i < lines; i += FD_THREADS * gridDim.x)
        prefetch_l2((const u8*)v + i * 128);
}

__device__ __forceinline__ const u16* fd_w(const u64* L, int f) { return (const u16*)L[f]; }
__device__ __forceinline__ const float* fd_v(const u64* L, int f) { return (const float*)L[f]; }

// Row r of Wq|Wk|Wv (nq, nkv rows), its output slot and bias.
__device__ __forceinline__ const u16* fd_qkv_row(const u64* L, int r, int nq, int nk, int hidden,
                                                 float*& out, const float*& bias, float* q,
                                                 float* k, float* v) {
    int f = L_WQ, fb = L_BQ;
    float* o = q;
    if (r >= nq + nk) { r -= nq + nk; f = L_WV; fb = L_BV; o = v; }
    else if (r >= nq) { r -= nq; f = L_WK; fb = L_BK; o = k; }
    out = o + r;
    bias = L[fb] ? fd_v(L, fb) + r : nullptr;
    return fd_w(L, f) + (i64)r * hidden;
}

__device__ __forceinline__ float fd_act(float g, int act) {
    if (act == 0) return g / (1.0f + expf(-g));
    const float C = 0.7978846f;  // sqrt(2/pi), as elementwise.cu's gated_act
    return 0.5f * g * (1.0f + tanhf(C * (g + 0.044715f * g * g * g)));
}

// ---- The GEMV phases' streams: each task's rows and where its sums go ----

// Rows 2t, 2t + 1 of Wq|Wk|Wv (+ bias) -> q, k, v.
struct FdQkv {
    const u64* L;
    int nq, nk, hidden;
    float *q, *k, *v;
    __device__ __forceinline__ void rows(int t, const u16* (&r)[2]) const {
        float* o;
        const float* b;
        r[0] = fd_qkv_row(L, 2 * t, nq, nk, hidden, o, b, q, k, v);
        r[1] = fd_qkv_row(L, 2 * t + 1, nq, nk, hidden, o, b, q, k, v);
    }
    __device__ __forceinline__ void emit(int t, const float (&s)[2]) const {
#pragma unroll
        for (int i = 0; i < 2; i++) {
            float* o;
            const float* b;
            fd_qkv_row(L, 2 * t + i, nq, nk, hidden, o, b, q, k, v);
            *o = b ? s[i] + __ldg(b) : s[i];
        }
    }
};

// x[t] += W[t] . xs: the O and down projections.
struct FdResidual {
    const u16* W;
    int cols;
    float* x;
    __device__ __forceinline__ void rows(int t, const u16* (&r)[1]) const {
        r[0] = W + (i64)t * cols;
    }
    __device__ __forceinline__ void emit(int t, const float (&s)[1]) const {
        x[t] = __ldcg(x + t) + s[0];
    }
};

// act[t] = act(Wg[t] . xs) * (Wu[t] . xs).
struct FdGateUp {
    const u16 *g, *u;
    int cols, act;
    float* out;
    __device__ __forceinline__ void rows(int t, const u16* (&r)[2]) const {
        r[0] = g + (i64)t * cols;
        r[1] = u + (i64)t * cols;
    }
    __device__ __forceinline__ void emit(int t, const float (&s)[2]) const {
        out[t] = fd_act(s[0], act) * s[1];
    }
};

// ---- Attention ----

// One head (D floats at src, written by other CTAs) normed by nw (when given) and rotated at
// position p into dst (shared), by one warp: attn_prologue's arithmetic. With `round`, each
// value is rounded to f16 and back, as attention.cu reads queries against an f16 cache.
template <int D>
__device__ __forceinline__ void fd_head(const float* src, const float* nw, float eps, float* dst,
                                        int p, const float* cs, const FusedArgs& a, bool round) {
    constexpr int E = D / 32, PE = (D / 2 + 31) / 32;  // values, and rotated pairs, per lane
    const int lane = threadIdx.x & 31, half = a.rope_dims / 2;
    const bool rotate = p >= 0 && p < a.max_pos;
    // Every load first (head, norm weights, this position's cos/sin), then the arithmetic.
    float xv[E], wv[E], cv[PE], sv[PE];
#pragma unroll
    for (int e = 0; e < E; e++) {
        xv[e] = __ldcg(src + lane + 32 * e);
        wv[e] = nw ? __ldg(nw + lane + 32 * e) : 1.f;
    }
#pragma unroll
    for (int e = 0; e < PE; e++) {
        const int i = lane + 32 * e;
        const bool ok = rotate && i < half;
        cv[e] = ok ? __ldg(cs + ((i64)p * half + i) * 2) : 1.f;
        sv[e] = ok ? __ldg(cs + ((i64)p * half + i) * 2 + 1) : 0.f;
    }
    if (nw) {
        float ss = 0.f;
#pragma unroll
        for (int e = 0; e < E; e++) ss = fmaf(xv[e], xv[e], ss);
        ss = warp_sum(ss);
        const float inv = 1.0f / sqrtf(ss / (float)D + eps);
#pragma unroll
        for (int e = 0; e < E; e++) xv[e] = xv[e] * (inv * wv[e]);
    }
#pragma unroll
    for (int e = 0; e < E; e++) dst[lane + 32 * e] = xv[e];
    __syncwarp();
    if (rotate) {
#pragma unroll
        for (int e = 0; e < PE; e++) {
            const int i = lane + 32 * e;
            if (i < half) {
                const int ia = a.neox ? i : 2 * i, ib = a.neox ? i + half : 2 * i + 1;
                const float x0 = dst[ia], x1 = dst[ib];
                dst[ia] = __fmaf_rn(x0, cv[e], -__fmul_rn(x1, sv[e]));
                dst[ib] = __fmaf_rn(x0, sv[e], __fmul_rn(x1, cv[e]));
            }
        }
    }
    __syncwarp();
    if (round) {
#pragma unroll
        for (int e = 0; e < E; e++) dst[lane + 32 * e] = h2f(f2h(dst[lane + 32 * e]));
        __syncwarp();
    }
}

// 8 f16 values of a 16-byte unit.
__device__ __forceinline__ void fd_unpack_h(const uint4 q, float* w) {
    const u32 ws[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        w[2 * i] = h2f((u16)(ws[i] & 0xffff));
        w[2 * i + 1] = h2f((u16)(ws[i] >> 16));
    }
}

// Shared memory of an attention item (floats): q heads, the new k head, then per warp and head
// (m, l) and the partial output.
template <int D>
struct FdAttnSmem {
    static constexpr int Q = 0, K = FD_GH * D, M = K + D, L = M + FD_WARPS * FD_GH,
                         ACC = L + FD_WARPS * FD_GH, TOTAL = ACC + FD_WARPS * FD_GH * D;
};

// One attention item: kv head kvh, query heads h0 .. h0 + nh - 1, keys k0 .. k1 - 1 (split sp of
// `used`). Lanes form 4 groups of 8 per warp; a group takes one key at a time, each lane D / 8
// of its dimensions (units li and li + 8 of 16 bytes for D = 128).
template <int D>
__device__ void fd_attn_item(const u64* L, const FusedArgs& a, const float* q, const float* k,
                             const float* v, float* att, float* ws, int* done, const int* table,
                             int pos, const float* cs, float* sm, int kvh, int chunk_i, int nh,
                             int k0, int k1, int sp, int used, int* last_flag) {
    typedef FdAttnSmem<D> S;
    constexpr int DL = D / 8, UL = DL / 8;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, grp = lane >> 3, li = lane & 7;
    const int G = a.n_heads / a.n_kv_heads, h0 = kvh * G + chunk_i * FD_GH;
    const int n = pos + 1, bs = a.block_size, nkv = a.n_kv_heads;
    u16* kc = (u16*)L[L_KC];
    u16* vc = (u16*)L[L_VC];

    if (warp < nh)
        fd_head<D>(q + (i64)(h0 + warp) * D, fd_v(L, L_Q_NORM), a.qk_eps, sm + S::Q + warp * D,
                   pos, cs, a, true);
    if (k1 == n) {  // this split holds the new token: store its k and v (as attn_prologue)
        const i64 blk = __ldg(table + pos / bs);
        const i64 dst = ((blk * nkv + kvh) * bs + pos % bs) * D;
        if (warp == FD_WARPS - 1) {
            fd_head<D>(k + (i64)kvh * D, fd_v(L, L_K_NORM), a.qk_eps, sm + S::K, pos, cs, a, false);
            for (int i = lane; i < D; i += 32) kc[dst + i] = f2h(sm[S::K + i]);
            __threadfence();  // in L2 before the block reads the row back past L1 (ld.cg)
        } else if (warp == FD_WARPS - 2) {
            for (int i = lane; i < D; i += 32) vc[dst + i] = f2h(__ldcg(v + (i64)kvh * D + i));
            __threadfence();
        }
    }
    __syncthreads();  // q heads in shared memory; the new k/v rows visible to the block

    // The queries stay in shared memory (registers go to the keys in flight and the outputs):
    // lane li's dimensions of head h are float4s 2 (li + 8u) and 2 (li + 8u) + 1 of qs[h].
    const float4* qs = (const float4*)(sm + S::Q);
    float m[FD_GH], l[FD_GH], acc[FD_GH][DL];
#pragma unroll
    for (int h = 0; h < FD_GH; h++) {
        m[h] = NEG_INF;
        l[h] = 0.f;
#pragma unroll
        for (int i = 0; i < DL; i++) acc[h][i] = 0.f;
    }

    // A round: each group loads FD_KPG keys (4 apart) before using any, so a warp has
    // 4 * FD_KPG rows of K and V in flight.
    for (int j0 = k0 + warp * 4 * FD_KPG; j0 < k1; j0 += FD_WARPS * 4 * FD_KPG) {  // warp-uniform
        uint4 kw[FD_KPG][UL], vw[FD_KPG][UL];
#pragma unroll
        for (int t = 0; t < FD_KPG; t++) {
            const int j = j0 + 4 * t + grp;
            if (j < k1) {
                const i64 blk = __ldg(table + j / bs);
                const i64 at = ((blk * nkv + kvh) * bs + j % bs) * D;
#pragma unroll
                for (int u = 0; u < UL; u++) {
                    kw[t][u] = __ldcg((const uint4*)(kc + at) + li + 8 * u);
                    vw[t][u] = __ldcg((const uint4*)(vc + at) + li + 8 * u);
                }
            } else {
#pragma unroll
                for (int u = 0; u < UL; u++) kw[t][u] = vw[t][u] = make_uint4(0, 0, 0, 0);
            }
        }
#pragma unroll
        for (int t = 0; t < FD_KPG; t++) {
            const bool ok = j0 + 4 * t + grp < k1;
            float kf[DL], vf[DL];
#pragma unroll
            for (int u = 0; u < UL; u++) {
                fd_unpack_h(kw[t][u], kf + 8 * u);
                fd_unpack_h(vw[t][u], vf + 8 * u);
            }
#pragma unroll
            for (int h = 0; h < FD_GH; h++) {
                if (h >= nh) break;  // uniform over the block
                float dot = 0.f;
#pragma unroll
                for (int u = 0; u < UL; u++) {
                    const float4 qa = qs[h * D / 4 + 2 * (li + 8 * u)];
                    const float4 qb = qs[h * D / 4 + 2 * (li + 8 * u) + 1];
                    const float* kk = kf + 8 * u;
                    dot += qa.x * kk[0] + qa.y * kk[1] + qa.z * kk[2] + qa.w * kk[3] +
                           qb.x * kk[4] + qb.y * kk[5] + qb.z * kk[6] + qb.w * kk[7];
                }
                dot += __shfl_xor_sync(FULL_MASK, dot, 4);
                dot += __shfl_xor_sync(FULL_MASK, dot, 2);
                dot += __shfl_xor_sync(FULL_MASK, dot, 1);
                if (ok) {
                    const float s = dot * a.scale;
                    const float mn = fmaxf(m[h], s);
                    const float corr = __expf(m[h] - mn), p = __expf(s - mn);
                    l[h] = l[h] * corr + p;
#pragma unroll
                    for (int i = 0; i < DL; i++) acc[h][i] = acc[h][i] * corr + p * vf[i];
                    m[h] = mn;
                }
            }
        }
    }

    // The warp's 4 groups into group 0 (lanes with the same li hold the same dimensions).
#pragma unroll
    for (int h = 0; h < FD_GH; h++) {
        if (h >= nh) break;
#pragma unroll
        for (int off = 8; off <= 16; off <<= 1) {
            const float mo = __shfl_xor_sync(FULL_MASK, m[h], off);
            const float lo = __shfl_xor_sync(FULL_MASK, l[h], off);
            const float M = fmaxf(m[h], mo);
            const float x = m[h] == NEG_INF ? 0.f : __expf(m[h] - M);
            const float y = mo == NEG_INF ? 0.f : __expf(mo - M);
            l[h] = l[h] * x + lo * y;
#pragma unroll
            for (int i = 0; i < DL; i++)
                acc[h][i] = acc[h][i] * x + __shfl_xor_sync(FULL_MASK, acc[h][i], off) * y;
            m[h] = M;
        }
        if (grp == 0) {
            if (li == 0) {
                sm[S::M + warp * FD_GH + h] = m[h];
                sm[S::L + warp * FD_GH + h] = l[h];
            }
#pragma unroll
            for (int u = 0; u < UL; u++)
#pragma unroll
                for (int e = 0; e < 8; e++)
                    sm[S::ACC + (warp * FD_GH + h) * D + (li + 8 * u) * 8 + e] = acc[h][u * 8 + e];
        }
    }
    __syncthreads();

    // The warps merged: the output, or this split's partial (acc | m | l).
    for (int e = tid; e < nh * D; e += FD_THREADS) {
        const int h = e / D, d = e % D;
        float M = NEG_INF;
        for (int w = 0; w < FD_WARPS; w++) M = fmaxf(M, sm[S::M + w * FD_GH + h]);
        float Lh = 0.f, O = 0.f;
        for (int w = 0; w < FD_WARPS; w++) {
            const float mw = sm[S::M + w * FD_GH + h];
            const float wgt = mw == NEG_INF ? 0.f : __expf(mw - M);
            Lh += sm[S::L + w * FD_GH + h] * wgt;
            O += sm[S::ACC + (w * FD_GH + h) * D + d] * wgt;
        }
        if (used == 1) {
            att[(i64)(h0 + h) * D + d] = O / Lh;
        } else {
            float* wp = ws + ((i64)(h0 + h) * a.max_splits + sp) * (D + 2);
            wp[d] = O;
            if (d == 0) { wp[D] = M; wp[D + 1] = Lh; }
        }
    }
    if (used > 1) {
        // The last split of this (kv head, chunk) to finish merges them all; it sets the
        // counter back to 0 for the next layer and launch.
        __threadfence();
        __syncthreads();
        if (tid == 0) {
            int* c = done + kvh * ((G + FD_GH - 1) / FD_GH) + chunk_i;
            *last_flag = atomicAdd(c, 1) == used - 1;
            if (*last_flag) *c = 0;
        }
        __syncthreads();
        if (*last_flag) {
            __threadfence();
            for (int e = tid; e < nh * D; e += FD_THREADS) {
                const int h = e / D, d = e % D;
                const float* wp = ws + (i64)(h0 + h) * a.max_splits * (D + 2);
                float M = NEG_INF, Lh = 0.f, O = 0.f;
                for (int s = 0; s < used; s++) {
                    const float* w = wp + s * (D + 2);
                    const float ms = __ldcg(w + D), ls = __ldcg(w + D + 1), os = __ldcg(w + d);
                    const float mn = fmaxf(M, ms);
                    const float x = M == NEG_INF ? 0.f : __expf(M - mn);
                    const float y = ms == NEG_INF ? 0.f : __expf(ms - mn);
                    Lh = Lh * x + ls * y;
                    O = O * x + os * y;
                    M = mn;
                }
                att[(i64)(h0 + h) * D + d] = O / Lh;
            }
        }
    }
    __syncthreads();  // shared memory is free for the next item
}

// How the keys of position `pos` split into items: `chunk` keys per split, `used` splits per
// (kv head, chunk of FD_GH query heads), `items` in all.
struct FdPlan {
    int nch, chunk, used, items;
};

__device__ __forceinline__ FdPlan fd_plan(const FusedArgs& a, int pos) {
    FdPlan p;
    const int G = a.n_heads / a.n_kv_heads, n = pos + 1;
    p.nch = (G + FD_GH - 1) / FD_GH;
    p.chunk = max((n + a.max_splits - 1) / a.max_splits, FD_MIN_KEYS);
    p.used = (n + p.chunk - 1) / p.chunk;
    p.items = a.n_kv_heads * p.nch * p.used;
    return p;
}

// The K and V rows this CTA's attention items will read, into L2 (issued before the barrier
// that precedes attention, so the phase starts on L2 hits instead of DRAM round trips).
template <int D>
__device__ void fd_attn_prefetch(const u64* L, const FusedArgs& a, const int* table, int pos) {
    const FdPlan p = fd_plan(a, pos);
    const int bs = a.block_size;
    const u8* kc = (const u8*)L[L_KC];
    const u8* vc = (const u8*)L[L_VC];
    for (int it = blockIdx.x; it < p.items; it += gridDim.x) {
        const int sp = it % p.used, kvh = it / p.used / p.nch;
        const int k0 = sp * p.chunk, k1 = min(k0 + p.chunk, pos);  // the new row is not there yet
        for (int j = k0 + threadIdx.x; j < k1; j += FD_THREADS) {
            const i64 at = (((i64)__ldg(table + j / bs) * a.n_kv_heads + kvh) * bs + j % bs) * D * 2;
#pragma unroll
            for (int o = 0; o < D * 2; o += 128) {
                prefetch_l2(kc + at + o);
                prefetch_l2(vc + at + o);
            }
        }
    }
}

template <int D>
__device__ void fd_attention(const u64* L, const FusedArgs& a, const float* q, const float* k,
                             const float* v, float* att, float* ws, int* done, const int* table,
                             int pos, bool active, const float* cs, float* sm, int* last_flag) {
    if (!active) {  // padding of a CUDA-graph batch: no keys, no store; O adds nothing
        for (int i = blockIdx.x * FD_THREADS + threadIdx.x; i < a.n_heads * D;
             i += gridDim.x * FD_THREADS)
            att[i] = 0.f;
        return;
    }
    const int G = a.n_heads / a.n_kv_heads, n = pos + 1;
    const FdPlan p = fd_plan(a, pos);
    for (int it = blockIdx.x; it < p.items; it += gridDim.x) {  // uniform over the block
        const int sp = it % p.used, hc = it / p.used, kvh = hc / p.nch, ci = hc % p.nch;
        const int nh = min(FD_GH, G - ci * FD_GH);
        const int k0 = sp * p.chunk, k1 = min(k0 + p.chunk, n);
        fd_attn_item<D>(L, a, q, k, v, att, ws, done, table, pos, cs, sm, kvh, ci, nh, k0, k1,
                        sp, p.used, last_flag);
    }
}

// ---- The step ----

template <int D, bool BF16>
__device__ void fd_step(const u64* layers, float* x, float* q, float* k, float* v, float* att,
                        float* act, float* ws, int* done, u64* bar, const int* tables,
                        const int* seqs, const float* cs, u64* prof, const FusedArgs a) {
    float* red = fd_smem();                  // 32 floats for block_sum
    int* last_flag = (int*)(fd_smem() + 32);  // the attention merge's flag
    float* fd_sm = fd_smem() + FD_HEAD;
    const int warp = threadIdx.x >> 5;
    const int gw = warp * gridDim.x + blockIdx.x, nw = FD_WARPS * gridDim.x;
    const int nq = a.n_heads * D, nk = a.n_kv_heads * D;
    // Recomputed where used, not held: registers live across attention are scarce.
#define s_qkv fd_stream<2>((nq + 2 * nk) / 2, a.hidden, gw, nw)
#define s_o fd_stream<1>(a.hidden, nq, gw, nw)
#define s_gu fd_stream<2>(a.inter, a.hidden, gw, nw)
#define s_down fd_stream<1>(a.hidden, a.inter, gw, nw)
    uint4 wb[FD_UNITS];  // the next phase's first weight step, loaded before its barrier
    // Weights are no kernel's output: the first layer's loads start before the PDL wait.
    fd_stream_prime<2>(FdQkv{layers, nq, nk, a.hidden, q, k, v}, s_qkv, wb);
    fd_pdl_wait();
    if (prof && threadIdx.x == 0 && blockIdx.x == 0) prof[0] = fd_now();
    u64 target = threadIdx.x == 0 ? fd_bar_base(bar) : 0;  // thread 0 runs the barriers
    const bool active = seqs[1] > 0;  // sequence 0: [row0, len, pos0, 0]
    const int pos = seqs[2];
    for (int li = 0; li < a.n_layers; li++) {
        const u64* L = layers + (i64)li * L_FIELDS;
        const int slot = li * 5;
        fd_load_normed(x, fd_v(L, L_IN_NORM), a.hidden, a.eps, fd_sm, red);
        fd_stream_run<2, BF16>(FdQkv{L, nq, nk, a.hidden, q, k, v}, s_qkv, fd_sm, wb);
        fd_grid_sync(bar, target, prof, slot, [&] {
            if (!active) return;
            if (li == 0) fd_attn_prefetch<D>(L, a, tables, pos);  // later layers: see below
            fd_prefetch_vec(fd_v(L, L_Q_NORM), D * 4);
            fd_prefetch_vec(fd_v(L, L_K_NORM), D * 4);
            if (pos < a.max_pos) fd_prefetch_vec(cs + (i64)pos * a.rope_dims, a.rope_dims * 4);
        });

        fd_attention<D>(L, a, q, k, v, att, ws, done, tables, pos, active, cs, fd_sm, last_flag);
        const FdResidual o{fd_w(L, L_WO), nq, x};
        fd_grid_sync(bar, target, prof, slot + 1, [&] { fd_stream_prime<1>(o, s_o, wb); });

        fd_load_vec(att, nq, fd_sm);
        fd_stream_run<1, BF16>(o, s_o, fd_sm, wb);
        const FdGateUp gu{fd_w(L, L_WG), fd_w(L, L_WU), a.hidden, a.act, act};
        fd_grid_sync(bar, target, prof, slot + 2, [&] {
            fd_prefetch_vec(fd_v(L, L_POST_NORM), a.hidden * 4);
            fd_stream_prime<2>(gu, s_gu, wb);
        });

        fd_load_normed(x, fd_v(L, L_POST_NORM), a.hidden, a.eps, fd_sm, red);
        fd_stream_run<2, BF16>(gu, s_gu, fd_sm, wb);
        const FdResidual down{fd_w(L, L_WD), a.inter, x};
        fd_grid_sync(bar, target, prof, slot + 3, [&] { fd_stream_prime<1>(down, s_down, wb); });

        fd_load_vec(act, a.inter, fd_sm);
        fd_stream_run<1, BF16>(down, s_down, fd_sm, wb);
        if (li + 1 < a.n_layers) {
            const u64* N = L + L_FIELDS;
            fd_grid_sync(bar, target, prof, slot + 4, [&] {
                // The next layer's K/V history now, so it arrives while its QKV phase runs.
                if (active) fd_attn_prefetch<D>(N, a, tables, pos);
                fd_prefetch_vec(fd_v(N, L_IN_NORM), a.hidden * 4);
                fd_prefetch_vec(fd_v(N, L_BQ), nq * 4);
                fd_prefetch_vec(fd_v(N, L_BK), nk * 4);
                fd_prefetch_vec(fd_v(N, L_BV), nk * 4);
                fd_stream_prime<2>(FdQkv{N, nq, nk, a.hidden, q, k, v}, s_qkv, wb);
            });
        }
    }
    if (prof && threadIdx.x == 0) atomicMax((unsigned long long*)prof + 1, (unsigned long long)fd_now());
#undef s_qkv
#undef s_o
#undef s_gu
#undef s_down
}

// AFM_FUSED_PROFILE=1: one thread after each fused step. It adds the step's per-phase times
// (from CTA 0's view, means over layers) to the running sums in prof[2..], clears the step's
// slots, and every `every` steps prints the means (device printf: stdout) and starts over.
//   work   CTA 0's phase, from its exit of the barrier before to its arrival at the next
//   skew   the last CTA's arrival after CTA 0's (imbalance and slow CTAs)
//   sync   CTA 0's exit after the last arrival (the barrier itself)
extern "C" __global__ void decode_fused_profile(u64* prof, int n_layers, int every) {
    fd_pdl_wait();
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    u64* sum = prof + 2;  // [phase][work, skew, sync] for 5 phases, then tail, total, steps
    const u64* sl = prof + FD_PROF_SLOTS;
    u64 prev = prof[0];
    const int nb = n_layers * 5 - 1;
    for (int b = 0; b < nb; b++) {
        const u64 arrive = sl[3 * b], leave = sl[3 * b + 1], last = sl[3 * b + 2];
        const int ph = b % 5;
        sum[3 * ph] += arrive - prev;
        sum[3 * ph + 1] += last > arrive ? last - arrive : 0;
        sum[3 * ph + 2] += leave > last ? leave - last : 0;
        prev = leave;
        prof[FD_PROF_SLOTS + 3 * b + 2] = 0;
    }
    sum[15] += prof[1] > prev ? prof[1] - prev : 0;
    sum[16] += prof[1] - prof[0];
    prof[1] = 0;
    if (++sum[17] < (u64)every) return;
    const double n = (double)sum[17], us = 1e-3;
    const char* names[5] = {"qkv", "attn", "o", "gate_up", "down"};
    printf("[fused profile] %d steps, %d layers: step %.1f us (last down + end %.2f); per layer (us):",
           (int)sum[17], n_layers, sum[16] * us / n, sum[15] * us / n);
    for (int ph = 0; ph < 5; ph++) {
        const double per = n * (ph == 4 ? n_layers - 1 : n_layers);
        if (per > 0)
            printf(" %s work %.2f skew %.2f sync %.2f%s", names[ph], sum[3 * ph] * us / per,
                   sum[3 * ph + 1] * us / per, sum[3 * ph + 2] * us / per, ph == 4 ? "\n" : " |");
    }
    for (int i = 0; i < 18; i++) sum[i] = 0;
}

#define FD_KERNEL(D, NAME, BF16)                                                               \
    extern "C" __global__ void __launch_bounds__(FD_THREADS, 1) decode_fused_##NAME##_##D(     \
        const u64* layers, float* x, float* q, float* k, float* v, float* att, float* act,     \
        float* ws, int* done, u64* bar, const int* tables, const int* seqs, const float* cs,   \
        u64* prof, const FusedArgs a) {                                                        \
        fd_step<D, BF16>(layers, x, q, k, v, att, act, ws, done, bar, tables, seqs, cs, prof, a); \
    }
FD_KERNEL(64, bf16, true)
FD_KERNEL(128, bf16, true)
FD_KERNEL(64, f16, false)
FD_KERNEL(128, f16, false)
