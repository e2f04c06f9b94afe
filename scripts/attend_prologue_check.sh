#!/usr/bin/env bash
# The attention prologue folded into the decode attention kernel (issue 9: attn_dec_pro_*,
# CudaContext::attend_prologue) on a GPU: correctness, then speed.
#
#   scripts/attend_prologue_check.sh build   here, no GPU: the CUDA builds of
#                                            tests/cuda_attend_prologue.rs, tests/cuda_ops.rs,
#                                            afm-runtime's unit tests (compute dispatch),
#                                            benches/cuda_bench.rs and the examples
#                                            device_compare, gpu_bench and graph_check, packed
#                                            into target/cuda/h20/bins.tar.xz, plus
#                                            target/cuda/h20/run.sh (this script). Carry
#                                            target/cuda/h20.
#   target/cuda/h20/run.sh test              on the GPU machine, repo root: the fused kernel bit
#                                            for bit against attn_prologue + paged_attention
#                                            (outputs and every cache block), the compute
#                                            dispatch's three attention paths, cuda_ops' prologue
#                                            and attention tests, then a random qwen3-0.6b: CPU vs
#                                            GPU teacher-forced logits (device_compare) and graphs
#                                            vs eager (graph_check).
#   target/cuda/h20/run.sh bench             cuda_bench attend_prologue (two launches vs one),
#                                            then batch-1 decode tok/s through the engine on
#                                            qwen3-0.6b and qwen3-8b with AFM_ATTN_FUSED_PRO=0
#                                            and =1.
#   BENCH_MODELS                             overrides the bench's model list (names of
#                                            scripts/gpu_random_models.py).
# Every command has a timeout.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
case "$here" in
*/target/cuda/h20) cd "$here/../../.." ;;
*) cd "$here/.." ;;
esac
H=target/cuda/h20
R=${RANDOM_MODELS_DIR:-/tmp/afm-gpucheck}
case "${1:-}" in
build)
    set -e
    mkdir -p "$H"
    export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target/cuda}
    pick() {
        python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") \
            and m["target"]["name"] == sys.argv[1]:
        print(m["executable"])' "$1"
    }
    json=$(cargo test --release -p afm-runtime --features cuda --no-run --message-format=json)
    printf '%s\n' "$json" | pick cuda_attend_prologue | xargs -I{} cp {} "$H/cuda_attend_prologue"
    printf '%s\n' "$json" | pick cuda_ops | xargs -I{} cp {} "$H/cuda_ops"
    printf '%s\n' "$json" | pick afm_runtime | xargs -I{} cp {} "$H/runtime_lib"
    cargo bench -p afm-runtime --features cuda --bench cuda_bench --no-run --message-format=json |
        pick cuda_bench | xargs -I{} cp {} "$H/cuda_bench"
    cargo build --release -p afm-models --features cuda --example device_compare
    cargo build --release -p afm-engine --features cuda --example gpu_bench --example graph_check
    for x in device_compare gpu_bench graph_check; do
        cp "$CARGO_TARGET_DIR/release/examples/$x" "$H/"
    done
    bins="cuda_attend_prologue cuda_ops runtime_lib cuda_bench device_compare gpu_bench graph_check"
    (cd "$H" && strip --strip-debug $bins && tar cJf bins.tar.xz $bins && rm -f $bins)
    cp scripts/attend_prologue_check.sh "$H/run.sh"
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
        export AFM_TEST_DEVICE=cuda
        echo "== attend_prologue vs attn_prologue + paged_attention (tests/cuda_attend_prologue.rs)"
        check timeout 300 "$B/cuda_attend_prologue" --test-threads=1
        echo "== compute dispatch: the three attention paths, GPU vs CPU and GPU vs GPU"
        check timeout 300 "$B/runtime_lib" fused_attention_step --test-threads=1
        echo "== cuda_ops: prologue and attention kernels against the CPU"
        check timeout 400 "$B/cuda_ops" prologue attention --test-threads=1
        gen qwen3-0.6b
        echo "== qwen3-0.6b: CPU vs GPU (teacher-forced logits, greedy)"
        check timeout 300 "$B/device_compare" "$R/qwen3-0.6b" cuda 32 32 16 1
        echo "== qwen3-0.6b: graphs + device sampling vs eager"
        check timeout 300 "$B/graph_check" "$R/qwen3-0.6b" cuda
    else
        echo "== cuda_bench attend_prologue"
        check timeout 300 "$B/cuda_bench" attend_prologue
        models=${BENCH_MODELS:-qwen3-0.6b qwen3-8b}
        gen $models
        for m in $models; do
            for fused in 0 1; do
                echo "== $m batch 1, AFM_ATTN_FUSED_PRO=$fused"
                log="$B/$m-$fused.log"
                AFM_ATTN_FUSED_PRO=$fused timeout 240 "$B/gpu_bench" "$R/$m" cuda 1 128 256 "" y >"$log" 2>&1 ||
                    failed+=("gpu_bench $m AFM_ATTN_FUSED_PRO=$fused")
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
    echo "usage: scripts/attend_prologue_check.sh build | target/cuda/h20/run.sh test|bench" >&2
    exit 2
    ;;
esac
