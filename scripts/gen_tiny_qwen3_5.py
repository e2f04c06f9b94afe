#!/usr/bin/env python3
"""Build tiny random-weight Qwen3.5 checkpoints (dense and MoE) and their reference logits.

Follows scripts/gen_tiny_fixtures.py (same token sequence rule, rounding and JSON keys) for the
Gated-DeltaNet hybrid, which that script's table cannot express:

* qwen3_5: the multimodal wrapper layout real checkpoints use (config.json `model_type`
  "qwen3_5" with a nested `text_config`, weights under `model.language_model.`), 4 layers
  (3 Gated DeltaNet, then 1 gated full attention), dense SwiGLU, and an MTP head in a separate
  `mtp.safetensors` shard, as some releases ship it.
* qwen3_5_moe: the text-only layout (`qwen3_5_moe_text`, weights under `model.`), 3 layers
  (DeltaNet, full attention, DeltaNet), 4 experts top-2 plus the sigmoid-gated shared expert,
  MTP weights inside model.safetensors, experts fused as transformers 5 holds them.
* qwen3_5_moe_hub: the same weights as the Hub's Qwen3.5-MoE checkpoints lay them out (the
  `qwen3_5_moe` wrapper config, `model.language_model.`, one `experts.{e}.{gate,up,down}_proj`
  per expert, which transformers fuses at load); same reference.json.

Every parameter is overwritten with seeded values: weights N(0, 0.1), zero-centred RMSNorm
weights (used as 1 + w) N(0, 0.1), the DeltaNet gated norm (used as w) 1 + N(0, 0.1).
transformers builds no MTP module (it drops `mtp.*` at load), so the MTP tensors are random
weights with the names vLLM's qwen3_5_mtp loader binds; no reference covers them.

reference.json holds the logits of ONE forward over a fixed 64-token sequence (transformers'
chunked gated-delta rule) and 16 greedy tokens after the first 8 (generate() with a cache: the
recurrent rule). The script also checks that token-by-token decode with transformers' cache
reproduces the one-pass logits, so both rules stand behind the same numbers.

CI never runs this; it reads the committed files. Run: python3 scripts/gen_tiny_qwen3_5.py
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file
import tiny_reference as tiny
from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "tests" / "fixtures" / "tiny"

VOCAB = 128
SEQ_LEN = 64
GREEDY_PROMPT_LEN = 8
GREEDY_NEW_TOKENS = 16
SEED = 20241129

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    # Partial RoPE: 4 of 16 dims rotated, as 64 of 256 in the real models.
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.25},
    # 2 key heads serving 4 value heads: exercises the grouped (repeat_interleave) expansion.
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    dtype="float32",
)

ARCHS = {
    "qwen3_5": dict(
        config_cls=Qwen3_5TextConfig,
        model_cls=Qwen3_5ForCausalLM,
        kwargs=dict(
            COMMON,
            num_hidden_layers=4,
            intermediate_size=64,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
        ),
        wrapper="qwen3_5",
        mtp_shard=True,
    ),
    "qwen3_5_moe": dict(
        config_cls=Qwen3_5MoeTextConfig,
        model_cls=Qwen3_5MoeForCausalLM,
        kwargs=dict(
            COMMON,
            num_hidden_layers=3,
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
        ),
        wrapper=None,
        mtp_shard=False,
    ),
}


def randomize(named: list[tuple[str, torch.Tensor]], gen: torch.Generator) -> None:
    with torch.no_grad():
        for name, p in sorted(named, key=lambda kv: kv[0]):
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if "linear_attn.norm" in name:
                p.copy_(1.0 + 0.1 * noise)  # Qwen3_5RMSNormGated: x * w
            elif "norm" in name:
                p.copy_(0.1 * noise)  # Qwen3_5RMSNorm: x * (1 + w)
            else:
                p.copy_(0.1 * noise)


def mtp_tensors(model: torch.nn.Module, cfg, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random MTP weights (names and shapes of vLLM's qwen3_5_mtp loader): fc, two pre-fc norms,
    one full-attention decoder layer with the model's MLP kind, and a final norm."""
    h, hd = cfg.hidden_size, cfg.head_dim
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    shapes = {
        "mtp.fc.weight": (h, 2 * h),
        "mtp.pre_fc_norm_embedding.weight": (h,),
        "mtp.pre_fc_norm_hidden.weight": (h,),
        "mtp.norm.weight": (h,),
        "mtp.layers.0.input_layernorm.weight": (h,),
        "mtp.layers.0.post_attention_layernorm.weight": (h,),
        "mtp.layers.0.self_attn.q_proj.weight": (2 * nh * hd, h),
        "mtp.layers.0.self_attn.k_proj.weight": (nkv * hd, h),
        "mtp.layers.0.self_attn.v_proj.weight": (nkv * hd, h),
        "mtp.layers.0.self_attn.o_proj.weight": (h, nh * hd),
        "mtp.layers.0.self_attn.q_norm.weight": (hd,),
        "mtp.layers.0.self_attn.k_norm.weight": (hd,),
    }
    if hasattr(cfg, "num_experts"):
        e, mi, si = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
        shapes.update({
            "mtp.layers.0.mlp.gate.weight": (e, h),
            "mtp.layers.0.mlp.experts.gate_up_proj": (e, 2 * mi, h),
            "mtp.layers.0.mlp.experts.down_proj": (e, h, mi),
            "mtp.layers.0.mlp.shared_expert.gate_proj.weight": (si, h),
            "mtp.layers.0.mlp.shared_expert.up_proj.weight": (si, h),
            "mtp.layers.0.mlp.shared_expert.down_proj.weight": (h, si),
            "mtp.layers.0.mlp.shared_expert_gate.weight": (1, h),
        })
    else:
        i = cfg.intermediate_size
        shapes.update({
            "mtp.layers.0.mlp.gate_proj.weight": (i, h),
            "mtp.layers.0.mlp.up_proj.weight": (i, h),
            "mtp.layers.0.mlp.down_proj.weight": (h, i),
        })
    return {k: 0.1 * torch.randn(s, generator=gen, dtype=torch.float32) for k, s in sorted(shapes.items())}


def build(arch: str, spec: dict, out_dir: Path) -> dict:
    torch.manual_seed(SEED)
    cfg = spec["config_cls"](**spec["kwargs"])
    model = spec["model_cls"](cfg).to(torch.float32)
    model.config._attn_implementation = "eager"
    gen = torch.Generator().manual_seed(SEED)
    randomize(list(model.named_parameters()), gen)
    model.eval()
    mtp = mtp_tensors(model, cfg, gen)

    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob("*"):
        stale.unlink()
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    text_cfg = cfg.to_dict()
    for k in ("dtype", "transformers_version", "architectures"):
        text_cfg.pop(k, None)
    text_cfg["mtp_num_hidden_layers"] = 1
    if spec["wrapper"]:
        # What Qwen3_5ForConditionalGeneration checkpoints look like, without the vision tower.
        state = {
            (k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k): v
            for k, v in state.items()
        }
        config = {
            "architectures": ["Qwen3_5ForConditionalGeneration"],
            "model_type": spec["wrapper"],
            "text_config": text_cfg,
            "tie_word_embeddings": False,
            "transformers_version": transformers.__version__,
        }
    else:
        config = dict(text_cfg, architectures=[type(model).__name__],
                      transformers_version=transformers.__version__)
    if spec["mtp_shard"]:
        save_file(state, out_dir / "model.safetensors", metadata={"format": "pt"})
        save_file(mtp, out_dir / "mtp.safetensors", metadata={"format": "pt"})
    else:
        save_file(dict(state, **mtp), out_dir / "model.safetensors", metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return reference(arch, model)


def reference(arch: str, model: torch.nn.Module) -> dict:
    tokens = tiny.reference_tokens(SEQ_LEN, VOCAB)
    logits = tiny.one_pass_logits(model, tokens)
    # The recurrent (decode) rule must give the same logits as the chunked one.
    rel = tiny.cached_decode_rel(model, tokens, logits)
    assert rel < 1e-4, f"{arch}: transformers' decode differs from its prefill by {rel:.2e}"
    ids, scores = tiny.greedy(model, tokens, GREEDY_PROMPT_LEN, GREEDY_NEW_TOKENS)
    return tiny.record(arch, tokens, logits, GREEDY_PROMPT_LEN, ids, scores,
                       decode_vs_prefill_rel=tiny.fmt_float(rel))


def hub_layout(src: Path, dst: Path) -> None:
    """qwen3_5_moe rewritten in the Hub's layout: wrapper config, per-expert tensors."""
    dst.mkdir(parents=True, exist_ok=True)
    for stale in dst.glob("*"):
        stale.unlink()
    out = {}
    for name, t in load_file(src / "model.safetensors").items():
        if name.endswith("experts.gate_up_proj"):
            base, inter = name[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = t[e, :inter].contiguous()
                out[f"{base}{e}.up_proj.weight"] = t[e, inter:].contiguous()
            continue
        if name.endswith("experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e].contiguous()
            continue
        out[name] = t
    out = {(k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k): v
           for k, v in out.items()}
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    text_cfg = json.loads((src / "config.json").read_text())
    for k in ("architectures", "transformers_version"):
        text_cfg.pop(k, None)
    config = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "text_config": text_cfg,
        "tie_word_embeddings": False,
        "transformers_version": transformers.__version__,
    }
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    ref = json.loads((src / "reference.json").read_text())
    ref["arch"] = dst.name
    (dst / "reference.json").write_text(json.dumps(ref, separators=(",", ":")) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--archs", nargs="+", default=list(ARCHS), choices=list(ARCHS))
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(2)
    for arch in args.archs:
        out_dir = args.out / arch
        ref = build(arch, ARCHS[arch], out_dir)
        (out_dir / "reference.json").write_text(json.dumps(ref, separators=(",", ":")) + "\n")
        # Loading back what was written must give the same tensors.
        names = sorted(k for f in out_dir.glob("*.safetensors") for k in load_file(f))
        size = sum(f.stat().st_size for f in out_dir.iterdir())
        print(f"{arch}: {len(names)} tensors, {size / 1024:.0f} KiB, greedy {ref['greedy']}, "
              f"min margin {ref['greedy_min_top2_margin']:.4f}, decode vs prefill {ref['decode_vs_prefill_rel']:.1e}")
    if "qwen3_5_moe" in args.archs:
        hub_layout(args.out / "qwen3_5_moe", args.out / "qwen3_5_moe_hub")
        print("qwen3_5_moe_hub: written from qwen3_5_moe")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
