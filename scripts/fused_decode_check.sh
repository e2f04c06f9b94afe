#!/usr/bin/env bash
# The fused decode step (issue 9: every layer of a batch-1 decode step in one persistent launch,
# crates/afm-runtime/src/cuda/kernels/decode_fused.cu) on a GPU: correctness, then speed.
#
#   scripts/fused_decode_check.sh build   here, no GPU: the CUDA builds of tests/fused_decode.rs
#                                         and the engine examples gpu_bench and graph_check,
#                                         packed into target/cuda/h17/bins.tar.xz, plus
#                                         target/cuda/h17/run.sh (this script). Carry
#                                         target/cuda/h17.
#   target/cuda/h17/run.sh test           on the GPU machine, repo root (~3-5 min): random bf16
#                                         models (qwen3-0.6b, qwen2.5-0.5b: Q/K/V biases and 7
#                                         query heads per KV head, smollm2-135m: llama, head_dim
#                                         64), the fused step against the layer loop
#                                         (tests/fused_decode.rs), then graph_check on two of them.
#   target/cuda/h17/run.sh bench          batch-1 decode tok/s through the engine (graphs, device
#                                         sampling) on qwen3-0.6b and qwen3-8b, old path
#                                         (AFM_FUSED_DECODE=0) then fused (=1) (~5-8 min with the 8B
#                                         model's generation).
# Every command has a timeout; a hung grid barrier traps after 2 s by itself.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
case "$here" in
*/target/cuda/h17) cd "$here/../../.." ;;
*) cd "$here/.." ;;
esac
H=target/cuda/h17
R=${RANDOM_MODELS_DIR:-/tmp/afm-gpucheck}
case "${1:-}" in
build)
    set -e
    mkdir -p "$H"
    export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target/cuda}
    exe=$(cargo test --release -p afm-models --features cuda --test fused_decode --no-run \
        --message-format=json | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") \
            and m["target"]["name"] == "fused_decode":
        print(m["executable"])')
    cp "$exe" "$H/fused_decode"
    cargo build --release -p afm-engine --features cuda --example gpu_bench --example graph_check
    cp "$CARGO_TARGET_DIR/release/examples/gpu_bench" "$CARGO_TARGET_DIR/release/examples/graph_check" "$H/"
    (cd "$H" && strip --strip-debug fused_decode gpu_bench graph_check &&
        tar cJf bins.tar.xz fused_decode gpu_bench graph_check && rm -f fused_decode gpu_bench graph_check)
    cp scripts/fused_decode_check.sh "$H/run.sh"
    chmod +x "$H/run.sh"
    du -sh "$H"
    ;;
test | bench)
    B=$(mktemp -d)
    tar xJf "$H/bins.tar.xz" -C "$B" || exit 1
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    failed=()
    check() { "$@" || failed+=("$*"); }
    gen() {
        for m in "$@"; do
            [ -d "$R/$m" ] || timeout 600 python3 scripts/gpu_random_models.py "$R" "$m" || failed+=("generate $m")
        done
    }
    if [ "$1" = test ]; then
        gen qwen3-0.6b qwen2.5-0.5b smollm2-135m
        export AFM_TEST_DEVICE=cuda AFM_FIXTURES_DIR="$PWD/tests/fixtures/tiny"
        export AFM_FUSED_MODELS="$R/qwen3-0.6b,$R/qwen2.5-0.5b,$R/smollm2-135m"
        echo "== fused step vs layer loop (tests/fused_decode.rs)"
        check timeout 400 "$B/fused_decode" --nocapture --test-threads=1
        for m in qwen3-0.6b qwen2.5-0.5b; do
            echo "== graph_check $m (fused step on)"
            check timeout 300 "$B/graph_check" "$R/$m" cuda
        done
    else
        gen qwen3-0.6b qwen3-8b
        for m in qwen3-0.6b qwen3-8b; do
            for fused in 0 1; do
                echo "== $m batch 1, AFM_FUSED_DECODE=$fused"
                log="$B/$m-$fused.log"
                AFM_FUSED_DECODE=$fused timeout 300 "$B/gpu_bench" "$R/$m" cuda 1 128 256 "" y >"$log" 2>&1 ||
                    failed+=("gpu_bench $m AFM_FUSED_DECODE=$fused")
                grep -E 'tok/s|RESULT|rror|panic|FAIL' "$log" | cut -c1-600
            done
        done
    fi
    if [ ${#failed[@]} -gt 0 ]; then
        printf 'FAILED: %s\n' "${failed[@]}"
        exit 1
    fi
    echo "all passed"
    ;;
*)
    echo "usage: scripts/fused_decode_check.sh build | target/cuda/h17/run.sh test|bench" >&2
    exit 2
    ;;
esac
