#!/usr/bin/env python3
"""The side-by-side table of bench/gpu_vs_llamacpp.sh: afm and llama.cpp on the same weights, per
shape and format, each number with the ratio afm / llama.cpp (>1: afm faster; for TTFT the
ratio of the speeds, llama.cpp's time over afm's).

usage: gpu_vs_llamacpp.py bytes GGUF|HF_DIR    bytes read per decoded token (every weight but an
                                              untied embedding table, which is only gathered; as
                                              bench/gpu_table.py counts them), gguf-py needed
       gpu_vs_llamacpp.py table RAW_DIR MODELS TTFT_LENS (e.g. 1024,16384)

RAW_DIR holds what the run wrote: ceilings.json (bench/gpu_ceilings.py), bytes-<model>-<q>.txt,
afm-<model>-<q>.json (gpu_bench's RESULT line), lb-<model>-<q>.jsonl (llama-bench -o jsonl),
bb-<model>-<q>.jsonl (llama-batched-bench --output-format jsonl), and the -long variants for the
TTFT at the longest prompt."""
import glob
import json
import os
import sys

NAMES = {"qwen3-0.6b": "Qwen3-0.6B", "qwen3-8b": "Qwen3-8B", "qwen2.5-0.5b": "Qwen2.5-0.5B"}


def lines(path):
    """The JSON objects of a file of JSON lines; none if it is missing or torn."""
    out = []
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("{"):
                    try:
                        out.append(json.loads(line))
                    except json.JSONDecodeError:
                        pass
    except OSError:
        pass
    return out


def weight_bytes(path):
    """Bytes read per decoded token, from a GGUF's tensors or an HF dir's safetensors."""
    if path.endswith(".gguf"):
        from gguf import GGUFReader

        sizes = {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors}
        total = sum(sizes.values())
        if "output.weight" in sizes:
            total -= sizes.get("token_embd.weight", 0)
        return total
    cfg = json.load(open(os.path.join(path, "config.json")))
    total = sum(os.path.getsize(f) for f in glob.glob(os.path.join(path, "*.safetensors")))
    if not cfg.get("tie_word_embeddings", False):
        total -= cfg["vocab_size"] * cfg["hidden_size"] * 2
    return total


def read_text(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return "?"


def read_int(path):
    try:
        return int(read_text(path))
    except ValueError:
        return None


def num(v, digits=0):
    return "-" if v is None else f"{v:,.{digits}f}"


def ratio(afm, llama):
    return f"{afm / llama:.2f}" if afm and llama else "-"


def table(raw, models, lens):
    ceil = next(iter(lines(f"{raw}/ceilings.json")), None)
    bw = ceil["copy_tb_s"] * 1e12 if ceil else None
    lb_any = next((r for p in sorted(glob.glob(f"{raw}/lb-*.jsonl")) for r in lines(p)), None)
    if ceil:
        print(f"{ceil['device']}: copy {ceil['copy_tb_s']} TB/s (read + write), bf16 GEMM "
              f"{ceil['gemm_tflops']} TFLOP/s, measured in the same run")
    if lb_any:
        print(f"llama.cpp: {read_text(f'{raw}/llama_version.txt')} (vendor/llama.cpp), "
              f"{lb_any.get('backends')}, {lb_any.get('gpu_info')}; afm: "
              f"{read_text(f'{raw}/afm_commit.txt')[:12]}")
    print()
    print("| shape | weights | measure | afm | llama.cpp | afm / llama.cpp |")
    print("|---|---|---|---|---|---|")
    for m in models:
        for q in ("bf16", "Q4_K_M"):
            key = f"{m}-{q}"
            afm = next(iter(lines(f"{raw}/afm-{key}.json")), None)
            lb = lines(f"{raw}/lb-{key}.jsonl")
            bb = {r["pl"]: r for r in lines(f"{raw}/bb-{key}.jsonl")}
            if not (afm or lb or bb):
                continue
            wb = read_int(f"{raw}/bytes-{key}.txt")
            cap = bw / wb if bw and wb else None
            a_dec = {d["streams"]: d["tok_s"] for d in (afm or {}).get("decode", [])}
            a_ttft = {t["prompt"]: t["ttft_ms"] for t in (afm or {}).get("ttft", [])}
            tg = next((r["avg_ts"] for r in lb if r["n_prompt"] == 0 and r["n_gen"] > 0), None)
            pp = {r["n_prompt"]: r["avg_ts"] for r in lb if r["n_gen"] == 0}
            label = f"| {NAMES.get(m, m)} | {q} |"

            def pct(v):
                return f" ({100 * v / cap:.0f}%)" if v and cap else ""

            b1 = a_dec.get(1)
            print(f"{label} batch-1 decode tok/s (% of the {num(cap)} tok/s ceiling, "
                  f"{wb / 1e9 if wb else float('nan'):.2f} GB/token) | {num(b1)}{pct(b1)} | "
                  f"{num(tg)}{pct(tg)} | {ratio(b1, tg)} |")
            for n in sorted(set(a_dec) | set(bb)):
                a, l = a_dec.get(n), bb.get(n, {}).get("speed_tg")
                print(f"{label} aggregate decode tok/s, {n} stream{'s' if n > 1 else ''} | "
                      f"{num(a)} | {num(l)} | {ratio(a, l)} |")
            long_afm = next(iter(lines(f"{raw}/afm-{key}-long.json")), None)
            if long_afm:
                a_ttft.update({t["prompt"]: t["ttft_ms"] for t in long_afm.get("ttft", [])})
            for r in lines(f"{raw}/lb-{key}-long.jsonl"):
                if r["n_gen"] == 0:
                    pp[r["n_prompt"]] = r["avg_ts"]
            for n in lens:
                a = a_ttft.get(n)
                l = 1e3 * n / pp[n] if pp.get(n) else None
                if a is None and l is None:
                    continue
                print(f"{label} TTFT ms, {n:,}-token prompt | {num(a, 1)} | {num(l, 1)} | "
                      f"{ratio(l, a)} |")
    print()
    print("afm: crates/afm-engine/examples/gpu_bench.rs through the engine (CUDA graphs, device "
          "sampling, greedy), the bf16 rows on the HF safetensors dir (the TTFT at the long prompt "
          "on the bf16 GGUF), aggregate = tokens after every stream's first token over the time "
          "to the last; TTFT median of 3. llama.cpp: batch 1 = llama-bench tg128 (mean of the "
          "repetitions), aggregate = llama-batched-bench S_TG (one pass, same prompt and "
          "generation lengths as afm), TTFT = prompt length / llama-bench pp rate (prefill alone, "
          "no sampled token), flash attention on (-fa 1). Random prompt tokens on both.")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "bytes":
        print(weight_bytes(sys.argv[2]))
    elif len(sys.argv) == 5 and sys.argv[1] == "table":
        table(sys.argv[2], sys.argv[3].split(","), [int(x) for x in sys.argv[4].split(",") if x])
    else:
        sys.exit(__doc__)
