#!/usr/bin/env python3
"""Real-shape models with seeded random bf16 weights, for GPU checks and speed runs on a machine
that cannot download checkpoints: N(0, 0.1) weights, norms 1 + N(0, 0.1) (Gemma stores w for its
(1 + w) norms: N(0, 0.1)), biases N(0, 0.05), as scripts/gen_tiny_fixtures.py does for the tiny
ones. Then, with --ceilings, the copy bandwidth of the GPU and transformers' eager `generate`
speed at batch 1 on the first model (a floor, not a peer).

The seed families' layer-truncated models (`qwen3.6-*-l4`, `deepseek-v4-flash-l2`: real widths,
few layers) draw every matrix from N(0, 1/fan_in) instead, so each projection keeps its input's
scale: with N(0, 0.1) at widths of 2048-17408 the DeltaNet and mHC activations grow by ~10x a
projection and leave bf16's range. Norms there follow what each family multiplies by (Qwen 3.5:
zero-centred 1 + w, so w ~ N(0, 0.1) around 0, but w itself for the DeltaNet output norm;
DeepSeek V4: w, around 1),
and DeepSeek V4's routing buffers are drawn too (distinct hash-routed experts per token, a small
score-correction bias), which transformers leaves at zero. Needs transformers >= 5.24 for these
(Qwen3_5*TextConfig, DeepseekV4Config); the older families load with any 5.x.

usage: gpu_random_models.py OUT_DIR NAME[,NAME...] [--ceilings]
"""
import os
import sys
import time

import torch
import transformers
from transformers import (AutoModelForCausalLM, Gemma3TextConfig, Gemma4TextConfig, LlamaConfig,
                          Qwen2Config, Qwen3Config)


# `AFM_RANDOM_DEVICE=cpu`: a dry run without a GPU (small specs, tests of this script).
DEVICE = os.environ.get("AFM_RANDOM_DEVICE", "cuda")


def config_class(name: str):
    """A config class that older transformers lack, by name, with the version in the error."""
    cls = getattr(transformers, name, None)
    if cls is None:
        sys.exit(f"transformers {transformers.__version__} has no {name}: install 5.24 or later")
    return cls


QWEN_ROPE = {"rope_type": "default", "rope_theta": 1000000.0}
GEMMA4 = dict(vocab_size=262144, num_hidden_layers=2, head_dim=256, global_head_dim=512,
    attention_k_eq_v=True, max_position_embeddings=8192, rms_norm_eps=1e-6,
    tie_word_embeddings=True, sliding_window=1024, final_logit_softcapping=30.0,
    hidden_size_per_layer_input=0, layer_types=["sliding_attention", "full_attention"])
# Qwen 3.5's shared fields (the 27B's), partial RoPE as its checkpoints give it.
QWEN35 = dict(vocab_size=248320, num_hidden_layers=4, head_dim=256,
    layer_types=["linear_attention"] * 3 + ["full_attention"], linear_conv_kernel_dim=4,
    linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
    max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                     "partial_rotary_factor": 0.25})
# name: (config class or its name, config fields, norm centre (older families) or the family
# whose fan-in rule `randomize_scaled` applies)
SPECS = {
    "qwen3-0.6b": (Qwen3Config, dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters=QWEN_ROPE), 1.0),
    "qwen3-8b": (Qwen3Config, dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
        num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters=QWEN_ROPE), 1.0),
    "qwen2.5-0.5b": (Qwen2Config, dict(vocab_size=151936, hidden_size=896, intermediate_size=4864,
        num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters=QWEN_ROPE), 1.0),
    "smollm2-135m": (LlamaConfig, dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
        max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0}), 1.0),
    "gemma3-270m": (Gemma3TextConfig, dict(vocab_size=262144, hidden_size=640,
        intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, max_position_embeddings=32768, rms_norm_eps=1e-6,
        tie_word_embeddings=True, sliding_window=512,
        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 3,
        query_pre_attn_scalar=256, final_logit_softcapping=None, attn_logit_softcapping=None,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}),
        0.0),
    # Gemma 4's real widths on two layers (one sliding, one global), 8k positions: head_dim 256
    # sliding / 512 global, K as V on global layers, proportional RoPE; norms multiply by w.
    "gemma4-31b-l2": (Gemma4TextConfig, dict(GEMMA4, hidden_size=5376, intermediate_size=21504,
        num_attention_heads=32, num_key_value_heads=16, num_global_key_value_heads=4), 1.0),
    "gemma4-26b-a4b-l2": (Gemma4TextConfig, dict(GEMMA4, hidden_size=2816, intermediate_size=2112,
        num_attention_heads=16, num_key_value_heads=8, num_global_key_value_heads=2,
        enable_moe_block=True, num_experts=128, top_k_experts=8, moe_intermediate_size=704), 1.0),
    # Qwen3.6-27B (Qwen3_5TextConfig) on 4 layers, 3 Gated DeltaNet + 1 gated full attention, at
    # the widths of ../shared/reference/architectures.md: hidden 5120, FFN 17408, 24 Q / 4 KV
    # heads x 256 (a quarter rotary, theta 1e7), DeltaNet 16 QK / 48 V heads x 128, conv 4.
    "qwen3.6-27b-l4": ("Qwen3_5TextConfig", dict(QWEN35, hidden_size=5120,
        intermediate_size=17408, num_attention_heads=24, num_key_value_heads=4,
        linear_num_value_heads=48), "qwen3_5"),
    # Qwen3.5/3.6-35B-A3B (Qwen3_5MoeTextConfig) on 4 layers. Assumed, as transformers 5.24's
    # defaults for this class give them (no released config.json was at hand): hidden 2048, 16 Q
    # / 2 KV heads x 256, DeltaNet 16 / 32 heads x 128, 256 experts top-8 of FFN 512 plus a
    # shared expert of 512; the vocabulary (248320), theta 1e7 and untied head as the 27B.
    "qwen3.6-35b-a3b-l4": ("Qwen3_5MoeTextConfig", dict(QWEN35, hidden_size=2048,
        num_attention_heads=16, num_key_value_heads=2, linear_num_value_heads=32,
        num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
        shared_expert_intermediate_size=512), "qwen3_5"),
    # DeepSeek V4 Flash (DeepseekV4Config's defaults are its widths: hidden 4096, 64 heads x 512
    # sharing one KV head, q rank 1024, 8 output groups of rank 1024, window 128, indexer 64 x
    # 128 top-512, mHC 4 streams / 20 Sinkhorn rounds, 256 experts top-6 of FFN 2048 + 1 shared,
    # vocab 129280) on 2 layers: one CSA (ratio 4, hash-routed MoE, as Flash's first layers) and
    # one HCA (ratio 128, score-routed). The compressed RoPE as released: YaRN x16 over 65536.
    # ~14B parameters, 28 GB of bf16 (26 GB of it experts).
    "deepseek-v4-flash-l2": ("DeepseekV4Config", dict(num_hidden_layers=2,
        layer_types=["compressed_sparse_attention", "heavily_compressed_attention"],
        mlp_layer_types=["hash_moe", "moe"],
        rope_parameters={"rope_type": "yarn", "factor": 16.0,
                         "original_max_position_embeddings": 65536, "beta_fast": 32,
                         "beta_slow": 1},
        max_position_embeddings=65536, tie_word_embeddings=False), "deepseek_v4"),
}


def make(out: str, name: str) -> None:
    t = time.time()
    cls, kw, rule = SPECS[name]
    if isinstance(cls, str):
        cls = config_class(cls)
    with torch.device(DEVICE):
        m = AutoModelForCausalLM.from_config(cls(**kw), dtype=torch.bfloat16)
    g = torch.Generator(device=DEVICE).manual_seed(0)
    with torch.no_grad():
        if isinstance(rule, str):
            randomize_scaled(m, g, rule)
        else:
            for pn, p in sorted(m.named_parameters(), key=lambda kv: kv[0]):
                n = torch.randn(p.shape, generator=g, device=DEVICE, dtype=torch.float32)
                if "norm" in pn:
                    p.copy_(rule + 0.1 * n)
                else:
                    p.copy_((0.05 if pn.endswith(".bias") else 0.1) * n)
    m.save_pretrained(f"{out}/{name}", safe_serialization=True)
    params = sum(p.numel() for p in m.parameters()) / 1e6
    print(f"{name}: {params:.0f}M params, {time.time() - t:.1f} s", flush=True)


def randomize_scaled(m, g: torch.Generator, family: str) -> None:
    """Matrices N(0, 1/fan_in) (fan_in: the last dimension, the input of every projection,
    fused expert stacks included); the rest by what the family does with it."""
    def randn(p, std, mean=0.0):
        p.copy_(mean + std * torch.randn(p.shape, generator=g, device=DEVICE, dtype=p.dtype))

    for pn, p in sorted(m.named_parameters(), key=lambda kv: kv[0]):
        leaf = pn.rsplit(".", 1)[-1]
        if "norm" in pn:
            # Qwen 3.5's RMSNorms are zero-centred (x * (1 + w)) but for the DeltaNet's gated
            # output norm (x * w); DeepSeek V4's all multiply by w.
            zero_centred = family == "qwen3_5" and "linear_attn.norm" not in pn
            randn(p, 0.1, 0.0 if zero_centred else 1.0)
        elif p.dim() >= 2:
            randn(p, p.shape[-1] ** -0.5)  # the DeltaNet's depthwise conv: fan-in 4
        elif leaf in ("scale", "hc_scale"):
            randn(p, 0.1, 1.0)  # mHC: the logits' scale, 1 at initialisation
        else:
            randn(p, 0.1)  # A_log, dt_bias, sinks, mHC bases, the compressors' position bias
    if family == "deepseek_v4":
        cfg = m.config
        for bn, b in m.named_buffers():
            if bn.endswith("tid2eid"):
                # Distinct experts per token, as the released hash table has.
                keys = torch.rand(b.shape[0], cfg.n_routed_experts, generator=g, device=DEVICE)
                b.copy_(keys.argsort(dim=1)[:, : b.shape[1]].to(b.dtype))
            elif bn.endswith("e_score_correction_bias"):
                b.copy_(0.01 * torch.randn(b.shape, generator=g, device=DEVICE, dtype=b.dtype))


def ceilings(model_dir: str) -> None:
    x = torch.empty(1 << 30, dtype=torch.float32, device=DEVICE)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(20):
        y.copy_(x)
    e.record()
    torch.cuda.synchronize()
    tbs = 2 * 4 * (1 << 30) * 20 / (s.elapsed_time(e) / 1e3) / 1e12
    print(f"copy bandwidth: {tbs:.2f} TB/s (read + write)")
    del x, y
    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    ids = torch.randint(0, 1000, (1, 32), device=DEVICE)
    m.generate(ids, max_new_tokens=8, do_sample=False)
    torch.cuda.synchronize()
    t = time.time()
    m.generate(ids, max_new_tokens=64, min_new_tokens=64, do_sample=False)
    torch.cuda.synchronize()
    print(f"transformers eager generate, batch 1: {64 / (time.time() - t):.1f} tok/s")


if __name__ == "__main__":
    names = sys.argv[2].split(",")
    for n in names:
        make(sys.argv[1], n)
    if "--ceilings" in sys.argv:
        ceilings(f"{sys.argv[1]}/{names[0]}")
