#!/usr/bin/env python3
"""Compare afm's logits with llama.cpp's, position by position, on the prompts and greedy
continuations recorded in tests/fixtures/llamacpp/<model>.json.

afm's side comes from `target/release/examples/logits_dump` (build it with
`cargo build --release -p afm-engine --example logits_dump`); llama.cpp's from llama-cpp-python
(logits_all, 2 threads, flash attention off, as the fixtures were recorded). Prints, per prompt,
the largest |afm − llama.cpp| over each position's logits as a fraction of that position's
largest |logit|, and how often the argmax agrees.

    python3 scripts/compare_llamacpp_logits.py models/SmolLM2-135M-Instruct.Q4_1.gguf \
        tests/fixtures/llamacpp/smollm2.json
"""
import json
import subprocess
import sys
import tempfile

import llama_cpp
import numpy as np

model, fixture = sys.argv[1], sys.argv[2]
llm = llama_cpp.Llama(model, n_ctx=2048, n_threads=2, logits_all=True, verbose=False, seed=1234)
n_vocab = llm.n_vocab()
with tempfile.NamedTemporaryFile(suffix=".f32") as out:
    for g in json.load(open(fixture))["greedy"]:
        ids = list(g["prompt_ids"]) + list(g["generated_ids"])
        llm.reset()
        llm.eval(ids)
        ref = np.array(llm.scores[: len(ids)], dtype=np.float32)
        subprocess.run(
            ["target/release/examples/logits_dump", model, ",".join(map(str, ids)), out.name],
            check=True,
        )
        afm = np.fromfile(out.name, dtype=np.float32).reshape(len(ids), -1)[:, :n_vocab]
        rel = np.abs(afm - ref).max(1) / np.abs(ref).max(1)
        agree = (afm.argmax(1) == ref.argmax(1)).mean()
        print(
            f"{len(ids):3d} positions: |Δ|/max|logit| median {np.median(rel):.2e}, "
            f"max {rel.max():.2e}; bit-identical rows {(rel == 0).mean():.1%}; "
            f"argmax agrees {agree:.1%}"
        )
