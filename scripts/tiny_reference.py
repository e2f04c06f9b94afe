"""What every tiny-fixture generator (scripts/gen_tiny_*.py) records the same way: the fixed token
sequence, float rounding, transformers' one-pass logits, its cached token-by-token decode, greedy
generation and the reference.json fields the Rust tests read. One copy here, so the fixtures of
every architecture stand on identical rules.
"""

from __future__ import annotations

import math

import torch
import transformers


def reference_tokens(n: int, vocab: int) -> list[int]:
    """A fixed, spread-out token sequence (no RNG, so it never changes across library versions)."""
    return [(17 + 37 * i + 11 * i * i) % vocab for i in range(n)]


def fmt_float(x: float) -> float:
    """Round to 8 significant digits: exact enough for float32 comparisons, half the JSON size."""
    if x == 0.0 or not math.isfinite(x):
        return x
    return float(f"{x:.8g}")


def one_pass_logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """Logits of one forward over the whole sequence, no cache (float32, [len, vocab])."""
    ids = torch.tensor([tokens], dtype=torch.long)
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits[0].float()


def cached_decode_rel(model: torch.nn.Module, tokens: list[int], logits: torch.Tensor) -> float:
    """transformers' own cached decode, one token at a time, against its one-pass logits: the
    largest per-row max-abs difference relative to the row's max-abs logit. Models with two
    rules (chunked and recurrent, or compressors) must agree with themselves before afm is held
    to either."""
    ids = torch.tensor([tokens], dtype=torch.long)
    cache, worst = None, 0.0
    with torch.no_grad():
        for i in range(len(tokens)):
            out = model(input_ids=ids[:, i:i + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            row = out.logits[0, -1].float()
            worst = max(worst, float((row - logits[i]).abs().max() / logits[i].abs().max()))
    return worst


def greedy(model: torch.nn.Module, tokens: list[int], prompt_len: int, new_tokens: int):
    """`generate` greedily after the first `prompt_len` tokens: (token ids, per-step scores)."""
    ids = torch.tensor([tokens[:prompt_len]], dtype=torch.long)
    with torch.no_grad():
        gen = model.generate(
            ids,
            attention_mask=torch.ones(1, prompt_len, dtype=torch.long),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
        )
    out = gen.sequences[0, prompt_len:].tolist()
    assert len(out) == new_tokens, out
    return out, gen.scores


def top2_margin(scores) -> float:
    """Smallest gap between the best and second-best logit over the greedy steps: a Rust test
    comparing greedy tokens of an approximate (quantized) path can only be strict above this."""
    return min(float(torch.topk(s[0].float(), 2).values.diff().abs()) for s in scores)


def record(arch: str, tokens: list[int], logits: torch.Tensor, prompt_len: int, greedy_ids: list[int],
           scores, **extra) -> dict:
    """reference.json's fields (the Rust tests read them by name; `extra` adds a generator's own)."""
    return {
        "arch": arch,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "dtype": "float32",
        "attn_implementation": "eager",
        "tokens": tokens,
        "logits": [[fmt_float(v) for v in row.tolist()] for row in logits],
        "greedy_prompt_len": prompt_len,
        "greedy": greedy_ids,
        "greedy_min_top2_margin": fmt_float(top2_margin(scores)),
        "logits_abs_max": fmt_float(float(logits.abs().max())),
        "logits_std": fmt_float(float(logits.std())),
        **extra,
    }
