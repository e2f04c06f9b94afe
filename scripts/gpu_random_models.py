#!/usr/bin/env python3
"""Real-shape models with seeded random bf16 weights, for GPU checks and speed runs on a machine
that cannot download checkpoints: N(0, 0.1) weights, norms 1 + N(0, 0.1) (Gemma stores w for its
(1 + w) norms: N(0, 0.1)), biases N(0, 0.05), as scripts/gen_tiny_fixtures.py does for the tiny
ones. Then, with --ceilings, the copy bandwidth of the GPU and transformers' eager `generate`
speed at batch 1 on the first model (a floor, not a peer).

usage: gpu_random_models.py OUT_DIR NAME[,NAME...] [--ceilings]
"""
import sys
import time

import torch
from transformers import (AutoModelForCausalLM, Gemma3TextConfig, Gemma4TextConfig, LlamaConfig,
                          Qwen2Config, Qwen3Config)

QWEN_ROPE = {"rope_type": "default", "rope_theta": 1000000.0}
GEMMA4 = dict(vocab_size=262144, num_hidden_layers=2, head_dim=256, global_head_dim=512,
    attention_k_eq_v=True, max_position_embeddings=8192, rms_norm_eps=1e-6,
    tie_word_embeddings=True, sliding_window=1024, final_logit_softcapping=30.0,
    hidden_size_per_layer_input=0, layer_types=["sliding_attention", "full_attention"])
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
}


def make(out: str, name: str) -> None:
    t = time.time()
    cls, kw, norm_center = SPECS[name]
    with torch.device("cuda"):
        m = AutoModelForCausalLM.from_config(cls(**kw), dtype=torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for pn, p in sorted(m.named_parameters(), key=lambda kv: kv[0]):
            n = torch.randn(p.shape, generator=g, device="cuda", dtype=torch.float32)
            if "norm" in pn:
                p.copy_(norm_center + 0.1 * n)
            else:
                p.copy_((0.05 if pn.endswith(".bias") else 0.1) * n)
    m.save_pretrained(f"{out}/{name}", safe_serialization=True)
    params = sum(p.numel() for p in m.parameters()) / 1e6
    print(f"{name}: {params:.0f}M params, {time.time() - t:.1f} s", flush=True)


def ceilings(model_dir: str) -> None:
    x = torch.empty(1 << 30, dtype=torch.float32, device="cuda")
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
    ids = torch.randint(0, 1000, (1, 32), device="cuda")
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
