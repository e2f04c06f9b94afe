#!/usr/bin/env python3
"""Convert the committed tiny HF fixtures of the newer families to GGUF with llama.cpp's own
convert_hf_to_gguf.py, into tests/fixtures/tiny/<arch>_gguf/, and check each file with
llama.cpp itself (llama-cpp-python) against the fixture's transformers reference logits.

    python3 scripts/gen_tiny_gguf.py [--archs qwen3_5 qwen3_5_moe deepseek_v4] \
        [--llama-cpp-src /tmp/fm/sdist/llama_cpp_python-0.3.36/vendor/llama.cpp]

What it writes, per fixture:
    model-f32.gguf    --outtype f32
    model-q8_0.gguf   --outtype q8_0 (where a tensor's rows are not whole Q8_0 blocks the
                      converter falls back to F16 or F32 itself)
    check.json        llama.cpp's logits vs transformers' reference (max relative error per
                      position, argmax agreement), so afm's tests can state both.

The converter runs in this process, unchanged, with two inputs prepared in a temporary copy of
the fixture (the committed fixture is never touched):
  * The fixtures have no tokenizer. The converter's vocab step is pointed at its own
    SentencePiece path (`_set_vocab_sentencepiece`) over a tiny trained SentencePiece model with
    exactly `vocab_size` pieces (scripts/gen_tiny_fixtures.py trains it), so llama.cpp can load
    the file; afm's model tests do not read the vocabulary.
  * Qwen3.5's separate `mtp.safetensors` is merged into `model.safetensors` (the converter reads
    one set of shards), and `rope_parameters.mrope_section` is set to the rotary pairs split
    [a, b, 0]: llama.cpp requires the sections to fit the rotated width, and for text the three
    position components are equal, so M-RoPE is plain RoPE and the reference logits still hold.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "tiny"
DEFAULT_LLAMA_CPP = Path("/tmp/fm/sdist/llama_cpp_python-0.3.36/vendor/llama.cpp")
MAX_BYTES = 2 * 1024 * 1024

# fixture -> the converter's outtypes to write
ARCHS: dict[str, tuple[str, ...]] = {
    "qwen3_5": ("f32", "q8_0"),
    "qwen3_5_moe": ("f32", "q8_0"),
    "deepseek_v4": ("f32", "q8_0"),
}


def prepare_source(arch: str, dst: Path) -> int:
    """Copy fixture `arch` into dst with the inputs the converter needs; returns vocab_size."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import gen_tiny_fixtures  # the SentencePiece trainer the older GGUF fixtures use

    src = FIXTURES / arch
    for f in src.iterdir():
        if f.suffix in (".json", ".safetensors") and f.name != "reference.json":
            shutil.copy(f, dst / f.name)
    if (dst / "mtp.safetensors").exists():
        from safetensors.torch import load_file, save_file

        tensors = load_file(dst / "model.safetensors")
        tensors.update(load_file(dst / "mtp.safetensors"))
        (dst / "mtp.safetensors").unlink()
        save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    rope = text.get("rope_parameters") or {}
    if "partial_rotary_factor" in rope and "mrope_section" not in rope:
        pairs = int(text["head_dim"] * rope["partial_rotary_factor"]) // 2
        rope["mrope_section"] = [pairs - pairs // 2, pairs // 2, 0]
        rope["mrope_interleaved"] = True
        (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    vocab = text["vocab_size"]
    gen_tiny_fixtures.train_sentencepiece(dst, vocab, {"kwargs": {}})
    return vocab


def convert(llama_cpp: Path, src: Path, outtype: str, out: Path) -> None:
    """llama.cpp's convert_hf_to_gguf.main() in this process, its vocab step on SentencePiece."""
    for p in (str(llama_cpp / "gguf-py"), str(llama_cpp)):
        if p not in sys.path:
            sys.path.insert(0, p)
    import convert_hf_to_gguf as conv

    original = getattr(conv, "_afm_original_get_model_class", conv.get_model_class)
    conv._afm_original_get_model_class = original

    def model_class(*args, **kwargs):
        cls = original(*args, **kwargs)
        cls.set_vocab = cls._set_vocab_sentencepiece
        return cls

    conv.get_model_class = model_class
    argv = sys.argv
    sys.argv = ["convert_hf_to_gguf.py", str(src), "--outtype", outtype, "--outfile", str(out)]
    try:
        conv.main()
    finally:
        sys.argv = argv


def check_with_llama_cpp(path: Path, reference: dict) -> dict:
    """llama.cpp's logits over the reference tokens against transformers' (one prefill)."""
    import numpy as np
    from llama_cpp import Llama

    tokens = reference["tokens"]
    llm = Llama(model_path=str(path), n_ctx=256, n_batch=256, n_ubatch=256, n_threads=2,
                logits_all=True, verbose=False, seed=0)
    llm.eval(tokens)
    got = np.array(llm.scores[: len(tokens)], dtype=np.float32)
    want = np.array(reference["logits"], dtype=np.float32)
    rel = np.abs(got - want).max(1) / np.abs(want).max(1)
    return {
        "max_rel_err": float(rel.max()),
        "argmax_agree": int((got.argmax(1) == want.argmax(1)).sum()),
        "positions": len(tokens),
        "logits": [[round(float(x), 6) for x in row] for row in got],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--archs", nargs="+", default=list(ARCHS), choices=list(ARCHS))
    ap.add_argument("--llama-cpp-src", type=Path, default=DEFAULT_LLAMA_CPP)
    ap.add_argument("--no-check", action="store_true", help="skip the llama-cpp-python check")
    args = ap.parse_args()
    if not (args.llama_cpp_src / "convert_hf_to_gguf.py").is_file():
        sys.exit(f"{args.llama_cpp_src}: no convert_hf_to_gguf.py (pass --llama-cpp-src)")
    for arch in args.archs:
        out_dir = FIXTURES / f"{arch}_gguf"
        out_dir.mkdir(exist_ok=True)
        reference = json.loads((FIXTURES / arch / "reference.json").read_text())
        checks = {}
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / arch
            src.mkdir()
            prepare_source(arch, src)
            for outtype in ARCHS[arch]:
                out = out_dir / f"model-{outtype}.gguf"
                convert(args.llama_cpp_src, src, outtype, out)
                size = out.stat().st_size
                if size > MAX_BYTES:
                    raise RuntimeError(f"{out}: {size} bytes, over the {MAX_BYTES}-byte fixture limit")
                if not args.no_check:
                    checks[outtype] = check_with_llama_cpp(out, reference)
                    c = checks[outtype]
                    print(f"{arch} {outtype}: llama.cpp vs transformers max rel err "
                          f"{c['max_rel_err']:.2e}, argmax {c['argmax_agree']}/{c['positions']}")
        if checks:
            (out_dir / "llama_cpp.json").write_text(json.dumps(checks) + "\n")


if __name__ == "__main__":
    main()
