"""Request deadline and slow readers against afm on a real model (SmolLM2-135M), through the
official openai client and a raw socket:

- a request past --request-timeout gets a timeout error, not a truncated answer: a 408 JSON
  error when not streamed, an SSE `{"error": ...}` event (which the openai client raises) when
  streamed; the server then serves the next request and every KV block is free again;
- a client that sends a streaming request and then stops reading is disconnected after
  --write-timeout, its request cancelled and its KV blocks back in the pool (/metrics).

EOS is banned with logit_bias so the answers run long.
"""

import json
import socket
import subprocess
import time
import urllib.request

import openai
import pytest

from conftest import SMOLLM2, _binary, _free_port, _start

# SmolLM2's <|endoftext|> and <|im_end|>.
MODEL = SMOLLM2.stem
NO_EOS = {"0": -100, "2": -100}


def _serve(*flags: str):
    if not SMOLLM2.exists():
        pytest.skip(f"{SMOLLM2} not fetched (scripts/fetch_models.sh smollm2)")
    binary = _binary("AFM_BIN", "afm", ["-p", "afm"])
    port = _free_port()
    cmd = [str(binary), "serve", "-m", str(SMOLLM2), "-p", str(port), "--max-context", "4096",
           "--concurrent", "8", *flags]
    return _start(cmd, f"http://127.0.0.1:{port}", 300)


@pytest.fixture(scope="module")
def strict():
    """A 2 s deadline per request."""
    server = _serve("--request-timeout", "2")
    yield server
    server.proc.terminate()
    server.proc.wait(10)


@pytest.fixture(scope="module")
def impatient():
    """No deadline; 2 s for a client to take what is written."""
    server = _serve("--request-timeout", "0", "--write-timeout", "2")
    yield server
    server.proc.terminate()
    server.proc.wait(10)


def metrics(server) -> dict[str, float]:
    with urllib.request.urlopen(server.base + "/metrics", timeout=10) as r:
        text = r.read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith("afm:"):
            name, value = line.split()
            values[name.removeprefix("afm:")] = float(value)
    return values


def kv_blocks(server) -> tuple[float, float]:
    """(free, total) KV blocks from /metrics."""
    m = metrics(server)
    return m["kv_blocks_free"], m["kv_blocks_total"]


def wait_all_blocks_free(server, within: float) -> float:
    start = time.time()
    while True:
        free, total = kv_blocks(server)
        if free == total:
            return time.time() - start
        assert time.time() - start < within, f"{total - free} KV blocks still held"
        time.sleep(0.1)


def long_request(**extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Count to ten thousand."}],
            "max_tokens": 3000, "logit_bias": NO_EOS, **extra}


def test_non_streamed_request_past_the_deadline_is_a_408_timeout_error(strict):
    client = strict.client()
    start = time.time()
    with pytest.raises(openai.APIStatusError) as err:
        client.chat.completions.create(**long_request())
    took = time.time() - start
    assert err.value.status_code == 408
    body = err.value.body
    assert body["code"] == "timeout", body
    assert "--request-timeout" in body["message"], body
    assert 1.5 < took < 10, took
    wait_all_blocks_free(strict, 5)
    # The next request is served.
    ok = client.chat.completions.create(model=MODEL, max_tokens=5,
                                        messages=[{"role": "user", "content": "Hi"}])
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_streamed_request_past_the_deadline_ends_with_an_error_event(strict):
    client = strict.client()
    chunks = 0
    with pytest.raises(openai.APIError) as err:
        for chunk in client.chat.completions.create(**long_request(stream=True)):
            chunks += 1
            assert chunk.choices[0].finish_reason is None, "a timed-out answer looked finished"
    assert chunks > 1, "no text arrived before the deadline"
    assert "--request-timeout" in err.value.message, err.value.message
    assert err.value.code == "timeout"
    wait_all_blocks_free(strict, 5)


def test_a_client_that_stops_reading_is_dropped_and_its_blocks_freed(impatient):
    _, total = kv_blocks(impatient)
    generated_before = metrics(impatient)["generation_tokens_total"]
    host, port = impatient.base.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    # Eight choices with 20 alternatives per token: a few KB per step, soon more than the
    # socket buffers hold; 8 x 1500 tokens would take far longer than the test waits.
    body = json.dumps(long_request(stream=True, n=8, logprobs=True, top_logprobs=20,
                                   max_tokens=1500)).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    start = time.time()
    while kv_blocks(impatient)[0] == total:
        assert time.time() - start < 60, "the request never took KV blocks"
        time.sleep(0.1)
    # Generation runs until the socket buffers (a few MB) are full, then 2 s more.
    freed_after = wait_all_blocks_free(impatient, 120)
    generated = metrics(impatient)["generation_tokens_total"] - generated_before
    assert generated < 8 * 1500, "the answer ran to its end: nothing was cancelled"
    # The server closed the connection: reading drains what was buffered, then ends.
    sock.settimeout(10)
    received = 0
    while chunk := sock.recv(65536):
        received += len(chunk)
    sock.close()
    assert received > 0
    print(f"blocks back {freed_after:.1f} s after the request took them; "
          f"{generated:.0f} of {8 * 1500} tokens generated, {received} bytes sent")
