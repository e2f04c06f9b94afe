#!/usr/bin/env bash
# The live API tests (tests/python/test_real_model.py: the official OpenAI client against
# `afm mlx`) with the server on a GPU: CUDA graphs, device sampling and the decode overlap
# under streaming, stop strings, seeds, log-probabilities, disconnects and concurrency.
#
#   scripts/gpu_live_tests.sh build   here: the CUDA build of afm and wheels of the client
#                                     packages, into target/cuda/live (carry it)
#   scripts/gpu_live_tests.sh run     on the GPU machine, repo root: SmolLM2-135M's shape with
#                                     random bf16 weights (scripts/gpu_random_models.py; the
#                                     GGUF is over what a run can carry) and its tokenizer and
#                                     chat template (tests/fixtures/tokenizer/smollm2), then
#                                     the tests with `--device cuda`, again with
#                                     `--decode-overlap n`, and with neither prefix caching nor
#                                     batching. Random weights give random text: the tests
#                                     check behaviour (determinism, stream = not stream, stops,
#                                     limits, seeds, disconnects), not answers. Their logits are
#                                     nearly tied, so on the GPU, where a prefix hit or another
#                                     batch shape takes other kernels, greedy tokens can part
#                                     (bench/RESULTS.md, session 11): the third set shows the
#                                     rest holds with the decode overlap on.
set -euo pipefail
cd "$(dirname "$0")/.."
D=${LIVE_DIR:-target/cuda/live}
case "${1:-}" in
build)
    mkdir -p "$D/wheels"
    CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target/cuda} cargo build --release -p afm --features cuda
    cp "${CARGO_TARGET_DIR:-target/cuda}/release/afm" "$D/afm"
    strip --strip-debug "$D/afm"
    python3 -m pip download -q openai pytest requests jsonschema --python-version 3.12 \
        --only-binary=:all: --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
        -d "$D/wheels"
    du -sh "$D"
    ;;
run)
    python3 -m pip install -q --no-index --find-links "$D/wheels" --target /tmp/afm-live-py \
        openai pytest requests jsonschema
    R=/tmp/afm-live
    [ -d "$R/smollm2-135m" ] || python3 scripts/gpu_random_models.py "$R" smollm2-135m
    # The tests ask for the model by this name.
    M="$R/SmolLM2-135M-Instruct.Q4_1"
    rm -rf "$M" && cp -r "$R/smollm2-135m" "$M"
    cp tests/fixtures/tokenizer/smollm2/{tokenizer.json,tokenizer_config.json,chat_template.jinja} "$M/"
    export PYTHONPATH=/tmp/afm-live-py AFM_BIN="$PWD/$D/afm" AFM_TEST_MODEL="$M"
    rc=0
    for extra in "" "--decode-overlap n" "--disable-prefix-caching --concurrent 1"; do
        echo "== --device cuda $extra"
        AFM_SERVER_ARGS="--device cuda $extra" python3 -m pytest -q tests/python/test_real_model.py \
            || rc=1
    done
    exit $rc
    ;;
*)
    echo "usage: scripts/gpu_live_tests.sh build|run" >&2
    exit 2
    ;;
esac
