#!/usr/bin/env python3
"""A short request arriving behind a 4,000-token prefill (issue 4's fairness target): its time to
first token should stay within 2x its uncontended TTFT plus one prefill chunk's time.

    python3 bench/fairness.py --model models/SmolLM2-135M-Instruct.Q4_1.gguf
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port, path, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    return urllib.request.urlopen(req)


def ttft(port, messages, max_tokens):
    """Seconds to the first content token of a streamed chat request, and its final usage."""
    t0 = time.perf_counter()
    first, usage = None, None
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with post(port, "/v1/chat/completions", body) as r:
        for line in r:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            ch = chunk.get("choices") or []
            if first is None and ch and ch[0]["delta"].get("content"):
                first = time.perf_counter() - t0
    return first, usage


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(ROOT, "models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--afm", default=os.path.join(ROOT, "target/release/afm"))
    ap.add_argument("--long-tokens", type=int, default=4000)
    ap.add_argument("--prefill-step-size", type=int, default=1024)
    a = ap.parse_args()
    port = free_port()
    server = subprocess.Popen([a.afm, "serve", "-m", a.model, "-p", str(port), "--concurrent", "4",
                               "--prefill-step-size", str(a.prefill_step_size), "--disable-prefix-caching"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health")
                break
            except OSError:
                time.sleep(0.1)
        short = [{"role": "user", "content": "What is the capital of France?"}]
        ttft(port, short, 4)  # warm-up
        alone = statistics.median(ttft(port, short, 4)[0] for _ in range(5))
        # A long prompt of distinct sentences, cut to the wanted token count.
        words = " ".join(f"Item {i} weighs {i * 7 % 13} kilograms." for i in range(1200))
        total = len(json.load(post(port, "/v1/tokenize", {"content": words}))["tokens"])
        long_msgs = [{"role": "user", "content": words[: len(words) * a.long_tokens // total]}]
        result = {}
        t = threading.Thread(target=lambda: result.update(long=ttft(port, long_msgs, 4)))
        t.start()
        time.sleep(0.5)  # the long prefill is under way
        behind, _ = ttft(port, short, 4)
        t.join()
        long_ttft, long_usage = result["long"]
        prompt_n = long_usage["prompt_tokens"]
        chunk = a.prefill_step_size // 2  # the engine's prefill chunk: half the step budget
        chunk_time = long_usage["prompt_time"] * chunk / prompt_n
        bound = 2 * alone + chunk_time
        print(f"short request alone: TTFT {alone * 1e3:.0f} ms (median of 5)")
        print(f"long request: {prompt_n} prompt tokens, TTFT {long_ttft * 1e3:.0f} ms; one {chunk}-token chunk ≈ {chunk_time * 1e3:.0f} ms")
        print(f"short request behind it: TTFT {behind * 1e3:.0f} ms; bound 2×alone + chunk = {bound * 1e3:.0f} ms "
              f"-> {'met' if behind <= bound else 'NOT met'}")
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    sys.exit(main())
