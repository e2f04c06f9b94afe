"""Strict tool-call grammars in all ten dialects, checked with a validator no one here wrote:
runs the Rust random-walk test (crates/afm-grammar/tests/dialects.rs: walks through each
dialect's grammar on SmolLM2's vocabulary, Qwen 2.5's and a special-token vocabulary, parsed by
afm's parser for that dialect) with AFM_WALKS_OUT set, and validates every call it recorded
against its tool's schema with the `jsonschema` package."""

import json
import os
import subprocess
from collections import Counter

import jsonschema

from conftest import ROOT

# The tools of crates/afm-grammar/tests/dialects.rs (`tools()`), kept in step by hand.
PARAMS = {
    "get_weather": {"type": "object", "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 24},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14}},
        "required": ["city", "unit"], "additionalProperties": False},
    "search": {"type": "object", "properties": {
        "query": {"type": "string", "minLength": 1, "maxLength": 40},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "filters": {"type": "object", "properties": {
            "lang": {"enum": ["en", "fr"]}, "safe": {"type": "boolean"}},
            "required": ["safe"], "additionalProperties": False},
        "limit": {"type": ["integer", "null"], "minimum": 1, "maximum": 50}},
        "required": ["query"], "additionalProperties": False},
    "set_code": {"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
        "when": {"type": "string", "format": "date"},
        "note": {"type": ["string", "null"]},
        "ratio": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["code", "ratio"], "additionalProperties": False},
    "ping": {"type": "object", "properties": {}},
    "pay": {"type": "object", "properties": {"payment": {"oneOf": [
        {"type": "object", "properties": {"method": {"const": "card"},
            "last4": {"type": "string", "pattern": "^[0-9]{4}$"}},
         "required": ["method", "last4"], "additionalProperties": False},
        {"type": "object", "properties": {"method": {"const": "cash"},
            "amount": {"type": "integer", "minimum": 1, "maximum": 1000}},
         "required": ["method", "amount"], "additionalProperties": False}]}},
        "required": ["payment"], "additionalProperties": False},
}
DIALECTS = {"hermes", "llama3_json", "mistral", "qwen3_xml", "gemma", "glm4", "kimi_k2",
            "minimax_m2", "deepseek_v3", "deepseek_v4"}


def test_every_walked_call_validates(tmp_path):
    out = tmp_path / "walks.jsonl"
    env = dict(os.environ, AFM_WALKS_OUT=str(out))
    subprocess.run(["cargo", "test", "--release", "-p", "afm-grammar", "--test", "dialects",
                    "--", "--test-threads", "2"], cwd=ROOT, env=env, check=True)
    calls = [json.loads(line) for line in out.read_text().splitlines()]
    per_dialect = Counter(c["dialect"] for c in calls)
    assert set(per_dialect) == DIALECTS, per_dialect
    assert min(per_dialect.values()) >= 50, per_dialect
    for c in calls:
        jsonschema.validate(c["arguments"], PARAMS[c["name"]],
                            cls=jsonschema.Draft202012Validator)
    # `format` is an annotation by default; afm's own raw-text dates (the XML-like and Gemma
    # dialects) also pass the format checker. JSON arguments follow llguidance's date
    # format, which allows 29 February in any year, so they are not held to it.
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    raw_text = {"qwen3_xml", "gemma", "glm4", "minimax_m2", "deepseek_v4"}
    for c in calls:
        if c["dialect"] in raw_text:
            jsonschema.validate(c["arguments"], PARAMS[c["name"]],
                                cls=jsonschema.Draft202012Validator, format_checker=checker)
