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
#                              and a table on stdout. MODELS (default qwen3-0.6b,qwen3-8b; any
#                              name of gpu_random_models.py, e.g. the seed families' real-width
#                              qwen3.6-27b-l4, qwen3.6-35b-a3b-l4, gemma4-31b-l2,
#                              gemma4-26b-a4b-l2, deepseek-v4-flash-l2), STREAMS (1,8,32,64),
#                              PROMPT (128), GEN (256), TTFT (1024,16384; empty: none),
#                              EAGER=1 adds a run with graphs and device sampling off, CLEAN=1
#                              deletes each random model after its run (disk: DeepSeek's is 28 GB),
#                              MODEL_TIMEOUT (seconds) bounds each model's gpu_bench, DEVICE=cpu
#                              tries the flow without a GPU (no ceilings).
#                              AFM_FUSED_DECODE=1 runs batch 1 of llama/qwen2/qwen3 bf16 models
#                              through the fused decode step (off by default: slower so far).
#                              Then a second table: whether the logits were finite, decode tok/s
#                              and device memory (weights, + KV pool, peak) per model.
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
    models=${MODELS:-qwen3-0.6b,qwen3-8b}
    dev=${DEVICE:-cuda}
    if [ "$dev" != cpu ]; then
        nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.mem --format=csv,noheader
        python3 bench/gpu_ceilings.py | tee -a "$J"
    fi
    for m in ${models//,/ }; do
        R=${RANDOM_MODELS_DIR:-/tmp/afm-gpucheck}
        [ -d "$R/$m" ] || python3 scripts/gpu_random_models.py "$R" "$m" || {
            echo "== $m: generating the random model failed"
            continue
        }
        echo "== $m"
        ${MODEL_TIMEOUT:+timeout "$MODEL_TIMEOUT"} "$B/gpu_bench" "$R/$m" "$dev" "${STREAMS:-1,8,32,64}" "${PROMPT:-128}" \
            "${GEN:-256}" "${TTFT-1024,16384}" y 2>&1 | tee "$O/$m.log" | grep -v '^RESULT' || true
        grep '^RESULT' "$O/$m.log" | sed 's/^RESULT //' >>"$J" || true
        if [ "${EAGER:-0}" = 1 ]; then
            "$B/gpu_bench" "$R/$m" "$dev" 1,64 "${PROMPT:-128}" "${GEN:-256}" "" n \
                2>&1 | tee "$O/$m-eager.log" | grep -v '^RESULT' || true
            grep '^RESULT' "$O/$m-eager.log" | sed 's/^RESULT //' >>"$J" || true
        fi
        # Its row now, while its files are there (gpu_table.py reads their sizes).
        { grep copy_tb_s "$J"; grep '^RESULT' "$O/$m.log" | sed 's/^RESULT //'; } >"$O/$m.jsonl" || true
        python3 bench/gpu_table.py "$O/$m.jsonl" || true
        if [ "${CLEAN:-0}" = 1 ]; then rm -rf "${R:?}/$m"; fi
    done
    [ "${CLEAN:-0}" = 1 ] || python3 bench/gpu_table.py "$J"
    python3 - "$J" <<'PY'
import json, sys
gb = lambda v: f"{v / 2**30:.1f}" if v else "-"
print("| model | logits finite (max abs) | decode tok/s by streams | weights GiB | + KV GiB | peak GiB |")
print("|---|---|---|---|---|---|")
for r in (json.loads(l) for l in open(sys.argv[1]) if l.strip()):
    if "decode" not in r:
        continue
    base = r["mem_used_start"] or 0
    w, kv, pk = (r.get(k) for k in ("mem_used_weights", "mem_used_kv", "mem_used_peak"))
    dec = ", ".join(f"{d['streams']}: {d['tok_s']:,.1f}" for d in r["decode"])
    print(f"| {r['model'].rsplit('/', 1)[-1]} | {r.get('logits_finite')} ({r.get('logit_abs_max')}) | {dec} "
          f"| {gb(w and w - base)} | {gb(kv and w and kv - w)} | {gb(pk and pk - base)} |")
PY
    ;;
*)
    echo "usage: bench/gpu_bench.sh build|run" >&2
    exit 2
    ;;
esac
