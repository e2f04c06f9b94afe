#!/usr/bin/env bash
# The fused decode step (issue 9: every layer of a batch-1 decode step in one persistent launch,
# crates/afm-runtime/src/cuda/kernels/decode_fused.cu) on a GPU: correctness, then speed.
#
#   scripts/fused_decode_check.sh build   here, no GPU: the CUDA builds of tests/fused_decode.rs
#                                         and the engine examples gpu_bench and graph_check,
#                                         packed into target/cuda/h19/bins.tar.xz, plus
#                                         target/cuda/h19/run.sh (this script). Carry
#                                         target/cuda/h19.
#   target/cuda/h19/run.sh test           on the GPU machine, repo root: random bf16 models
#                                         (qwen3-0.6b; qwen2.5-0.5b: Q/K/V biases, 7 query heads
#                                         per KV head, hidden 896 = rows not a multiple of the
#                                         weight stream's step), the fused step against the layer
#                                         loop (tests/fused_decode.rs), then graph_check on
#                                         qwen3-0.6b with the fused step on.
#   target/cuda/h19/run.sh bench          batch-1 decode tok/s through the engine (graphs, device
#                                         sampling) on qwen3-0.6b and qwen3-8b: the layer loop
#                                         (AFM_FUSED_DECODE=0), fused (=1), then fused with
#                                         AFM_FUSED_PROFILE=1 (per-phase µs per layer, printed by
#                                         the GPU every 64 steps: "[fused profile]" lines).
#                                         BENCH_MODES picks among 0 1 profile.
#   TEST_MODELS / BENCH_MODELS            override the model lists (names of
#                                         scripts/gpu_random_models.py).
# Every command has a timeout; a hung grid barrier traps after 2 s by itself.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# Copied into target/cuda/<dir> (CALLS_DIR at build, default h19) it runs from there.
case "$here" in
*/target/cuda/*) cd "$here/../../.." && H=target/cuda/${here##*/} ;;
*) cd "$here/.." && H=${CALLS_DIR:-target/cuda/h19} ;;
esac
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
        models=${TEST_MODELS:-qwen3-0.6b qwen2.5-0.5b}
        gen $models
        export AFM_TEST_DEVICE=cuda AFM_FIXTURES_DIR="$PWD/tests/fixtures/tiny"
        AFM_FUSED_MODELS=$(for m in $models; do printf '%s,' "$R/$m"; done)
        export AFM_FUSED_MODELS=${AFM_FUSED_MODELS%,}
        echo "== fused step vs layer loop (tests/fused_decode.rs) on $models"
        check timeout 300 "$B/fused_decode" --nocapture --test-threads=1
        echo "== graph_check qwen3-0.6b (fused step on)"
        AFM_FUSED_DECODE=1 check timeout 200 "$B/graph_check" "$R/qwen3-0.6b" cuda
    else
        models=${BENCH_MODELS:-qwen3-0.6b qwen3-8b}
        gen $models
        for m in $models; do
            for mode in ${BENCH_MODES:-0 1 profile}; do
                # 0: the layer loop; 1: fused; profile: fused with its profile.
                fused=1 prof=0
                [ "$mode" = 0 ] && fused=0
                [ "$mode" = profile ] && prof=1
                envs="AFM_FUSED_DECODE=$fused AFM_FUSED_PROFILE=$prof"
                echo "== $m batch 1, $envs"
                log="$B/$m-$mode.log"
                env $envs timeout 240 "$B/gpu_bench" "$R/$m" cuda 1 128 256 "" y >"$log" 2>&1 ||
                    failed+=("gpu_bench $m $envs")
                grep -E 'tok/s|RESULT|rror|panic|FAIL|trap' "$log" | cut -c1-600
                grep -F '[fused profile]' "$log" | tail -n 5
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
    echo "usage: scripts/fused_decode_check.sh build | target/cuda/h19/run.sh test|bench" >&2
    exit 2
    ;;
esac
