#!/usr/bin/env python3
"""Build tiny random-weight Gemma 4 checkpoints and their transformers reference logits.

Follows scripts/gen_tiny_fixtures.py (same token sequence formula, same float rounding, every
parameter overwritten with seeded values so no norm or scale is an identity), for two variants:

* tests/fixtures/tiny/gemma4      dense, saved as the multimodal wrapper (`model_type` gemma4,
  nested `text_config`, weights under `model.language_model.`) with a tiny vision tower that
  afm must ignore; the config is rewritten to the spelling of Google's checkpoints
  (`global_head_dim`, `num_global_key_value_heads` instead of transformers' `per_layer_config`).
  Global layers: head_dim 32 vs 16, 1 KV head vs 2, `attention_k_eq_v` (no v_proj),
  proportional RoPE over a quarter of the pairs.
* tests/fixtures/tiny/gemma4_ple  `gemma4_text` with per-layer input embeddings
  (`hidden_size_per_layer_input` 8), as Gemma 4's small variants have.
* tests/fixtures/tiny/gemma4_moe  `gemma4_text` with the parallel dense MLP + MoE block (4
  experts, top-2, router scale and per-expert scale), `attention_k_eq_v` off so the global
  layers' own v_proj path is covered too, `per_layer_config` as transformers writes it.

Both: sliding window 8 over a 72-token sequence, both layer types, final logit soft-capping,
a random `layer_scalar` per layer, RMSNorm weights around 1 (Gemma 4 multiplies by `w`).

reference.json holds one forward pass's logits over the 72 tokens, and 12 greedy tokens after
the first 66 (past the window) with each step's top-3 log-probabilities, for the engine tests.
A tiny BPE tokenizer.json (Metaspace, 128 pieces) makes `afm serve -m <dir>` work.
model-f32.gguf holds the same weights as llama.cpp's converter would write them (no tokenizer:
the reference test reads its weights only).

CI never runs this script. Run from anywhere:

    python3 scripts/gen_tiny_gemma4.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from transformers import Gemma4Config, Gemma4ForCausalLM, Gemma4ForConditionalGeneration, Gemma4TextConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_reference as tiny  # noqa: E402
from gen_tiny_fixtures import tokenizer_corpus  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
OUT = REPO_ROOT / "tests" / "fixtures" / "tiny"
VOCAB = 128
SEQ_LEN = 72
GREEDY_PROMPT_LEN = 66
GREEDY_NEW_TOKENS = 12
SEED = 20260401

TEXT_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    global_head_dim=32,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    sliding_window=8,
    final_logit_softcapping=5.0,
    hidden_size_per_layer_input=0,
    vocab_size_per_layer_input=VOCAB,
    tie_word_embeddings=True,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
    },
    dtype="float32",
)

VARIANTS = {
    "gemma4": dict(
        text=dict(
            TEXT_COMMON,
            num_hidden_layers=5,
            intermediate_size=64,
            num_global_key_value_heads=1,
            attention_k_eq_v=True,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                         "full_attention"],
        ),
        wrapper=True,
    ),
    "gemma4_moe": dict(
        text=dict(
            TEXT_COMMON,
            num_hidden_layers=4,
            intermediate_size=32,
            attention_k_eq_v=False,
            enable_moe_block=True,
            num_experts=4,
            top_k_experts=2,
            moe_intermediate_size=16,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        ),
        wrapper=False,
    ),
    # The small variants' per-layer input embeddings (E2B/E4B style, without their KV sharing).
    "gemma4_ple": dict(
        text=dict(
            TEXT_COMMON,
            num_hidden_layers=3,
            intermediate_size=48,
            num_global_key_value_heads=1,
            attention_k_eq_v=True,
            hidden_size_per_layer_input=8,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        ),
        wrapper=False,
    ),
}

# Not committed (about 1 MB): the real models' head widths (256 sliding, 512 global), for
# checking the GPU attention kernels of those widths. `--wide DIR` writes it to DIR/gemma4_wide.
WIDE = dict(
    text=dict(
        TEXT_COMMON,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=256,
        global_head_dim=512,
        num_global_key_value_heads=1,
        intermediate_size=32,
        attention_k_eq_v=True,
        layer_types=["sliding_attention", "full_attention"],
    ),
    wrapper=False,
)

TINY_VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                   num_key_value_heads=2, head_dim=8, patch_size=4, position_embedding_size=64,
                   pooling_kernel_size=2)


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Seeded values everywhere: norms and scales around 1, weights N(0, 0.1), layer scalars in [0.6, 1.4]."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if "norm" in name or name.endswith("router.scale") or name.endswith("per_expert_scale"):
                p.copy_(1.0 + 0.2 * noise)
            else:
                p.copy_(0.1 * noise)
        for name, b in sorted(model.named_buffers(), key=lambda kv: kv[0]):
            if name.endswith("layer_scalar"):
                b.copy_(0.6 + 0.8 * torch.rand(b.shape, generator=gen))


def build(name: str, spec: dict, out_dir: Path) -> None:
    torch.manual_seed(SEED)
    text = Gemma4TextConfig(**spec["text"])
    if spec["wrapper"]:
        cfg = Gemma4Config(text_config=text.to_dict(), vision_config=TINY_VISION, audio_config=None)
        model = Gemma4ForConditionalGeneration(cfg)
    else:
        model = Gemma4ForCausalLM(text)
    randomize(model, SEED)
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.do_sample = False
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("model.safetensors", "config.json", "generation_config.json"):
        (out_dir / stale).unlink(missing_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    if spec["wrapper"]:
        google_spelling(out_dir / "config.json", spec["text"])


def google_spelling(path: Path, text: dict) -> None:
    """Rewrite the text config's geometry the way Google's released config.json spells it."""
    cfg = json.loads(path.read_text())
    tc = cfg["text_config"]
    tc.pop("per_layer_config", None)
    tc["global_head_dim"] = text["global_head_dim"]
    tc["num_global_key_value_heads"] = text["num_global_key_value_heads"]
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def load(name: str, spec: dict, out_dir: Path) -> torch.nn.Module:
    cls = Gemma4ForConditionalGeneration if spec["wrapper"] else Gemma4ForCausalLM
    model = cls.from_pretrained(out_dir, attn_implementation="eager", dtype=torch.float32)
    return model.eval()


def reference(name: str, model: torch.nn.Module) -> dict:
    tokens = tiny.reference_tokens(SEQ_LEN, VOCAB)
    logits = tiny.one_pass_logits(model, tokens)
    ids, scores = tiny.greedy(model, tokens, GREEDY_PROMPT_LEN, GREEDY_NEW_TOKENS)
    # The top-3 log-probabilities of each greedy step (the engine tests compare logprobs too).
    top3 = []
    for s in scores:
        v, i = torch.topk(torch.log_softmax(s[0].float(), dim=-1), 3)
        top3.append([[int(a), tiny.fmt_float(float(b))] for a, b in zip(i.tolist(), v.tolist())])
    return tiny.record(name, tokens, logits, GREEDY_PROMPT_LEN, ids, scores, greedy_top3_logprobs=top3)


def write_tokenizer(out_dir: Path) -> None:
    """A 128-piece BPE over the fixture corpus with Gemma's special ids (pad 0, eos 1, bos 2, unk 3)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<pad>", "<eos>", "<bos>", "<unk>"],
                                  show_progress=False)
    tok.train_from_iterator(tokenizer_corpus().splitlines(), trainer)
    if tok.get_vocab_size() != VOCAB:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} pieces, the model {VOCAB}")
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
        "add_bos_token": True,
    }, indent=2) + "\n")


def write_gguf(spec: dict, out_dir: Path) -> None:
    """model-f32.gguf laid out as llama.cpp's converter does it (conversion/gemma.py, Gemma4Model:
    gguf-py's tensor map; router.scale -> ffn_gate_inp.scale, per_expert_scale ->
    ffn_down_exps.scale; norms unshifted; a rope_freqs tensor of 1 / 1e30 factors for the
    unrotated pairs of proportional RoPE; per-layer head_count_kv and the SWA pattern)."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    hp = spec["text"]
    n = hp["num_hidden_layers"]
    swa = [t == "sliding_attention" for t in hp["layer_types"]]
    hd_full, hd_swa = hp["global_head_dim"], hp["head_dim"]
    rope = hp["rope_parameters"]
    path = out_dir / "model-f32.gguf"
    w = gguf.GGUFWriter(str(path), "gemma4")
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_block_count(n)
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(hp["num_attention_heads"])
    if hp.get("num_global_key_value_heads") is not None:
        w.add_head_count_kv([hp["num_key_value_heads"] if s else hp["num_global_key_value_heads"] for s in swa])
    else:
        w.add_head_count_kv(hp["num_key_value_heads"])
    w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    w.add_key_length(hd_full)
    w.add_value_length(hd_full)
    w.add_key_length_swa(hd_swa)
    w.add_value_length_swa(hd_swa)
    w.add_final_logit_softcapping(hp["final_logit_softcapping"])
    w.add_sliding_window(hp["sliding_window"])
    w.add_shared_kv_layers(0)
    w.add_embedding_length_per_layer_input(hp.get("hidden_size_per_layer_input") or 0)
    w.add_sliding_window_pattern(swa)
    w.add_rope_dimension_count(hd_full)
    w.add_rope_dimension_count_swa(hd_swa)
    if hp.get("enable_moe_block"):
        w.add_expert_count(hp["num_experts"])
        w.add_expert_used_count(hp["top_k_experts"])
        w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    n_rot = int(hd_full * rope["full_attention"]["partial_rotary_factor"] / 2)
    freqs = np.array([1.0] * n_rot + [1e30] * (hd_full // 2 - n_rot), dtype=np.float32)
    w.add_tensor("rope_freqs.weight", freqs)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, n)
    for name, t in sorted(load_file(out_dir / "model.safetensors").items()):
        name = name.replace("model.language_model.", "model.")
        if not name.startswith("model.") or "vision" in name or "audio" in name:
            continue
        bid = int(name.split(".")[2]) if name.startswith("model.layers.") else None
        if name.endswith("router.scale"):
            gname = f"blk.{bid}.ffn_gate_inp.scale"
        elif name.endswith("router.per_expert_scale"):
            gname = f"blk.{bid}.ffn_down_exps.scale"
        else:
            base = name[: -len(".weight")] if name.endswith(".weight") else name
            gname = names.get_name(base)
            if gname is None:
                raise RuntimeError(f"no GGUF name for {name}")
            gname += ".weight"
        w.add_tensor(gname, np.ascontiguousarray(t.astype(np.float32)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wide", type=Path, help="write only the uncommitted gemma4_wide variant under this folder")
    args = ap.parse_args()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(2)
    todo = {"gemma4_wide": (WIDE, args.wide / "gemma4_wide")} if args.wide else \
        {name: (spec, OUT / name) for name, spec in VARIANTS.items()}
    for name, (spec, out_dir) in todo.items():
        build(name, spec, out_dir)
        ref = reference(name, load(name, spec, out_dir))
        (out_dir / "reference.json").write_text(json.dumps(ref, separators=(",", ":")) + "\n")
        write_tokenizer(out_dir)
        write_gguf(spec, out_dir)
        size = sum(f.stat().st_size for f in out_dir.iterdir())
        print(f"{name}: {size} bytes, logits std {ref['logits_std']:.3f} max {ref['logits_abs_max']:.3f} "
              f"greedy {ref['greedy']} min margin {ref['greedy_min_top2_margin']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
