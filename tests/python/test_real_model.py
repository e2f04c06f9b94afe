"""afm itself on a real model (SmolLM2-135M-Instruct Q4_1) through the official client:
what a user notices when real text flows — determinism, stream = non-stream, stop strings,
usage that adds up, seeds, logprobs, limits, cancellation, concurrency, and `-s`."""

import json
import os
import subprocess
import threading
import time

import openai
import pytest

from conftest import SMOLLM2, _binary

MODEL = "SmolLM2-135M-Instruct.Q4_1"
Q = [{"role": "user", "content": "Name three colors."}]


def greedy(server, messages=Q, **kw):
    return server.client().chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=kw.pop("max_tokens", 24), **kw)


def test_greedy_is_deterministic_and_stream_matches(real):
    a = greedy(real)
    b = greedy(real)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.choices[0].message.content.strip()
    chunks = list(real.client().chat.completions.create(
        model=MODEL, messages=Q, temperature=0, max_tokens=24, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == a.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == a.usage.completion_tokens


def test_usage_adds_up(real):
    r = greedy(real, logprobs=True)
    status, _, tok = real.post("/v1/tokenize", {"messages": Q})
    assert r.usage.prompt_tokens == tok["count"]
    assert r.usage.completion_tokens == len(r.choices[0].logprobs.content)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    t = r.model_extra["timings"]
    assert t["predicted_n"] == r.usage.completion_tokens and t["predicted_ms"] > 0


def test_stop_string_cuts_the_greedy_answer(real):
    full = greedy(real).choices[0].message.content
    words = full.split()
    assert len(words) >= 3, full
    stop = words[2]
    r = greedy(real, stop=[stop])
    assert r.choices[0].message.content == full[: full.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_max_tokens_and_length(real):
    r = greedy(real, max_tokens=5)
    assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("length", 5)


def test_seeded_sampling_repeats_and_n(real):
    kw = dict(model=MODEL, messages=Q, temperature=0.9, seed=7, max_tokens=16, n=2)
    a = real.client().chat.completions.create(**kw)
    b = real.client().chat.completions.create(**kw)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert len(a.choices) == 2


def test_logprobs_are_consistent(real):
    r = greedy(real, logprobs=True, top_logprobs=3, max_tokens=8)
    content = r.choices[0].logprobs.content
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert t.logprob <= 0
        assert len(t.top_logprobs) == 3
        # Greedy picks the most likely token.
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-4)


def test_prompt_longer_than_context(real):
    long = [{"role": "user", "content": "word " * 3000}]
    with pytest.raises(openai.BadRequestError) as e:
        greedy(real, messages=long)
    assert e.value.code == "context_length_exceeded" and "2048" in e.value.message


def test_disconnect_then_server_still_serves(real):
    stream = real.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Write a long story."}],
        temperature=0, max_tokens=1500, stream=True)
    it = iter(stream)
    next(it)
    next(it)
    stream.close()
    start = time.time()
    r = greedy(real, max_tokens=4)
    assert r.choices[0].finish_reason == "length"
    # Had the abandoned 1500-token generation kept the engine busy, this would take far longer.
    assert time.time() - start < 30


def test_concurrent_requests_keep_their_own_answers(real):
    prompts = [[{"role": "user", "content": f"What is {i} plus {i}?"}] for i in range(3)]
    solo = [greedy(real, messages=p, max_tokens=12).choices[0].message.content for p in prompts]
    results = [None] * 3

    def run(i):
        results[i] = greedy(real, messages=prompts[i], max_tokens=12).choices[0].message.content

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == solo


def test_single_prompt_mode_uses_the_same_pipeline(real):
    binary = _binary("AFM_BIN", "afm", ["-p", "afm"])
    served = greedy(real, max_tokens=16).choices[0].message.content
    # On the server's device ($AFM_SERVER_ARGS, e.g. --device cuda).
    device = os.environ.get("AFM_SERVER_ARGS", "").split()
    out = subprocess.run([str(binary), "mlx", "-m", str(SMOLLM2), "-s", Q[0]["content"], "-t", "0",
                          "--max-tokens", "16", "--max-context", "2048", *device],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.rstrip("\n") == served
    out = subprocess.run([str(binary), "mlx", "-m", str(SMOLLM2), "-s", Q[0]["content"], "-t", "0",
                          "--max-tokens", "16", "--max-context", "2048", "--json"],
                         capture_output=True, text=True, timeout=300)
    body = json.loads(out.stdout)
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["content"] == served


def test_cli_errors_are_one_line_exit_1(tmp_path):
    binary = _binary("AFM_BIN", "afm", ["-p", "afm"])
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 10)
    for args in (["-m", str(tmp_path / "missing.gguf"), "-s", "hi"], ["-m", str(bad), "-s", "hi"],
                 ["-m", "x", "--mtp"], ["-m", "x", "--top-p", "3"]):
        out = subprocess.run([str(binary), "mlx", *args], capture_output=True, text=True, timeout=60)
        assert out.returncode == 1, (args, out.stderr)
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr
        assert "panicked" not in out.stderr
