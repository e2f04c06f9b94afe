#!/usr/bin/env bash
# One GPU call of many small measurements (issue 9's A/B sessions), logs into $OUT.
#
#   scripts/gpu_calls.sh build [TEST ...]   here, no GPU: scripts/fused_decode_check.sh build
#                                           (gpu_bench, graph_check, fused_decode into
#                                           target/cuda/h19/bins.tar.xz), each CUDA test binary
#                                           named (default: cuda_skinny cuda_fused cuda_ops
#                                           cuda_mmh cuda_attend_prologue) and cuda_bench as
#                                           target/cuda/h19/<name>.xz, and this script as
#                                           target/cuda/h19/call.sh. Carry target/cuda/h19.
#   target/cuda/h19/call.sh "CMD" ...       on the GPU machine, repo root. Each CMD is
#                                           [NAME=VALUE ...] KIND [ARGS]: the assignments are its
#                                           environment. KINDs:
#     bench MODEL STREAMS       gpu_bench MODEL cuda STREAMS 128 256 "" y (graphs, device sampling)
#     ttft MODEL LENS           gpu_bench MODEL cuda "" 128 16 LENS y: time to first token (median
#                               of 3) at each prompt length of LENS (e.g. 1024,16384)
#     graph64                   graph_check on qwen3-0.6b, AFM_GRAPH_CHECK_COPIES=8 (64 rows)
#     t_TEST [ARGS]             a test binary, --test-threads=1 (timeout 300 s: a hang ends it)
#     tfd                       tests/fused_decode.rs on qwen3-0.6b
#     cb [SECTION]              cuda_bench
#     ncu MODEL STREAMS SKIP N  bench/ncu_kernels.py's per-kernel profile
#     gpucheck                  scripts/gpu_check.sh run (needs target/cuda/gpucheck carried too)
#   TIMEOUT=S among a CMD's assignments bounds it to S seconds (bench, graph64, t_, cb).
#   CALLS_DIR=target/cuda/<dir> at build puts everything there instead of target/cuda/h19, so
#   builds of two branches can travel in one call (carry both; run each dir's call.sh).
#   MODELs are scripts/gpu_random_models.py's names (qwen3-0.6b, qwen3-8b), made on first use.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# Copied into target/cuda/<dir> (CALLS_DIR at build, default h19) it runs from there.
case "$here" in
*/target/cuda/*) cd "$here/../../.." && H=target/cuda/${here##*/} ;;
*) cd "$here/.." && H=${CALLS_DIR:-target/cuda/h19} ;;
esac
R=${RANDOM_MODELS_DIR:-/tmp/afm-gpucheck}

exe_of() { # cargo's JSON on stdin -> the executable of target $1
    python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") \
            and m["target"]["name"] == sys.argv[1]:
        print(m["executable"])' "$1" | tail -1
}

if [ "${1:-}" = build ]; then
    set -e
    shift
    export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target/cuda}
    CALLS_DIR=$H bash scripts/fused_decode_check.sh build
    tests=("$@")
    [ ${#tests[@]} -gt 0 ] || tests=(cuda_skinny cuda_fused cuda_ops cuda_mmh cuda_attend_prologue)
    for t in "${tests[@]}"; do
        exe=$(cargo test --release -p afm-runtime --features cuda --test "$t" --no-run \
            --message-format=json | exe_of "$t")
        strip --strip-debug -o "$H/$t" "$exe" && xz -f "$H/$t"
    done
    exe=$(cargo bench -p afm-runtime --features cuda --bench cuda_bench --no-run \
        --message-format=json | exe_of cuda_bench)
    strip --strip-debug -o "$H/cuda_bench" "$exe" && xz -f "$H/cuda_bench"
    cp scripts/gpu_calls.sh "$H/call.sh"
    chmod +x "$H/call.sh"
    du -sh "$H"
    exit 0
fi

B=$(mktemp -d)
tar xJf "$H/bins.tar.xz" -C "$B" || exit 1
O=${OUT:-/tmp/out}
mkdir -p "$O"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
gen() { [ -d "$R/$1" ] || timeout 600 python3 scripts/gpu_random_models.py "$R" "$1" >/dev/null 2>&1 || echo "generate $1 failed"; }
unpack() { [ -x "$B/$1" ] || { xz -dc "$H/$1.xz" >"$B/$1" && chmod +x "$B/$1"; }; }
for c in "$@"; do
    read -ra w <<<"$c"
    envs=()
    while [ ${#w[@]} -gt 0 ] && [[ ${w[0]} == *=* ]]; do
        envs+=("${w[0]}")
        w=("${w[@]:1}")
    done
    # TIMEOUT=S among the assignments bounds this command (default: each kind's own).
    to=""
    for e in "${envs[@]}"; do [[ $e == TIMEOUT=* ]] && to=${e#TIMEOUT=}; done
    [ ${#w[@]} -gt 0 ] || continue
    name=$(echo "$c" | tr -c 'A-Za-z0-9_.-' '_' | cut -c1-90)
    log="$O/$name.log"
    echo "== $c ($(date +%T))"
    case "${w[0]}" in
    bench)
        gen "${w[1]}"
        env "${envs[@]}" timeout ${to:-400} "$B/gpu_bench" "$R/${w[1]}" cuda "${w[2]}" 128 256 "" y >"$log" 2>&1
        grep -E "^streams|error|panick" "$log" | tail -6
        ;;
    ttft)
        gen "${w[1]}"
        env "${envs[@]}" timeout ${to:-400} "$B/gpu_bench" "$R/${w[1]}" cuda "" 128 16 "${w[2]}" y >"$log" 2>&1
        grep -E "^TTFT|error|panick" "$log" | tail -6
        ;;
    graph64)
        gen qwen3-0.6b
        env "${envs[@]}" AFM_GRAPH_CHECK_COPIES=8 timeout ${to:-300} "$B/graph_check" "$R/qwen3-0.6b" cuda >"$log" 2>&1
        tail -3 "$log"
        ;;
    t_*)
        t=${w[0]#t_}
        unpack "$t"
        env "${envs[@]}" AFM_TEST_DEVICE=cuda AFM_FIXTURES_DIR="$PWD/tests/fixtures/tiny" timeout ${to:-300} \
            "$B/$t" --test-threads=1 "${w[@]:1}" >"$log" 2>&1
        echo "exit $?"
        grep -E "test result|FAILED|panicked" "$log" | head -8
        ;;
    tfd)
        gen qwen3-0.6b
        env "${envs[@]}" AFM_TEST_DEVICE=cuda AFM_FIXTURES_DIR="$PWD/tests/fixtures/tiny" \
            AFM_FUSED_MODELS="$R/qwen3-0.6b" timeout 300 "$B/fused_decode" --nocapture --test-threads=1 >"$log" 2>&1
        grep -E "prompt|test result|panicked" "$log" | head -8
        ;;
    cb)
        unpack cuda_bench
        env "${envs[@]}" timeout ${to:-400} "$B/cuda_bench" "${w[@]:1}" >"$log" 2>&1
        grep -E "^\||error|panick" "$log" | head -40
        ;;
    ncu)
        gen "${w[1]}"
        env "${envs[@]}" timeout 500 python3 bench/ncu_kernels.py run "$B/gpu_bench" "$R/${w[1]}" "${w[2]}" \
            --skip "${w[3]}" --count "${w[4]}" --csv "$O/$name.csv" >"$log" 2>&1
        tail -14 "$log"
        ;;
    gpucheck)
        env "${envs[@]}" GPU_BIN_DIR="$B" timeout 420 bash scripts/gpu_check.sh run >"$log" 2>&1
        grep -E "^==|test result|FAILED|PASS|agree" "$log" | tail -60
        ;;
    *) echo "unknown command ${w[0]}" ;;
    esac
done
