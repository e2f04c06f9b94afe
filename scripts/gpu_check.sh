#!/usr/bin/env bash
# The general runtime's models on a GPU against the CPU (issue 9 item 5), and first decode speeds.
#
#   scripts/gpu_check.sh build   here, no GPU needed: the CUDA builds of the reference-logits test,
#                                the DeepSeek V4 test (tests/deepseek_v4.rs), the compute-dispatch
#                                unit tests, the kernel tests (tests/cuda_ops.rs,
#                                cuda_attention_mma.rs, cuda_gemv_int8.rs, cuda_mmq.rs,
#                                cuda_mmh.rs, cuda_fused.rs, cuda_gemv_rows.rs,
#                                cuda_attend_prologue.rs) and
#                                examples/device_compare, plus
#                                subsets of the real GGUFs in models/ (scripts/gguf_subset.py),
#                                all into target/cuda/gpucheck (~45 MB, the binaries packed in
#                                bins.tar.xz: carry that folder).
#   scripts/gpu_check.sh run     on the GPU machine, from the repo root (needs python3 with torch,
#                                transformers and a CUDA device 0). MODELS picks the random models
#                                (none: skip them); GGUFS=0 skips the real-GGUF subsets.
#
# `run` checks: each CUDA kernel against the CPU (the kernel tests); every dispatch op on the GPU
# against the CPU; transformers' logits on the tiny
# fixtures (relative error <= 1e-3 in f32; DeepSeek V4's own test: prefill, decode, chunks, two
# sequences, rejected drafts, ratio 128, an f16 pool); CPU vs GPU greedy and logits on the real-GGUF subsets and
# on real-shape random bf16 models; the engine's GPU decode path (CUDA graphs + device sampling)
# against its host path on the same requests (graph_check, from `bench/gpu_bench.sh build`; on
# the random models also at 64 rows, AFM_GRAPH_CHECK_COPIES=8: a full graph bucket, so the
# eager and graph GEMMs have the same shapes); the
# fused batch-1 decode step against the layer loop on the random llama/qwen2/qwen3 models
# (tests/fused_decode.rs).
# Speed: bench/gpu_bench.sh. GPUCHECK_DIR and CARGO_TARGET_DIR override the folders.
set -euo pipefail
cd "$(dirname "$0")/.."
D=${GPUCHECK_DIR:-target/cuda/gpucheck}
G=${GPU_BIN_DIR:-target/cuda/gpubench}
case "${1:-}" in
build)
    mkdir -p "$D"
    export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target/cuda}
    json=$(cargo test --release -p afm-models -p afm-runtime --features afm-runtime/cuda \
        --no-run --message-format=json)
    kernel_tests="cuda_ops:cuda_ops cuda_attention_mma:cuda_attention_mma cuda_gemv_int8:cuda_gemv_int8 cuda_mmq:cuda_mmq cuda_mmh:cuda_mmh cuda_fused:cuda_fused cuda_gemv_rows:cuda_gemv_rows cuda_attend_prologue:cuda_attend_prologue"
    for pair in reference_logits:reference_logits deepseek_v4:deepseek_v4 fused_decode:fused_decode afm_runtime:runtime_lib $kernel_tests; do
        exe=$(printf '%s\n' "$json" | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"] \
            and m["target"]["name"] == sys.argv[1]:
        print(m["executable"])' "${pair%%:*}")
        cp "$exe" "$D/${pair##*:}"
    done
    cargo build --release -p afm-models --features cuda --example device_compare
    cp "$CARGO_TARGET_DIR/release/examples/device_compare" "$D/"
    bins="reference_logits deepseek_v4 fused_decode runtime_lib device_compare cuda_ops cuda_attention_mma cuda_gemv_int8 cuda_mmq cuda_mmh cuda_fused cuda_gemv_rows cuda_attend_prologue"
    # Stripped and packed: the folder travels to the GPU machine beside the working tree (64 MiB).
    (cd "$D" && strip --strip-debug $bins && tar cJf bins.tar.xz $bins && rm -f $bins gguf_new_families)
    M=${MODELS_DIR:-models}
    [ -f "$D/qwen2.5-l1-v4k.gguf" ] || python3 scripts/gguf_subset.py "$M/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf" "$D/qwen2.5-l1-v4k.gguf" 1 4096
    [ -f "$D/gemma3-l2-v4k.gguf" ] || python3 scripts/gguf_subset.py "$M/gemma-3-270m-q4_k_m.gguf" "$D/gemma3-l2-v4k.gguf" 2 4096
    [ -f "$D/smollm2-l2-v4k.gguf" ] || python3 scripts/gguf_subset.py "$M/SmolLM2-135M-Instruct.Q4_1.gguf" "$D/smollm2-l2-v4k.gguf" 2 4096
    du -sh "$D"
    ;;
run)
    export AFM_TEST_DEVICE=cuda AFM_FIXTURES_DIR="$PWD/tests/fixtures/tiny" PYTHONUNBUFFERED=1
    B=$(mktemp -d)
    tar xJf "$D/bins.tar.xz" -C "$B"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    # Every check runs even when one fails; the exit status says whether all passed.
    failed=()
    check() { "$@" || failed+=("$*"); }
    for t in cuda_ops cuda_attention_mma cuda_gemv_int8 cuda_mmq cuda_mmh cuda_fused cuda_gemv_rows cuda_attend_prologue; do
        echo "== kernel tests: $t"
        check "$B/$t" --test-threads=1
    done
    echo "== compute dispatch on the GPU vs the CPU"
    check "$B/runtime_lib" compute --test-threads=1
    echo "== transformers reference logits on the GPU"
    check "$B/reference_logits"
    echo "== DeepSeek V4 against transformers on the GPU"
    check "$B/deepseek_v4" --nocapture
    for g in "$D"/*.gguf; do
        [ "${GGUFS:-1}" = 0 ] && break
        echo "== $g"
        check "$B/device_compare" "$g" cuda 32 32 16 1
        echo "== $g: GPU decode path (graphs + device sampling) vs host path"
        check "$G/graph_check" "$g" cuda
    done
    models=${MODELS:-qwen3-0.6b}
    [ "$models" = none ] && models=
    [ -z "$models" ] || [ -d "/tmp/afm-gpucheck/${models%%,*}" ] || python3 scripts/gpu_random_models.py /tmp/afm-gpucheck "$models"
    fused=()
    for m in ${models//,/ }; do
        case $m in qwen3-0.6b | qwen3-8b | qwen2.5-* | smollm2-*) fused+=("/tmp/afm-gpucheck/$m") ;; esac
    done
    if [ ${#fused[@]} -gt 0 ]; then
        echo "== fused decode step vs the layer loop (tests/fused_decode.rs): $models"
        check env AFM_FUSED_MODELS="$(IFS=,; echo "${fused[*]}")" "$B/fused_decode" --nocapture --test-threads=1
    fi
    for m in ${models//,/ }; do
        echo "== $m"
        check "$B/device_compare" "/tmp/afm-gpucheck/$m" cuda 32 32 16 1
        echo "== $m: GPU decode path (graphs + device sampling) vs host path"
        check "$G/graph_check" "/tmp/afm-gpucheck/$m" cuda
        echo "== $m: the same at 64 rows (cuBLAS GEMMs, tensor-core decode attention)"
        AFM_GRAPH_CHECK_COPIES=8 check "$G/graph_check" "/tmp/afm-gpucheck/$m" cuda
    done
    if [ ${#failed[@]} -gt 0 ]; then
        printf 'FAILED: %s\n' "${failed[@]}"
        exit 1
    fi
    echo "all GPU checks passed"
    ;;
*)
    echo "usage: scripts/gpu_check.sh build|run" >&2
    exit 2
    ;;
esac
