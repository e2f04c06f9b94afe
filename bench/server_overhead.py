#!/usr/bin/env python3
"""Server overhead per streamed token and time to first token over HTTP, against the same
model, prompt and settings run without a server (`afm mlx -s --json`), in one run.

overhead = 1 - (decode tok/s seen by an HTTP streaming client) / (decode tok/s of `afm -s`)
TTFT gap = (HTTP time to first content token) - (prefill time `afm -s` reports)

    python3 bench/server_overhead.py --model models/SmolLM2-135M-Instruct.Q4_1.gguf
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = "Write a long story about a lighthouse keeper who learns to paint."


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def single(binary, model, prompt, n):
    out = subprocess.run(
        [binary, "mlx", "-m", model, "-s", prompt, "--max-tokens", str(n), "-t", "0", "--json"],
        capture_output=True, text=True, check=True,
    ).stdout
    u = json.loads(out)["usage"]
    return u["prompt_time"], (u["completion_tokens"] - 1) / u["completion_time"], u["completion_tokens"]


def stream(port, prompt, n):
    body = json.dumps({
        "messages": [{"role": "user", "content": prompt}], "max_tokens": n, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True},
    }).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                 {"content-type": "application/json"})
    t0 = time.perf_counter()
    stamps = []
    with urllib.request.urlopen(req) as r:
        for line in r:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            ch = chunk.get("choices") or []
            if ch and ch[0]["delta"].get("content"):
                stamps.append(time.perf_counter())
    ttft = stamps[0] - t0
    decode = (len(stamps) - 1) / (stamps[-1] - stamps[0])
    return ttft, decode, len(stamps)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(ROOT, "models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--afm", default=os.path.join(ROOT, "target/release/afm"))
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    port = free_port()
    server = subprocess.Popen([a.afm, "serve", "-m", a.model, "-p", str(port), "--disable-prefix-caching"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health")
                break
            except OSError:
                time.sleep(0.1)
        stream(port, PROMPT, 8)  # warm-up
        rows = {"single_decode": [], "http_decode": [], "single_prefill": [], "http_ttft": [],
                "single_ttft_1tok": [], "http_ttft_1tok": []}
        for _ in range(a.runs):
            p, d, _ = single(a.afm, a.model, PROMPT, a.tokens)
            rows["single_prefill"].append(p)
            rows["single_decode"].append(d)
            t, d2, _ = stream(port, PROMPT, a.tokens)
            rows["http_ttft"].append(t)
            rows["http_decode"].append(d2)
            p1, _, _ = single(a.afm, a.model, "Hi", 2)
            rows["single_ttft_1tok"].append(p1)
            t1 = stream(port, "Hi", 3)[0]
            rows["http_ttft_1tok"].append(t1)
        med = {k: statistics.median(v) for k, v in rows.items()}
        overhead = 1 - med["http_decode"] / med["single_decode"]
        print(f"decode: afm -s {med['single_decode']:.1f} tok/s, HTTP stream {med['http_decode']:.1f} tok/s "
              f"-> server overhead {overhead * 100:.2f}% per token")
        print(f"TTFT long prompt: afm -s prefill {med['single_prefill'] * 1e3:.1f} ms, HTTP {med['http_ttft'] * 1e3:.1f} ms")
        print(f"TTFT short prompt: afm -s prefill {med['single_ttft_1tok'] * 1e3:.1f} ms, HTTP first token "
              f"{med['http_ttft_1tok'] * 1e3:.1f} ms (gap {(med['http_ttft_1tok'] - med['single_ttft_1tok']) * 1e3:.1f} ms)")
        print(json.dumps({"model": os.path.basename(a.model), "tokens": a.tokens, "runs": a.runs, "median": med}))
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    sys.exit(main())
