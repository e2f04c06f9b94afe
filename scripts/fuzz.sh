#!/usr/bin/env bash
# Fuzzes afm's input parsers with cargo-fuzz (fuzz/): GGUF, safetensors, hostile chat templates,
# request JSON, every tool-call parser, the tokenizer. Each target runs SECONDS (default 15) from
# the committed seeds in fuzz/seeds/<target>; new inputs go to fuzz/corpus/<target> (ignored).
# Installs the nightly toolchain and cargo-fuzz when missing. Exits non-zero on the first crash;
# the crashing input is in fuzz/artifacts/<target>/.
#
#   bash scripts/fuzz.sh [SECONDS] [TARGET...]
set -euo pipefail
cd "$(dirname "$0")/.."

SECONDS_PER_TARGET=${1:-15}
shift || true
TARGETS=("$@")
if [[ ${#TARGETS[@]} -eq 0 ]]; then
  TARGETS=(gguf safetensors chat_template request_json tool_calls tokenizer)
fi

if ! rustup run nightly rustc --version >/dev/null 2>&1; then
  echo "== installing the nightly toolchain (rustup, minimal profile)"
  rustup toolchain install nightly --profile minimal
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "== installing cargo-fuzz (crates.io)"
  cargo install cargo-fuzz --locked
fi

# No sanitizer: the targets look for panics, wrong answers and runaway time or memory in safe
# Rust, and an uninstrumented std builds several times faster on a 2-core CI machine.
# Debug assertions on, so integer overflow is a crash.
FLAGS=(--sanitizer none --debug-assertions)
echo "== building fuzz targets"
cargo +nightly fuzz build "${FLAGS[@]}"

for target in "${TARGETS[@]}"; do
  mkdir -p "fuzz/corpus/$target" "fuzz/artifacts/$target"
  before=$(ls "fuzz/artifacts/$target" | wc -l)
  echo "== fuzz $target (${SECONDS_PER_TARGET} s)"
  # -timeout: one input taking 10 s is a hang; -rss_limit_mb: 2 GiB is a runaway allocation.
  set +e
  cargo +nightly fuzz run "${FLAGS[@]}" "$target" "fuzz/corpus/$target" "fuzz/seeds/$target" -- \
    -max_total_time="$SECONDS_PER_TARGET" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
    2>&1 | grep -E "^(stat::number_of_executed_units|stat::peak_rss_mb|==|INFO: -max_total_time|SUMMARY|No such file|Error:|.*(panicked|ERROR|Done))"
  status=${PIPESTATUS[0]}
  set -e
  if [[ $(ls "fuzz/artifacts/$target" | wc -l) -gt $before ]]; then
    echo "fuzz: $target crashed; inputs in fuzz/artifacts/$target/"
    exit 1
  fi
  # A run that ends in error without a crash input did not fuzz (e.g. a missing seed folder).
  if [[ $status -ne 0 ]]; then
    echo "fuzz: $target did not run (exit $status)"
    exit 1
  fi
done
echo "fuzz: ${#TARGETS[@]} targets, no crashes"
