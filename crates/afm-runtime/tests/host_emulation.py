"""What the host emulations of the CUDA kernels share (gemv_int8_, mmq_ and
mmh_host_emulation.py): a kernel's source and the functions cut out of it or taken from it, the
build of the emulation with g++ in a scratch folder after host_emulation.h (the stand-ins for
CUDA and common.cuh), a grid of blocks run one at a time as std::threads (GRID, for the
emulations whose warps act together), and on the Python side random GGML weights,
quantize_x_q8's int8 rounding of activations, the two gated activations and the relative error.
The warp operations each emulation replaces, its driver and what it checks stay in its script.
"""
import os
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
KERNELS = os.path.join(HERE, "../src/cuda/kernels")
HEADER = os.path.join(HERE, "host_emulation.h")


def source(name):
    """The text of src/cuda/kernels/`name` (a kernel module, or common.cuh)."""
    with open(os.path.join(KERNELS, name)) as f:
        return f.read()


def _span(text, sig):
    """Where the definition whose first line contains `sig` starts (a `template` line right
    above it included) and ends (its closing brace, and a `;` right after it)."""
    if sig not in text:
        raise SystemExit(f"host emulation: {sig!r} is no longer in the kernel source")
    at = text.index(sig)
    i = text.rfind("\n", 0, at) + 1
    above = text.rfind("\n", 0, i - 1) + 1
    if text[above:i].startswith("template"):
        i = above
    depth = 0
    for m in range(text.index("{", at), len(text)):
        if text[m] == "{":
            depth += 1
        elif text[m] == "}":
            depth -= 1
            if depth == 0:
                end = m + 1
                if text[end:end + 1] == ";":
                    end += 1
                return i, end
    raise SystemExit("host emulation: unbalanced braces after " + sig)


def cut(text, *sigs):
    """`text` without the definitions whose signatures contain `sigs` (the emulation supplies
    its own)."""
    for sig in sigs:
        i, end = _span(text, sig)
        text = text[:i] + text[end:]
    return text


def extract(text, sig):
    """The definition whose signature contains `sig`, as written."""
    i, end = _span(text, sig)
    return text[i:end] + "\n"


def build(code, prefix):
    """Compiles host_emulation.h then `code` into ./emu in a fresh scratch folder `prefix`*,
    which becomes the working folder (the drivers read and write their files there); prints the
    compiler's errors and exits if it fails."""
    os.chdir(tempfile.mkdtemp(prefix=prefix))
    with open("emu.cpp", "w") as f:
        f.write(f'#include "{HEADER}"\n' + code)
    r = subprocess.run(["g++", "-O2", "-std=c++20", "-pthread", "-ffp-contract=off", "-o", "emu", "emu.cpp"],
                       capture_output=True, text=True)
    if r.returncode:
        print(r.stderr[:6000])
        sys.exit(1)


# A grid on the host, for emulations that run a block's threads together: blocks one at a time
# (in grid order, or shuffled by `seed`), each as `threads` std::threads with a barrier of the
# block (__syncthreads) and one per warp (warp_bar, for the emulated warp collectives). One block
# at a time, so __shared__ arrays may be static. `before_block` runs before a block's threads
# start, `after_thread` in each thread after the kernel.
GRID = r'''
#include <barrier>
#include <random>
#include <thread>
#include <vector>
struct Dim { unsigned x, y, z; };
static thread_local Dim threadIdx;
static Dim blockIdx, blockDim;
#define __shared__ static
static std::barrier<>* block_bar;
static std::barrier<>* warp_bar[8];
static inline void __syncthreads() { block_bar->arrive_and_wait(); }

template <class F, class B, class A>
static void run_grid(unsigned gx, unsigned gy, unsigned threads, unsigned seed, F f, B before_block,
                     A after_thread) {
    blockDim.x = threads;
    std::vector<std::pair<unsigned, unsigned>> order;
    for (unsigned y = 0; y < gy; y++)
        for (unsigned x = 0; x < gx; x++) order.push_back({x, y});
    if (seed) std::shuffle(order.begin(), order.end(), std::mt19937(seed));
    for (auto [x, y] : order) {
        blockIdx.x = x;
        blockIdx.y = y;
        std::barrier<> bb(threads);
        for (unsigned w = 0; w < threads / 32; w++) warp_bar[w] = new std::barrier<>(32);
        block_bar = &bb;
        before_block();
        std::vector<std::thread> ts;
        for (unsigned t = 0; t < threads; t++)
            ts.emplace_back([t, &f, &after_thread] { threadIdx.x = t; f(); after_thread(); });
        for (auto& t : ts) t.join();
        for (unsigned w = 0; w < threads / 32; w++) delete warp_bar[w];
    }
}
template <class F>
static void run_grid(unsigned blocks, unsigned threads, F f) {
    run_grid(blocks, 1, threads, 0, f, [] {}, [] {});
}
'''


# GGML blocks (values, bytes) by gguf's type name (gguf itself is not needed here).
BLOCK = {"Q4_K": (256, 144), "Q6_K": (256, 210), "Q8_0": (32, 34)}


def type_code(t):
    """The kernels' code for gguf type `t` (Q4_K 0, Q6_K 1, Q8_0 2)."""
    return {"Q4_K": 0, "Q6_K": 1, "Q8_0": 2}[t.name]


def random_weight(rng, t, rows, cols):
    """A `rows` x `cols` matrix of gguf type `t` (Q4_K, Q6_K, Q8_0) as bytes: random quants and
    scales, small positive f16 super-scales (a valid encoding)."""
    bw, bb = BLOCK[t.name]
    nblk = rows * cols // bw
    b = rng.integers(0, 256, size=(nblk, bb), dtype=np.uint8)
    sc = lambda: np.float16(0.002 + 0.01 * rng.random(nblk)).view(np.uint8).reshape(nblk, 2)
    if t.name == "Q8_0":
        b[:, 0:2] = sc()
    elif t.name == "Q4_K":
        b[:, 0:2] = sc()
        b[:, 2:4] = sc()
    else:
        b[:, 208:210] = sc()
    return b.reshape(rows, -1)


def quant8(x):
    """quantize_x_q8 in f32: q = rint(x * (127/amax)), d = amax/127, s = d * sum(q)."""
    xb = x.reshape(-1, 32).astype(np.float32)
    amax = np.abs(xb).max(axis=1)
    with np.errstate(divide="ignore"):
        idv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(xb * idv[:, None]).astype(np.int32)
    d = (amax / np.float32(127)).astype(np.float32)
    s = (d * q.sum(axis=1).astype(np.float32)).astype(np.float32)
    return q.astype(np.int8), d, s


def int8_values(q, d, shape):
    """The activations the int8 kernels multiply: q * d per block of 32, in f64."""
    return (q.astype(np.float64).reshape(-1, 32) * d[:, None]).reshape(shape)


# The gated activations (act 0 = SiLU, 1 = GELU tanh), as elementwise.cu's gated_act.
ACTS = [lambda g: g / (1 + np.exp(-g)),
        lambda g: 0.5 * g * (1 + np.tanh(0.7978846 * (g + 0.044715 * g ** 3)))]


def rel(a, b):
    """||a - b|| / ||b||, in f64."""
    return float(np.linalg.norm(a.astype(np.float64) - b) / np.linalg.norm(b))
