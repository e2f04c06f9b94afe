"""Tool calls through the official `openai` client, against the scripted fake engine: a marker in
the system prompt makes it answer with a Hermes tool call (crates/afm-server/src/testing.rs lists
them). Checks `message.tool_calls`, streamed `delta.tool_calls` reassembled by index (by hand
and by the client's own stream accumulator), finish_reason, and a history round trip."""

import json

MODEL = "fake-model"

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object",
                       "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                       "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_time", "parameters": {"type": "object",
                                           "properties": {"tz": {"type": "string"}}}}},
    {"type": "function", "function": {
        "name": "echo", "parameters": {"type": "object",
                                       "properties": {"text": {"type": "string"}}}}},
]


def ask(marker, question="What is the weather in Paris?"):
    return [{"role": "system", "content": f"You can call tools. {marker}"},
            {"role": "user", "content": question}]


def create(fake, marker, **kw):
    return fake.client().chat.completions.create(
        model=MODEL, messages=ask(marker), tools=TOOLS, temperature=0, **kw)


def reassemble(chunks):
    """Content, calls (by index) and finish reasons, as a streaming client rebuilds them."""
    content, calls, finishes = "", {}, []
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        content += delta.content or ""
        for d in delta.tool_calls or []:
            if d.index not in calls:
                # First chunk of a call: id, type, name and empty arguments.
                assert d.id.startswith("call_") and d.type == "function", d
                assert d.function.name and d.function.arguments == "", d
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
            else:
                assert d.id is None and d.function.name is None, d
            calls[d.index]["arguments"] += d.function.arguments or ""
        if choice.finish_reason:
            finishes.append(choice.finish_reason)
    return content, [calls[i] for i in sorted(calls)], finishes


def test_one_call_non_streamed(fake):
    r = create(fake, "[tool]")
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_")
    assert call.type == "function"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_one_call_streamed(fake):
    content, calls, finishes = reassemble(create(fake, "[tool]", stream=True))
    assert content == ""
    assert [c["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris"}
    assert finishes == ["tool_calls"]


def test_several_calls_and_text_streamed_and_not(fake):
    r = create(fake, "[tools]")
    m = r.choices[0].message
    assert m.content.startswith("Checking both.") and m.content.rstrip().endswith("One moment.")
    assert [c.function.name for c in m.tool_calls] == ["get_weather", "get_time"]
    assert json.loads(m.tool_calls[1].function.arguments) == {"tz": "Europe/Paris"}
    assert len({c.id for c in m.tool_calls}) == 2
    assert r.choices[0].finish_reason == "tool_calls"

    content, calls, finishes = reassemble(create(fake, "[tools]", stream=True))
    assert content == m.content
    assert [c["name"] for c in calls] == ["get_weather", "get_time"]
    assert [json.loads(c["arguments"]) for c in calls] == \
        [{"city": "Paris"}, {"tz": "Europe/Paris"}]
    assert finishes == ["tool_calls"]


def test_the_clients_stream_accumulator_agrees(fake):
    """openai's own `chat.completions.stream` helper rebuilds the message from our deltas."""
    with fake.client().chat.completions.stream(
            model=MODEL, messages=ask("[tools]"), tools=TOOLS, temperature=0) as stream:
        done = [e for e in stream if e.type == "tool_calls.function.arguments.done"]
        final = stream.get_final_completion()
    assert [e.name for e in done] == ["get_weather", "get_time"]
    assert [e.index for e in done] == [0, 1]
    m = final.choices[0].message
    assert [json.loads(c.function.arguments) for c in m.tool_calls] == \
        [{"city": "Paris"}, {"tz": "Europe/Paris"}]
    assert final.choices[0].finish_reason == "tool_calls"


def test_closing_tag_inside_a_string_argument(fake):
    r = create(fake, "[tool-tag]")
    (call,) = r.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == {"text": "a </tool_call> b"}
    _, calls, _ = reassemble(create(fake, "[tool-tag]", stream=True))
    assert json.loads(calls[0]["arguments"]) == {"text": "a </tool_call> b"}


def test_parallel_tool_calls_false_keeps_the_first(fake):
    r = create(fake, "[tools]", parallel_tool_calls=False)
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather"]
    _, calls, finishes = reassemble(create(fake, "[tools]", parallel_tool_calls=False,
                                           stream=True))
    assert [c["name"] for c in calls] == ["get_weather"]
    assert finishes == ["tool_calls"]


def test_tool_choice_none_is_plain_text(fake):
    r = create(fake, "[tool]", tool_choice="none")
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content.startswith("<tool_call>")
    assert r.choices[0].finish_reason == "stop"
    content, calls, finishes = reassemble(create(fake, "[tool]", tool_choice="none", stream=True))
    assert calls == [] and content == r.choices[0].message.content and finishes == ["stop"]


def test_history_with_the_call_and_its_result_is_accepted(fake):
    client = fake.client()
    first = create(fake, "[tool]").choices[0].message
    call = first.tool_calls[0]
    messages = [{"role": "user", "content": "Weather in Paris?"},
                first.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                       temperature=0)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == "Hello! You said: Weather in Paris?"
