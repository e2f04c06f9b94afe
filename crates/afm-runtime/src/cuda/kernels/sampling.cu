// Choosing the next token on the device, one block of 1024 threads per row of logits, so only
// the token id crosses to the host.
//
// sample_rows follows afm-engine's Sampler::draw: top-k by (logit desc, id asc), softmax with
// temperature over those, top-p (shortest prefix whose mass reaches top_p), min-p (relative to
// the best), then a draw r = u * kept_mass walked in sorted order. Candidates are the tokens with
// p >= e^-30 * p_max (the rest hold under 1e-13 of the best token's mass each), narrowed by
// top-k and min-p; up to SAMPLE_CAP of them are sorted and the draw equals the engine's for the
// same u. Flatter rows take the unsorted path: the same kept set and distribution, drawn in id
// order. Bias and penalties are applied to the logits beforehand.

#define SAMPLE_THREADS 1024

// Calls f(value, index) for every logit of a row, each thread in increasing index order;
// 16-byte loads when the row allows (a pass is latency-bound in one block otherwise).
template <typename F>
__device__ __forceinline__ void for_each_logit(const float* x, int vocab, F f) {
    if ((vocab & 3) == 0 && ((u64)x & 15) == 0) {
        const float4* x4 = (const float4*)x;
#pragma unroll 4
        for (int k = threadIdx.x; k < vocab / 4; k += blockDim.x) {
            const float4 v = x4[k];
            f(v.x, 4 * k); f(v.y, 4 * k + 1); f(v.z, 4 * k + 2); f(v.w, 4 * k + 3);
        }
    } else {
#pragma unroll 4
        for (int k = threadIdx.x; k < vocab; k += blockDim.x) f(x[k], k);
    }
}
#define SAMPLE_CAP 4096
#define SAMPLE_BINS 2048

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    argmax_rows(const float* logits, int* out, int vocab) { pdl_begin();
    __shared__ float shv[32];
    __shared__ int shi[32];
    const float* x = logits + (i64)blockIdx.x * vocab;
    float v = NEG_INF;
    int i = 0x7fffffff;
    for_each_logit(x, vocab, [&](float y, int k) {
        if (y > v || i == 0x7fffffff) { v = y; i = k; }
    });
    block_argmax(v, i, shv, shi);
    if (threadIdx.x == 0) out[blockIdx.x] = i;
}

// Ascending order of keys = descending logit, then ascending id.
__device__ __forceinline__ u32 ord_key(float v) {
    const u32 b = __float_as_uint(v);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);  // ascending with v
}
__device__ __forceinline__ float key_value(u32 k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}
__device__ __forceinline__ u64 sort_key(float v, int id) {
    return ((u64)(~ord_key(v)) << 32) | (u32)id;
}

__device__ int count_at_least(const float* x, int vocab, float t, int* shi) {
    int c = 0;
    for_each_logit(x, vocab, [&](float y, int) { c += y >= t; });
    return block_sum_int(c, shi);
}

__device__ float block_scan_excl(float v, float* sh, float& total);

// A floor at or below the k-th largest value with few values above it, from one histogram
// pass over SAMPLE_BINS equal bins of [floor_v, best]: the lower edge of the bin where the
// count from the top reaches k (a little lower still, against rounding).
__device__ float topk_floor(const float* x, int vocab, float best, float floor_v, int k,
                            int* hist, float* shv, int* shi) {
    const float w = (best - floor_v) / SAMPLE_BINS;
    if (!(w > 0.f)) return floor_v;
    for (int i = threadIdx.x; i < SAMPLE_BINS; i += blockDim.x) hist[i] = 0;
    __syncthreads();
    for_each_logit(x, vocab, [&](float v, int) {
        if (v >= floor_v) atomicAdd(&hist[min(SAMPLE_BINS - 1, (int)((best - v) / w))], 1);
    });
    __syncthreads();
    // Bins per thread: SAMPLE_BINS / blockDim.x = 2.
    const int b0 = 2 * threadIdx.x;
    const int c0 = hist[b0], c1 = hist[b0 + 1];
    float total;
    const int before = (int)block_scan_excl((float)(c0 + c1), shv, total);
    int bin = 0x7fffffff;
    if (before < k && before + c0 + c1 >= k) bin = before + c0 >= k ? b0 : b0 + 1;
    bin = block_min_int(bin, shi);
    if (bin == 0x7fffffff) return floor_v;
    return fmaxf(floor_v, best - (bin + 1) * w * 1.0001f - 1e-6f * fabsf(best));
}

// The k-th largest value (k >= 1) by bisection over the ordered bit patterns.
__device__ float kth_value(const float* x, int vocab, int k, int* shi) {
    u32 lo = 0, hi = 0xffffffffu;  // largest t with count(key >= t) >= k
    while (lo < hi) {
        const u32 mid = lo + (u32)(((u64)hi - lo + 1) >> 1);
        int c = 0;
        for_each_logit(x, vocab, [&](float y, int) { c += ord_key(y) >= mid; });
        if (block_sum_int(c, shi) >= k) lo = mid; else hi = mid - 1;
    }
    return key_value(lo);
}

// Exclusive prefix of v over the block in thread order, and the block total.
__device__ float block_scan_excl(float v, float* sh, float& total) {
    float incl = v;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const float y = __shfl_up_sync(FULL_MASK, incl, o);
        if (lane >= o) incl += y;
    }
    __syncthreads();
    if (lane == 31) sh[w] = incl;
    __syncthreads();
    if (w == 0) {
        float t = lane < (int)(blockDim.x >> 5) ? sh[lane] : 0.f;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const float y = __shfl_up_sync(FULL_MASK, t, o);
            if (lane >= o) t += y;
        }
        sh[lane] = t;
    }
    __syncthreads();
    total = sh[31];
    return incl - v + (w > 0 ? sh[w - 1] : 0.f);
}

// Sorted path: the candidates (x >= floor_v, at most SAMPLE_CAP) are sorted, then top-k,
// top-p, min-p and the draw walk them in the engine's order.
__device__ int sample_sorted(const float* x, int vocab, float floor_v, float temp, int top_k,
                             float top_p, float min_p, float u, u64* keys, float* shv, int* shi,
                             int* n_cand) {
    const int tid = threadIdx.x;
    if (tid == 0) *n_cand = 0;
    __syncthreads();
    for_each_logit(x, vocab, [&](float y, int k) {
        if (y >= floor_v) {
            const int slot = atomicAdd(n_cand, 1);
            if (slot < SAMPLE_CAP) keys[slot] = sort_key(y, k);
        }
    });
    __syncthreads();
    const int n = min(*n_cand, SAMPLE_CAP);
    int n2 = 2;
    while (n2 < n) n2 <<= 1;
    for (int k = n + tid; k < n2; k += blockDim.x) keys[k] = ~0ull;
    __syncthreads();
    for (int size = 2; size <= n2; size <<= 1) {  // bitonic sort, ascending
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            for (int t = tid; t < n2 / 2; t += blockDim.x) {
                const int i = 2 * t - (t & (stride - 1)), j = i + stride;
                const u64 a = keys[i], b = keys[j];
                if ((a > b) == ((i & size) == 0)) { keys[i] = b; keys[j] = a; }
            }
            __syncthreads();
        }
    }
    // Unnormalized probabilities of the top k, 4 per thread, and their inclusive prefix.
    const int k = top_k > 0 ? min(top_k, n) : n;
    const float l0 = x[(u32)keys[0]];
    int ids[4];
    float p[4], run = 0.f;
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const int i = 4 * tid + j;
        ids[j] = i < n2 ? (int)(u32)keys[i] : 0;
        p[j] = i < k ? expf((x[ids[j]] - l0) / temp) : 0.f;
        run += p[j];
    }
    float total_k;
    float cum = block_scan_excl(run, shv, total_k);
    float cums[4];
#pragma unroll
    for (int j = 0; j < 4; j++) {
        cum += p[j];
        cums[j] = cum;
        const int i = 4 * tid + j;
        if (i < n2) keys[i] = ((u64)__float_as_uint(cum) << 32) | (u32)ids[j];
    }
    int keep = k;
    if (top_p < 1.f) {
        int first = 0x7fffffff;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int i = 4 * tid + j;
            if (i < k && cums[j] >= top_p * total_k) first = min(first, i);
        }
        first = block_min_int(first, shi);
        if (first != 0x7fffffff) keep = first + 1;
    }
    if (min_p > 0.f) {
        int c = 0;
#pragma unroll
        for (int j = 0; j < 4; j++) c += (4 * tid + j < k) && p[j] >= min_p;
        keep = min(keep, max(block_sum_int(c, shi), 1));
    }
    __syncthreads();
    const float r = u * __uint_as_float((u32)(keys[keep - 1] >> 32));
    int pick = 0x7fffffff;
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const int i = 4 * tid + j;
        if (i < keep && cums[j] >= r) pick = min(pick, i);
    }
    pick = block_min_int(pick, shi);
    if (pick == 0x7fffffff) pick = keep - 1;
    return (int)(u32)keys[pick];
}

// Unsorted path, for more candidates than fit: the kept set by thresholds (top-k by count,
// top-p by mass, both found by bisection over the ordered bit patterns; min-p per token), then
// the draw walks the kept tokens in id order. The same distribution as the engine's, though a
// given u may pick a different token.
__device__ int sample_unsorted(const float* x, int vocab, float l0, int best_id, float temp,
                               int top_k, float top_p, float min_p, float u, float* shv,
                               int* shi) {
    const float inv_t = 1.0f / temp;
    const float t_k = (top_k > 0 && top_k < vocab) ? kth_value(x, vocab, top_k, shi) : NEG_INF;
    float t_keep = t_k;
    if (top_p < 1.f) {
        float s = 0.f;
        for_each_logit(x, vocab, [&](float y, int) {
            if (y >= t_k) s += expf((y - l0) * inv_t);
        });
        const float target = top_p * block_sum(s, shv);
        u32 lo = ord_key(t_k), hi = ord_key(l0);  // largest t with mass(x >= t) >= target
        while (lo < hi) {
            const u32 mid = lo + (u32)(((u64)hi - lo + 1) >> 1);
            const float tv = key_value(mid);
            float m = 0.f;
            for_each_logit(x, vocab, [&](float y, int) {
                if (y >= tv) m += expf((y - l0) * inv_t);
            });
            if (block_sum(m, shv) >= target) lo = mid; else hi = mid - 1;
        }
        t_keep = fmaxf(t_keep, key_value(lo));
    }
    // Thread t owns ids [t*chunk, (t+1)*chunk), so thread order is id order.
    const int chunk = (vocab + blockDim.x - 1) / blockDim.x;
    const int i0 = min(vocab, (int)threadIdx.x * chunk), i1 = min(vocab, i0 + chunk);
    float mine = 0.f;
    for (int i = i0; i < i1; i++) {
        const float p = expf((x[i] - l0) * inv_t);
        if (x[i] >= t_keep && p >= min_p) mine += p;
    }
    float total;
    const float before = block_scan_excl(mine, shv, total);
    const float r = u * total;
    int pick = 0x7fffffff;
    if (mine > 0.f && before < r && r <= before + mine) {
        float acc = before;
        for (int i = i0; i < i1; i++) {
            const float p = expf((x[i] - l0) * inv_t);
            if (x[i] >= t_keep && p >= min_p) {
                acc += p;
                pick = i;  // the last kept one if rounding never reaches r
                if (acc >= r) break;
            }
        }
    }
    pick = block_min_int(pick, shi);
    return pick == 0x7fffffff ? best_id : pick;
}

// params per row: temperature, top_k (0 = off), top_p, min_p, u in [0, 1).
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    sample_rows(const float* logits, const float* params, int* out, int vocab) { pdl_begin();
    __shared__ u64 keys[SAMPLE_CAP];  // sort keys, then (cumulative mass bits << 32 | id)
    __shared__ int hist[SAMPLE_BINS];
    __shared__ float shv[32];
    __shared__ int shi[32];
    __shared__ int n_cand;
    const float* x = logits + (i64)blockIdx.x * vocab;
    const float* pr = params + blockIdx.x * 5;
    const float temp = pr[0], top_p = pr[2], min_p = pr[3], u = pr[4];
    const int top_k = (int)pr[1];

    float best = NEG_INF;
    int bi = 0x7fffffff;
    for_each_logit(x, vocab, [&](float y, int k) {
        if (y > best || bi == 0x7fffffff) { best = y; bi = k; }
    });
    block_argmax(best, bi, shv, shi);
    if (temp <= 0.f || best == NEG_INF || top_k == 1) {
        if (threadIdx.x == 0) out[blockIdx.x] = bi;
        return;
    }
    // Candidates: tokens within e^-30 of the best (the rest hold < 1e-13 of its mass each),
    // narrowed by min-p when top-p does not need the others' mass, and by top-k.
    float floor_v = best - 30.f * temp;
    if (min_p > 0.f && top_p >= 1.f) floor_v = fmaxf(floor_v, best + temp * logf(min_p) - 1e-3f * temp);
    int n = count_at_least(x, vocab, floor_v, shi);
    if (n > SAMPLE_CAP && top_k > 0 && top_k <= SAMPLE_CAP) {
        const float f = topk_floor(x, vocab, best, floor_v, top_k, hist, shv, shi);
        const int m = count_at_least(x, vocab, f, shi);
        if (m <= SAMPLE_CAP) {
            floor_v = f;
            n = m;
        } else {  // a crowded bin: the exact k-th value by bisection
            floor_v = fmaxf(floor_v, kth_value(x, vocab, top_k, shi));
            n = count_at_least(x, vocab, floor_v, shi);
        }
    }
    int pick;
    if (n <= SAMPLE_CAP) {
        pick = sample_sorted(x, vocab, floor_v, temp, top_k, top_p, min_p, u, keys, shv, shi,
                             &n_cand);
    } else {
        pick = sample_unsorted(x, vocab, best, bi, temp, top_k, top_p, min_p, u, shv, shi);
    }
    if (threadIdx.x == 0) out[blockIdx.x] = pick;
}

// Logit bias and repetition/presence/frequency penalties, as afm-engine's Sampler::process:
// one thread per (row, token) entry {row, token, bias, repetition, subtract} (floats as bits);
// each token appears once per row. l <- rep(l + bias) - subtract.
extern "C" __global__ void adjust_logits(float* logits, const int* e, int n, int vocab) { pdl_begin();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const int* p = e + 5 * i;
    const int row = p[0], tok = p[1];
    if (tok < 0 || tok >= vocab) return;
    const float bias = __int_as_float(p[2]), rep = __int_as_float(p[3]), sub = __int_as_float(p[4]);
    float* l = logits + (i64)row * vocab + tok;
    float v = *l + bias;
    if (rep != 1.f) v = v > 0.f ? v / rep : v * rep;
    *l = v - sub;
}
