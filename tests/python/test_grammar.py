"""Grammar-constrained decoding through the official `openai` client against afm on
SmolLM2-135M-Instruct with `--enable-grammar-constraints`: every strict `json_schema` answer in
tests/fixtures/schemas/ validates under the `jsonschema` package (several seeds at temperature 1,
two requests at a time so they share decode steps), `json_object` answers are objects, and tool
calls with `tool_choice` "required" or a named function are valid calls, streamed and not.
Without the switch, strict requests are served best effort with `X-Grammar-Constraints:
downgraded`."""

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import openai
import pytest

from conftest import ROOT, SMOLLM2, _binary, _free_port, _start

MODEL = "SmolLM2-135M-Instruct.Q4_1"
SCHEMAS = sorted((ROOT / "tests" / "fixtures" / "schemas").glob("*.json"))
SEEDS = (0, 1, 2)


@pytest.fixture(scope="module")
def constrained():
    if not SMOLLM2.exists():
        pytest.skip(f"{SMOLLM2} not fetched (scripts/fetch_models.sh smollm2)")
    binary = _binary("AFM_BIN", "afm", ["-p", "afm"])
    port = _free_port()
    cmd = [str(binary), "mlx", "-m", str(SMOLLM2), "-p", str(port), "--max-context", "2048",
           "--enable-grammar-constraints", "--concurrent", "2"]
    server = _start(cmd, f"http://127.0.0.1:{port}", 300)
    yield server
    server.proc.terminate()
    server.proc.wait(10)


def ask_json(client, schema, name, seed):
    return client.chat.completions.create(
        model=MODEL, temperature=1.0, seed=seed, max_tokens=400,
        messages=[{"role": "system", "content": "You answer with JSON only."},
                  {"role": "user", "content": f"Give an example `{name}` as JSON."}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": name, "schema": schema, "strict": True}})


def test_there_are_at_least_twenty_schemas():
    assert len(SCHEMAS) >= 20


@pytest.mark.parametrize("path", SCHEMAS, ids=[p.stem for p in SCHEMAS])
def test_strict_schema_answers_always_validate(constrained, path):
    schema = json.loads(path.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    client = constrained.client()
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda s: ask_json(client, schema, path.stem, s), SEEDS))
    for seed, r in zip(SEEDS, answers):
        choice = r.choices[0]
        assert choice.finish_reason == "stop", (seed, choice.message.content)
        value = json.loads(choice.message.content)
        jsonschema.validate(value, schema, cls=jsonschema.Draft202012Validator)


def test_json_object_answers_are_objects(constrained):
    # Greedy, on questions this 135M model answers briefly: an object with no schema bounds
    # nothing, and the model can loop on keys until max_tokens ("Describe a cat" does).
    for question in ("Give the name and age of a person as JSON.",
                     "What is the capital of France? Answer in JSON.",
                     "List two cities and their countries as JSON."):
        r = constrained.client().chat.completions.create(
            model=MODEL, temperature=0, max_tokens=300,
            messages=[{"role": "user", "content": question}],
            response_format={"type": "json_object"})
        assert r.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_streamed_schema_answer_equals_the_whole_answer(constrained):
    schema = json.loads((SCHEMAS[0]).read_text())
    kw = dict(model=MODEL, temperature=1.0, seed=5, max_tokens=200,
              messages=[{"role": "user", "content": "A person as JSON."}],
              response_format={"type": "json_schema",
                               "json_schema": {"name": "p", "schema": schema, "strict": True}})
    whole = constrained.client().chat.completions.create(**kw).choices[0].message.content
    chunks = constrained.client().chat.completions.create(stream=True, **kw)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole
    jsonschema.validate(json.loads(streamed), schema)


def test_a_schema_that_cannot_compile_is_a_400_naming_the_field(constrained):
    bad = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(["}}}
    with pytest.raises(openai.BadRequestError) as e:
        ask_json(constrained.client(), bad, "bad", 0)
    assert e.value.body["param"] == "response_format.json_schema.schema"


TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 30},
            "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Local time in a time zone",
        "parameters": {"type": "object", "properties": {
            "tz": {"type": "string", "pattern": "^[A-Z][a-z]{1,12}/[A-Z][a-z]{1,12}$"}},
            "required": ["tz"], "additionalProperties": False}}},
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def check_call(name, arguments):
    assert name in PARAMS, name
    jsonschema.validate(json.loads(arguments), PARAMS[name])


@pytest.mark.parametrize("seed", SEEDS)
def test_tool_choice_required_gives_valid_calls(constrained, seed):
    r = constrained.client().chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", temperature=1.0,
        seed=seed, max_tokens=300)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        check_call(call.function.name, call.function.arguments)


def test_named_tool_choice_streamed_and_not(constrained):
    named = {"type": "function", "function": {"name": "get_time"}}
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named, temperature=1.0,
              seed=3, max_tokens=300, parallel_tool_calls=False)
    r = constrained.client().chat.completions.create(**kw)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    check_call(call.function.name, call.function.arguments)
    calls, finishes = {}, []
    for chunk in constrained.client().chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        for d in chunk.choices[0].delta.tool_calls or []:
            c = calls.setdefault(d.index, {"name": d.function.name, "arguments": ""})
            c["arguments"] += d.function.arguments or ""
        if chunk.choices[0].finish_reason:
            finishes.append(chunk.choices[0].finish_reason)
    assert finishes == ["tool_calls"]
    assert [c["name"] for c in calls.values()] == ["get_time"]
    assert json.loads(calls[0]["arguments"]) == json.loads(call.function.arguments)


def test_tool_call_round_trip(constrained):
    client = constrained.client()
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=300,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = r.choices[0].message.tool_calls[0]
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"}]
    answer = client.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, temperature=0, max_tokens=40)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_named_function_not_in_tools_is_a_400(constrained):
    with pytest.raises(openai.BadRequestError) as e:
        constrained.client().chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, max_tokens=10,
            tool_choice={"type": "function", "function": {"name": "nope"}})
    assert e.value.body["param"] == "tool_choice"


def test_strict_without_the_switch_is_downgraded(real):
    schema = json.loads(SCHEMAS[0].read_text())
    raw = real.client().chat.completions.with_raw_response.create(
        model=MODEL, messages=ASK, max_tokens=8,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "p", "schema": schema, "strict": True}})
    assert raw.headers["x-grammar-constraints"] == "downgraded"
    raw = real.client().chat.completions.with_raw_response.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=8)
    assert raw.headers["x-grammar-constraints"] == "downgraded"


# Strict tools in the other call dialects: SmolLM2 forced to each with --tool-call-parser, so
# every marker is plain text; the grammar makes the model write the dialect's exact syntax and
# afm's parser for that dialect must read back valid calls (no downgrade).
DIALECTS = ("qwen3_xml", "gemma", "kimi_k2", "deepseek_v4")
DIALECT_TOOLS = TOOLS + [
    {"type": "function", "function": {
        "name": "book_room", "description": "Book a hotel room",
        "parameters": {"type": "object", "properties": {
            "hotel": {"type": "string", "minLength": 1, "maxLength": 24},
            "nights": {"type": "integer", "minimum": 1, "maximum": 9},
            "guests": {"type": "array", "items": {"type": "string", "maxLength": 12},
                       "minItems": 1, "maxItems": 3},
            "breakfast": {"type": "boolean"}},
            "required": ["hotel", "nights", "guests"], "additionalProperties": False}}},
]
DIALECT_PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in DIALECT_TOOLS}
BOOK = [{"role": "user", "content": "Book two nights at the Ritz for Ann and Bob."}]


@pytest.fixture(scope="module", params=DIALECTS)
def dialect(request):
    if not SMOLLM2.exists():
        pytest.skip(f"{SMOLLM2} not fetched (scripts/fetch_models.sh smollm2)")
    binary = _binary("AFM_BIN", "afm", ["-p", "afm"])
    port = _free_port()
    cmd = [str(binary), "mlx", "-m", str(SMOLLM2), "-p", str(port), "--max-context", "2048",
           "--enable-grammar-constraints", "--tool-call-parser", request.param]
    server = _start(cmd, f"http://127.0.0.1:{port}", 300)
    server.dialect = request.param
    yield server
    server.proc.terminate()
    server.proc.wait(10)


def check_dialect_call(name, arguments):
    assert name in DIALECT_PARAMS, name
    jsonschema.validate(json.loads(arguments), DIALECT_PARAMS[name],
                        cls=jsonschema.Draft202012Validator)


@pytest.mark.parametrize("seed", SEEDS)
def test_dialect_required_calls_are_valid(dialect, seed):
    raw = dialect.client().chat.completions.with_raw_response.create(
        model=MODEL, messages=BOOK, tools=DIALECT_TOOLS, tool_choice="required",
        temperature=1.0, seed=seed, max_tokens=400)
    assert "x-grammar-constraints" not in raw.headers, dialect.dialect
    choice = raw.parse().choices[0]
    assert choice.finish_reason == "tool_calls", (dialect.dialect, choice.message)
    assert choice.message.tool_calls, (dialect.dialect, choice.message)
    for call in choice.message.tool_calls:
        check_dialect_call(call.function.name, call.function.arguments)


def test_dialect_named_single_call_streamed_and_not(dialect):
    named = {"type": "function", "function": {"name": "book_room"}}
    kw = dict(model=MODEL, messages=BOOK, tools=DIALECT_TOOLS, tool_choice=named,
              temperature=1.0, seed=11, max_tokens=400, parallel_tool_calls=False)
    raw = dialect.client().chat.completions.with_raw_response.create(**kw)
    assert "x-grammar-constraints" not in raw.headers
    r = raw.parse()
    assert r.choices[0].finish_reason == "tool_calls", (dialect.dialect, r.choices[0].message)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "book_room"
    check_dialect_call(call.function.name, call.function.arguments)
    raw = dialect.client().chat.completions.with_raw_response.create(stream=True, **kw)
    assert "x-grammar-constraints" not in raw.headers
    calls, finishes = {}, []
    for chunk in raw.parse():
        if not chunk.choices:
            continue
        for d in chunk.choices[0].delta.tool_calls or []:
            c = calls.setdefault(d.index, {"name": d.function.name, "arguments": ""})
            c["arguments"] += d.function.arguments or ""
        if chunk.choices[0].finish_reason:
            finishes.append(chunk.choices[0].finish_reason)
    assert finishes == ["tool_calls"], dialect.dialect
    assert [c["name"] for c in calls.values()] == ["book_room"]
    check_dialect_call("book_room", calls[0]["arguments"])
    # Same seed, same grammar: the stream carries the same call.
    assert json.loads(calls[0]["arguments"]) == json.loads(call.function.arguments)


OPENERS = {"qwen3_xml": ("<tool_call>", "<function="), "gemma": ("<|tool_call>",),
           "kimi_k2": ("<|tool_call_begin|>", "<|tool_calls_section_begin|>"),
           "deepseek_v4": ("<｜DSML｜",)}


def test_dialect_auto_with_strict_tools_is_text_or_valid_calls(dialect):
    strict = [{**t, "function": {**t["function"], "strict": True}} for t in DIALECT_TOOLS]
    for seed in SEEDS:
        raw = dialect.client().chat.completions.with_raw_response.create(
            model=MODEL, messages=BOOK, tools=strict, temperature=1.0, seed=seed,
            max_tokens=150)
        assert "x-grammar-constraints" not in raw.headers
        choice = raw.parse().choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            for call in choice.message.tool_calls:
                check_dialect_call(call.function.name, call.function.arguments)
        else:
            # Text that could be read as a call is not offered: no opener anywhere.
            assert choice.finish_reason in ("stop", "length")
            assert not any(o in (choice.message.content or "") for o in OPENERS[dialect.dialect])
