// One decode step of a llama-family model (Llama, Qwen 2, Qwen 3) for ONE sequence and ONE new
// token in one persistent launch: every layer's phases run back to back, separated by a grid
// barrier instead of a kernel boundary, so the ~8 launch floors per layer are gone.
//
//   per layer (5 barriers):
//     QKV   every CTA: rstd(x) and h = x * rstd * input_norm in shared memory; its rows of
//           Wq|Wk|Wv (+ bias)                                        -> q, k, v (f32 scratch)
//     ATTN  items (kv head, chunk of <= 4 query heads, key split): the item's q heads normed
//           (q_norm) + rotated + rounded to f16 as attn_prologue and attention do; the split
//           holding the new token also norms/rotates k and stores k and v into the paged f16
//           cache (attn_prologue's slots); online softmax over the split's keys; splits merged
//           by the last one to finish (a counter per item group)     -> att
//     O     its rows of Wo: x[r] += Wo[r] . att
//     GU    rstd(x), h = x * rstd * post_norm; act[i] = silu(Wg[i] . h) * (Wu[i] . h)
//     DOWN  x[r] += Wd[r] . act
//
// sm_90: a CTA is FD_WARPS consumer warps, which run the phases above, and one producer warp,
// which copies the step's weights into a ring in shared memory with bulk copies (see "The
// weight ring"), ahead of the consumers across barriers and attention. The consumers' block
// barriers are named barrier 1 (fd_sync), which the producer never joins.
//
// x stays the residual stream (f32 [hidden]); the final norm and lm_head run after this kernel.
// Arithmetic follows the unfused kernels (elementwise.cu's RMSNorm formula; attn_prologue's
// head norm and RoPE; f16 K/V and f16-rounded q as attention.cu) except in the GEMVs: the
// tensor cores multiply the 16-bit weights by the input as two 16-bit parts (hi + lo, see "The
// weight ring"), with f32 sums in another order than gemv_half's f32 activations (~1e-5
// relative).
//
// AFM_FUSED_PROFILE=1 compiles the module with FD_PROFILE (cuda/context.rs MODULE_DEFINES) and
// passes `prof` (else null): barrier timestamps, decode_fused_profile below. Without FD_PROFILE
// the profile's code is not in the kernel at all (its registers and branches cost the step).
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

// Seven consumer warps and the producer make 8 warps, 2 per SM sub-partition, so a thread may
// hold 255 registers; a ninth warp puts 3 on one sub-partition and caps every thread at 168,
// and the kernel then keeps ~400 bytes a thread in local memory (stack), whose loads sat on
// each phase's critical path.
#define FD_WARPS 7
#define FD_THREADS (FD_WARPS * 32)  // the consumer warps; the producer warp comes after them
#define FD_BLOCK (FD_THREADS + 32)
#define FD_GH 4           // query heads per attention item
#define FD_KPG 4          // keys per lane group in flight in attention
// Fewest keys per attention split: one round of the key loop (every group's FD_KPG keys), so
// a split costs one trip to memory, and short contexts skip the merge (one split up to 112).
#define FD_MIN_KEYS (FD_WARPS * 4 * FD_KPG)
#ifndef FD_SPIN_NS
#define FD_SPIN_NS 2000000000ull  // a barrier waiting longer traps
#endif
// The profile buffer (u64): [0] CTA 0's start, [1] the last CTA's end, [2..FD_PROF_SLOTS) the
// report's running sums (2..19 the barriers' view; 20..55 CTA 0 thread 0's view of each GEMV
// phase, fd_step; 56, 57 CTA 0's producer: cycles blocked on a free slot, cycles in all), then
// 3 per barrier (layer * 5 + phase): CTA 0 arrives, CTA 0 leaves, the last CTA arrives.
#define FD_PROF_SLOTS 60
#ifdef FD_PROFILE
#define FD_PROF_ON true
#else
#define FD_PROF_ON false
#endif
#define FD_HEAD 128       // floats of block scratch (reduction, merge flag, ring mbarriers) before the phases' buffers

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
    float eps, qk_eps, scale;
    int stages, ring_at;  // the weight ring's slots and its byte offset in shared memory
};

// Device primitives; scripts/decode_fused_emulate.cpp supplies them (AFM_HOST_EMULATION) to
// run this file on the CPU.
#ifndef AFM_HOST_EMULATION
__device__ __forceinline__ u64 fd_now() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// SM clock cycles (the profile's fine-grained counts: %globaltimer ticks are coarse).
__device__ __forceinline__ u64 fd_cycles() { return clock64(); }

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

// The consumer warps' block barrier (named barrier 1): the producer warp never joins one.
__device__ __forceinline__ void fd_sync() {
    asm volatile("bar.sync 1, %0;" ::"n"(FD_THREADS) : "memory");
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

// Sum over the consumer warps; every consumer thread gets it. `sh` holds FD_WARPS.
__device__ __forceinline__ float fd_block_sum(float v, float* sh) {
    v = warp_sum(v);
    const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
    fd_sync();
    if (l == 0) sh[w] = v;
    fd_sync();
    return warp_sum(l < FD_WARPS ? sh[l] : 0.f);
}

// The grid barrier (CUTLASS's generic barrier pattern): the block's writes are ordered before
// thread 0's release add by fd_sync; thread 0 polls with acquire loads until all CTAs have
// added, then releases the block. (Relaxed polls and one acquire fence after them, which
// spare the L1 invalidation of each acquire load, were slower: 922 against 960 tok/s on
// Qwen3-0.6B, bench/RESULTS.md session 16.) `target` is this barrier's count: the counter's value
// at the launch's start (a multiple of gridDim.x, see fd_bar_base) plus gridDim.x per barrier.
// With a profile buffer (AFM_FUSED_PROFILE=1), barrier `slot` records CTA 0's arrival and exit
// and the grid's last arrival (FdProf).
//
// `pre` (L2 prefetches of what the next phase reads besides weights, which the ring brings: no
// block barrier inside) runs after thread 0's arrival, so its release fence does not wait for
// the warp's own outstanding loads, and before the wait.
template <class F>
__device__ __forceinline__ void fd_grid_sync(u64* bar, u64& target, u64* prof, int slot,
                                             const F& pre) {
    fd_sync();
    u64* ps = FD_PROF_ON && prof ? prof + FD_PROF_SLOTS + 3 * slot : nullptr;
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
    fd_sync();
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

__device__ __forceinline__ const u16* fd_w(const u64* L, int f) { return (const u16*)L[f]; }
__device__ __forceinline__ const float* fd_v(const u64* L, int f) { return (const float*)L[f]; }

__device__ __forceinline__ float fd_act(float g, int act) {
    if (act == 0) return g / (1.0f + expf(-g));
    const float C = 0.7978846f;  // sqrt(2/pi), as elementwise.cu's gated_act
    return 0.5f * g * (1.0f + tanhf(C * (g + 0.044715f * g * g * g)));
}

// ---- The weight ring ----
// Weights are no phase's output, so the whole step's weight bytes are one fixed sequence per
// CTA, known before the step starts: the producer warp copies it, tile by tile, into a ring of
// `a.stages` slots in shared memory, and runs ahead across the grid barriers and the attention
// phase as far as the ring allows (~200 KB, most of a small model's layer), so the barriers'
// latency and the attention overlap the DRAM reads of the next phases. The owner of a slot's
// tile waits on its "full" mbarrier, uses it and arrives on its "empty" one, which frees it.
//
// A GEMV phase gives each CTA a contiguous range of rows (an even split of the phase's rows
// over the grid) of up to three matrices (Wq|Wk|Wv; Wg then Wu over the same rows; Wo; Wd),
// its pieces. A piece is cut into row groups of 8 rows, and a group into tiles of up to
// FD_TILE_COLS columns: a tile is one ring slot, its rows copied by one cp.async.bulk each to
// a row stride of 16 bytes more than the row (so ldmatrix's 8 row addresses fall in 8
// different bank quads). Every consumer warp takes a share of every tile (fd_gemv), so every
// warp waits for every tile's "full" and arrives on its "empty" (FD_WARPS arrivals free a
// slot); the sums' order depends on the shape alone (never on timing).
//
// The products run on the tensor cores (mma m16n8k16, f32 accumulate): a tile's 8 rows are
// the 8 columns of B, and the input vector is A's first two rows, as its 16-bit rounding (hi)
// and the rounding of what that left (lo), so hi + lo carries x to ~2^-16 of itself, about
// what the f32 x times 16-bit weights of the unfused GEMVs keep (rows 2..15 of A hold copies
// and are ignored: a row of C depends on that row of A alone).
#define FD_TILE_COLS 1024
#define FD_TILE_ROWS 8
#define FD_STAGE_BYTES (FD_TILE_ROWS * (2 * FD_TILE_COLS + 16))
#define FD_MAX_STAGES 16

struct FdPiece {
    const u8* w;  // the CTA's first row
    int first, rows, cols;
};

__device__ __forceinline__ void fd_split(int total, int& r0, int& r1) {
    r0 = (int)((i64)total * blockIdx.x / gridDim.x);
    r1 = (int)((i64)total * (blockIdx.x + 1) / gridDim.x);
}

__device__ __forceinline__ FdPiece fd_make_piece(const u16* w, int first, int rows, int cols) {
    FdPiece pc;
    pc.w = (const u8*)(w + (i64)first * cols);
    pc.first = first;
    pc.rows = max(rows, 0);
    pc.cols = cols;
    return pc;
}

// Piece m of phase ph (0 Q/K/V: m = 0..2 for q, k, v; 1 O; 2 gate+up: m = 0 gate, 1 up;
// 3 down) of layer L for this CTA; rows 0 when the CTA has none of it.
__device__ __forceinline__ FdPiece fd_piece(const u64* L, const FusedArgs& a, int nq, int nk,
                                            int ph, int m) {
    int r0, r1;
    if (ph == 0) {  // rows of the stacked Wq | Wk | Wv
        fd_split(nq + 2 * nk, r0, r1);
        const int b0 = m == 0 ? 0 : m == 1 ? nq : nq + nk, b1 = m == 0 ? nq : m == 1 ? nq + nk : nq + 2 * nk;
        const int lo = max(r0, b0), hi = min(r1, b1);
        return fd_make_piece(fd_w(L, L_WQ + m), lo - b0, hi - lo, a.hidden);
    }
    if (ph == 1) {
        fd_split(a.hidden, r0, r1);
        return fd_make_piece(fd_w(L, L_WO), r0, r1 - r0, nq);
    }
    if (ph == 2) {
        fd_split(a.inter, r0, r1);
        return fd_make_piece(fd_w(L, m == 0 ? L_WG : L_WU), r0, r1 - r0, a.hidden);
    }
    fd_split(a.hidden, r0, r1);
    return fd_make_piece(fd_w(L, L_WD), r0, r1 - r0, a.inter);
}

__device__ __forceinline__ int fd_pieces(int ph) { return ph == 0 ? 3 : ph == 2 ? 2 : 1; }
__device__ __forceinline__ int fd_groups(const FdPiece& pc) {
    return (pc.rows + FD_TILE_ROWS - 1) / FD_TILE_ROWS;
}
__device__ __forceinline__ int fd_chunks(const FdPiece& pc) {
    return (pc.cols + FD_TILE_COLS - 1) / FD_TILE_COLS;
}

// Shared addresses of the ring: `full` and `empty` mbarriers (8 bytes each, FD_MAX_STAGES of
// each from byte FD_MBAR_AT), slot 0 at byte a.ring_at.
#define FD_MBAR_AT 256
// Byte of the producer's issued-stage count (the profile's view of how far ahead it runs).
#define FD_ISSUED_AT 160
struct FdRing {
    u32 full, empty, data;
    int stages;
};

// A place in the step's stage sequence, in one register: the slot (t % stages, bits 0..15) and
// the parity of that slot's use ((t / stages) & 1, bit 16), kept by counting (a runtime-divisor
// % and / before each tile's wait were ~25 dependent instructions with a reciprocal, ncu session
// 17). `t`, the count itself, only for the producer's first pass and the profile.
struct FdCursor {
    u32 t, at;
};

__device__ __forceinline__ u32 fd_slot(const FdCursor& cur) { return cur.at & 0xffff; }
__device__ __forceinline__ u32 fd_parity(const FdCursor& cur) { return cur.at >> 16; }

__device__ __forceinline__ void fd_advance(FdCursor& cur, int stages) {
    cur.t++;
    cur.at++;
    if ((cur.at & 0xffff) == (u32)stages) cur.at = (cur.at & 0x10000) ^ 0x10000;
}

__device__ __forceinline__ FdRing fd_ring(const FusedArgs& a) {
    const u32 base = (u32)__cvta_generic_to_shared(fd_smem());
    FdRing r;
    r.full = base + FD_MBAR_AT;
    r.empty = r.full + 8 * FD_MAX_STAGES;
    r.data = base + a.ring_at;
    r.stages = a.stages;
    return r;
}

#if defined(AFM_HOST_EMULATION)
// scripts/decode_fused_emulate.cpp supplies fd_bulk, fd_evict_first, ldsm_x4 and mma_m16n8k16.
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// `bytes` (a multiple of 16) at global src into shared dst, completing on mbarrier bar; L2
// keeps the lines as first to evict (each weight is read once per step).
__device__ __forceinline__ void fd_bulk(u32 dst, const void* src, u32 bytes, u32 bar, u64 pol) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
        " [%0], [%1], %2, [%3], %4;" ::"r"(dst),
        "l"(src), "r"(bytes), "r"(bar), "l"(pol)
        : "memory");
}
__device__ __forceinline__ u64 fd_evict_first() {
    u64 pol;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
    return pol;
}
#else
__device__ __forceinline__ void fd_bulk(u32, const void*, u32, u32, u64) { __trap(); }
__device__ __forceinline__ u64 fd_evict_first() { return 0; }
#endif

// The producer (one thread): every tile of the step, in the consumers' order.
__device__ void fd_produce(const u64* layers, const FusedArgs& a, int nq, int nk,
                           const FdRing& r, u64* prof) {
    const u64 pol = fd_evict_first();
    FdCursor cur = {0, 0};
    u64 blocked = 0, c_start = FD_PROF_ON ? fd_cycles() : 0;  // the profile: CTA 0's producer
    for (int li = 0; li < a.n_layers; li++) {
        const u64* L = layers + (i64)li * L_FIELDS;
        for (int ph = 0; ph < 4; ph++) {
            for (int m = 0; m < fd_pieces(ph); m++) {
                const FdPiece pc = fd_piece(L, a, nq, nk, ph, m);
                const int ng = fd_groups(pc), nc = fd_chunks(pc);
                for (int grp = 0; grp < ng; grp++) {
                    const int rows = min(FD_TILE_ROWS, pc.rows - grp * FD_TILE_ROWS);
                    for (int ch = 0; ch < nc; ch++, fd_advance(cur, r.stages)) {
                        const int c0 = ch * FD_TILE_COLS, cols = min(FD_TILE_COLS, pc.cols - c0);
                        const u32 slot = fd_slot(cur);
                        if (cur.t >= (u32)r.stages) {  // the slot's previous use must be freed
                            const u64 cw = FD_PROF_ON ? fd_cycles() : 0;
                            mbar_wait(r.empty + 8 * slot, fd_parity(cur) ^ 1);
                            if (FD_PROF_ON) blocked += fd_cycles() - cw;
                        }
                        const u32 full = r.full + 8 * slot, dst = r.data + slot * FD_STAGE_BYTES;
                        mbar_expect_tx(full, rows * cols * 2);
                        const u8* src = pc.w + ((i64)grp * FD_TILE_ROWS * pc.cols + c0) * 2;
                        for (int i = 0; i < rows; i++)
                            fd_bulk(dst + i * (2 * cols + 16), src + (i64)i * pc.cols * 2,
                                    cols * 2, full, pol);
                        if (FD_PROF_ON) *(volatile u32*)((u8*)fd_smem() + FD_ISSUED_AT) = cur.t + 1;
                    }
                }
            }
        }
    }
    if (FD_PROF_ON && prof && blockIdx.x == 0) {
        prof[56] += blocked;
        prof[57] += fd_cycles() - c_start;
    }
}

// The GEMV input in shared memory, as A's fragments want it: the hi values (16-bit, as the
// weights), then the lo values, each [pair of k16 tiles][tig 0..3][4 words], words {tile 2p:
// k 2tig, 2tig + 8; tile 2p + 1: the same}, two values per word (lower k in the low half). A
// vector of n values (a multiple of 32) takes 4n bytes, as its f32 values would.
__device__ __forceinline__ int fd_xs_word(int k) {
    const int j = k & 15;
    return ((k >> 5) * 4 + ((j & 7) >> 1)) * 4 + ((k >> 4) & 1) * 2 + (j >> 3);
}

template <bool BF16>
__device__ __forceinline__ float fd_widen16(u16 v) {
    return BF16 ? bf2f(v) : h2f(v);
}

// Values k .. k + 3 of the vector (n values) into xs's hi/lo layout.
template <bool BF16>
__device__ __forceinline__ void fd_xs_put4(u32* xs, int n, int k, float4 v) {
    const u32 h0 = pack16x2<BF16>(v.x, v.y), h1 = pack16x2<BF16>(v.z, v.w);
    const u32 l0 = pack16x2<BF16>(v.x - fd_widen16<BF16>((u16)h0), v.y - fd_widen16<BF16>((u16)(h0 >> 16)));
    const u32 l1 = pack16x2<BF16>(v.z - fd_widen16<BF16>((u16)h1), v.w - fd_widen16<BF16>((u16)(h1 >> 16)));
    const int w0 = fd_xs_word(k), w1 = fd_xs_word(k + 2), half = n / 2;
    xs[w0] = h0;
    xs[w1] = h1;
    xs[half + w0] = l0;
    xs[half + w1] = l1;
}

// Where a finished row's sum goes. `g` (shared, one float per gate row of the CTA) holds the
// gate's sums until the same lane finishes the up row. KIND: 0 q/k/v (+ bias), 3 gate, 4 up,
// 5 residual (O, down; `res` is x[r] as the row group began).
template <int KIND>
__device__ __forceinline__ void fd_emit(const FdPiece& pc, int row, float s, const float* bias,
                                        float res, float* out, float* g, int act_kind) {
    const int r = pc.first + row;
    if (KIND == 0) out[r] = bias ? s + __ldg(bias + r) : s;
    if (KIND == 3) g[row] = s;
    if (KIND == 4) out[r] = fd_act(g[row], act_kind) * s;
    if (KIND == 5) out[r] = res + s;
}

// A row group's slot in a GEMV phase's partials (shared): each warp's 8 sums (its part of the
// group's 8 rows), then the 8 residual rows as the group began (KIND 5).
#define FD_GROUP_FLOATS (FD_WARPS * 8 + 8)

// One piece of a GEMV phase on the consumer side: its tiles in order (`cur` walks the step's
// stages, as the producer's does); xs: the input vector (shared, fd_xs_word's layout); part:
// the phase's partials (shared, FD_GROUP_FLOATS a row group), the piece's groups from slot g0
// (the phase's groups before it). Every warp takes every tile, its share of the tile's
// k16-tile pairs (pair p goes to warp p % FD_WARPS), into its own sums, over all the group's
// tiles, and leaves them in the group's slot without waiting for the other warps; after the
// piece, one block barrier, then warp grp % FD_WARPS adds each group's parts in warp order
// and writes its rows (session 16 had a block barrier after every group). With `ready_at` (the
// profile, CTA 0's thread 0): [0] when its first stage was there, [1] when it began to wait for
// it, [2] whether the stage was already full then, [3] cycles spent waiting for stages, [4]
// stages not yet full when it came to them.
template <bool BF16, int KIND>
__device__ void fd_gemv(const FdPiece& pc, const FusedArgs& a, const FdRing& r, FdCursor& cur, int g0,
                        const u32* xs, float* part, const float* bias, float* out, float* g,
                        u64* ready_at) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, tig = lane & 3;
    const int K = pc.cols, ng = fd_groups(pc), nc = fd_chunks(pc);
    // This lane's A fragments: hi (lanes g = 0 mod 2) or lo, words of tig; copies elsewhere.
    const uint4* xq = (const uint4*)(xs + ((lane >> 2) & 1) * (K / 2)) + tig;
    for (int grp = 0; grp < ng; grp++) {
        const bool fin = grp % FD_WARPS == warp;  // this warp writes the group's rows
        // Lanes 0..3 finish rows 2 tig and 2 tig + 1 of the group.
        const int row0 = grp * FD_TILE_ROWS + 2 * tig;
        float res[2] = {0.f, 0.f};
        if (KIND == 5 && fin && lane < 4) {
#pragma unroll
            for (int e = 0; e < 2; e++)
                if (row0 + e < pc.rows) res[e] = __ldcg(out + pc.first + row0 + e);
        }
        float c[4][4] = {};
        for (int ch = 0; ch < nc; ch++, fd_advance(cur, r.stages)) {
            const int c0 = ch * FD_TILE_COLS, cols = min(FD_TILE_COLS, K - c0);
            const u32 slot = fd_slot(cur), parity = fd_parity(cur);
            u64 cw = 0;
            if (ready_at) {
                const u32 full = mbar_test(r.full + 8 * slot, parity);
                if (ready_at[0] == 0) {
                    ready_at[1] = fd_now();
                    ready_at[2] = full;
                }
                ready_at[4] += !full;
                cw = fd_cycles();
            }
            mbar_wait(r.full + 8 * slot, parity);
            // The lanes may leave the wait's loop apart; ldmatrix and mma need the warp
            // converged.
            __syncwarp();
            if (ready_at) {
                ready_at[3] += fd_cycles() - cw;
                if (ready_at[0] == 0) ready_at[0] = fd_now();
            }
            // ldmatrix: lane l gives row l % 8 of matrix l / 8 (columns 8 (l / 8) on).
            const u32 lm = r.data + slot * FD_STAGE_BYTES + (lane & 7) * (2 * cols + 16) +
                           (lane >> 3) * 16;
            const uint4* xc = xq + (c0 >> 5) * 4;
            const int np = cols >> 5;  // pairs of k16 tiles
            int p = warp;
            for (; p + FD_WARPS < np; p += 2 * FD_WARPS) {
                u32 b0[4], b1[4];
                ldsm_x4(b0, lm + p * 64);
                ldsm_x4(b1, lm + (p + FD_WARPS) * 64);
                const uint4 x0 = xc[p * 4], x1 = xc[(p + FD_WARPS) * 4];
                // A's rows g + 8 (registers 1 and 3) repeat rows g: ignored, as rows 2..15.
                mma_m16n8k16<BF16>(c[0], x0.x, x0.x, x0.y, x0.y, b0[0], b0[1]);
                mma_m16n8k16<BF16>(c[1], x0.z, x0.z, x0.w, x0.w, b0[2], b0[3]);
                mma_m16n8k16<BF16>(c[2], x1.x, x1.x, x1.y, x1.y, b1[0], b1[1]);
                mma_m16n8k16<BF16>(c[3], x1.z, x1.z, x1.w, x1.w, b1[2], b1[3]);
            }
            if (p < np) {
                u32 b0[4];
                ldsm_x4(b0, lm + p * 64);
                const uint4 x0 = xc[p * 4];
                mma_m16n8k16<BF16>(c[0], x0.x, x0.x, x0.y, x0.y, b0[0], b0[1]);
                mma_m16n8k16<BF16>(c[1], x0.z, x0.z, x0.w, x0.w, b0[2], b0[3]);
            }
            __syncwarp();
            if (lane == 0) mbar_arrive(r.empty + 8 * slot);
        }
        // Row 0 of C (lanes 0..3) is W . hi, row 1 (lanes 4..7) W . lo, columns 2 tig, 2 tig + 1:
        // this warp's part of the group, hi + lo, into the group's slot of the partials; the
        // finishing lanes park the residual rows there too (FD_GROUP_FLOATS).
        float* pg = part + (g0 + grp) * FD_GROUP_FLOATS;
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const float hl = (c[0][e] + c[1][e]) + (c[2][e] + c[3][e]);
            const float lo = __shfl_xor_sync(0xffffffffu, hl, 4);
            if (lane < 4) pg[warp * 8 + 2 * lane + e] = hl + lo;
        }
        if (KIND == 5 && fin && lane < 4) {
            pg[FD_WARPS * 8 + 2 * lane] = res[0];
            pg[FD_WARPS * 8 + 2 * lane + 1] = res[1];
        }
    }
    // The piece's rows, once every warp's parts are in: group grp by warp grp % FD_WARPS, its
    // lanes 0..3 rows 2 tig and 2 tig + 1, the parts added in warp order (the same operations
    // as a barrier after each group, without the barriers).
    fd_sync();
    if (lane < 4) {
        for (int grp = warp; grp < ng; grp += FD_WARPS) {
            const float* pg = part + (g0 + grp) * FD_GROUP_FLOATS;
            const int row0 = grp * FD_TILE_ROWS + 2 * tig;
#pragma unroll
            for (int e = 0; e < 2; e++) {
                float s = 0.f;
#pragma unroll
                for (int w = 0; w < FD_WARPS; w++) s += pg[w * 8 + 2 * lane + e];
                const float res = KIND == 5 ? pg[FD_WARPS * 8 + 2 * lane + e] : 0.f;
                if (row0 + e < pc.rows) fd_emit<KIND>(pc, row0 + e, s, bias, res, out, g, a.act);
            }
        }
    }
}

// xs = x (n floats, written by other CTAs) in fd_xs_word's layout, then fd_sync.
template <bool BF16>
__device__ __forceinline__ void fd_load_vec(const float* x, int n, u32* xs) {
    for (int i = threadIdx.x; i < n / 4; i += FD_THREADS)
        fd_xs_put4<BF16>(xs, n, 4 * i, __ldcg((const float4*)x + i));
    fd_sync();
}

// xs = x / rms(x) * w (RMSNorm of the residual, elementwise.cu's formula) in fd_xs_word's
// layout, then fd_sync.
template <bool BF16>
__device__ __forceinline__ void fd_load_normed(const float* x, const float* w, int d, float eps,
                                               u32* xs, float* red) {
    constexpr int NV = 5;  // float4s per thread held in registers: rows up to 4,480 in one pass
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
        ss = fd_block_sum(ss, red);
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
                fd_xs_put4<BF16>(xs, d, 4 * i, v);
            }
        }
        fd_sync();
        return;
    }
    // Wider rows: x read twice (the second time from L2), as xs cannot hold x as it is.
    float ss = 0.f;
    for (int i = threadIdx.x; i < n4; i += FD_THREADS) {
        const float4 v = __ldcg((const float4*)x + i);
        ss = fmaf(v.x, v.x, ss);
        ss = fmaf(v.y, v.y, ss);
        ss = fmaf(v.z, v.z, ss);
        ss = fmaf(v.w, v.w, ss);
    }
    ss = fd_block_sum(ss, red);
    const float inv = 1.0f / sqrtf(ss / (float)d + eps);
    for (int i = threadIdx.x; i < n4; i += FD_THREADS) {
        float4 v = __ldcg((const float4*)x + i);
        const float4 ww = __ldg((const float4*)w + i);
        v.x = v.x * (inv * ww.x);
        v.y = v.y * (inv * ww.y);
        v.z = v.z * (inv * ww.z);
        v.w = v.w * (inv * ww.w);
        fd_xs_put4<BF16>(xs, d, 4 * i, v);
    }
    fd_sync();
}

// `bytes` at v into L2, 128-byte lines spread over every thread of the grid (all CTAs call it).
__device__ __forceinline__ void fd_prefetch_vec(const void* v, int bytes) {
    if (!v) return;
    const int lines = (bytes + 127) / 128;
    for (int i = threadIdx.x * gridDim.x + blockIdx.x; i < lines; i += FD_THREADS * gridDim.x)
        prefetch_l2((const u8*)v + i * 128);
}

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
    fd_sync();  // q heads in shared memory; the new k/v rows visible to the block

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
    fd_sync();

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
        fd_sync();
        if (tid == 0) {
            int* c = done + kvh * ((G + FD_GH - 1) / FD_GH) + chunk_i;
            *last_flag = atomicAdd(c, 1) == used - 1;
            if (*last_flag) *c = 0;
        }
        fd_sync();
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
    fd_sync();  // shared memory is free for the next item
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
    float* red = fd_smem();                  // FD_WARPS floats for fd_block_sum
    int* last_flag = (int*)(fd_smem() + 32);  // the attention merge's flag
    float* fd_sm = fd_smem() + FD_HEAD;
    u32* xs = (u32*)fd_sm;           // a GEMV's input vector (fd_xs_word's layout)
    float* gate = fd_sm + a.hidden;  // gate sums while xs holds the normed x (ring_at in .rs)
    const int nq = a.n_heads * D, nk = a.n_kv_heads * D;
    // Each GEMV phase's partials right past its input (and the gate sums: cuda/decode_fused.rs
    // ring_at).
    const int gate_end = a.hidden + (a.inter + (int)gridDim.x - 1) / (int)gridDim.x;
    const FdRing ring = fd_ring(a);
    if (threadIdx.x == 0) {
        if (FD_PROF_ON) *(volatile u32*)((u8*)fd_smem() + FD_ISSUED_AT) = 0;
        for (int i = 0; i < ring.stages; i++) {
            mbar_init(ring.full + 8 * i, 1);
            mbar_init(ring.empty + 8 * i, FD_WARPS);
        }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        mbar_init_fence();
#endif
    }
    __syncthreads();  // the only barrier of all FD_BLOCK threads
    if (threadIdx.x >= FD_THREADS) {
        // Weights are no kernel's output: the producer starts before the PDL wait.
        if (threadIdx.x == FD_THREADS) fd_produce(layers, a, nq, nk, ring, prof);
        return;
    }
    FdCursor cur = {0, 0};  // stages consumed, as the producer counts them
    fd_pdl_wait();
    if (FD_PROF_ON && prof && threadIdx.x == 0 && blockIdx.x == 0) prof[0] = fd_now();
    u64 target = threadIdx.x == 0 ? fd_bar_base(bar) : 0;  // thread 0 runs the barriers
    const bool active = seqs[1] > 0;  // sequence 0: [row0, len, pos0, 0]
    const int pos = seqs[2];
    const auto none = [] {};
    // The profile's inner view (CTA 0's thread 0), per GEMV phase (buffer slots): its input
    // load, the wait for its first stage and the rest (20..31), the stages the producer had
    // issued beyond the phase's first (32..35), the time to reach the first stage's wait
    // (36..39) and whether that stage was already full (40..43). Summed over the step in
    // registers and added to the buffer once at its end: a global read-modify-write per phase
    // would put an L2 round trip into what it measures.
    const bool inner = FD_PROF_ON && prof && threadIdx.x == 0 && blockIdx.x == 0;
    u64 in_acc[36] = {};
    u64 t0 = 0, t1 = 0, c1 = 0, ready[5] = {0, 0, 0, 0, 0};
#define FD_LOADED(ph)                                                                \
    if (inner) {                                                                     \
        t1 = fd_now();                                                               \
        in_acc[3 * (ph)] += t1 - t0;                                                 \
        in_acc[12 + (ph)] += *(volatile u32*)((u8*)fd_smem() + FD_ISSUED_AT) - cur.t; \
        ready[0] = ready[3] = ready[4] = 0;                                          \
        c1 = fd_cycles();                                                            \
    }
#define FD_DONE(ph)                                        \
    if (inner) {                                           \
        const u64 t2 = fd_now();                           \
        if (ready[0] == 0) ready[0] = ready[1] = t1;       \
        in_acc[3 * (ph) + 1] += ready[0] - t1;             \
        in_acc[3 * (ph) + 2] += t2 - ready[0];             \
        in_acc[16 + (ph)] += ready[1] - t1;                \
        in_acc[20 + (ph)] += ready[2];                     \
        in_acc[24 + (ph)] += ready[3];                     \
        in_acc[28 + (ph)] += ready[4];                     \
        in_acc[32 + (ph)] += fd_cycles() - c1;             \
    }
#define FD_START if (inner) t0 = fd_now();
    u64* rp = inner ? ready : nullptr;
    for (int li = 0; li < a.n_layers; li++) {
        const u64* L = layers + (i64)li * L_FIELDS;
        const int slot = li * 5;
        FD_START
        fd_load_normed<BF16>(x, fd_v(L, L_IN_NORM), a.hidden, a.eps, xs, red);
        FD_LOADED(0)
        int g0 = 0;  // the phase's row groups before the piece
#pragma unroll
        for (int m = 0; m < 3; m++) {
            const FdPiece pc = fd_piece(L, a, nq, nk, 0, m);
            fd_gemv<BF16, 0>(pc, a, ring, cur, g0, xs, fd_sm + a.hidden, fd_v(L, L_BQ + m),
                             m == 0 ? q : m == 1 ? k : v, gate, rp);
            g0 += fd_groups(pc);
        }
        FD_DONE(0)
        fd_grid_sync(bar, target, prof, slot, [&] {
            if (!active) return;
            if (li == 0) fd_attn_prefetch<D>(L, a, tables, pos);  // later layers: see below
            fd_prefetch_vec(fd_v(L, L_Q_NORM), D * 4);
            fd_prefetch_vec(fd_v(L, L_K_NORM), D * 4);
            if (pos < a.max_pos) fd_prefetch_vec(cs + (i64)pos * a.rope_dims, a.rope_dims * 4);
        });

        fd_attention<D>(L, a, q, k, v, att, ws, done, tables, pos, active, cs, fd_sm, last_flag);
        fd_grid_sync(bar, target, prof, slot + 1, none);

        FD_START
        fd_load_vec<BF16>(att, nq, xs);
        FD_LOADED(1)
        fd_gemv<BF16, 5>(fd_piece(L, a, nq, nk, 1, 0), a, ring, cur, 0, xs, fd_sm + nq, nullptr, x,
                         gate, rp);
        FD_DONE(1)
        fd_grid_sync(bar, target, prof, slot + 2,
                     [&] { fd_prefetch_vec(fd_v(L, L_POST_NORM), a.hidden * 4); });

        FD_START
        fd_load_normed<BF16>(x, fd_v(L, L_POST_NORM), a.hidden, a.eps, xs, red);
        FD_LOADED(2)
        // The same lanes finish gate group j and up group j: the up row finds its gate sum.
        const FdPiece pg = fd_piece(L, a, nq, nk, 2, 0);
        fd_gemv<BF16, 3>(pg, a, ring, cur, 0, xs, fd_sm + gate_end, nullptr, act, gate, rp);
        fd_gemv<BF16, 4>(fd_piece(L, a, nq, nk, 2, 1), a, ring, cur, fd_groups(pg), xs,
                         fd_sm + gate_end, nullptr, act, gate, rp);
        FD_DONE(2)
        fd_grid_sync(bar, target, prof, slot + 3, none);

        FD_START
        fd_load_vec<BF16>(act, a.inter, xs);
        FD_LOADED(3)
        fd_gemv<BF16, 5>(fd_piece(L, a, nq, nk, 3, 0), a, ring, cur, 0, xs, fd_sm + a.inter, nullptr,
                         x, gate, rp);
        FD_DONE(3)
        if (li + 1 < a.n_layers) {
            const u64* N = L + L_FIELDS;
            fd_grid_sync(bar, target, prof, slot + 4, [&] {
                // The next layer's K/V history now, so it arrives while its QKV phase runs.
                if (active) fd_attn_prefetch<D>(N, a, tables, pos);
                fd_prefetch_vec(fd_v(N, L_IN_NORM), a.hidden * 4);
                fd_prefetch_vec(fd_v(N, L_BQ), nq * 4);
                fd_prefetch_vec(fd_v(N, L_BK), nk * 4);
                fd_prefetch_vec(fd_v(N, L_BV), nk * 4);
            });
        }
    }
#undef FD_LOADED
#undef FD_DONE
#undef FD_START
    if (FD_PROF_ON && prof && threadIdx.x == 0)
        atomicMax((unsigned long long*)prof + 1, (unsigned long long)fd_now());
    if (inner) {
#pragma unroll
        for (int i = 0; i < 36; i++) prof[20 + i] += in_acc[i];
    }
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
    const char* gemvs[4] = {"qkv", "o", "gate_up", "down"};
    printf("[fused profile] inner, CTA 0 thread 0, per layer (us):");
    for (int ph = 0; ph < 4; ph++) {
        const u64* in = prof + 20 + 3 * ph;
        const double per = n * n_layers;
        printf(" %s load %.2f first stage %.2f rest %.2f ahead %.1f%s", gemvs[ph],
               in[0] * us / per, in[1] * us / per, in[2] * us / per, prof[32 + ph] / per,
               ph == 3 ? "\n" : " |");
    }
    printf("[fused profile] first stage: entry (us) / already full at entry (fraction):");
    for (int ph = 0; ph < 4; ph++) {
        const double per = n * n_layers;
        printf(" %s %.2f / %.2f%s", gemvs[ph], prof[36 + ph] * us / per, prof[40 + ph] / per,
               ph == 3 ? "\n" : " |");
    }
    printf("[fused profile] cycles per layer (CTA 0 thread 0): GEMV phase / waiting for stages /"
           " stages not full at arrival:");
    for (int ph = 0; ph < 4; ph++) {
        const double per = n * n_layers;
        printf(" %s %.0f / %.0f / %.2f%s", gemvs[ph], prof[52 + ph] / per, prof[44 + ph] / per,
               prof[48 + ph] / per, ph == 3 ? "\n" : " |");
    }
    printf("[fused profile] CTA 0's producer: blocked on a free slot %.1f%% of its %.0f cycles a step\n",
           100.0 * prof[56] / (double)(prof[57] ? prof[57] : 1), prof[57] / n);
    for (int i = 0; i < 18; i++) sum[i] = 0;
    for (int i = 20; i < FD_PROF_SLOTS; i++) prof[i] = 0;
}

#define FD_KERNEL(D, NAME, BF16)                                                               \
    extern "C" __global__ void __launch_bounds__(FD_BLOCK, 1) decode_fused_##NAME##_##D(     \
        const u64* layers, float* x, float* q, float* k, float* v, float* att, float* act,     \
        float* ws, int* done, u64* bar, const int* tables, const int* seqs, const float* cs,   \
        u64* prof, const FusedArgs a) {                                                        \
        fd_step<D, BF16>(layers, x, q, k, v, att, act, ws, done, bar, tables, seqs, cs, prof, a); \
    }
FD_KERNEL(64, bf16, true)
FD_KERNEL(128, bf16, true)
FD_KERNEL(64, f16, false)
FD_KERNEL(128, f16, false)
