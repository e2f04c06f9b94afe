// 16-bit weights times 1..64 activation rows on tensor cores (MMH): out[n][row] = x[n] . W[row]
// for W bf16 or f16 [rows][cols] row-major (cols a multiple of 64), x f32 [n][cols] rounded to
// the weights' type as it is staged (round to nearest even, as elementwise.cu's f32_to_bf16 /
// f32_to_f16, which the cuBLAS path runs first), f32 accumulation. One launch replaces that
// conversion plus one cuBLAS GEMM per matrix.
//
// mma.sync m16n8k16 (.bf16 or .f16, f32 accumulate). Fragment layout (PTX ISA, "Matrix Fragments
// for mma.m16n8k16 with floating point type"; lane = 4g + t, g = lane >> 2, t = lane & 3; a
// 32-bit register holds two 16-bit values, the lower k in the low half), as attention_mma.cu:
//   A 16x16 (row-major)  a0: (row g, k 2t..2t+1)    a1: (row g+8, k 2t..2t+1)
//                        a2: (row g, k 2t+8..2t+9)  a3: (row g+8, k 2t+8..2t+9)
//   B 16x8 (k x n)       b0: (k 2t..2t+1, col g)    b1: (k 2t+8..2t+9, col g)
//   C 16x8 f32           c0, c1: (row g, cols 2t, 2t+1)  c2, c3: (row g+8, cols 2t, 2t+1)
// A dot product does not depend on the order of k, so A and B may take any one assignment of a
// chunk's columns to the mma's k slots. A chunk of 64 columns is four mma (j = 0..3), and lane t
// holds columns 8t..8t+7 and 32+8t..32+8t+7 of its rows: two 16-byte shared-memory loads per
// row. mma j gives lane t's k slots 2t, 2t+1, 2t+8, 2t+9 to the columns 32(j >> 1) + 8t +
// 4(j & 1) + 0..3, in A (weights) and B (activations) alike, so the A registers are the loaded
// words as they are and B is x's same columns packed in pairs:
//   j = 0: a0 = row g .x, a2 = row g .y, a1/a3 = row g+8 .x/.y of the first load,
//          b0 = x cols 8t, 8t+1, b1 = 8t+2, 8t+3
//   j = 1: the same with .z, .w and x cols 8t+4..8t+7;  j = 2, 3: the second load's and
//          x cols 32+8t..32+8t+7.
//
// Tiling. A block of W warps (4 or 8) owns 32W consecutive weight rows (warp w: two 16-row
// tiles, rows 32w.. of the block), or for gate+up 16W rows of both (warp w: gate rows 16w.. and
// the same up rows, so act(gate) * up is formed from its two tiles), and every activation row
// (NT tiles of 8). blockIdx.y = s of `splits` takes chunks [s nch / splits, (s+1) nch / splits)
// of the nch = cols / 64. Every weight byte is read once per call; x is re-read by each block
// from L2 (f32: at 64 rows and 8 warps half a byte per weight byte, as cuBLAS's bf16 x with its
// 128-row tiles).
//
// Pipeline. The block copies each chunk's weights (32W rows x 128 bytes) and x (8NT rows x 64
// f32, rows >= n zero-filled) global -> shared by cp.async into a ring of ST stages (4 with 8
// warps, 6 with 4), up to ST - 1 chunks ahead of the one its warps multiply, one barrier per
// chunk. While the warps multiply chunk c, the block rounds chunk c + 1's x (landed) to 16-bit
// pairs into the other half of a double buffer (cvt.rn.{bf16,f16}x2.f32: round to nearest
// even, as f2bf / f2h), so chunks c + 2 .. c + ST - 1 are in flight (64 KB per block, about
// twice what the copy bandwidth needs per SM at a microsecond's latency) and x is rounded once
// per block rather than once per warp. The weights of the first chunks are asked for before
// pdl_begin (they do not depend on the kernel before; x and the outputs do). Each warp reads
// its A registers from the stage (one 16-byte load per row and half chunk: the layout above).
//
//   stage: [32W rows][8 segments of 16 bytes] weights, segment s of row r stored at s ^ 4(r & 1)
//          (a quarter warp reads rows g, g+1 at segments t or 4+t: no bank conflict), then
//          [8NT rows][64] f32 x
//   xb (after the ring, two buffers): u32 [8NT][MMH_XB_STRIDE = 48], row c's 64 columns as 32
//          pairs, then 16 words of padding (192-byte rows: a quarter warp's two rows land on
//          different banks)
//   block row r of the stage: rows b 32W + r of the block's matrix, or for gate+up gate rows
//   b 16W + r (r < 16W) then up rows b 16W + r - 16W; rows past a matrix repeat its last row
//   (their outputs are not stored)
//
// Split-K (splits > 1): each block writes its C fragments, in fragment order, to `part`
// ([block][split][2 NT][32 W] float4). Then either (fixup) it counts itself in done[block] and
// the last of the block's splits to arrive sums the splits' partials in split order, writes the
// output and sets done[block] back to 0 (no second launch, but one block reads all splits'
// partials); or mmh_reduce, launched next, sums them in split order with every SM. Either way
// the sum's order is fixed, so the result does not depend on scheduling.
// accumulate != 0: out += result (the residual add of the O and down projections).

#define MMH_XB_STRIDE 48
#define MMH_CHUNK 64

// Up to three matrices of one type and width against the same activations (Q, K, V): the first
// ceil(r0 / rb) blocks serve W0, the next ceil(r1 / rb) W1, the rest W2 (rows 0 for absent ones;
// rb = 32 W). For gate+up (act >= 0) w0 is the gate, w1 the up matrix (rows r0, output o0) and
// rb = 16 W. Fields, not arrays: a kernel parameter indexed at run time would go to the stack.
struct MmhMats {
    const u16 *w0, *w1, *w2;
    float *o0, *o1, *o2;
    int r0, r1, r2;
};

// 16 bytes global -> shared without registers (cp.async, sm_80+), or 16 zero bytes when !ok
// (nothing read then). Before sm_80 a plain copy (these kernels are not launched there).
__device__ __forceinline__ void mmh_cp16(void* dst, const void* src, bool ok) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(a), "l"(src),
                 "r"(ok ? 16 : 0)
                 : "memory");
#else
    *(uint4*)dst = ok ? *(const uint4*)src : make_uint4(0u, 0u, 0u, 0u);
#endif
}

__device__ __forceinline__ void mmh_cp_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

// Waits until at most N of this thread's copy groups are pending.
template <int N>
__device__ __forceinline__ void mmh_cp_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}

__device__ __forceinline__ float mmh_act(float x, int act) {
    if (act == 0) return x / (1.0f + expf(-x));  // SiLU, as gemv.cu's gemv_silu
    const float C = 0.7978846f;                  // GELU tanh: sqrt(2/pi), as gemv_gelu_tanh
    return 0.5f * x * (1.0f + tanhf(C * (x + 0.044715f * x * x * x)));
}

// A warp's place: its two 16-row tiles (matrix and first row), the block's matrix and output.
struct MmhWarp {
    const u16* w[2];
    int row0[2];
    int rows;
    float* out;
    bool active;  // the warp has rows (a block's last warps may not)
};

// Warp `warp` of row block b in a launch of W warps per block.
__device__ __forceinline__ MmhWarp mmh_warp(const MmhMats& m, int act, int b, int warp, int W) {
    MmhWarp l;
    if (act >= 0) {
        const int rb = 16 * W;
        l.w[0] = m.w0;
        l.w[1] = m.w1;
        l.row0[0] = l.row0[1] = b * rb + 16 * warp;
        l.rows = m.r0;
        l.out = m.o0;
    } else {
        const int rb = 32 * W, nb0 = (m.r0 + rb - 1) / rb, nb1 = (m.r1 + rb - 1) / rb;
        const u16* w = m.w0;
        l.out = m.o0;
        l.rows = m.r0;
        if (b >= nb0 + nb1) {
            b -= nb0 + nb1;
            w = m.w2;
            l.out = m.o2;
            l.rows = m.r2;
        } else if (b >= nb0) {
            b -= nb0;
            w = m.w1;
            l.out = m.o1;
            l.rows = m.r1;
        }
        l.w[0] = l.w[1] = w;
        l.row0[0] = b * rb + 32 * warp;
        l.row0[1] = l.row0[0] + 16;
    }
    l.active = l.row0[0] < l.rows;
    return l;
}

// The ring's stages, bytes of one stage, and of all the dynamic shared memory: the ring, then
// the two 16-bit x buffers (cuda/mmh.rs `smem_bytes` computes the same).
template <int NT, int W>
struct MmhSmem {
    static constexpr int ST = W == 8 ? 4 : 6;
    static constexpr int W_BYTES = 32 * W * 2 * MMH_CHUNK;
    static constexpr int STAGE = W_BYTES + 8 * NT * MMH_CHUNK * 4;
    static constexpr int XB = 8 * NT * MMH_XB_STRIDE * 4;
    static constexpr int BYTES = ST * STAGE + 2 * XB;
};

// 16-byte pieces a thread copies per chunk: weights 32W rows x 8 = 8 per thread, x 8NT rows x 16
// spread over the block (some threads none at small NT).
template <int NT, int W>
struct MmhX {
    static constexpr int PER = (NT * 128 + 32 * W - 1) / (32 * W);
};

// This thread's weight pieces k = 0..7: block row (tid >> 3) + 4W k, segment tid & 7 (8 threads
// per 128-byte row: coalesced); src[k] points at the piece in chunk 0.
template <int W>
__device__ __forceinline__ void mmh_w_sources(const MmhMats& m, int act, int cols,
                                              const u16* (&src)[8]) {
    const int r0 = threadIdx.x >> 3, seg = threadIdx.x & 7;
    const MmhWarp l = mmh_warp(m, act, blockIdx.x, 0, W);  // the block's first rows
#pragma unroll
    for (int k = 0; k < 8; k++) {
        const int r = r0 + 4 * W * k;
        // Gate+up: gate rows first (k < 4: r < 16W), then the same up rows.
        const bool up = act >= 0 && k >= 4;
        const int row = min(l.row0[0] + (up ? r - 16 * W : r), l.rows - 1);
        src[k] = (up ? l.w[1] : l.w[0]) + (i64)row * cols + 8 * seg;
    }
}

// Asks for chunk c's weights into stage `st` (segment swizzled: see the stage layout).
template <int W>
__device__ __forceinline__ void mmh_copy_w(unsigned char* st, const u16* const (&src)[8], int c) {
    const int r0 = threadIdx.x >> 3, seg = threadIdx.x & 7;
    unsigned char* d = st + r0 * 2 * MMH_CHUNK + 16 * (seg ^ ((r0 & 1) << 2));
#pragma unroll
    for (int k = 0; k < 8; k++)
        mmh_cp16(d + k * 4 * W * 2 * MMH_CHUNK, src[k] + MMH_CHUNK * c, true);
}

// Asks for chunk c's activations (rows >= n zero) into stage `st`.
template <int NT, int W>
__device__ __forceinline__ void mmh_copy_x(unsigned char* st, const float* x, int cols, int n,
                                           int c) {
    float* xs = (float*)(st + MmhSmem<NT, W>::W_BYTES);
#pragma unroll
    for (int i = 0; i < MmhX<NT, W>::PER; i++) {
        const int idx = threadIdx.x + 32 * W * i, row = idx >> 4, c4 = idx & 15;
        if (idx < NT * 128) {
            const bool ok = row < n;
            const float* p = ok ? x + (i64)row * cols + MMH_CHUNK * c + 4 * c4 : x;
            mmh_cp16(xs + row * MMH_CHUNK + 4 * c4, p, ok);
        }
    }
}

// Rounds this thread's pieces of stage `st`'s x (the ones it copied) into the 16-bit buffer xb.
template <bool BF, int NT, int W>
__device__ __forceinline__ void mmh_round_x(const unsigned char* st, u32* xb) {
    const float* xs = (const float*)(st + MmhSmem<NT, W>::W_BYTES);
#pragma unroll
    for (int i = 0; i < MmhX<NT, W>::PER; i++) {
        const int idx = threadIdx.x + 32 * W * i, row = idx >> 4, c4 = idx & 15;
        if (idx < NT * 128) {
            const float4 v = *(const float4*)(xs + row * MMH_CHUNK + 4 * c4);
            *(uint2*)(xb + row * MMH_XB_STRIDE + 2 * c4) =
                make_uint2(pack16x2<BF>(v.x, v.y), pack16x2<BF>(v.z, v.w));
        }
    }
}

// One chunk: weights from stage `st`, x from the 16-bit buffer xb. Per half chunk q, the A
// registers of each weight tile (rows g and g + 8 of the tile at block row rt[mt]; columns
// 32q + 8t..+7) and per activation tile x's same columns as B; 2 mma per (q, weight tile,
// activation tile).
template <bool BF, int NT>
__device__ __forceinline__ void mmh_chunk(const unsigned char* st, const u32* xb,
                                          const int (&rt)[2], int g, int t,
                                          float (&acc)[2][NT][4]) {
    const int sw = (g & 1) << 2;  // rt[mt] + 8h + g has g's parity
#pragma unroll
    for (int q = 0; q < 2; q++) {
        uint4 a[2][2];
#pragma unroll
        for (int mt = 0; mt < 2; mt++)
#pragma unroll
            for (int h = 0; h < 2; h++)
                a[mt][h] = *(const uint4*)(st + (rt[mt] + 8 * h + g) * 2 * MMH_CHUNK +
                                           16 * ((4 * q + t) ^ sw));
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            const uint4 b = *(const uint4*)(xb + (8 * nt + g) * MMH_XB_STRIDE + 16 * q + 4 * t);
#pragma unroll
            for (int mt = 0; mt < 2; mt++) {
                const uint4 &r = a[mt][0], &s = a[mt][1];  // rows g and g + 8
                mma_m16n8k16<BF>(acc[mt][nt], r.x, s.x, r.y, s.y, b.x, b.y);
                mma_m16n8k16<BF>(acc[mt][nt], r.z, s.z, r.w, s.w, b.z, b.w);
            }
        }
    }
}

// Writes a lane's results of activation tile nt (element e of weight tile mt: row row0[mt] + g +
// 8 (e >> 1), activation row 8 nt + 2t + (e & 1)), or for gate+up act(gate) * up; accumulate:
// added to the output.
__device__ __forceinline__ void mmh_store_tile(const float (&v)[2][4], const MmhWarp& l, int g,
                                               int t, int nt, int n, int act, int accumulate) {
#pragma unroll
    for (int e = 0; e < 4; e++) {
        const int col = 8 * nt + 2 * t + (e & 1);
        if (col >= n) continue;
#pragma unroll
        for (int mt = 0; mt < 2; mt++) {
            if (act >= 0 && mt == 1) break;
            const int row = l.row0[mt] + g + 8 * (e >> 1);
            if (row >= l.rows) continue;
            float r = act >= 0 ? mmh_act(v[0][e], act) * v[1][e] : v[mt][e];
            float* o = l.out + (i64)col * l.rows + row;
            if (accumulate) r += *o;
            *o = r;
        }
    }
}

template <int NT>
__device__ __forceinline__ void mmh_store(const float (&acc)[2][NT][4], const MmhWarp& l, int g,
                                          int t, int n, int act, int accumulate) {
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        const float v[2][4] = {{acc[0][nt][0], acc[0][nt][1], acc[0][nt][2], acc[0][nt][3]},
                               {acc[1][nt][0], acc[1][nt][1], acc[1][nt][2], acc[1][nt][3]}};
        mmh_store_tile(v, l, g, t, nt, n, act, accumulate);
    }
}

// Split-K partials: [block][split][2 NT][32 W] float4, a thread's float4s adjacent to its
// neighbours' (coalesced), element (mt, nt) at index mt NT + nt.
__device__ __forceinline__ i64 mmh_part_at(int b, int s, int splits, int q, int nt2, int threads,
                                           int tid) {
    return (((i64)b * splits + s) * nt2 + q) * threads + tid;
}

template <int NT, int W>
__device__ __forceinline__ void mmh_write_part(const float (&acc)[2][NT][4], float4* part,
                                               int splits) {
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            const float* a = acc[mt][nt];
            part[mmh_part_at(blockIdx.x, blockIdx.y, splits, mt * NT + nt, 2 * NT, 32 * W,
                             threadIdx.x)] = make_float4(a[0], a[1], a[2], a[3]);
        }
}

// Split-K in the kernel: publishes this split's fragments; returns whether this block is its
// row block's last split, which then holds the sum of all splits (in split order) in acc.
template <int NT, int W>
__device__ __forceinline__ bool mmh_fixup(float (&acc)[2][NT][4], float4* part, int* done,
                                          int splits, bool active) {
    const int s = blockIdx.y, tid = threadIdx.x;
    float4* base = part + (i64)blockIdx.x * splits * (2 * NT) * (32 * W);
    if (active) mmh_write_part<NT, W>(acc, part, splits);
    __shared__ int last;
    __threadfence();
    __syncthreads();
    if (tid == 0) {
        int* c = done + blockIdx.x;
        last = atomicAdd(c, 1) == splits - 1;
        if (last) *c = 0;  // every split has counted: ready for the next launch
    }
    __syncthreads();
    if (!last) return false;
    __threadfence();
    if (!active) return true;
    // Splits in order; this block's own from its registers (the same bits). Each split's 2 NT
    // loads go out together: the last block reads splits x 2 NT x 32 W float4, a latency chain
    // of `splits` L2 round trips.
    float sum[2][NT][4];
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) sum[mt][nt][e] = 0.f;
    for (int sp = 0; sp < splits; sp++) {
        float4 p[2][NT];
#pragma unroll
        for (int mt = 0; mt < 2; mt++)
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                const float* a = acc[mt][nt];
                // Past L1: other blocks wrote these.
                p[mt][nt] = sp == s ? make_float4(a[0], a[1], a[2], a[3])
                                    : __ldcg(base + ((i64)sp * 2 * NT + mt * NT + nt) * (32 * W) + tid);
            }
#pragma unroll
        for (int mt = 0; mt < 2; mt++)
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                float* v = sum[mt][nt];
                v[0] += p[mt][nt].x;
                v[1] += p[mt][nt].y;
                v[2] += p[mt][nt].z;
                v[3] += p[mt][nt].w;
            }
    }
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[mt][nt][e] = sum[mt][nt][e];
    return true;
}

template <bool BF, int NT, int W>
__device__ __forceinline__ void mmh(const MmhMats& m, const float* x, float4* part, int* done,
                                    int cols, int n, int splits, int fixup, int pf, int act,
                                    int accumulate) {
    extern __shared__ __align__(16) unsigned char mmh_smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const MmhWarp l = mmh_warp(m, act, blockIdx.x, warp, W);
    // The warp's two tiles as block rows of a stage.
    const int rt[2] = {act >= 0 ? 16 * warp : 32 * warp,
                       act >= 0 ? 16 * W + 16 * warp : 32 * warp + 16};
    const u16* src[8];
    mmh_w_sources<W>(m, act, cols, src);
    // L2 prefetch `pf` chunks ahead (0: none): lane L asks for the 128-byte line of the warp's
    // row L (tile L >> 4, row L & 15); only useful past the ST - 1 chunks in flight.
    // (Selected, not indexed: a run-time index would put `l` on the stack.)
    const bool pf_hi = lane >= 16;
    const u16* pfp = (pf_hi ? l.w[1] : l.w[0]) +
                     (i64)min((pf_hi ? l.row0[1] : l.row0[0]) + (lane & 15), l.rows - 1) * cols;
    const int nch = cols / MMH_CHUNK, s = blockIdx.y;
    const int c0 = (int)((i64)nch * s / splits), c1 = (int)((i64)nch * (s + 1) / splits);
    float acc[2][NT][4];
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[mt][nt][e] = 0.f;
    using S = MmhSmem<NT, W>;
    // Prologue: the first S::ST - 1 chunks' weights before waiting for the kernel before
    // (which x comes from), then their x, one copy group per chunk (the first holds all their
    // weights too); then the first chunk's x rounded into xb(0).
    // xb(k): buffer k & 1 (arithmetic, not an array: a run-time index would go to the stack).
    u32* const xb0 = (u32*)(mmh_smem + S::ST * S::STAGE);
    auto xb = [xb0](int k) { return xb0 + (k & 1) * (S::XB / 4); };
#pragma unroll
    for (int d = 0; d < S::ST - 1; d++)
        if (c0 + d < c1) mmh_copy_w<W>(mmh_smem + d * S::STAGE, src, c0 + d);
    pdl_begin();
#pragma unroll
    for (int d = 0; d < S::ST - 1; d++) {
        if (c0 + d < c1) mmh_copy_x<NT, W>(mmh_smem + d * S::STAGE, x, cols, n, c0 + d);
        mmh_cp_commit();
    }
    if (c0 < c1) {
        mmh_cp_wait<S::ST - 2>();  // chunk c0's group (each thread rounds its own copies)
        mmh_round_x<BF, NT, W>(mmh_smem, xb(0));
    }
    for (int c = c0; c < c1; c++) {
        const int i = c - c0;
        // Chunk c + 1's group has landed (the groups of the S::ST - 3 chunks after it may
        // be pending); after the barrier every warp is past chunk c - 1, so its stage takes
        // chunk c + S::ST - 1 and its x buffer chunk c + 1's rounded x, and xb(i)
        // (chunk c's, rounded in the step before) is complete.
        mmh_cp_wait<S::ST - 3>();
        __syncthreads();
        const int cn = c + S::ST - 1;
        if (cn < c1) {
            unsigned char* st = mmh_smem + ((i + S::ST - 1) % S::ST) * S::STAGE;
            mmh_copy_w<W>(st, src, cn);
            mmh_copy_x<NT, W>(st, x, cols, n, cn);
        }
        mmh_cp_commit();  // empty past the end: the count of groups stays one per chunk
        if (c + 1 < c1) mmh_round_x<BF, NT, W>(mmh_smem + ((i + 1) % S::ST) * S::STAGE, xb(i + 1));
        if (l.active && pf > 0 && c + pf < c1) prefetch_l2(pfp + MMH_CHUNK * (c + pf));
        if (l.active) mmh_chunk<BF, NT>(mmh_smem + (i % S::ST) * S::STAGE, xb(i), rt, g, t, acc);
    }
    if (splits > 1 && !fixup) {
        if (l.active) mmh_write_part<NT, W>(acc, part, splits);  // mmh_reduce sums them
        return;
    }
    if (splits > 1 && !mmh_fixup<NT, W>(acc, part, done, splits, l.active)) return;
    if (l.active) mmh_store<NT>(acc, l, g, t, n, act, accumulate);
}

// Split-K after the main kernel (fixup == 0): one thread per (row block, activation tile nt,
// main-kernel thread) sums that thread's two float4 of every split in split order (all loads
// in flight at once: one L2 round trip) and stores them as the main kernel would have.
#define MMH_MAX_SPLITS 16
extern "C" __global__ void mmh_reduce(MmhMats m, const float4* part, int blocks, int splits,
                                      int nt_count, int warps, int n, int act, int accumulate) {
    pdl_begin();
    const int threads = 32 * warps;
    const i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x;
    if (i >= (i64)blocks * nt_count * threads) return;
    const int tid = (int)(i % threads), nt = (int)(i / threads % nt_count);
    const int b = (int)(i / ((i64)threads * nt_count));
    const int lane = tid & 31, g = lane >> 2, t = lane & 3;
    const MmhWarp l = mmh_warp(m, act, b, tid >> 5, warps);
    if (!l.active) return;
    float4 p[MMH_MAX_SPLITS][2];
#pragma unroll
    for (int s = 0; s < MMH_MAX_SPLITS; s++)
#pragma unroll
        for (int mt = 0; mt < 2; mt++)
            if (s < splits)
                p[s][mt] = __ldcg(part + mmh_part_at(b, s, splits, mt * nt_count + nt,
                                                     2 * nt_count, threads, tid));
    float v[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int s = 0; s < MMH_MAX_SPLITS; s++)
#pragma unroll
        for (int mt = 0; mt < 2; mt++)
            if (s < splits) {
                v[mt][0] += p[s][mt].x;
                v[mt][1] += p[s][mt].y;
                v[mt][2] += p[s][mt].z;
                v[mt][3] += p[s][mt].w;
            }
    mmh_store_tile(v, l, g, t, nt, n, act, accumulate);
}

// mmh_<bf16|f16>_w<W>_<NT>: activation rows 8 (NT - 1) + 1 ..= 8 NT; grid (row blocks, splits)
// of 32 W threads (cuda/mmh.rs picks W and the splits). `part` and `done`: split-K scratch
// (unused when splits == 1; done zero between launches); fixup: 1 = the last split to arrive
// sums the partials in the kernel, 0 = mmh_reduce (launched next) does; pf: L2 prefetch
// distance in chunks (0: none). Dynamic shared memory: MmhSmem<NT, W>::BYTES.
#define MMH(T, BF, W, NT)                                                                      \
    extern "C" __global__ void __launch_bounds__(32 * W) mmh_##T##_w##W##_##NT(                \
        MmhMats m, const float* x, float4* part, int* done, int cols, int n, int splits,      \
        int fixup, int pf, int act, int accumulate) {                                          \
        mmh<BF, NT, W>(m, x, part, done, cols, n, splits, fixup, pf, act, accumulate);         \
    }
#define MMH_ALL(NT) MMH(bf16, true, 4, NT) MMH(bf16, true, 8, NT) MMH(f16, false, 4, NT) \
    MMH(f16, false, 8, NT)

MMH_ALL(1)
MMH_ALL(2)
MMH_ALL(3)
MMH_ALL(4)
MMH_ALL(5)
MMH_ALL(6)
MMH_ALL(7)
MMH_ALL(8)
