#!/usr/bin/env python3
"""The two ceilings of the GPU, measured in the same run as the benchmarks (METHOD.md): a large
device-to-device copy (bytes read + written) and a large bf16 GEMM on random data. Prints one
JSON line: {"copy_tb_s": ..., "gemm_tflops": ..., "device": ...}."""
import json

import torch


def timed(f, reps):
    for _ in range(3):
        f()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        f()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / 1e3 / reps


x = torch.randn(1 << 30, device="cuda")
y = torch.empty_like(x)
copy = 2 * 4 * (1 << 30) / timed(lambda: y.copy_(x), 20) / 1e12
del x, y
n = 8192
a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
gemm = 2 * n**3 / timed(lambda: a @ b, 10) / 1e12
print(json.dumps({"device": torch.cuda.get_device_name(), "copy_tb_s": round(copy, 3),
                  "gemm_tflops": round(gemm, 1)}))
