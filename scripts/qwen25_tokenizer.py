#!/usr/bin/env python3
"""The Qwen2.5 tokenizer as Hugging Face files, rebuilt from a Qwen2.5 GGUF's metadata.

    python3 scripts/qwen25_tokenizer.py [GGUF] [OUT_DIR]

GGUF defaults to models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf (scripts/fetch_models.sh qwen05),
OUT_DIR to models/hf/qwen25. Writes tokenizer.json and tokenizer_config.json: what llama.cpp's
convert_hf_to_gguf.py reads to give the random Qwen3-shape models of bench/gpu_vs_llamacpp.sh
their vocabulary (both shapes have Qwen's 151,936-token vocabulary). Needs `gguf` and
`tokenizers` (no torch: transformers reads GGUF tokenizers only with torch installed).

The tokenizer is Qwen2's byte-level BPE: NFC, the Qwen2 split regex, byte-level mapping, the
GGUF's merges; control tokens (type 3) become special added tokens and user-defined ones (type 4)
plain added tokens; the padding entries llama.cpp's converter appends (type 5) are left out.
Before writing, it checks the pre-tokenizer hash that convert_hf_to_gguf.py recognizes as
"qwen2", so a mismatch fails here rather than in the GPU run.
"""

import hashlib
import json
import sys
from pathlib import Path

import gguf
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import AddedToken

QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# convert_hf_to_gguf.py's test string and the hashes of its encoding that it names "qwen2".
CHKTXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis "
    "concatenated) ✅ 🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 "
    "កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ ------======= нещо на Български "
    "''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, 'RE you sure? 'M not "
    "sure I'll make it, 'D you like some tea? We'Ve a'lL"
)
QWEN2_HASHES = {
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea",
    "d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c",
}


def field(reader: gguf.GGUFReader, key: str):
    f = reader.fields[key]
    if f.types and f.types[0] == gguf.GGUFValueType.ARRAY:
        if f.types[-1] == gguf.GGUFValueType.STRING:
            return [bytes(f.parts[i]).decode("utf-8") for i in f.data]
        return [int(f.parts[i][0]) for i in f.data]
    if f.types[0] == gguf.GGUFValueType.STRING:
        return bytes(f.parts[f.data[0]]).decode("utf-8")
    return int(f.parts[f.data[0]][0])


def build(path: str) -> tuple[Tokenizer, dict]:
    r = gguf.GGUFReader(path)
    tokens = field(r, "tokenizer.ggml.tokens")
    types = field(r, "tokenizer.ggml.token_type")
    merges = field(r, "tokenizer.ggml.merges")
    keep = [i for i, t in enumerate(types) if t != 5]
    vocab = {tokens[i]: i for i in keep}
    bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges],
                     fuse_unk=False, byte_fallback=False)
    tok = Tokenizer(bpe)
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    added = [AddedToken(tokens[i], special=types[i] == 3, normalized=False)
             for i in keep if types[i] in (3, 4)]
    tok.add_tokens(added)
    eos = tokens[field(r, "tokenizer.ggml.eos_token_id")]
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "model_max_length": 131072,
        "eos_token": eos,
        "pad_token": tokens[field(r, "tokenizer.ggml.padding_token_id")]
        if "tokenizer.ggml.padding_token_id" in r.fields else eos,
        "bos_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
    }
    if "tokenizer.chat_template" in r.fields:
        config["chat_template"] = field(r, "tokenizer.chat_template")
    return tok, config


def main() -> None:
    src = sys.argv[1] if len(sys.argv) > 1 else "models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    out = Path(sys.argv[2] if len(sys.argv) > 2 else "models/hf/qwen25")
    tok, config = build(src)
    ids = tok.encode(CHKTXT, add_special_tokens=False).ids
    h = hashlib.sha256(str(ids).encode()).hexdigest()
    if h not in QWEN2_HASHES:
        sys.exit(f"qwen25_tokenizer: pre-tokenizer hash {h} is not one llama.cpp names qwen2")
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    print(f"{out}: {tok.get_vocab_size()} tokens, pre-tokenizer hash {h[:12]}… (qwen2)")


if __name__ == "__main__":
    main()
