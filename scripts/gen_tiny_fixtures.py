#!/usr/bin/env python3
"""Build tiny random-weight models and their reference logits for afm's Rust tests.

For each architecture (llama, qwen2, qwen3, gemma3, plus gemma3_alt, a safetensors-only gemma3
variant exercising config keys llama.cpp's GGUF cannot express) this script:

1. builds a transformers config with tiny sizes (vocab 128, hidden 64, 4 heads / 2 KV heads),
   creates the model with a fixed torch seed, and overwrites *every* parameter with seeded
   random values: weights N(0, std), RMSNorm weights around their identity value (1 for
   llama/qwen, 0 for gemma's (1 + w) norms) and biases N(0, 0.05). transformers' own init
   leaves norms at identity and biases at zero, which would hide bugs in applying them;
2. saves it with save_pretrained(safe_serialization=True) into tests/fixtures/tiny/<arch>/
   (config.json, generation_config.json, model.safetensors);
3. reloads it from disk in float32 with attn_implementation="eager" and writes reference.json:
   the logits of ONE forward pass over a fixed 40-token sequence, and 16 tokens of greedy
   generation (model.generate, do_sample=False, no EOS stop) after the first 8 tokens;
4. optionally (--gguf, on by default) converts the saved model to GGUF f32 and q8_0 with
   llama.cpp's own convert_hf_to_gguf.py (from the llama-cpp-python sdist on PyPI), after
   adding a tiny SentencePiece tokenizer with exactly `vocab` pieces (the converter insists on
   a tokenizer). It then checks tensor by tensor that the GGUFs hold the HF values (after
   llama's Q/K permutation and gemma's +1 norm shift; Q8_0 tensors equal gguf-py's round trip),
   writes reference_q8_0.json (the HF forward with the Q8_0 tensors round-tripped: the target
   for a Rust path that dequantizes Q8_0 to f32) and runs both GGUFs in llama-cpp-python,
   recording how close llama.cpp comes in gguf_check.json.

Everything is deterministic for a given torch/transformers version; CI never runs this script,
it only reads what it wrote. Run from anywhere:

    python3 scripts/gen_tiny_fixtures.py                 # all archs, with GGUF
    python3 scripts/gen_tiny_fixtures.py --archs qwen3 --no-gguf
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

import torch
import tiny_reference as tiny
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    Qwen2Config,
    Qwen3Config,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "tests" / "fixtures" / "tiny"
LLAMA_CPP_PY_VERSION = "0.3.36"

VOCAB = 128
SEQ_LEN = 40
GREEDY_PROMPT_LEN = 8
GREEDY_NEW_TOKENS = 16
SEED = 20241129

# Shared tiny sizes. head_dim is 16 where hidden/heads gives it; qwen3 and gemma3 use 32 so that
# num_heads * head_dim (128) != hidden (64), as in the real Qwen3 and Gemma 3 checkpoints.
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    dtype="float32",
)

# Gemma 3 layer pattern matching llama.cpp's hard-coded rule for gemma3 GGUFs (no pattern key is
# written by the converter): layer il is sliding iff il % 6 < 5, i.e. 5 sliding then 1 global.
GEMMA3_LAYER_TYPES = ["sliding_attention"] * 5 + ["full_attention"]

ARCHS: dict[str, dict] = {
    # Untied embeddings, SmolLM2's rope_theta (100000), rms_norm_eps 1e-5.
    "llama": dict(
        config_cls=LlamaConfig,
        kwargs=dict(
            COMMON,
            num_hidden_layers=2,
            head_dim=16,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
            bos_token_id=1,
            eos_token_id=2,
        ),
        weight_std=0.1,
        norm_center=1.0,
        gguf=True,
    ),
    # Tied embeddings (as Qwen2.5-0.5B/1.5B), q/k/v biases (always on in Qwen2), theta 1e6.
    "qwen2": dict(
        config_cls=Qwen2Config,
        kwargs=dict(
            COMMON,
            num_hidden_layers=2,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
        weight_std=0.1,
        norm_center=1.0,
        gguf=True,
    ),
    # Untied (the Qwen3Config default), per-head q_norm/k_norm, head_dim 32 != hidden/heads.
    "qwen3": dict(
        config_cls=Qwen3Config,
        kwargs=dict(
            COMMON,
            num_hidden_layers=2,
            head_dim=32,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
        weight_std=0.1,
        norm_center=1.0,
        gguf=True,
    ),
    # Tied, 6 layers (5 sliding with window 8, then 1 global), q/k norms, sandwich norms,
    # (1 + w) RMSNorm, sqrt(hidden) embedding scale, gelu_pytorch_tanh, per-type rope theta.
    # query_pre_attn_scalar == head_dim and no softcapping: what llama.cpp assumes for gemma3.
    "gemma3": dict(
        config_cls=Gemma3TextConfig,
        kwargs=dict(
            COMMON,
            num_hidden_layers=6,
            head_dim=32,
            intermediate_size=96,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            sliding_window=8,
            layer_types=GEMMA3_LAYER_TYPES,
            query_pre_attn_scalar=32,
            final_logit_softcapping=None,
            attn_logit_softcapping=None,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            },
            pad_token_id=0,
            eos_token_id=1,
            bos_token_id=2,
        ),
        weight_std=0.1,
        norm_center=0.0,
        gguf=True,
    ),
    # safetensors-only Gemma 3 variant: query_pre_attn_scalar (64) != head_dim (32), final logit
    # softcapping small enough to change the logits visibly, a non-default local rope theta and a
    # layer pattern that is not llama.cpp's "every 6th is global".
    "gemma3_alt": dict(
        config_cls=Gemma3TextConfig,
        kwargs=dict(
            COMMON,
            num_hidden_layers=4,
            head_dim=32,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            query_pre_attn_scalar=64,
            final_logit_softcapping=3.0,
            attn_logit_softcapping=None,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 20000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 500000.0},
            },
            pad_token_id=0,
            eos_token_id=1,
            bos_token_id=2,
        ),
        weight_std=0.1,
        norm_center=0.0,
        gguf=False,
    ),
}


def randomize_parameters(model: torch.nn.Module, weight_std: float, norm_center: float, seed: int) -> None:
    """Overwrite every parameter with seeded values so norms and biases are not identities."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if "norm" in name:
                p.copy_(norm_center + 0.1 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.05 * noise)
            else:
                p.copy_(weight_std * noise)


def build_and_save(arch: str, spec: dict, out_dir: Path) -> None:
    """Construct the tiny model, randomize it and save config + safetensors into out_dir."""
    torch.manual_seed(SEED)
    config = spec["config_cls"](**spec["kwargs"])
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    randomize_parameters(model, spec["weight_std"], spec["norm_center"], SEED)
    model.eval()
    # No EOS stop during greedy generation: every run must emit exactly GREEDY_NEW_TOKENS.
    model.generation_config.eos_token_id = None
    model.generation_config.do_sample = False
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("model.safetensors", "config.json", "generation_config.json"):
        (out_dir / stale).unlink(missing_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)


def load_saved(out_dir: Path) -> torch.nn.Module:
    """Load a saved tiny model the way the references are computed: float32, eager attention."""
    model = AutoModelForCausalLM.from_pretrained(out_dir, attn_implementation="eager", dtype=torch.float32)
    return model.eval()


def compute_reference(arch: str, out_dir: Path, model: torch.nn.Module | None = None) -> dict:
    """Compute reference logits (one forward) and greedy tokens in float32 for the saved model."""
    if model is None:
        model = load_saved(out_dir)
    tokens = tiny.reference_tokens(SEQ_LEN, VOCAB)
    logits = tiny.one_pass_logits(model, tokens)
    ids, scores = tiny.greedy(model, tokens, GREEDY_PROMPT_LEN, GREEDY_NEW_TOKENS)
    return tiny.record(arch, tokens, logits, GREEDY_PROMPT_LEN, ids, scores)


# ----------------------------------------------------------------------------- GGUF conversion


def tokenizer_corpus() -> str:
    """Fixed English-ish training text for the tiny SentencePiece tokenizer."""
    words = (
        "the quick brown fox jumps over the lazy dog while a small crab writes rust code "
        "tokens flow through attention layers and every model learns to predict the next word "
        "sliding windows and rotary embeddings keep positions honest in long sequences of text"
    ).split()
    lines = []
    for i in range(400):
        lines.append(" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(6 + i % 5)))
    return "\n".join(lines) + "\n"


def train_sentencepiece(dst_dir: Path, vocab: int, spec: dict) -> None:
    """Train a BPE SentencePiece model with exactly `vocab` pieces into dst_dir/tokenizer.model."""
    import sentencepiece as spm

    kw = spec["kwargs"]
    # Put the special ids where the model config says they are (gemma: pad 0, eos 1, bos 2).
    if kw.get("pad_token_id") == 0:
        ids = dict(pad_id=0, eos_id=1, bos_id=2, unk_id=3)
    else:
        ids = dict(unk_id=0, bos_id=1, eos_id=2, pad_id=-1)
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.txt"
        corpus.write_text(tokenizer_corpus(), encoding="utf-8")
        spm.SentencePieceTrainer.train(
            input=str(corpus),
            model_prefix=str(dst_dir / "tokenizer"),
            vocab_size=vocab,
            model_type="bpe",
            character_coverage=1.0,
            hard_vocab_limit=True,
            num_threads=1,
            minloglevel=2,
            **ids,
        )
    (dst_dir / "tokenizer.vocab").unlink(missing_ok=True)
    sp = spm.SentencePieceProcessor(model_file=str(dst_dir / "tokenizer.model"))
    if sp.get_piece_size() != vocab:
        raise RuntimeError(f"sentencepiece vocab is {sp.get_piece_size()} pieces, model vocab_size is {vocab}")


def ensure_llama_cpp_src(arg: str | None, cache_dir: Path) -> Path:
    """Return vendor/llama.cpp of the llama-cpp-python sdist, downloading the sdist if needed.

    `pip download --no-binary :all:` would build cmake from source just to read the package
    metadata, so the sdist is fetched by URL from PyPI's simple index for this one package.
    """
    if arg:
        p = Path(arg)
        for cand in (p, p / "vendor" / "llama.cpp"):
            if (cand / "convert_hf_to_gguf.py").is_file():
                return cand
        raise FileNotFoundError(f"--llama-cpp-src {arg}: no convert_hf_to_gguf.py there or in vendor/llama.cpp")
    root = cache_dir / f"llama_cpp_python-{LLAMA_CPP_PY_VERSION}"
    conv = root / "vendor" / "llama.cpp"
    if (conv / "convert_hf_to_gguf.py").is_file():
        return conv
    cache_dir.mkdir(parents=True, exist_ok=True)
    # The PEP 691 JSON form of PyPI's simple index (the index pip itself uses).
    name = f"llama_cpp_python-{LLAMA_CPP_PY_VERSION}.tar.gz"
    req = urllib.request.Request("https://pypi.org/simple/llama-cpp-python/",
                                 headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        index = json.load(r)
    sdist = next(f for f in index["files"] if f["filename"] == name)
    tgz = cache_dir / name
    print(f"downloading {sdist['url']}", file=sys.stderr)
    urllib.request.urlretrieve(sdist["url"], tgz)
    digest = hashlib.sha256(tgz.read_bytes()).hexdigest()
    if digest != sdist["hashes"]["sha256"]:
        raise RuntimeError(f"{tgz}: sha256 {digest}, PyPI says {sdist['hashes']['sha256']}")
    with tarfile.open(tgz) as tf:
        tf.extractall(cache_dir, filter="data")
    return conv


def convert_to_gguf(arch: str, spec: dict, model_dir: Path, llama_cpp: Path) -> dict:
    """Convert model_dir to model-f32.gguf and model-q8_0.gguf with llama.cpp's converter."""
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / arch
        src.mkdir()
        for f in ("config.json", "generation_config.json", "model.safetensors"):
            shutil.copy(model_dir / f, src / f)
        train_sentencepiece(src, VOCAB, spec)
        env = dict(os.environ, PYTHONPATH=str(llama_cpp / "gguf-py"))
        for outtype in ("f32", "q8_0"):
            out = model_dir / f"model-{outtype}.gguf"
            cmd = [sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(src),
                   "--outtype", outtype, "--outfile", str(out)]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"{arch} {outtype}: converter failed:\n{proc.stdout}\n{proc.stderr}")
            result[outtype] = out
    return result


GGUF_ARCH = {"llama": "LLAMA", "qwen2": "QWEN2", "qwen3": "QWEN3", "gemma3": "GEMMA3"}


def llama_permute(w: "np.ndarray", n_head: int) -> "np.ndarray":
    """llama.cpp's Q/K row permutation for llama GGUFs (HF rotate-half -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_to_gguf_tensor(arch: str, hf_name: str, w: "np.ndarray", cfg: dict) -> "np.ndarray":
    """What llama.cpp's converter does to one HF tensor's values (besides renaming/quantizing)."""
    if arch == "llama" and hf_name.endswith("self_attn.q_proj.weight"):
        return llama_permute(w, cfg["num_attention_heads"])
    if arch == "llama" and hf_name.endswith("self_attn.k_proj.weight"):
        return llama_permute(w, cfg["num_key_value_heads"])
    if arch.startswith("gemma3") and hf_name.endswith("norm.weight"):
        return w + 1.0  # GGUF stores gemma's (1 + w) RMSNorm scale
    return w


def q8_0_reference(arch: str, out_dir: Path) -> dict:
    """Reference for the Q8_0 GGUF: HF float32 forward with quantized tensors round-tripped.

    Also checks, tensor by tensor, that both GGUFs hold exactly what we think they hold:
    f32 tensors equal the (permuted / shifted) HF values bit for bit, and Q8_0 tensors equal
    gguf-py's quantize->dequantize of them.
    """
    import gguf
    import numpy as np

    cfg = json.loads((out_dir / "config.json").read_text())
    model = load_saved(out_dir)
    name_map = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, GGUF_ARCH[arch]), cfg["num_hidden_layers"])
    readers = {t: gguf.GGUFReader(out_dir / f"model-{t}.gguf") for t in ("f32", "q8_0")}
    tensors = {t: {x.name: x for x in r.tensors} for t, r in readers.items()}
    n_quantized = 0
    with torch.no_grad():
        for hf_name, p in model.named_parameters():
            gname = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
            if gname is None:
                raise RuntimeError(f"{arch}: no GGUF name for {hf_name}")
            w = p.detach().numpy().astype(np.float32)
            want = hf_to_gguf_tensor(arch, hf_name, w, cfg)
            for t in ("f32", "q8_0"):
                gt = tensors[t].get(gname)
                if gt is None:
                    raise RuntimeError(f"{arch}: {gname} ({hf_name}) missing from model-{t}.gguf")
                got = gguf.quants.dequantize(gt.data, gt.tensor_type).reshape(want.shape)
                if gt.tensor_type == gguf.GGMLQuantizationType.Q8_0:
                    rt = gguf.quants.dequantize(gguf.quants.quantize(want, gt.tensor_type), gt.tensor_type)
                    if not np.array_equal(got, rt.reshape(want.shape)):
                        raise RuntimeError(f"{arch}: {gname} in model-{t}.gguf is not the Q8_0 round trip of {hf_name}")
                    # Quantization acts along rows, so it commutes with the row permutation and
                    # the round trip of the HF tensor is the HF-layout reference weight.
                    hf_rt = gguf.quants.dequantize(gguf.quants.quantize(w, gt.tensor_type), gt.tensor_type)
                    p.copy_(torch.from_numpy(hf_rt.reshape(w.shape)))
                    n_quantized += 1
                elif not np.array_equal(got, want):
                    raise RuntimeError(f"{arch}: {gname} in model-{t}.gguf differs from {hf_name}")
    ref = compute_reference(arch, out_dir, model)
    ref["note"] = ("HF float32 forward where every tensor that model-q8_0.gguf stores as Q8_0 is replaced "
                   "by its Q8_0 round trip; norms and biases stay float32")
    ref["q8_0_tensors"] = n_quantized
    return ref


def check_gguf_with_llama_cpp(gguf_path: Path, ref: dict) -> dict:
    """Evaluate the reference tokens with llama-cpp-python and compare against the HF logits."""
    import numpy as np
    from llama_cpp import Llama

    # f32 K/V cache (GGML_TYPE_F32 = 0): the default f16 cache alone costs ~1e-2 in these logits.
    llm = Llama(model_path=str(gguf_path), n_ctx=64, n_threads=2, logits_all=True, verbose=False, seed=0,
                type_k=0, type_v=0, flash_attn=False)
    llm.eval(ref["tokens"])
    got = np.array(llm.scores[: len(ref["tokens"])], dtype=np.float64)
    want = np.array(ref["logits"], dtype=np.float64)
    diff = np.abs(got - want)
    # Greedy continuation in llama.cpp, fed the same 8-token prompt.
    llm.reset()
    prompt = ref["tokens"][: ref["greedy_prompt_len"]]
    greedy = []
    for tok in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0):
        greedy.append(int(tok))
        if len(greedy) == len(ref["greedy"]):
            break
    del llm
    return {
        "max_abs_diff": float(diff.max()),
        "mean_abs_diff": float(diff.mean()),
        "argmax_agree": int((got.argmax(1) == want.argmax(1)).sum()),
        "greedy_agree": greedy == ref["greedy"],
        "llama_cpp_greedy": greedy,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--archs", nargs="+", default=list(ARCHS), choices=list(ARCHS))
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="fixtures root (default: %(default)s)")
    ap.add_argument("--gguf", action=argparse.BooleanOptionalAction, default=True,
                    help="also write model-f32.gguf / model-q8_0.gguf via llama.cpp's converter")
    ap.add_argument("--llama-cpp-src", default=None,
                    help="llama-cpp-python sdist dir or its vendor/llama.cpp (default: download to --cache)")
    ap.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "afm-llama-cpp-src")
    args = ap.parse_args()

    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(2)
    llama_cpp = ensure_llama_cpp_src(args.llama_cpp_src, args.cache) if args.gguf else None

    summary = {}
    for arch in args.archs:
        spec = ARCHS[arch]
        out_dir = args.out / arch
        build_and_save(arch, spec, out_dir)
        ref = compute_reference(arch, out_dir)
        (out_dir / "reference.json").write_text(json.dumps(ref, separators=(",", ":")) + "\n")
        line = (f"{arch}: {out_dir.relative_to(REPO_ROOT) if out_dir.is_relative_to(REPO_ROOT) else out_dir} "
                f"logits std {ref['logits_std']:.3f} max {ref['logits_abs_max']:.3f} "
                f"greedy {ref['greedy']} min margin {ref['greedy_min_top2_margin']:.4f}")
        print(line)
        checks = {}
        if args.gguf and spec["gguf"]:
            paths = convert_to_gguf(arch, spec, out_dir, llama_cpp)
            ref_q8 = q8_0_reference(arch, out_dir)
            (out_dir / "reference_q8_0.json").write_text(json.dumps(ref_q8, separators=(",", ":")) + "\n")
            print(f"  reference_q8_0.json: greedy {ref_q8['greedy']} min margin {ref_q8['greedy_min_top2_margin']:.4f}")
            for outtype, path in paths.items():
                checks[outtype] = check_gguf_with_llama_cpp(path, ref if outtype == "f32" else ref_q8)
                c = checks[outtype]
                print(f"  {path.name}: {path.stat().st_size} bytes, llama.cpp vs HF max|diff| {c['max_abs_diff']:.2e} "
                      f"mean {c['mean_abs_diff']:.2e}, argmax agree {c['argmax_agree']}/{SEQ_LEN}, "
                      f"greedy agree {c['greedy_agree']}")
        elif not spec["gguf"]:
            for stale in ("model-f32.gguf", "model-q8_0.gguf", "reference_q8_0.json"):
                (out_dir / stale).unlink(missing_ok=True)
        summary[arch] = checks
    if args.gguf:
        # Kept beside the fixtures so the README's numbers can be checked without llama.cpp;
        # merged so a run over a subset of archs keeps the other entries.
        check_path = args.out / "gguf_check.json"
        merged = json.loads(check_path.read_text()) if check_path.is_file() else {}
        merged.update({k: v for k, v in summary.items() if v})
        check_path.write_text(json.dumps(merged, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
