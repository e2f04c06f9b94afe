"""The HTTP surface through the official `openai` client, against the scripted fake engine
(crates/afm-server/src/testing.rs): exact shapes, every error, cancellation."""

import json
import time

import openai
import pytest

MODEL = "fake-model"


def user(text):
    return [{"role": "user", "content": text}]


def test_chat_non_stream_shape_usage_timings(fake):
    r = fake.client().chat.completions.create(model=MODEL, messages=user("hi"), temperature=0)
    assert r.id.startswith("chatcmpl-")
    assert r.object == "chat.completion"
    assert r.model == MODEL
    c = r.choices[0]
    assert c.message.role == "assistant"
    assert c.message.content == "Hello! You said: hi"
    assert c.finish_reason == "stop"
    u = r.usage
    assert u.completion_tokens == len("Hello! You said: hi")
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens == 0
    extra = u.model_extra
    for key in ("prompt_time", "completion_time", "total_time",
                "prompt_tokens_per_second", "completion_tokens_per_second"):
        assert isinstance(extra[key], float), key
    assert r.model_extra["timings"]["predicted_n"] == u.completion_tokens


def test_stream_role_first_then_content_finish_usage(fake):
    chunks = list(fake.client().chat.completions.create(
        model=MODEL, messages=user("stream me"), temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello! You said: stream me"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == len(text)
    assert len({c.id for c in chunks}) == 1


def test_stream_without_usage(fake):
    chunks = list(fake.client().chat.completions.create(
        model=MODEL, messages=user("x"), stream=True, stream_options={"include_usage": False}))
    assert all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_stop_strings_never_emitted(fake):
    client = fake.client()
    r = client.chat.completions.create(model=MODEL, messages=user("hi"), stop=["said"], temperature=0)
    assert r.choices[0].message.content == "Hello! You "
    assert r.choices[0].finish_reason == "stop"
    chunks = client.chat.completions.create(model=MODEL, messages=user("hi"), stop="You",
                                            temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello! "


def test_seed_reproducible_and_n(fake):
    client = fake.client()
    kw = dict(model=MODEL, messages=user("hi"), temperature=0.9, seed=123, n=3)
    a = [c.message.content for c in client.chat.completions.create(**kw).choices]
    b = [c.message.content for c in client.chat.completions.create(**kw).choices]
    assert a == b
    assert len(set(a)) == 3
    unseeded = {client.chat.completions.create(model=MODEL, messages=user("hi"),
                                               temperature=0.9).choices[0].message.content
                for _ in range(3)}
    assert len(unseeded) > 1


def test_logprobs(fake):
    r = fake.client().chat.completions.create(model=MODEL, messages=user("a"), temperature=0,
                                              logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert "".join(t.token for t in content) == r.choices[0].message.content
    assert all(len(t.top_logprobs) == 3 for t in content)
    assert content[0].bytes == list(b"H")


def test_max_tokens_length(fake):
    r = fake.client().chat.completions.create(model=MODEL, messages=user("[long]"), max_tokens=4)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 4


def test_reasoning_split(fake):
    client = fake.client()
    r = client.chat.completions.create(model=MODEL, messages=user("[think]"), temperature=0)
    m = r.choices[0].message
    assert m.model_extra["reasoning_content"] == "Let me think."
    assert m.content == "The answer is 42."
    chunks = list(client.chat.completions.create(model=MODEL, messages=user("[think]"),
                                                 temperature=0, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    assert reasoning == "Let me think."
    assert "".join(d.content or "" for d in deltas) == "The answer is 42."
    # Eager tag: the chunk after the role chunk is already a reasoning delta.
    assert (deltas[1].model_extra or {}).get("reasoning_content") == ""


def test_template_opened_think_and_enable_thinking_false(fake):
    client = fake.client()
    r = client.chat.completions.create(model=MODEL, messages=user("go"), temperature=0,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert r.choices[0].message.model_extra["reasoning_content"] == "Plan."
    assert r.choices[0].message.content == "Done."
    r = client.chat.completions.create(model=MODEL, messages=user("go"), temperature=0,
                                       reasoning_effort="high",
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].message.content == "Hello! You said: go"


def test_sampling_fields_reach_the_engine(fake):
    fake.client().chat.completions.create(
        model=MODEL, messages=user("x"), temperature=0.5, top_p=0.9, seed=5, max_tokens=9,
        extra_body={"top_k": 7, "repeat_penalty": 1.2, "min_p": 0.1})
    last = fake.get("/debug/fake")["last"]
    assert (last["temperature"], last["top_p"], last["top_k"], last["seed"], last["max_tokens"]) \
        == (0.5, pytest.approx(0.9), 7, 5, 9)


@pytest.mark.parametrize("kwargs,exc,param", [
    (dict(temperature=-0.5), openai.BadRequestError, "temperature"),
    (dict(temperature=2.1), openai.BadRequestError, "temperature"),
    (dict(top_p=0), openai.BadRequestError, "top_p"),
    (dict(top_p=1.5), openai.BadRequestError, "top_p"),
    (dict(max_tokens=0), openai.BadRequestError, "max_tokens"),
    (dict(max_tokens=-5), openai.BadRequestError, "max_tokens"),
    (dict(n=9), openai.BadRequestError, "n"),
    (dict(logprobs=True, top_logprobs=99), openai.BadRequestError, "top_logprobs"),
    (dict(model="gpt-4o"), openai.NotFoundError, "model"),
    (dict(extra_body={"temperature": "hot"}), openai.BadRequestError, "temperature"),
    (dict(messages=[]), openai.BadRequestError, "messages"),
])
def test_errors(fake, kwargs, exc, param):
    args = dict(model=MODEL, messages=user("hi"))
    args.update(kwargs)
    with pytest.raises(exc) as e:
        fake.client().chat.completions.create(**args)
    assert e.value.param == param
    assert param.split("_")[0] in e.value.message
    assert e.value.body["type"]


def test_prompt_too_long(fake):
    with pytest.raises(openai.BadRequestError) as e:
        fake.client().chat.completions.create(model=MODEL, messages=user("x" * 5000))
    assert e.value.code == "context_length_exceeded"
    assert "4096" in e.value.message


def test_malformed_json_and_oversized_body(fake):
    status, _, body = fake.post("/v1/chat/completions", b'{"messages": [')
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    status, _, body = fake.post("/v1/chat/completions", {"messages": user("z" * 200_000)})
    assert status == 413 and "100000" in body["error"]["message"]


def test_queue_full_is_429(fake):
    with pytest.raises(openai.RateLimitError) as e:
        fake.client().chat.completions.create(model=MODEL, messages=user("[busy]"))
    assert e.value.response.headers["retry-after"] == "1"


def test_engine_error_is_500(fake):
    with pytest.raises(openai.InternalServerError):
        fake.client().chat.completions.create(model=MODEL, messages=user("[error]"))


def _wait_cancelled(fake, before):
    for _ in range(100):
        state = fake.get("/debug/fake")
        if state["cancelled"] > before and state["running"] == 0:
            return state
        time.sleep(0.05)
    raise AssertionError(f"no cancellation seen: {state}")


def test_disconnect_cancels(fake):
    before = fake.get("/debug/fake")["cancelled"]
    stream = fake.client().chat.completions.create(model=MODEL, messages=user("[slow]"),
                                                   max_tokens=2000, stream=True)
    it = iter(stream)
    next(it)
    next(it)
    stream.close()
    _wait_cancelled(fake, before)


def test_cancel_endpoint(fake):
    before = fake.get("/debug/fake")["cancelled"]
    stream = fake.client().chat.completions.create(model=MODEL, messages=user("[slow]"),
                                                   max_tokens=2000, stream=True)
    it = iter(stream)
    first = next(it)
    status, _, ack = fake.post(f"/v1/chat/completions/{first.id}/cancel", {})
    assert status == 200 and ack["cancelled"] is True
    rest = list(it)
    assert rest[-2].choices[0].finish_reason == "cancelled"
    _wait_cancelled(fake, before)
    status, _, _ = fake.post(f"/v1/chat/completions/{first.id}/cancel", {})
    assert status == 404


def test_grammar_downgraded_header(fake):
    raw = fake.client().chat.completions.with_raw_response.create(
        model=MODEL, messages=user("hi"),
        response_format={"type": "json_schema",
                         "json_schema": {"name": "x", "strict": True, "schema": {"type": "object"}}})
    assert raw.headers["x-grammar-constraints"] == "downgraded"
    assert raw.parse().choices[0].message.content


def test_completions(fake):
    client = fake.client()
    r = client.completions.create(model=MODEL, prompt="user: abc", temperature=0)
    assert r.object == "text_completion"
    assert r.choices[0].text == "Hello! You said: abc"
    r = client.completions.create(model=MODEL, prompt="user: q", echo=True, n=2, temperature=0)
    assert [c.text for c in r.choices] == ["user: qHello! You said: q"] * 2
    r = client.completions.create(model=MODEL, prompt=[list(b"user: t")], max_tokens=2,
                                  logprobs=2, temperature=0)
    assert r.choices[0].text == "He"
    assert r.choices[0].logprobs.tokens == ["H", "e"]
    text = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="user: s", temperature=0, stream=True) if c.choices)
    assert text == "Hello! You said: s"


def test_models_health_tokenize(fake):
    models = fake.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert fake.get("/health")["status"] == "ok"
    status, _, body = fake.post("/v1/tokenize", {"prompt": "ab"})
    assert status == 200 and body["tokens"] == [97, 98] and body["count"] == 2
    status, _, body = fake.post("/v1/count_tokens", {"messages": user("hi")})
    assert body["count"] == len("user: hi\nassistant:")
