#!/usr/bin/env python3
"""Cut a real GGUF down to its first LAYERS blocks and first VOCAB token rows, keeping every
tensor's bytes and type as stored (GGML blocks run along rows, so whole rows slice), and dropping
the tokenizer. The result exercises the same quantized tensors in a file small enough to carry
to the GPU machine (scripts/gpu_check.sh).

usage: gguf_subset.py SRC DST LAYERS VOCAB
"""
import sys

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter

src, dst, layers, vocab = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
r = GGUFReader(src)
arch = r.fields["general.architecture"].contents()
w = GGUFWriter(dst, arch)
for name, f in r.fields.items():
    if name.startswith(("GGUF.", "tokenizer.")) or name == "general.architecture":
        continue
    val = layers if name == f"{arch}.block_count" else f.contents()
    vt = f.types[0]
    sub = f.types[1] if vt == GGUFValueType.ARRAY and len(f.types) > 1 else None
    w.add_key_value(name, val, vt, sub)
for t in r.tensors:
    if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= layers:
        continue
    data = np.asarray(t.data)
    if t.name in ("token_embd.weight", "output.weight"):
        data = data[:vocab]
    w.add_tensor(t.name, data, raw_dtype=t.tensor_type)
w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
