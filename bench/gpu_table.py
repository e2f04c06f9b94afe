#!/usr/bin/env python3
"""The table of bench/gpu_bench.sh from its JSON lines: batch-1 decode against the bandwidth
ceiling of the same run (bytes read per token = every weight but an untied embedding table,
which is only gathered), aggregate decode per stream count, TTFT and prefill rate."""
import glob
import json
import os
import sys


def weight_bytes(path):
    if path.endswith(".gguf"):
        from gguf import GGUFReader
        r = GGUFReader(path)
        sizes = {t.name: int(t.n_bytes) for t in r.tensors}
        total = sum(sizes.values())
        if "output.weight" in sizes:
            total -= sizes.get("token_embd.weight", 0)
        return total
    cfg = json.load(open(os.path.join(path, "config.json")))
    total = sum(os.path.getsize(f) for f in glob.glob(os.path.join(path, "*.safetensors")))
    if not cfg.get("tie_word_embeddings", False):
        total -= cfg["vocab_size"] * cfg["hidden_size"] * 2
    return total


rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
ceil = next((r for r in rows if "copy_tb_s" in r), None)
bw = ceil["copy_tb_s"] * 1e12 if ceil else float("nan")
if ceil:
    print(f"ceilings: copy {ceil['copy_tb_s']} TB/s (read + write), bf16 GEMM {ceil['gemm_tflops']} TFLOP/s ({ceil['device']})")
print("| model | graphs | bytes/token | ceiling tok/s | batch 1 tok/s | % ceiling | 8 | 32 | 64 | TTFT 1k ms | TTFT 16k ms | prefill 16k tok/s |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
for r in rows:
    if "decode" not in r:
        continue
    wb = weight_bytes(r["model"])
    c = bw / wb
    d = {x["streams"]: x["tok_s"] for x in r["decode"]}
    t = {x["prompt"]: x for x in r["ttft"]}
    b1 = d.get(1)
    pct = f"{100 * b1 / c:.0f}%" if b1 else "-"
    f = lambda v: f"{v:,.0f}" if v else "-"
    t16 = t.get(16384, {})
    print(f"| {os.path.basename(r['model'])} | {'y' if r['graphs'] else 'n'} | {wb / 1e9:.3f} GB | {c:,.0f} | {f(b1)} | {pct} | {f(d.get(8))} | {f(d.get(32))} | {f(d.get(64))} | "
          f"{t.get(1024, {}).get('ttft_ms', '-')} | {t16.get('ttft_ms', '-')} | {f(t16.get('prefill_tok_s'))} |")
