#!/usr/bin/env bash
# Builds afm-runtime's CUDA test and benchmark binaries (feature `cuda`, ../shared/GPU.md
# Route B: cudarc loads libcuda/libnvrtc/libcublas at run time, so no CUDA toolkit is needed
# here) into target/cuda, leaving target/'s CPU build alone, and copies them, stripped, to
# target/cuda/bin/{cuda_ops,cuda_gemv_int8,cuda_attention_mma,cuda_bench} for the GPU machine
# (carry target/cuda/bin).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR=target/cuda
mkdir -p target/cuda/bin
json=$(cargo test -p afm-runtime --features cuda --release --no-run --message-format=json \
    --test cuda_ops --test cuda_gemv_int8 --test cuda_attention_mma --bench cuda_bench)
for name in cuda_ops cuda_gemv_int8 cuda_attention_mma cuda_bench; do
    exe=$(printf '%s\n' "$json" | python3 -c '
import json, sys
name = sys.argv[1]
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == name:
        print(m["executable"])' "$name")
    cp "$exe" "target/cuda/bin/$name"
    strip --strip-debug "target/cuda/bin/$name" 2>/dev/null || true
    echo "target/cuda/bin/$name ($(du -h "target/cuda/bin/$name" | cut -f1))"
done
