#!/usr/bin/env bash
# afm on the GPU through the real engine (CUDA graphs, device sampling): batch-1 decode as a
# fraction of the bandwidth ceiling measured in the same run, aggregate decode at 1/8/32/64
# streams, TTFT at 1k and 16k prompts (issue 9 item 6).
#
#   bench/gpu_bench.sh build   here: the CUDA build of crates/afm-engine/examples/gpu_bench.rs and
#                              graph_check.rs into target/cuda/gpubench (carry that folder)
#   bench/gpu_bench.sh run     on the GPU machine, repo root: random-weight models of real shape
#                              (scripts/gpu_random_models.py), the ceilings (bench/gpu_ceilings.py),
#                              then gpu_bench per model; JSON lines into ${OUT:-bench/out}/gpu_bench.jsonl
#                              and a table on stdout. MODELS (default qwen3-0.6b,qwen3-8b),
#                              STREAMS (1,8,32,64), PROMPT (128), GEN (256), TTFT (1024,16384),
#                              EAGER=1 adds a run with graphs and device sampling off.
set -euo pipefail
cd "$(dirname "$0")/.."
B=${GPU_BIN_DIR:-target/cuda/gpubench}
case "${1:-}" in
build)
    mkdir -p "$B"
    export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target/cuda}
    cargo build --release -p afm-engine --features cuda --example gpu_bench --example graph_check
    for x in gpu_bench graph_check; do
        cp "$CARGO_TARGET_DIR/release/examples/$x" "$B/"
        strip --strip-debug "$B/$x"
    done
    du -sh "$B"
    ;;
run)
    O=${OUT:-bench/out}
    mkdir -p "$O"
    J="$O/gpu_bench.jsonl"
    : >"$J"
    export PYTHONUNBUFFERED=1
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.mem --format=csv,noheader
    models=${MODELS:-qwen3-0.6b,qwen3-8b}
    python3 bench/gpu_ceilings.py | tee -a "$J"
    for m in ${models//,/ }; do
        R=${RANDOM_MODELS_DIR:-/tmp/afm-gpucheck}
        [ -d "$R/$m" ] || python3 scripts/gpu_random_models.py "$R" "$m"
        echo "== $m"
        "$B/gpu_bench" "$R/$m" cuda "${STREAMS:-1,8,32,64}" "${PROMPT:-128}" \
            "${GEN:-256}" "${TTFT:-1024,16384}" y 2>&1 | tee "$O/$m.log" | grep -v '^RESULT' || true
        grep '^RESULT' "$O/$m.log" | sed 's/^RESULT //' >>"$J" || true
        if [ "${EAGER:-0}" = 1 ]; then
            "$B/gpu_bench" "$R/$m" cuda 1,64 "${PROMPT:-128}" "${GEN:-256}" "" n \
                2>&1 | tee "$O/$m-eager.log" | grep -v '^RESULT' || true
            grep '^RESULT' "$O/$m-eager.log" | sed 's/^RESULT //' >>"$J" || true
        fi
    done
    python3 bench/gpu_table.py "$J"
    ;;
*)
    echo "usage: bench/gpu_bench.sh build|run" >&2
    exit 2
    ;;
esac
