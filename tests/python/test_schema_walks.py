"""Issue #6 item 6 on a "tiny model": runs the Rust random-walk test
(crates/afm-grammar/tests/schema_walks.rs: every schema of tests/fixtures/schemas, sent as a
strict `response_format` json_schema, constrains uniform random walks on SmolLM2's vocabulary)
with AFM_WALKS_OUT set, and validates every recorded output against its schema with the
`jsonschema` package (the schema's `$schema` dialect, Draft 2020-12 otherwise)."""

import json
import os
import subprocess
from collections import Counter

import jsonschema

from conftest import ROOT

SCHEMAS = ROOT / "tests" / "fixtures" / "schemas"
WALKS = 8  # `WALKS` in schema_walks.rs


def test_every_walked_output_validates(tmp_path):
    out = tmp_path / "walks.jsonl"
    env = dict(os.environ, AFM_WALKS_OUT=str(out))
    subprocess.run(["cargo", "test", "--release", "-p", "afm-grammar", "--test", "schema_walks"],
                   cwd=ROOT, env=env, check=True)
    walks = [json.loads(line) for line in out.read_text().splitlines()]
    files = sorted(p.name for p in SCHEMAS.glob("*.json"))
    assert len(files) >= 20
    per_schema = Counter(w["schema"] for w in walks)
    assert sorted(per_schema) == files, per_schema
    assert set(per_schema.values()) == {WALKS}, per_schema
    invalid = []
    for w in walks:
        schema = json.loads((SCHEMAS / w["schema"]).read_text())
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        cls.check_schema(schema)
        validator = cls(schema, format_checker=cls.FORMAT_CHECKER)
        errors = [e.message for e in validator.iter_errors(w["output"])]
        if errors:
            invalid.append((w["schema"], w["text"], errors))
    assert not invalid, invalid
