#!/usr/bin/env python3
"""Regenerate tests/fixtures/quant_rows.bin: raw GGML rows and gguf-py's own dequantization.

The Rust test `quant::tests::dequantize_matches_gguf_py` decodes every row and compares the f32
bits with what gguf-py produced here, so the reference is code no one in afm wrote.

Rows per type:
  - random rows quantized by `gguf.quants.quantize` where gguf-py can quantize the type;
  - random valid blocks (random payload bytes, finite random f16 scales) for every block type;
  - for F16/BF16: special values (±0, subnormals, ±inf, extremes);
  - real rows from the GGUF files in <repo>/models/ when present (--models DIR).

File layout (little-endian):
  b"AFMQ" | u32 version=1 | u32 case_count
  per case: u32 ggml_type | u32 n_elems | u32 n_bytes | u32 label_len | label utf-8
            | raw row bytes | f32 × n_elems
Usage: python3 gen_quant_fixtures.py [--models DIR] [--out PATH]
"""

import argparse
import pathlib
import struct

import numpy as np
from gguf import GGMLQuantizationType as T, GGUFReader
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quantize

HERE = pathlib.Path(__file__).resolve().parent
ROW = 512  # elements per synthetic row: two K-quant blocks, sixteen 32-blocks

# Byte offsets of the f16 scale fields in each block type (the rest is free payload).
F16_FIELDS = {
    T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
    T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
}
QUANTIZABLE = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]


def random_blocks(rng, qtype, n_elems):
    """Random payload bytes with finite, varied f16 scale fields (any payload bits are valid)."""
    block, size = GGML_QUANT_SIZES[qtype]
    n_blocks = n_elems // block
    raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        scale = (rng.standard_normal(n_blocks) * 10.0 ** rng.uniform(-4, 0, n_blocks)).astype(np.float16)
        raw[:, off:off + 2] = scale.view(np.uint8).reshape(n_blocks, 2)
    return raw.reshape(-1)


def add(cases, label, qtype, raw):
    raw = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)
    block, size = GGML_QUANT_SIZES[qtype]
    n_elems = raw.size // size * block
    ref = np.asarray(dequantize(raw.reshape(1, -1), qtype), dtype=np.float32).reshape(-1)
    assert ref.size == n_elems, (label, ref.size, n_elems)
    cases.append((label, qtype, n_elems, raw.tobytes(), ref.tobytes()))


def synthetic(cases, rng):
    for qtype in [T.F32, T.F16, T.BF16] + QUANTIZABLE:
        for k, scale in enumerate([1.0, 1e-3, 40.0]):
            x = (rng.standard_normal(ROW) * scale).astype(np.float32)
            if k == 2:
                x[rng.integers(0, ROW, 8)] *= 30.0  # outliers, as real activations have
            if qtype == T.F32:
                raw = x.view(np.uint8)
            elif qtype == T.F16:
                raw = x.astype(np.float16).view(np.uint8)
            else:
                raw = quantize(x.reshape(1, -1), qtype).view(np.uint8)
            add(cases, f"{qtype.name} encoded by gguf-py, scale {scale}", qtype, raw)
    specials = np.array([0.0, -0.0, 6e-8, -6e-8, 1e-5, 65504.0, -65504.0, np.inf, -np.inf, 1.0, -2.5, 0.1,
                         3.0e-38, -1.2e-38, 3.3e38, 1e-40], dtype=np.float32)
    with np.errstate(over="ignore"):  # the large values are meant to become ±inf in f16
        add(cases, "F16 special values", T.F16, specials.astype(np.float16).view(np.uint8))
    bf = (specials.view(np.uint32) >> 16).astype(np.uint16)
    add(cases, "BF16 special values", T.BF16, bf.view(np.uint8))
    for qtype in F16_FIELDS:
        for k in range(2):
            add(cases, f"{qtype.name} random valid blocks #{k}", qtype, random_blocks(rng, qtype, ROW))


def real_rows(cases, models_dir, rng):
    """Two rows (first ≤512 elements) of the first tensor of each block type in each model."""
    for path in sorted(models_dir.glob("*.gguf")):
        seen = set()
        for t in GGUFReader(path).tensors:
            qtype = t.tensor_type
            if qtype not in F16_FIELDS or qtype in seen or len(t.shape) != 2:
                continue
            seen.add(qtype)
            block, size = GGML_QUANT_SIZES[qtype]
            data = np.asarray(t.data).view(np.uint8).reshape(int(t.shape[1]), -1)
            n_take = min(data.shape[1], ROW // block * size)
            for r in sorted(rng.choice(data.shape[0], 2, replace=False)):
                add(cases, f"{path.name} {t.name} row {r}", qtype, data[r, :n_take])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", type=pathlib.Path, default=HERE.parents[2] / "models")
    ap.add_argument("--out", type=pathlib.Path, default=HERE / "fixtures" / "quant_rows.bin")
    args = ap.parse_args()
    rng = np.random.default_rng(20240611)
    cases = []
    synthetic(cases, rng)
    if args.models.is_dir():
        real_rows(cases, args.models, rng)
    out = bytearray(b"AFMQ" + struct.pack("<II", 1, len(cases)))
    for label, qtype, n_elems, raw, ref in cases:
        lb = label.encode()
        out += struct.pack("<IIII", int(qtype), n_elems, len(raw), len(lb)) + lb + raw + ref
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(bytes(out))
    print(f"{len(cases)} cases, {len(out)} bytes -> {args.out}")


if __name__ == "__main__":
    main()
