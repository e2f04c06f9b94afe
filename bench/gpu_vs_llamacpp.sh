#!/usr/bin/env bash
# afm beside llama.cpp's CUDA build, in one command on the GPU machine, on the same weights
# (issue 9 item 6). For each shape (MODELS, default qwen3-0.6b,qwen3-8b): a random bf16 model of
# the real shape (scripts/gpu_random_models.py), converted to a bf16 GGUF by llama.cpp's
# convert_hf_to_gguf.py (with the Qwen2.5 tokenizer: both shapes have its 151,936-token
# vocabulary) and quantized to Q4_K_M by llama-quantize. Then, on those files:
#   afm        gpu_bench: batch-1 decode, aggregate decode at STREAMS, TTFT at 1k, on the bf16 HF
#              dir and on the Q4_K_M GGUF
#   llama.cpp  llama-bench -ngl 99 -fa 1 -p 512,1024 -n 128 -r REPS (batch-1 decode, 1k prefill)
#              and llama-batched-bench -npp PROMPT -ntg GEN -npl STREAMS (aggregate decode), on
#              the bf16 GGUF and the Q4_K_M GGUF
# and one side-by-side markdown table (bench/gpu_vs_llamacpp.py) against the bandwidth ceiling
# measured in the same run (bench/gpu_ceilings.py).
#
#   bench/gpu_vs_llamacpp.sh carry   here: fills CARRY (default target/cuda/h7carry, ~20 MB): a
#                                    trimmed llama.cpp source tarball from LLAMA_SRC (llama-cpp-
#                                    python's sdist, vendor/llama.cpp), gpu_bench from GPU_BIN_DIR
#                                    (bench/gpu_bench.sh build) and the Qwen2.5 tokenizer files
#                                    (made by scripts/qwen25_tokenizer.py from the Qwen2.5 GGUF
#                                    when TOKENIZER_DIR has none)
#   bench/gpu_vs_llamacpp.sh run     on the GPU machine, repo root, with CARRY carried
#
# Time (run): every step is capped so that the steps end BUDGET seconds (default 530) after the
# start; the table and the archive follow in seconds. llama.cpp builds in the background (CUDA
# sm_90, three tools, ~4 min) while the GPU makes the models and afm measures the bf16 dirs;
# conversion and quantization run in the background too, on the CPUs the benchmarks leave alone
# (benchmarks on cores 0-3, the rest on 4-N). Order of the measurements, most useful first: afm
# bf16, llama.cpp bf16, then afm and llama.cpp Q4_K_M per shape, then TTFT at LONG tokens while
# time is left. WORK_DIR outlives a call while the machine stays warm: a quick second call reuses
# the llama.cpp build there.
# Knobs: MODELS, STREAMS (1,8,32,64), PROMPT (128), GEN (256), TTFT (1024), PP (llama-bench's
# prompt lengths, 512,TTFT), REPS (10), LONG (16384; empty: none), BUDGET, WORK_DIR
# (/tmp/afm-vs-llama), KEEP_HF=1 keeps each HF dir after its conversion, Q4=0 leaves out the
# Q4_K_M files and their rows (e.g. a call for the LONG rows alone), REBUILD=1, DEVICE=cpu
# (the flow without a GPU: no ceilings, llama.cpp built without CUDA, -ngl 0).
# Output: progress and the table on stdout; under ${OUT:-bench/out}: table.md, steps.log and
# raw.tar.gz (every log and JSON line; few files, as the device tool returns at most eight).
set -euo pipefail
cd "$(dirname "$0")/.."
C=${CARRY:-target/cuda/h7carry}
SELF=$PWD/bench/gpu_vs_llamacpp.sh

die() {
    echo "gpu_vs_llamacpp: $*" >&2
    exit 1
}

carry() {
    local src=${LLAMA_SRC:-/tmp/fm/sdist/llama_cpp_python-0.3.36/vendor/llama.cpp}
    local bin=${GPU_BIN_DIR:-target/cuda/gpubench}/gpu_bench
    local tok=${TOKENIZER_DIR:-models/hf/qwen25}
    [ -f "$src/convert_hf_to_gguf.py" ] || die "LLAMA_SRC=$src has no convert_hf_to_gguf.py (unpack llama-cpp-python's sdist)"
    [ -x "$bin" ] || die "$bin missing: run bench/gpu_bench.sh build first"
    [ -f "$tok/tokenizer.json" ] || python3 scripts/qwen25_tokenizer.py "${QWEN25_GGUF:-models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf}" "$tok" ||
        die "$tok/tokenizer.json missing and not made (scripts/fetch_models.sh qwen05, then scripts/qwen25_tokenizer.py)"
    mkdir -p "$C"
    local tmp
    tmp=$(mktemp -d)
    cp -r "$src" "$tmp/llama.cpp"
    # What the CUDA build of the three tools and the converter do not read (~150 MB of 176).
    (cd "$tmp/llama.cpp" && rm -rf models docs media tests examples benches pocs skills app \
        scripts grammars licenses ci .github tools/ui tools/server tools/cli tools/tuning tools/rpc)
    (cd "$tmp/llama.cpp/ggml/src" && rm -rf ggml-blas ggml-cann ggml-et ggml-hexagon ggml-metal \
        ggml-opencl ggml-openvino ggml-rpc ggml-sycl ggml-virtgpu ggml-vulkan ggml-webgpu \
        ggml-zdnn ggml-zendnn)
    tar czf "$C/llama.cpp.tar.gz" -C "$tmp" llama.cpp
    rm -rf "$tmp"
    cp "$bin" "$C/gpu_bench"
    cp "$tok/tokenizer.json" "$tok/tokenizer_config.json" "$C/"
    # The last commit that changed the Rust code gpu_bench is built from (stable across cherry-picks).
    { git log -1 --format=%H -- crates Cargo.toml Cargo.lock 2>/dev/null || echo unknown; } >"$C/AFM_COMMIT"
    # e.g. llama_cpp_python-0.3.36, the sdist the source came from
    basename "$(dirname "$(dirname "$(cd "$src" && pwd)")")" >"$C/LLAMA_VERSION"
    local mib
    mib=$(du -sm "$C" | cut -f1)
    ls -la "$C"
    echo "carry: $C, $mib MiB"
    [ "$mib" -le 60 ] || die "$C is $mib MiB, over the 60 MiB that one call may carry"
}

# --- run: time and markers --------------------------------------------------------------------
START=$(date +%s)
BUDGET=${BUDGET:-530}
left() { echo $((BUDGET - ($(date +%s) - START))); }
# Progress to the run's stdout (fd 3, also from steps whose output goes to a log) and steps.log.
say() { printf '[%4ds] %s\n' $(($(date +%s) - START)) "$*" | tee -a "$R/steps.log" >&3; }

# capped MAX CMD...: CMD under a timeout of MAX seconds or the time left, whichever is less.
capped() {
    local max=$1 t
    shift
    t=$(left)
    [ "$t" -lt "$max" ] || t=$max
    if [ "$t" -lt 5 ]; then
        say "skipped (no time left): $*"
        return 124
    fi
    timeout -k 5 "$t" "$@"
}

# mark NAME CMD...: runs CMD; ok.NAME on success, end.NAME always (waiters stop on it).
mark() {
    local name=$1 rc=0
    shift
    "$@" || rc=$?
    [ "$rc" != 0 ] || touch "$W/ok.$name"
    touch "$W/end.$name"
    if [ "$rc" = 0 ]; then say "$name: done"; else say "$name: FAILED (rc $rc)"; fi
    return "$rc"
}

# await NAME: waits for end.NAME (or the end of the budget); true if it succeeded.
await() {
    while [ ! -e "$W/end.$1" ]; do
        [ "$(left)" -gt 5 ] || return 1
        sleep 1
    done
    [ -e "$W/ok.$1" ]
}

# --- run: the steps ---------------------------------------------------------------------------
# The build, as its own process so that `timeout` can bound it (run's background lane).
build_llama() {
    local L=$W/llama.cpp
    exec >"$R/build.log" 2>&1
    # shellcheck disable=SC2086
    $BG nice -n 5 cmake -S "$L" -B "$L/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DGGML_CUDA="$([ "$DEV" = cpu ] && echo OFF || echo ON)" -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=OFF -DLLAMA_BUILD_APP=OFF \
        -DLLAMA_OPENSSL=OFF -DGGML_CUDA_NCCL=OFF -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF &&
        $BG nice -n 5 cmake --build "$L/build" -j "$JOBS" \
            --target llama-bench llama-batched-bench llama-quantize
}

# weight_bytes KEY: bytes read per decoded token of KEY.gguf into bytes-KEY.txt, here in the
# background, because gguf-py reads a 151,936-token vocabulary for seconds.
weight_bytes() {
    # shellcheck disable=SC2086
    capped 120 $BG env PYTHONPATH="$W/llama.cpp/gguf-py" python3 bench/gpu_vs_llamacpp.py bytes \
        "$W/$1.gguf" >"$R/bytes-$1.txt" 2>>"$R/bytes.log" || true
}

# Background lane: bf16 GGUFs as the models appear, then Q4_K_M once llama-quantize is built.
gguf_lane() {
    local m
    for m in ${MODELS//,/ }; do
        await "gen.$m" || continue
        # shellcheck disable=SC2086
        mark "conv.$m" capped 400 $BG python3 "$W/llama.cpp/convert_hf_to_gguf.py" \
            --outtype bf16 --outfile "$W/$m-bf16.gguf" "$W/$m" >>"$R/convert.log" 2>&1 &&
            weight_bytes "$m-bf16"
    done
    await build || return 0
    [ "$Q4" = 1 ] || return 0
    for m in ${MODELS//,/ }; do
        await "conv.$m" || continue
        # shellcheck disable=SC2086
        mark "quant.$m" capped 300 $BG "$LB/llama-quantize" "$W/$m-bf16.gguf" \
            "$W/$m-Q4_K_M.gguf" Q4_K_M "$JOBS" >>"$R/quantize.log" 2>&1 &&
            weight_bytes "$m-Q4_K_M"
    done
}

# drop_hf MODEL: once afm has measured it and its bf16 GGUF exists, the safetensors go (disk:
# the 8B is 16 GB in each form), unless KEEP_HF=1.
drop_hf() {
    [ "${KEEP_HF:-0}" = 1 ] || [ ! -e "$W/ok.conv.$1" ] || rm -f "$W/$1"/*.safetensors
}

# afm_bench NAME MODEL STREAMS TTFT: gpu_bench on cores 0-3, its RESULT line into NAME.json.
afm_bench() {
    local name=$1
    say "afm $name"
    # shellcheck disable=SC2086
    capped 200 $BENCH "$C/gpu_bench" "$2" "$DEV" "$3" "$PROMPT" "$GEN" "$4" y >"$R/$name.log" 2>&1 || true
    grep -E '^(streams|TTFT|logits)' "$R/$name.log" | sed 's/^/    /' || true
    grep '^RESULT' "$R/$name.log" | sed 's/^RESULT //' >"$R/$name.json" || true
}

# llama_bench NAME GGUF: llama-bench (batch-1 decode, prefill) and llama-batched-bench.
llama_bench() {
    local name=$1 f=$2
    say "llama.cpp $name"
    # shellcheck disable=SC2086
    capped 120 $BENCH "$LB/llama-bench" -m "$f" -ngl "$NGL" -fa 1 -p "$PP" -n 128 -r "$REPS" \
        -t 4 -o jsonl >"$R/lb-$name.jsonl" 2>"$R/lb-$name.log" || say "llama-bench $name: rc $?"
    # shellcheck disable=SC2086
    capped 120 $BENCH "$LB/llama-batched-bench" -m "$f" -ngl "$NGL" -fa 1 -c "$CTX" -b 2048 -ub 512 \
        -npp "$PROMPT" -ntg "$GEN" -npl "$STREAMS" -t 4 --output-format jsonl \
        >"$R/bb-$name.out" 2>"$R/bb-$name.log" || say "llama-batched-bench $name: rc $?"
    grep '^{' "$R/bb-$name.out" >"$R/bb-$name.jsonl" || true
    python3 - "$R/lb-$name.jsonl" "$R/bb-$name.jsonl" <<'PY' || true
import json, sys
for path in sys.argv[1:]:
    for l in open(path):
        if l.startswith("{"):
            r = json.loads(l)
            if "avg_ts" in r:
                print(f"    llama-bench pp{r['n_prompt']} tg{r['n_gen']}: {r['avg_ts']:.1f} ± {r['stddev_ts']:.1f} tok/s")
            else:
                print(f"    batched-bench {r['pl']} streams: decode {r['speed_tg']:.1f} tok/s, prefill {r['speed_pp']:.1f} tok/s")
PY
}

run() {
    O=${OUT:-bench/out}
    W=${WORK_DIR:-/tmp/afm-vs-llama}
    R=$W/out
    MODELS=${MODELS:-qwen3-0.6b,qwen3-8b}
    STREAMS=${STREAMS:-1,8,32,64}
    PROMPT=${PROMPT:-128}
    GEN=${GEN:-256}
    REPS=${REPS:-10}
    LONG=${LONG-16384}
    TTFT=${TTFT:-1024}
    Q4=${Q4:-1}
    PP=${PP:-512,$TTFT}
    DEV=${DEVICE:-cuda}
    NGL=99
    [ "$DEV" != cpu ] || NGL=0
    [ "$DEV" != cpu ] || export AFM_RANDOM_DEVICE=cpu
    chmod +x "$C/gpu_bench" 2>/dev/null || true
    [ -f "$C/llama.cpp.tar.gz" ] && [ -x "$C/gpu_bench" ] || die "$C lacks llama.cpp.tar.gz or gpu_bench: carry it (bench/gpu_vs_llamacpp.sh carry here)"
    set +e # the steps go on past a failed one; each says so
    exec 3>&1
    # A warm machine keeps WORK_DIR: only the llama.cpp build is reused, never old results.
    rm -rf "$R" "$W"/ok.* "$W"/end.* "$W"/*.gguf
    mkdir -p "$O" "$R"
    : >"$R/steps.log"
    export PYTHONUNBUFFERED=1
    [ -d /usr/local/cuda/bin ] && export PATH=/usr/local/cuda/bin:$PATH
    local n max_streams
    n=$(nproc)
    BENCH="" BG="" JOBS=$n
    if [ "$n" -ge 8 ] && command -v taskset >/dev/null; then
        BENCH="taskset -c 0-3" BG="taskset -c 4-$((n - 1))" JOBS=$((n - 4))
    fi
    max_streams=$(tr ',' '\n' <<<"$STREAMS" | sort -n | tail -1)
    CTX=$((max_streams * (PROMPT + GEN)))
    [ "$CTX" -ge 40960 ] || CTX=40960
    LB=$W/llama.cpp/build/bin
    say "start: $(nproc) CPUs, benchmarks on '${BENCH:-all}', background on '${BG:-all}'; afm $(cat "$C/AFM_COMMIT" 2>/dev/null)"
    [ "$DEV" = cpu ] || nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$R/steps.log"
    df -h "$W" | tail -1 | tee -a "$R/steps.log"
    cp "$C/AFM_COMMIT" "$R/afm_commit.txt"
    cp "$C/LLAMA_VERSION" "$R/llama_version.txt"

    export W R JOBS BG DEV Q4
    if [ "${REBUILD:-0}" != 1 ] && [ -x "$LB/llama-bench" ] && [ -x "$LB/llama-batched-bench" ] &&
        [ -x "$LB/llama-quantize" ]; then
        say "llama.cpp: reusing the build in $LB (REBUILD=1 rebuilds)"
        touch "$W/ok.build" "$W/end.build"
    else
        rm -rf "$W/llama.cpp"
        tar xzf "$C/llama.cpp.tar.gz" -C "$W"
        (mark build capped 420 bash "$SELF" build-llama) &
    fi
    gguf_lane &

    if [ "$DEV" != cpu ]; then
        capped 60 python3 bench/gpu_ceilings.py >"$R/ceilings.json" 2>"$R/ceilings.log"
        say "ceilings: $(cat "$R/ceilings.json")"
    fi
    local m
    for m in ${MODELS//,/ }; do
        rm -rf "${W:?}/$m"
        mark "gen.$m" capped 240 python3 scripts/gpu_random_models.py "$W" "$m" >>"$R/gen.log" 2>&1 || true
        cp "$C/tokenizer.json" "$C/tokenizer_config.json" "$W/$m/" 2>/dev/null || true
        # From the safetensors until the bf16 GGUF's count replaces it.
        python3 bench/gpu_vs_llamacpp.py bytes "$W/$m" >"$R/bytes-$m-bf16.txt" 2>>"$R/bytes.log"
    done
    for m in ${MODELS//,/ }; do
        await "gen.$m" && afm_bench "afm-$m-bf16" "$W/$m" "$STREAMS" "$TTFT"
        drop_hf "$m"
    done
    await build || say "llama.cpp build failed or timed out: tail of build.log:"
    [ -e "$W/ok.build" ] || tail -20 "$R/build.log"
    for m in ${MODELS//,/ }; do
        if await "conv.$m"; then
            drop_hf "$m"
            [ -e "$W/ok.build" ] && llama_bench "$m-bf16" "$W/$m-bf16.gguf"
        else
            say "no bf16 GGUF of $m: tail of convert.log:"
            grep -v 'Writing:' "$R/convert.log" | tail -8
        fi
    done
    for m in ${MODELS//,/ }; do
        [ "$Q4" = 1 ] || break
        if await "quant.$m"; then
            afm_bench "afm-$m-Q4_K_M" "$W/$m-Q4_K_M.gguf" "$STREAMS" "$TTFT"
            llama_bench "$m-Q4_K_M" "$W/$m-Q4_K_M.gguf"
        else
            say "no Q4_K_M GGUF of $m"
        fi
    done
    # Long prompts last, each only if its share of time is left: afm's TTFT (median of 3) and
    # llama-bench's prefill at LONG tokens.
    if [ -n "$LONG" ]; then
        local f q
        for m in ${MODELS//,/ }; do
            for q in bf16 Q4_K_M; do
                f=$W/$m-$q.gguf
                [ "$(left)" -gt 75 ] && [ -f "$f" ] || continue
                if [ $q = bf16 ] && [ -n "$(ls "$W/$m"/*.safetensors 2>/dev/null)" ]; then
                    afm_bench "afm-$m-$q-long" "$W/$m" "" "$LONG"
                else
                    afm_bench "afm-$m-$q-long" "$f" "" "$LONG"
                fi
                [ -e "$W/ok.build" ] || continue
                say "llama.cpp $m-$q-long"
                # shellcheck disable=SC2086
                capped 90 $BENCH "$LB/llama-bench" -m "$f" -ngl "$NGL" -fa 1 -p "$LONG" -n 0 -r 3 -t 4 \
                    -o jsonl >"$R/lb-$m-$q-long.jsonl" 2>"$R/lb-$m-$q-long.log" || true
            done
        done
    fi
    say "table"
    timeout 20 python3 bench/gpu_vs_llamacpp.py table "$R" "$MODELS" "$TTFT${LONG:+,$LONG}" |
        tee "$O/table.md"
    cp "$R/steps.log" "$O/steps.log"
    tar czf "$O/raw.tar.gz" -C "$W" out
}

case "${1:-}" in
carry) carry ;;
run) run ;;
build-llama) build_llama ;;
*)
    echo "usage: bench/gpu_vs_llamacpp.sh carry|run" >&2
    exit 2
    ;;
esac
