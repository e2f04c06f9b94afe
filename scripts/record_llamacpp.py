#!/usr/bin/env python3
"""Record llama.cpp's tokenization and greedy continuations of the real GGUFs, for afm's tests.

For each model in models/ (fetched by scripts/fetch_models.sh) this loads the GGUF in
llama-cpp-python (n_threads=2, n_ctx=2048, fixed seed) and writes
tests/fixtures/llamacpp/<model>.json with:

- "model": file name, sha256, size, llama-cpp-python version, vocab facts (n_vocab, BOS/EOS ids,
  whether the vocab adds BOS, tokenizer.ggml.model / .pre, whether a chat template is present);
- "tokenize": for a list of tricky strings, `llm.tokenize(text.encode(), add_bos, special)` for
  all four (add_bos, special) combinations, plus `detokenize` of the (add_bos=False) ids with
  special=False and special=True and whether that round trip gives back the input;
- "greedy": 4 prompts (2 raw text, 2 rendered through the GGUF's chat template with
  llama-cpp-python's Jinja2ChatFormatter, add_generation_prompt=True; Gemma 3 270M has no
  template, so it gets 2 prompts with hand-written <start_of_turn> markup instead). Each records
  the exact prompt string, the prompt ids fed, and up to 32 greedily generated ids (top_k 1,
  temperature 0, repeat_penalty 1.0; generation stops early at an end-of-generation token) with
  their text, the top-1/top-2 logit margin and runner-up id at each step, and (--hf-greedy,
  needs `accelerate`) transformers' float32 greedy ids from the same GGUF for comparison.

With --hf-tokenizer (on by default) it also writes tests/fixtures/tokenizer/smollm2/: the HF
tokenizer transformers builds from the SmolLM2 GGUF (tokenizer.json, tokenizer_config.json) and
reference.json with HF's ids for the same strings (add_special_tokens=False), compared against
llama.cpp's ids (add_bos=False, special=True: both parse special-token text).

    python3 scripts/record_llamacpp.py                   # all three models
    python3 scripts/record_llamacpp.py --models smollm2 --no-hf-tokenizer
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
MODELS_DIR = REPO_ROOT / "models"
OUT_DIR = REPO_ROOT / "tests" / "fixtures" / "llamacpp"
TOKENIZER_OUT = REPO_ROOT / "tests" / "fixtures" / "tokenizer" / "smollm2"

MODELS = {
    "smollm2": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "qwen05": "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    "gemma3": "gemma-3-270m-q4_k_m.gguf",
}

SEED = 1234
N_CTX = 2048
N_THREADS = 2
MAX_NEW_TOKENS = 32

# Strings that tend to break tokenizers: whitespace handling, pre-tokenizer splits, multi-byte
# UTF-8, and text that looks like special tokens (parsed as specials only with special=True).
TRICKY_STRINGS = [
    "Hello, world! This is a plain English sentence.",
    "",
    " leading space",
    "trailing space ",
    "  two leading spaces and three trailing   ",
    "multiple   internal    spaces",
    "line one\nline two\n\n\nafter three newlines\n",
    "\n\n",
    "a\r\nb",
    "tabs\tand\t\ttabs",
    "12345678",
    "3.14159 and 2,718 and 1e-9",
    "你好，世界",
    "🦀🔥",
    "café naïve résumé",
    "Ünïcödé ß ﬁ Å",
    "don't you'll I'M it's",
    "def f(x):\n    if x:\n        return x * 2\n    return None\n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "<|endoftext|><s></s><bos><eos>",
]

RAW_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
]

CHAT_CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name three primary colors."},
        {"role": "assistant", "content": "Red, yellow, blue."},
        {"role": "user", "content": "And the secondary ones?"},
    ],
]

# Gemma 3 270M (base) ships no chat template; these exercise its turn markers as special tokens.
GEMMA_TURN_PROMPTS = [
    "<start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n",
    "<start_of_turn>user\nWrite a haiku about the sea.<end_of_turn>\n<start_of_turn>model\n",
]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def decode(b: bytes) -> str:
    """bytes -> str; invalid UTF-8 (e.g. half of an emoji) becomes U+FFFD."""
    return b.decode("utf-8", errors="replace")


def record_tokenization(llm) -> list[dict]:
    out = []
    for text in TRICKY_STRINGS:
        entry = {"text": text, "ids": {}}
        for add_bos in (True, False):
            for special in (True, False):
                key = f"add_bos={str(add_bos).lower()},special={str(special).lower()}"
                entry["ids"][key] = llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=special)
        for special in (True, False):
            ids = entry["ids"][f"add_bos=false,special={str(special).lower()}"]
            raw = llm.detokenize(ids, special=special)
            entry[f"detokenize_special={str(special).lower()}"] = {
                "text": decode(raw),
                "roundtrip": raw == text.encode("utf-8"),
            }
        out.append(entry)
    return out


def render_chat(llm, messages: list[dict]) -> str:
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    template = llm.metadata["tokenizer.chat_template"]
    bos = decode(llm.detokenize([llm.token_bos()], special=True))
    eos = decode(llm.detokenize([llm.token_eos()], special=True))
    fmt = Jinja2ChatFormatter(template=template, eos_token=eos, bos_token=bos, add_generation_prompt=True)
    return fmt(messages=messages).prompt


def greedy(llm, prompt_ids: list[int]) -> dict:
    """Greedy continuation through llama-cpp-python's sampler, plus the top-2 margin per step.

    The margins come from a second pass that feeds the same tokens one at a time and reads the
    logits llama.cpp hands the sampler; a step with a small margin is a near-tie that another
    correct implementation (different rounding, e.g. f32 activations) may legitimately flip.
    """
    import llama_cpp
    import numpy as np

    vocab = llm._model.vocab
    out: list[int] = []
    stopped = False
    out_eog = None
    llm.reset()
    for tok in llm.generate(prompt_ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
        tok = int(tok)
        if llama_cpp.llama_vocab_is_eog(vocab, tok):
            stopped = True
            out_eog = tok
            break
        out.append(tok)
        if len(out) == MAX_NEW_TOKENS:
            break

    margins, runner_up = [], []
    llm.reset()
    llm.eval(prompt_ids)
    chosen = out + ([out_eog] if stopped else [])
    for i, tok in enumerate(chosen):
        ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)  # the row the sampler reads
        row = np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).astype(np.float32)
        order = np.argsort(-row, kind="stable")[:2]
        if int(order[0]) != tok:
            raise RuntimeError(f"second pass disagrees at step {i}: argmax {int(order[0])}, generated {tok}")
        margins.append(round(float(row[order[0]] - row[order[1]]), 4))
        runner_up.append(int(order[1]))
        if i + 1 < len(chosen):
            llm.eval([tok])
    rec = {
        "generated_ids": out,
        "text": decode(llm.detokenize(out, prev_tokens=prompt_ids)),
        "stopped_at_eog": stopped,
        "top2_margins": margins,
        "runner_up_ids": runner_up,
    }
    if stopped:
        rec["eog_id"] = out_eog
    return rec


def hf_greedy(path: Path, runs: list[dict]) -> dict:
    """Cross-check: transformers' float32 greedy tokens from the same GGUF (dequantized weights).

    Needs `accelerate` (transformers insists on it for GGUF loading). Adds hf_generated_ids and
    hf_agree_prefix (how many leading tokens equal llama.cpp's) to each run.
    """
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(N_THREADS)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model.eval()
    for run in runs:
        ids = torch.tensor([run["prompt_ids"]], dtype=torch.long)
        n_new = len(run["generated_ids"]) + (1 if run["stopped_at_eog"] else 0)
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
        hf = gen[0, ids.shape[1]:].tolist()
        want = run["generated_ids"] + ([run["eog_id"]] if run["stopped_at_eog"] else [])
        agree = next((i for i, (a, b) in enumerate(zip(hf, want)) if a != b), min(len(hf), len(want)))
        run["hf_generated_ids"] = hf
        run["hf_agree_prefix"] = agree
    del model
    return {"transformers_version": transformers.__version__, "torch_version": torch.__version__,
            "dtype": "float32", "note": "hf_generated_ids: transformers greedy on the dequantized GGUF, "
            "same prompt ids, no EOS stop; hf_agree_prefix counts leading tokens equal to llama.cpp's "
            "(the EOG token included when llama.cpp stopped)"}


def record_model(key: str, path: Path, with_hf: bool) -> dict:
    import llama_cpp
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=N_CTX, n_threads=N_THREADS, n_threads_batch=N_THREADS,
                seed=SEED, verbose=False)
    md = llm.metadata
    vocab = llm._model.vocab
    has_template = "tokenizer.chat_template" in md
    info = {
        "file": path.name,
        "sha256": sha256_file(path),
        "size": path.stat().st_size,
        "llama_cpp_python_version": llama_cpp.__version__,
        "n_ctx": N_CTX,
        "n_threads": N_THREADS,
        "seed": SEED,
        "architecture": md.get("general.architecture"),
        "tokenizer_model": md.get("tokenizer.ggml.model"),
        "tokenizer_pre": md.get("tokenizer.ggml.pre"),
        "n_vocab": llm.n_vocab(),
        "bos_id": llm.token_bos(),
        "eos_id": llm.token_eos(),
        "vocab_adds_bos": bool(llama_cpp.llama_vocab_get_add_bos(vocab)),
        "vocab_adds_eos": bool(llama_cpp.llama_vocab_get_add_eos(vocab)),
        "has_chat_template": has_template,
    }

    prompts = [{"kind": "raw", "prompt": p, "add_bos": True, "special": False} for p in RAW_PROMPTS]
    if has_template:
        for conv in CHAT_CONVERSATIONS:
            # llama-cpp-python's chat completion tokenizes the rendered prompt like this.
            prompts.append({"kind": "chat_template", "messages": conv, "prompt": render_chat(llm, conv),
                            "add_bos": True, "special": True})
    else:
        for p in GEMMA_TURN_PROMPTS:
            prompts.append({"kind": "turn_markup_no_template", "prompt": p, "add_bos": True, "special": True})
    runs = []
    for p in prompts:
        ids = llm.tokenize(p["prompt"].encode("utf-8"), add_bos=p["add_bos"], special=p["special"])
        runs.append(dict(p, prompt_ids=ids, **greedy(llm, ids)))
    rec = {
        "model": info,
        "sampling": {"top_k": 1, "temperature": 0.0, "repeat_penalty": 1.0, "max_new_tokens": MAX_NEW_TOKENS,
                     "stop": "end-of-generation token (not included in generated_ids)"},
        "tokenize_note": ("ids[key] = llm.tokenize(text.encode(), add_bos, special); add_bos adds BOS only "
                          "when the vocab says so (model.vocab_adds_bos); detokenize_* use the "
                          "add_bos=false ids of the same special setting"),
        "tokenize": record_tokenization(llm),
        "greedy": runs,
    }
    del llm
    if with_hf:
        rec["hf_cross_check"] = hf_greedy(path, runs)
    return rec


def record_hf_tokenizer(llama_rec: dict, gguf_path: Path, out_dir: Path) -> dict:
    """Save transformers' GGUF-derived SmolLM2 tokenizer and its ids for the tricky strings."""
    import tokenizers
    import transformers
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tok.save_pretrained(tmp)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            src = Path(tmp) / name
            if src.stat().st_size > 4 * 1024 * 1024:
                raise RuntimeError(f"{name} is {src.stat().st_size} bytes, over the 4 MB fixture limit")
            shutil.copy(src, out_dir / name)
        for extra in ("special_tokens_map.json", "chat_template.jinja"):
            (out_dir / extra).unlink(missing_ok=True)
            if (Path(tmp) / extra).is_file():
                shutil.copy(Path(tmp) / extra, out_dir / extra)
    llama_ids = {e["text"]: e["ids"]["add_bos=false,special=true"] for e in llama_rec["tokenize"]}
    entries = []
    disagree = []
    for text in TRICKY_STRINGS:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        e = {"text": text, "ids": ids, "decoded": tok.decode(ids)}
        if ids != llama_ids[text]:
            e["llama_cpp_ids"] = llama_ids[text]
            disagree.append(text)
        entries.append(e)
    return {
        "source_gguf": gguf_path.name,
        "source_sha256": llama_rec["model"]["sha256"],
        "transformers_version": transformers.__version__,
        "tokenizers_version": tokenizers.__version__,
        "note": ("ids = tokenizer(text, add_special_tokens=False); decoded = tokenizer.decode(ids). "
                 "Where llama.cpp (tokenize add_bos=False, special=True) gives other ids, they are in "
                 "llama_cpp_ids and the text is listed in disagreements"),
        "strings": entries,
        "disagreements": disagree,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--models-dir", type=Path, default=MODELS_DIR)
    ap.add_argument("--out", type=Path, default=OUT_DIR)
    ap.add_argument("--hf-tokenizer", action=argparse.BooleanOptionalAction, default=True,
                    help="also write tests/fixtures/tokenizer/smollm2 (needs smollm2 in --models)")
    ap.add_argument("--tokenizer-out", type=Path, default=TOKENIZER_OUT)
    ap.add_argument("--hf-greedy", action=argparse.BooleanOptionalAction, default=True,
                    help="also record transformers' greedy ids from the same GGUF (needs accelerate)")
    args = ap.parse_args()

    args.out.mkdir(parents=True, exist_ok=True)
    for key in args.models:
        path = args.models_dir / MODELS[key]
        if not path.is_file():
            print(f"{key}: {path} missing; run scripts/fetch_models.sh {key}", file=sys.stderr)
            return 1
        rec = record_model(key, path, args.hf_greedy)
        dst = args.out / f"{key}.json"
        dst.write_text(json.dumps(rec, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
        gens = "; ".join(f"{g['kind']}: {len(g['generated_ids'])} tok, min margin {min(g['top2_margins']):.3f}"
                         + (f", HF agrees {g['hf_agree_prefix']}" if "hf_agree_prefix" in g else "")
                         for g in rec["greedy"])
        print(f"{key}: {dst.relative_to(REPO_ROOT)} ({dst.stat().st_size} bytes) {gens}")
        if key == "smollm2" and args.hf_tokenizer:
            hf = record_hf_tokenizer(rec, path, args.tokenizer_out)
            (args.tokenizer_out / "reference.json").write_text(
                json.dumps(hf, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
            print(f"  HF tokenizer -> {args.tokenizer_out.relative_to(REPO_ROOT)}; "
                  f"disagreements with llama.cpp: {hf['disagreements']!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
