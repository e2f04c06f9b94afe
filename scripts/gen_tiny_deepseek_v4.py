#!/usr/bin/env python3
"""Build a tiny random-weight DeepSeek V4 checkpoint and its transformers reference logits.

Follows scripts/gen_tiny_fixtures.py (seeded random f32 weights, save_pretrained, reload,
reference.json), with what DeepSeek V4 adds:

- 4 layers covering every attention kind: sliding-window only, CSA (compression ratio 4 with the
  lightning indexer, top-3 of the compressed rows), HCA (ratio 8 here; 128 in the real model,
  the config's `compress_rates` lets a tiny model use a tiny ratio) and CSA again;
  the first two layers are hash-routed MoE (`tid2eid`), the rest score-routed (sqrt-softplus,
  bias-corrected top-k); mHC with 2 residual streams and 4 Sinkhorn iterations; per-head sinks;
  grouped low-rank output projection (2 groups); YaRN on the compressed-branch RoPE (as the
  real checkpoint), plain RoPE on the sliding layer.
- The sequence is 70 tokens: it crosses the window of 8, closes 17 CSA and 8 HCA windows and
  leaves both ratios' last window open.
- transformers keeps no `mtp.*` weights (it drops them at load), so the script adds one MTP
  module by hand under the real checkpoint's names (`mtp.0.*`: e_proj, h_proj, enorm, hnorm,
  norm, hc_head_*, and a full sliding-window block's attn/ffn/hc weights). Nothing in the
  reference logits depends on them; afm must load them.
- Besides the one-pass logits, the script runs transformers itself token by token with its cache
  and records how far that is from the one-pass logits (`hf_decode_vs_prefill_max_rel`), so a
  Rust decode test has a transformers-side bound to stand on.

saved names: save_pretrained writes DeepSeek's original names under `model.` (`model.layers.0.
attn.wq_a.weight`, `model.layers.0.ffn.experts.3.w1.weight`, `head.weight`), close to the real
checkpoint's unprefixed names; afm accepts both.

A second, smaller fixture (`deepseek_v4_r128`) uses the real HCA ratio, 128, over 144 tokens
(one HCA row, 36 CSA rows of which the indexer keeps 8, a window of 16) and the real mHC shape
(4 streams, 20 Sinkhorn iterations).

    python3 scripts/gen_tiny_deepseek_v4.py [--variants deepseek_v4 deepseek_v4_r128] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
import tiny_reference as tiny
from transformers import AutoModelForCausalLM, DeepseekV4Config

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "tests" / "fixtures" / "tiny"

VOCAB = 128
SEQ_LEN = 70
GREEDY_PROMPT_LEN = 8
GREEDY_NEW_TOKENS = 16
SEED = 20241129

CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    moe_intermediate_size=8,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=32,
    partial_rotary_factor=0.25,  # 8 rope dims, the trailing ones of each head
    q_lora_rank=32,
    o_groups=2,
    o_lora_rank=16,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    routed_scaling_factor=1.5,
    scoring_func="sqrtsoftplus",
    layer_types=[
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
    ],
    mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    sliding_window=8,
    hc_mult=2,
    hc_sinkhorn_iters=4,
    # 8 indexer heads: with 2 (transformers' own test), ReLU zeros tie top-k scores often, and
    # transformers' one-pass and cached runs then break the ties differently (up to 0.4 apart).
    index_n_heads=8,
    index_head_dim=16,
    index_topk=3,
    num_nextn_predict_layers=1,
    rope_theta=10000.0,
    compress_rope_theta=160000.0,
    # Folded by the config into the compress rope only (attention_factor forced to 1).
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                     "beta_fast": 32, "beta_slow": 1},
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    swiglu_limit=10.0,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=1,
    dtype="float32",
)


# The real HCA ratio (128) needs a sequence past 128 tokens; small sizes keep it cheap.
CONFIG_R128 = dict(
    CONFIG,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    q_lora_rank=16,
    o_lora_rank=8,
    layer_types=["heavily_compressed_attention", "compressed_sparse_attention"],
    mlp_layer_types=["hash_moe", "moe"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    sliding_window=16,
    index_topk=8,
    # The real 4 streams and 20 Sinkhorn iterations: with 2 streams a doubly-stochastic mix is
    # symmetric, which would hide a transposed stream-mixing matrix.
    hc_mult=4,
    hc_sinkhorn_iters=20,
)

VARIANTS = {
    "deepseek_v4": (CONFIG, SEQ_LEN),
    "deepseek_v4_r128": (CONFIG_R128, 144),
}


def randomize(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Seeded values for every parameter and the routing buffers, none at an identity."""
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            n = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            leaf = name.rsplit(".", 1)[-1]
            if "norm" in name:
                p.copy_(1.0 + 0.1 * n)
            elif leaf in ("sinks", "position_bias", "base", "hc_base"):
                p.copy_(0.5 * n)
            elif leaf in ("scale", "hc_scale"):
                p.copy_(1.0 + 0.2 * n)
            else:
                p.copy_(0.1 * n)
        cfg = model.config
        for name, b in sorted(model.named_buffers(), key=lambda kv: kv[0]):
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))
            elif name.endswith("tid2eid"):
                # Distinct experts per token, as a real hash table has.
                rows = [torch.randperm(cfg.n_routed_experts, generator=gen)[: cfg.num_experts_per_tok]
                        for _ in range(b.shape[0])]
                b.copy_(torch.stack(rows).to(b.dtype))


def mtp_tensors(cfg: DeepseekV4Config, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """One MTP module under the real checkpoint's names: a sliding-window V4 block plus the
    embedding/hidden projections and its own hc head."""
    h, hd, hc = cfg.hidden_size, cfg.head_dim, cfg.hc_mult
    inter, e = cfg.moe_intermediate_size, cfg.n_routed_experts
    mix = (2 + hc) * hc

    def w(*shape):
        return 0.1 * torch.randn(shape, generator=gen)

    def norm(n):
        return 1.0 + 0.1 * torch.randn(n, generator=gen)

    p = "mtp.0."
    t = {
        p + "e_proj.weight": w(h, h),
        p + "h_proj.weight": w(h, h),
        p + "enorm.weight": norm(h),
        p + "hnorm.weight": norm(h),
        p + "norm.weight": norm(h),
        p + "hc_head_fn": w(hc, hc * h),
        p + "hc_head_base": 0.5 * torch.randn(hc, generator=gen),
        p + "hc_head_scale": norm(1),
        p + "attn_norm.weight": norm(h),
        p + "ffn_norm.weight": norm(h),
        p + "attn.wq_a.weight": w(cfg.q_lora_rank, h),
        p + "attn.q_norm.weight": norm(cfg.q_lora_rank),
        p + "attn.wq_b.weight": w(cfg.num_attention_heads * hd, cfg.q_lora_rank),
        p + "attn.wkv.weight": w(hd, h),
        p + "attn.norm.weight": norm(hd),
        p + "attn.wo_a.weight": w(cfg.o_groups * cfg.o_lora_rank, cfg.num_attention_heads * hd // cfg.o_groups),
        p + "attn.wo_b.weight": w(h, cfg.o_groups * cfg.o_lora_rank),
        p + "attn.attn_sink": 0.5 * torch.randn(cfg.num_attention_heads, generator=gen),
        p + "ffn.gate.weight": w(e, h),
        p + "ffn.gate.bias": 0.1 * torch.randn(e, generator=gen),
        p + "ffn.shared_experts.w1.weight": w(inter, h),
        p + "ffn.shared_experts.w2.weight": w(h, inter),
        p + "ffn.shared_experts.w3.weight": w(inter, h),
    }
    for x in ("attn", "ffn"):
        t[p + f"hc_{x}_fn"] = w(mix, hc * h)
        t[p + f"hc_{x}_base"] = 0.5 * torch.randn(mix, generator=gen)
        t[p + f"hc_{x}_scale"] = 1.0 + 0.2 * torch.randn(3, generator=gen)
    for j in range(e):
        t[p + f"ffn.experts.{j}.w1.weight"] = w(inter, h)
        t[p + f"ffn.experts.{j}.w2.weight"] = w(h, inter)
        t[p + f"ffn.experts.{j}.w3.weight"] = w(inter, h)
    return {k: v.float().contiguous() for k, v in t.items()}


def build_and_save(out_dir: Path, config_kwargs: dict) -> None:
    torch.manual_seed(SEED)
    gen = torch.Generator().manual_seed(SEED)
    config = DeepseekV4Config(**config_kwargs)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    randomize(model, gen)
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.do_sample = False
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("model.safetensors", "config.json", "generation_config.json"):
        (out_dir / stale).unlink(missing_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    path = out_dir / "model.safetensors"
    tensors = load_file(path)
    tensors.update(mtp_tensors(config, gen))
    save_file(tensors, path, metadata={"format": "pt"})


def compute_reference(out_dir: Path, seq_len: int) -> dict:
    model = AutoModelForCausalLM.from_pretrained(out_dir, attn_implementation="eager", dtype=torch.float32).eval()
    tokens = tiny.reference_tokens(seq_len, VOCAB)
    logits = tiny.one_pass_logits(model, tokens)
    worst = tiny.cached_decode_rel(model, tokens, logits)
    if worst > 1e-4:
        raise RuntimeError(f"transformers' cached decode is {worst:.2e} from its one-pass logits: "
                           "a top-k tie in the indexer? change the seed or the indexer heads")
    ids, scores = tiny.greedy(model, tokens, GREEDY_PROMPT_LEN, GREEDY_NEW_TOKENS)
    return tiny.record(out_dir.name, tokens, logits, GREEDY_PROMPT_LEN, ids, scores,
                       hf_decode_vs_prefill_max_rel=tiny.fmt_float(worst))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="fixtures root (default: %(default)s)")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = ap.parse_args()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(2)
    for name in args.variants:
        config_kwargs, seq_len = VARIANTS[name]
        out = args.out / name
        build_and_save(out, config_kwargs)
        ref = compute_reference(out, seq_len)
        (out / "reference.json").write_text(json.dumps(ref, separators=(",", ":")) + "\n")
        report(name, out, ref)
    return 0


def report(name: str, out: Path, ref: dict) -> None:
    sizes = {p.name: p.stat().st_size for p in sorted(out.iterdir())}
    print(f"{name}: logits std {ref['logits_std']:.3f} max {ref['logits_abs_max']:.3f} "
          f"hf decode vs prefill {ref['hf_decode_vs_prefill_max_rel']:.2e} greedy {ref['greedy']} "
          f"min margin {ref['greedy_min_top2_margin']:.4f} files {sizes}")


if __name__ == "__main__":
    sys.exit(main())
