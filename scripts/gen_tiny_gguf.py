#!/usr/bin/env python3
"""Convert the committed tiny HF fixtures of the newer families to GGUF with llama.cpp's own
convert_hf_to_gguf.py, into tests/fixtures/tiny/<arch>_gguf/, and check each file with
llama.cpp itself (llama-cpp-python) against the fixture's transformers reference logits.

    python3 scripts/gen_tiny_gguf.py [--archs qwen3_5 qwen3_5_moe deepseek_v4 gemma4_vocab] \
        [--llama-cpp-src /tmp/fm/sdist/llama_cpp_python-0.3.36/vendor/llama.cpp] [--no-check]

Needs torch, transformers 5.24, safetensors, sentencepiece, tokenizers and llama-cpp-python
0.3.36 (built from the same llama.cpp source). Conversions are deterministic: rerunning gives
byte-identical GGUFs.

What it writes, per fixture:
    model-f32.gguf        --outtype f32
    model-q8_0.gguf       --outtype q8_0 (where a tensor's rows are not whole Q8_0 blocks the
                          converter falls back to F16 or F32 itself)
    model-f32-fused.gguf  (qwen3_5_moe) --fuse-gate-up-exps: one ffn_gate_up_exps per layer
    llama_cpp.json        llama.cpp's logits vs transformers' reference (max relative error per
                          position, argmax agreement; the logits of quantized files), so afm's
                          tests can state both.

gemma4_vocab writes tests/fixtures/tiny/gemma4_gguf/: vocab.gguf (--vocab-only, a tiny tokenizer
in Gemma 4's shape, `tokenizer.ggml.model = "gemma4"`) and llama_cpp_tokens.json (llama.cpp's ids
and detokenization for the tokenizer tests' strings).

DeepSeek V4 is different (see `deepseek_v4_source`): the converter takes DeepSeek's released
layout with FP4 experts only, so the script builds a variant of the r128 fixture whose experts
are MXFP4 values, records transformers' logits for it in deepseek_v4_gguf/reference.json, and
writes model-mxfp4.gguf (everything F32 but the MXFP4 experts).

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

# fixture -> (file label, the converter's --outtype, extra converter flags) of each file to
# write. DeepSeek V4's routed experts are MXFP4 whatever the outtype; with f32 sources the rest
# stays F32. The fused variant stores gate and up experts as one `ffn_gate_up_exps`.
ARCHS: dict[str, tuple[tuple[str, str, tuple[str, ...]], ...]] = {
    "qwen3_5": (("f32", "f32", ()), ("q8_0", "q8_0", ())),
    "qwen3_5_moe": (("f32", "f32", ()), ("q8_0", "q8_0", ()),
                    ("f32-fused", "f32", ("--fuse-gate-up-exps",))),
    "deepseek_v4": (("mxfp4", "f32", ()),),
}


# llama-cpp-python 0.3.36 loads the tiny deepseek4 file but aborts building its graph
# (GGML_ASSERT(ggml_nelements(a) == ne0*ne1) in ggml_reshape_2d, from
# llama_model_deepseek4::graph::build_attention_impl): its DeepSeek V4 graph assumes more of the
# real shapes than these tiny ones have. transformers stays the reference there.
LLAMA_CPP_CANNOT_RUN = {"deepseek_v4"}


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


def to_mxfp4_grid(w: "torch.Tensor", gguf) -> tuple["torch.Tensor", "torch.Tensor", "torch.Tensor"]:
    """`w` ([rows, cols], cols a multiple of 32) snapped to gguf-py's MXFP4 quantization:
    (the values it decodes to, DeepSeek's packed codes [rows, cols/2] with element 2i in the low
    nibble, DeepSeek's E8M0 scales [rows, cols/32])."""
    import numpy as np
    import torch

    rows, cols = w.shape
    blocks = gguf.quants.quantize(w.numpy().astype(np.float32), gguf.GGMLQuantizationType.MXFP4)
    blocks = blocks.reshape(rows, cols // 32, 17)
    values = gguf.quants.dequantize(blocks.reshape(rows, -1), gguf.GGMLQuantizationType.MXFP4)
    qs = blocks[:, :, 1:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, cols)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    scale = blocks[:, :, 0].astype(np.uint8)
    return (torch.from_numpy(np.ascontiguousarray(values.reshape(rows, cols))),
            torch.from_numpy(packed), torch.from_numpy(np.ascontiguousarray(scale)))


def deepseek_v4_source(llama_cpp: Path, hf_dir: Path, dst: Path, out_dir: Path) -> None:
    """A DeepSeek V4 made for conversion, written in two forms.

    llama.cpp's converter takes DeepSeek's released layout only: unprefixed names and routed
    experts as packed FP4 codes with E8M0 scales (it repacks them into MXFP4 losslessly), and
    MXFP4 blocks are 32 wide, so the committed fixtures (experts 8 wide) cannot be converted,
    and llama.cpp runs compression ratios 0, 4 and 128 only. This builds gen_tiny_deepseek_v4.py's
    `deepseek_v4_r128` model (the real ratio 128, 144 tokens, 4 mHC streams) with 32-wide
    experts whose weights are snapped
    to MXFP4 values, saves it with transformers (hf_dir) to compute reference logits from, and
    rewrites it in the released layout (dst) for the converter.
    """
    import torch
    from safetensors.torch import load_file, save_file

    for p in (str(llama_cpp / "gguf-py"), str(ROOT / "scripts")):
        if p not in sys.path:
            sys.path.insert(0, p)
    import gguf
    import gen_tiny_deepseek_v4 as dsv4

    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(2)
    config_kwargs, seq_len = dsv4.VARIANTS["deepseek_v4_r128"]
    config = dict(config_kwargs, moe_intermediate_size=32)
    dsv4.build_and_save(hf_dir, config)
    tensors = load_file(hf_dir / "model.safetensors")
    packed: dict[str, torch.Tensor] = {}
    for name in [n for n in tensors if ".ffn.experts." in n]:
        values, codes, scale = to_mxfp4_grid(tensors[name], gguf)
        tensors[name] = values
        packed[name] = codes
        packed[name.removesuffix(".weight") + ".scale"] = scale
    save_file(tensors, hf_dir / "model.safetensors", metadata={"format": "pt"})
    reference = dsv4.compute_reference(hf_dir, seq_len)
    reference["note"] = ("transformers on gen_tiny_deepseek_v4.py's deepseek_v4_r128 model with moe_intermediate_size 32 "
                         "and every routed expert weight snapped to MXFP4 values (gguf-py's quantizer), "
                         "so model-mxfp4.gguf holds exactly these weights")
    (out_dir / "reference.json").write_text(json.dumps(reference, separators=(",", ":")) + "\n")

    released: dict[str, torch.Tensor] = {}
    top = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
           "model.hc_head.hc_fn": "hc_head_fn", "model.hc_head.hc_base": "hc_head_base",
           "model.hc_head.hc_scale": "hc_head_scale"}
    for name, t in tensors.items():
        new = top.get(name, name.removeprefix("model."))
        new = new.replace(".attn.norm.weight", ".attn.kv_norm.weight")
        if ".ffn.experts." in name:
            released[new] = packed[name]
            scale = name.removesuffix(".weight") + ".scale"
            released[new.removesuffix(".weight") + ".scale"] = packed[scale]
        else:
            released[new] = t.contiguous()
    save_file(released, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((hf_dir / "config.json").read_text())
    # The released config's spelling of what transformers calls layer_types / mlp_layer_types.
    kinds = {"sliding_attention": 0, "compressed_sparse_attention": 4,
             "heavily_compressed_attention": config["compress_rates"]["heavily_compressed_attention"]}
    cfg["compress_ratios"] = [kinds[t] for t in config["layer_types"]]
    cfg["num_hash_layers"] = config["mlp_layer_types"].count("hash_moe")
    # The released config keeps the compressed branch's YaRN under `rope_scaling`, where the
    # converter reads it (transformers folds it into rope_parameters.compress).
    yarn = dict(config["rope_parameters"])
    yarn["type"] = yarn.pop("rope_type")
    cfg["rope_scaling"] = yarn
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    sys.path.insert(0, str(ROOT / "scripts"))
    import gen_tiny_fixtures

    gen_tiny_fixtures.train_sentencepiece(dst, cfg["vocab_size"], {"kwargs": {}})


GEMMA4_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<|turn>", "<turn|>",
                   "<|tool_call>", "<tool_call|>", "<|channel>", "<channel|>"]


def gemma4_tokenizer(dst: Path) -> None:
    """A tiny tokenizer in Gemma 4's shape, which llama.cpp's converter turns into
    `tokenizer.ggml.model = "gemma4"` (its Gemma4Model.set_vocab, via gguf-py's LlamaHfVocab):
    BPE with byte fallback over the 256 `<0xXX>` tokens, spaces replaced by '▁' by the
    normalizer, a Replace/ByteFallback/Fuse decoder, Gemma 4's special tokens, trained on the
    fixtures' corpus plus multilingual lines and newline runs."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import gen_tiny_fixtures
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    corpus = gen_tiny_fixtures.tokenizer_corpus().splitlines()
    corpus += ["Hello world!\n\nHello again.", "café naïve résumé", "中文测试，你好世界", "def f(x):\n    return x"] * 20
    tok = Tokenizer(models.BPE(byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    # Lines and newline runs apart, as llama.cpp's gemma4 pre-tokenizer splits them.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("\n+"), "isolated")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=640, special_tokens=GEMMA4_SPECIALS + byte_tokens,
                                  show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(dst / "tokenizer.json"))
    (dst / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
        "pad_token": "<pad>", "unk_token": "<unk>", "add_bos_token": True,
    }))


def record_llama_cpp_tokens(path: Path, out: Path) -> None:
    """llama.cpp's ids and detokenization for the tokenizer tests' strings, as
    crates/afm-chat/tests/fixtures/record_llamacpp.py records them for the real models."""
    import ctypes

    import llama_cpp

    sys.path.insert(0, str(ROOT / "crates" / "afm-chat" / "tests" / "fixtures"))
    from record_llamacpp import MODES, TEXTS, detok

    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    vocab = llm._model.vocab
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
    texts = TEXTS + ["<|turn>user\nhi<turn|>\n", "Hello world!\n\nHello again.\n\n\n", "naïve ü 𝕏 ☃"]
    cases = [{"text": t, "add_special": a, "parse_special": p,
              "ids": llm.tokenize(t.encode("utf-8"), add_bos=a, special=p)}
             for t in texts for a, p in MODES]
    decodes = []
    for t in texts:
        ids = llm.tokenize(t.encode("utf-8"), add_bos=True, special=True)
        for remove_special, unparse_special in [(False, True), (True, False)]:
            decodes.append({"ids": ids, "skip_special": remove_special,
                            "text": detok(llm, ids, remove_special, unparse_special)})
    eog = [i for i in range(n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, i)]
    del ctypes
    out.write_text(json.dumps({"gguf": path.name, "llama_cpp_python": llama_cpp.__version__,
                               "n_vocab": n_vocab, "bos": llama_cpp.llama_vocab_bos(vocab), "eog": eog,
                               "cases": cases, "decodes": decodes}, ensure_ascii=False, indent=0) + "\n")
    print(f"gemma4 vocab: {len(cases)} cases, n_vocab {n_vocab}, eog {eog} -> {out}")


def gemma4_vocab(llama_cpp: Path) -> None:
    """tests/fixtures/tiny/gemma4_gguf/vocab.gguf: the converter's --vocab-only output for the
    gemma4 fixture's config with `gemma4_tokenizer`, and llama.cpp's ids for it."""
    out_dir = FIXTURES / "gemma4_gguf"
    out_dir.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "gemma4"
        src.mkdir()
        shutil.copy(FIXTURES / "gemma4" / "config.json", src / "config.json")
        gemma4_tokenizer(src)
        out = out_dir / "vocab.gguf"
        argv = sys.argv
        for p in (str(llama_cpp / "gguf-py"), str(llama_cpp)):
            if p not in sys.path:
                sys.path.insert(0, p)
        import convert_hf_to_gguf as conv

        sys.argv = ["convert_hf_to_gguf.py", str(src), "--vocab-only", "--outfile", str(out)]
        try:
            conv.main()
        finally:
            sys.argv = argv
    record_llama_cpp_tokens(out, out_dir / "llama_cpp_tokens.json")


def convert(llama_cpp: Path, src: Path, outtype: str, out: Path, extra: tuple[str, ...] = ()) -> None:
    """llama.cpp's convert_hf_to_gguf.main() in this process, its vocab step on SentencePiece."""
    for p in (str(llama_cpp / "gguf-py"), str(llama_cpp)):
        if p not in sys.path:
            sys.path.insert(0, p)
    import convert_hf_to_gguf as conv

    original = conv.get_model_class
    patched: list[tuple[type, object]] = []

    def model_class(*args, **kwargs):
        cls = original(*args, **kwargs)
        patched.append((cls, cls.__dict__.get("set_vocab")))
        cls.set_vocab = cls._set_vocab_sentencepiece
        return cls

    conv.get_model_class = model_class
    argv = sys.argv
    sys.argv = ["convert_hf_to_gguf.py", str(src), "--outtype", outtype, "--outfile", str(out), *extra]
    try:
        conv.main()
    finally:
        # Undo the patch, so a later conversion in this process (gemma4's vocab) is unchanged.
        sys.argv = argv
        conv.get_model_class = original
        for cls, own in patched:
            if own is None:
                del cls.set_vocab
            else:
                cls.set_vocab = own


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--archs", nargs="+", default=list(ARCHS) + ["gemma4_vocab"],
                    choices=list(ARCHS) + ["gemma4_vocab"])
    ap.add_argument("--llama-cpp-src", type=Path, default=DEFAULT_LLAMA_CPP)
    ap.add_argument("--no-check", action="store_true", help="skip the llama-cpp-python check")
    args = ap.parse_args()
    if not (args.llama_cpp_src / "convert_hf_to_gguf.py").is_file():
        sys.exit(f"{args.llama_cpp_src}: no convert_hf_to_gguf.py (pass --llama-cpp-src)")
    for arch in args.archs:
        if arch == "gemma4_vocab":
            gemma4_vocab(args.llama_cpp_src)
            continue
        out_dir = FIXTURES / f"{arch}_gguf"
        out_dir.mkdir(exist_ok=True)
        checks = {}
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / arch
            src.mkdir()
            if arch == "deepseek_v4":
                deepseek_v4_source(args.llama_cpp_src, Path(tmp) / "hf", src, out_dir)
                reference = json.loads((out_dir / "reference.json").read_text())
            else:
                prepare_source(arch, src)
                reference = json.loads((FIXTURES / arch / "reference.json").read_text())
            for label, outtype, extra in ARCHS[arch]:
                out = out_dir / f"model-{label}.gguf"
                convert(args.llama_cpp_src, src, outtype, out, extra)
                size = out.stat().st_size
                if size > MAX_BYTES:
                    raise RuntimeError(f"{out}: {size} bytes, over the {MAX_BYTES}-byte fixture limit")
                if not args.no_check and arch not in LLAMA_CPP_CANNOT_RUN:
                    checks[label] = check_with_llama_cpp(out, reference)
                    if outtype == "f32":
                        del checks[label]["logits"]  # afm's tests need them for quantized files only
                    c = checks[label]
                    print(f"{arch} {label}: llama.cpp vs transformers max rel err "
                          f"{c['max_rel_err']:.2e}, argmax {c['argmax_agree']}/{c['positions']}")
        if checks:
            (out_dir / "llama_cpp.json").write_text(json.dumps(checks) + "\n")


if __name__ == "__main__":
    main()
