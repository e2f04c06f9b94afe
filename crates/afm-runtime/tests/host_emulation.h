// Host stand-ins for what afm's CUDA kernels take from CUDA and from common.cuh, so that a
// kernel's own source compiles with g++ (C++20) in the CPU emulations: tests/*_host_emulation.py
// (through host_emulation.py) and scripts/*_emulate.cpp. Everything here behaves as on the
// device for one thread; what depends on how an emulation runs its threads (threadIdx and the
// other indices, barriers, shuffles, warp reductions, mma, ldmatrix, cp.async, shared memory)
// stays in each emulation.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

// common.cuh's fixed-width types and constants.
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;
#define NEG_INF (-INFINITY)
#define FULL_MASK 0xffffffffu

#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __align__(n) __attribute__((aligned(n)))
#define AFM_HOST_EMULATION

using std::max;
using std::min;

struct uint2 {
    u32 x, y;
};
struct uint4 {
    u32 x, y, z, w;
};
struct int2 {
    int x, y;
};
struct int4 {
    int x, y, z, w;
};
struct float2 {
    float x, y;
};
struct float4 {
    float x, y, z, w;
};
static inline uint2 make_uint2(u32 a, u32 b) { return {a, b}; }
static inline uint4 make_uint4(u32 a, u32 b, u32 c, u32 d) { return {a, b, c, d}; }
static inline float2 make_float2(float a, float b) { return {a, b}; }
static inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }

// Bit casts, and arithmetic rounded to nearest even (the host's default rounding mode).
static inline float __uint_as_float(u32 u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline u32 __float_as_uint(float f) {
    u32 u;
    memcpy(&u, &f, 4);
    return u;
}
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
static inline int __float2int_rn(float a) { return (int)nearbyintf(a); }
#define __expf expf

// common.cuh's conversions: f16 by bit arithmetic (as cvt.rn.f16.f32 and cvt.f32.f16, which
// common.cuh uses through PTX), bf16 as common.cuh writes it.
static inline u16 f2h(float f) {
    const u32 x = __float_as_uint(f);
    const u32 sign = (x >> 16) & 0x8000u;
    const u32 ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0);
    if (ax >= 0x477ff000u) return sign | 0x7c00u;  // rounds past the largest f16
    if (ax < 0x38800000u) {                        // subnormal f16 (or zero)
        const float a = __uint_as_float(ax);
        return sign | (u16)lrintf(a * 16777216.0f);  // units of 2^-24, ties to even
    }
    const u32 m = ax + 0xfffu + ((ax >> 13) & 1u);  // round the 13 dropped bits to even
    return sign | (u16)((m - 0x38000000u) >> 13);
}
static inline float h2f(u16 h) {
    const u32 sign = (u32)(h & 0x8000u) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
    if (e == 0) {
        const float f = ldexpf((float)m, -24);
        return sign ? -f : f;
    }
    return __uint_as_float(e == 31 ? (sign | 0x7f800000u | (m << 13))
                                   : (sign | ((e + 112) << 23) | (m << 13)));
}
static inline float bf2f(u16 b) { return __uint_as_float((u32)b << 16); }
static inline u16 f2bf(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (u16)(u >> 16);
}

// cvt.rn.{bf16,f16}x2.f32 as documented (common.cuh pack16x2): each value rounded to nearest
// even, a in the low half.
template <bool BF>
static inline u32 pack16x2(float a, float b) {
    const u16 lo = BF ? f2bf(a) : f2h(a), hi = BF ? f2bf(b) : f2h(b);
    return (u32)lo | ((u32)hi << 16);
}

// mma m16n8k16 (f32 accumulate) for lane l, from the fragments every lane of its warp posted:
// frag(ln, i) is lane ln's register i (a[0..3], then b0, b1); half(reg, hi) one 16-bit value
// of a register as f32 (hi: the upper half). The emulators post and synchronise; this is the
// layout (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type").
template <class Frag, class Half>
static inline void mma16816_lane(int l, float (&c)[4], Frag frag, Half half) {
    float A[16][16], B[16][8];
    for (int ln = 0; ln < 32; ln++) {
        const int g = ln / 4, t = ln % 4;
        for (int r = 0; r < 4; r++)
            for (int e = 0; e < 2; e++)
                A[g + 8 * (r % 2)][2 * t + 8 * (r / 2) + e] = half(frag(ln, r), e);
        for (int r = 0; r < 2; r++)
            for (int e = 0; e < 2; e++) B[2 * t + 8 * r + e][g] = half(frag(ln, 4 + r), e);
    }
    const int g = l / 4, t = l % 4;
    for (int e = 0; e < 4; e++) {
        const int row = g + 8 * (e / 2), col = 2 * t + e % 2;
        float s = c[e];
        for (int k = 0; k < 16; k++) s += A[row][k] * B[k][col];
        c[e] = s;
    }
}

// common.cuh's little-endian loads from 2-byte-aligned GGML blocks.
static inline u16 ld16(const u8* p) {
    u16 v;
    memcpy(&v, p, 2);
    return v;
}
static inline u32 ld32_a2(const u8* p) { return (u32)ld16(p) | ((u32)ld16(p + 2) << 16); }

// Memory: loads through the caches are plain loads; the fence and atomics are sequentially
// consistent (stronger than the device's).
template <class T>
static inline T __ldg(const T* p) {
    return *p;
}
template <class T>
static inline T __ldcg(const T* p) {
    return *p;
}
static inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
static inline int atomicAdd(int* p, int v) { return std::atomic_ref<int>(*p).fetch_add(v); }
static inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
    return std::atomic_ref<unsigned long long>(*p).fetch_add(v);
}

// common.cuh's launch and cache hints do nothing here; an emulation that wants every L2
// prefetch checked (inside the weights, say) sets emu_prefetch_check.
static inline void pdl_begin() {}
static void (*emu_prefetch_check)(const void*) = nullptr;
static inline void prefetch_l2(const void* p) {
    if (emu_prefetch_check) emu_prefetch_check(p);
}

// For the emulations' drivers: a whole file, malloc'd (exits with status 2 if it cannot).
static inline char* read_file(const char* path, size_t& len) {
    FILE* f = fopen(path, "rb");
    if (!f) exit(2);
    fseek(f, 0, SEEK_END);
    len = ftell(f);
    fseek(f, 0, SEEK_SET);
    char* b = (char*)malloc(len);
    if (fread(b, 1, len, f) != len) exit(2);
    fclose(f);
    return b;
}
