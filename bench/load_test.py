#!/usr/bin/env python3
"""Load and fault test (issue #8): afm on SmolLM2-135M with many streaming clients that finish,
disconnect mid-answer or cancel through /cancel, then checks the server came back clean.

Loopback only and bounded: one afm process on 127.0.0.1, CLIENTS concurrent clients for
DURATION seconds, every request with a client-side deadline. Checks, after the run:
  - every request got a complete answer or a clear error (HTTP status + OpenAI error JSON, or
    an SSE error event); anything else (reset by the server, a stream cut without [DONE],
    garbage) is counted as "unclear" and fails the run;
  - every KV block is back in the pool (afm:kv_blocks_free == afm:kv_blocks_total) and nothing
    runs or waits (afm:num_requests_running / _waiting == 0);
  - resident memory (VmRSS) within 10% of what it was after warm-up (the KV pool is sized
    small, 64 MiB, so the warm-up touches all of it: its pages stay resident once used, by
    design, and would otherwise read as growth);
  - no panic ("internal error", "panicked") in the server log.

    python3 bench/load_test.py [--clients 200] [--duration 60] [--concurrent 8] [--json out.json]

Requests past --max-waiting (the server's default, 64) get 429 and their client retries after
the Retry-After second, so the queue stays bounded and overload shows as clear errors.

Standard library only (asyncio streams speak HTTP/1.1 directly), so a client can drop its
connection at any byte.
"""

import argparse
import asyncio
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [
    "Write a short poem about the sea.",
    "Explain what a hash map is in two sentences.",
    "List three fruits.",
    "What is the capital of France?",
    "Tell me a story about a dragon who loves tea.",
    "Count from one to twenty in words.",
    "Give me a recipe for pancakes.",
    "Why is the sky blue?",
]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vm_rss_kib(pid):
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


async def http(port, method, path, body=None, timeout=30):
    """One request on a fresh connection; returns (status, body bytes)."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), timeout)
    try:
        data = json.dumps(body).encode() if body is not None else b""
        head = (f"{method} {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n"
                f"content-type: application/json\r\ncontent-length: {len(data)}\r\n\r\n")
        writer.write(head.encode() + data)
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()
    head, _, rest = raw.partition(b"\r\n\r\n")
    status = int(head.split()[1]) if head.startswith(b"HTTP/1.1 ") else 0
    if b"transfer-encoding: chunked" in head.lower():
        rest = dechunk(rest)
    return status, rest


def dechunk(data):
    out, i = b"", 0
    while True:
        j = data.find(b"\r\n", i)
        if j < 0:
            return out
        size = int(data[i:j].split(b";")[0] or b"0", 16)
        if size == 0:
            return out
        out += data[j + 2:j + 2 + size]
        i = j + 2 + size + 2


async def metrics(port):
    status, body = await http(port, "GET", "/metrics")
    values = {}
    for line in body.decode().splitlines():
        m = re.match(r"^([\w:]+)(\{[^}]*\})?\s+(\S+)$", line)
        if m:
            values[m.group(1)] = values.get(m.group(1), 0) + float(m.group(3))
    return values


class Stats:
    def __init__(self):
        self.outcomes = Counter()
        self.unclear = []
        self.tokens = 0


async def one_request(port, rng, stats, deadline_s):
    """One streamed chat request with a random fate: read to the end, drop the connection
    mid-stream, or cancel it through /cancel and read the rest. Returns the HTTP status."""
    fate = rng.choices(["complete", "disconnect", "cancel"], weights=[70, 15, 15])[0]
    body = {
        "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
        "max_tokens": rng.randint(8, 96),
        "temperature": 0.8,
        "stream": True,
    }
    data = json.dumps(body).encode()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError as e:
        stats.outcomes["connect_refused"] += 1
        stats.unclear.append(f"connect: {e}")
        return
    try:
        writer.write((f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
                      f"connection: close\r\ncontent-type: application/json\r\n"
                      f"content-length: {len(data)}\r\n\r\n").encode() + data)
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), deadline_s)
        status = int(head.split()[1])
        if status != 200:
            rest = await asyncio.wait_for(reader.read(), deadline_s)
            if b"transfer-encoding: chunked" in head.lower():
                rest = dechunk(rest)
            try:
                err = json.loads(rest)["error"]
                stats.outcomes[f"error_{status}_{err.get('code')}"] += 1
            except (ValueError, KeyError, TypeError):
                stats.outcomes["unclear"] += 1
                stats.unclear.append(f"HTTP {status} without error JSON: {rest[:200]!r}")
            return status
        # SSE over chunked encoding: parse `data:` lines out of the raw bytes.
        buf, chunks, req_id, finish, done = b"", 0, None, None, False
        stop_after = rng.randint(1, 12)
        while not done:
            piece = await asyncio.wait_for(reader.read(65536), deadline_s)
            if not piece:
                break
            buf += piece
            events = re.findall(rb"data: ?([^\r\n]+)\r?\n", buf)
            buf = buf[buf.rfind(b"\n") + 1:] if events else buf
            for ev in events:
                if ev == b"[DONE]":
                    done = True
                    break
                try:
                    chunk = json.loads(ev)
                except ValueError:
                    continue  # a chunk boundary fell inside this event's framing
                if "error" in chunk:
                    stats.outcomes["stream_error_event"] += 1
                    return
                req_id = req_id or chunk.get("id")
                for choice in chunk.get("choices", []):
                    if choice.get("delta", {}).get("content"):
                        chunks += 1
                    finish = choice.get("finish_reason") or finish
            if fate == "disconnect" and chunks >= stop_after and not done:
                stats.outcomes["disconnected_by_client"] += 1
                return  # the finally closes the socket mid-stream
            if fate == "cancel" and chunks >= stop_after and req_id and not done:
                fate = "cancel_sent"
                status, _ = await http(port, "POST", f"/v1/chat/completions/{req_id}/cancel")
                stats.outcomes[f"cancel_call_{status}"] += 1
        stats.tokens += chunks
        if done and finish:
            stats.outcomes[f"finished_{finish}"] += 1
        else:
            stats.outcomes["unclear"] += 1
            stats.unclear.append(f"stream ended without [DONE]/finish (fate {fate}, {chunks} chunks)")
    except asyncio.TimeoutError:
        stats.outcomes["unclear"] += 1
        stats.unclear.append(f"no progress within {deadline_s} s (fate {fate})")
    except (ConnectionError, asyncio.IncompleteReadError, OSError) as e:
        stats.outcomes["unclear"] += 1
        stats.unclear.append(f"{type(e).__name__}: {e} (fate {fate})")
    finally:
        writer.close()


async def client(port, seed, stats, until, deadline_s):
    rng = random.Random(seed)
    while time.monotonic() < until:
        status = await one_request(port, rng, stats, deadline_s)
        # Retry-After: 1 on 429 (queue full) and 503.
        await asyncio.sleep(1.0 if status in (429, 503) else rng.random() * 0.2)


async def settle(port, timeout):
    """Waits until nothing runs or waits and every block is free; returns the last metrics."""
    end = time.monotonic() + timeout
    m = {}
    while time.monotonic() < end:
        m = await metrics(port)
        if (m.get("afm:num_requests_running", 1) == 0 and m.get("afm:num_requests_waiting", 1) == 0
                and m.get("afm:kv_blocks_free") == m.get("afm:kv_blocks_total")):
            return m, True
        await asyncio.sleep(0.5)
    return m, False


async def run(args):
    port = free_port()
    log_path = Path(args.log)
    log = open(log_path, "wb")
    cmd = [args.afm, "serve", "-m", args.model, "-p", str(port), "--concurrent", str(args.concurrent),
           "--max-waiting", str(args.max_waiting), "--kv-memory", args.kv_memory,
           "--max-context", str(args.max_context)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        for _ in range(600):
            try:
                if (await http(port, "GET", "/health", timeout=2))[0] == 200:
                    break
            except OSError:
                pass
            if proc.poll() is not None:
                raise SystemExit(f"afm exited early; see {log_path}")
            await asyncio.sleep(0.2)
        # Warm-up, so the baseline is the server's working size: first every KV block is written
        # once (one long distinct prompt per slot fills the pool), then the run's own traffic
        # at full concurrency grows the allocator's arenas.
        m = await metrics(port)
        tokens_per_slot = int(m["afm:kv_blocks_total"]) * 16 // args.concurrent - 32
        fill = [{"prompt": f"{i} " + "the quick brown fox jumps over the lazy dog " * (tokens_per_slot // 10),
                 "max_tokens": 1} for i in range(args.concurrent)]
        await asyncio.gather(*(http(port, "POST", "/v1/completions", body, timeout=600) for body in fill))
        warm = Stats()
        await asyncio.gather(*(client(port, 1000 + i, warm, time.monotonic() + args.warmup, 120)
                               for i in range(min(args.clients, 64))))
        m0, _ = await settle(port, 60)
        rss0 = vm_rss_kib(proc.pid)
        print(f"baseline: VmRSS {rss0 / 1024:.1f} MiB, blocks {m0.get('afm:kv_blocks_free'):.0f}/"
              f"{m0.get('afm:kv_blocks_total'):.0f} free", flush=True)

        stats = Stats()
        started = time.monotonic()
        peak = [rss0]

        running = [True]

        async def sample_rss():
            while running[0]:
                peak[0] = max(peak[0], vm_rss_kib(proc.pid))
                await asyncio.sleep(1)

        async def clients():
            await asyncio.gather(*(client(port, i, stats, started + args.duration, args.deadline)
                                   for i in range(args.clients)))
            running[0] = False

        await asyncio.gather(sample_rss(), clients())
        elapsed = time.monotonic() - started
        m1, clean = await settle(port, 60)
        await asyncio.sleep(2)
        rss1 = vm_rss_kib(proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = "killed"
        log.close()

    text = log_path.read_text(errors="replace")
    panics = [l for l in text.splitlines() if "internal error" in l or "panicked" in l]
    total = sum(stats.outcomes.values())
    result = {
        "clients": args.clients, "duration_s": round(elapsed, 1), "concurrent": args.concurrent,
        "warmup_requests": sum(warm.outcomes.values()),
        "requests": total, "outcomes": dict(sorted(stats.outcomes.items())),
        "content_chunks": stats.tokens, "unclear_examples": stats.unclear[:10],
        "kv_blocks_free": m1.get("afm:kv_blocks_free"), "kv_blocks_total": m1.get("afm:kv_blocks_total"),
        "running_after": m1.get("afm:num_requests_running"), "waiting_after": m1.get("afm:num_requests_waiting"),
        "rss_before_mib": round(rss0 / 1024, 1), "rss_peak_mib": round(peak[0] / 1024, 1),
        "rss_after_mib": round(rss1 / 1024, 1), "panics": panics[:5], "exit_code": code,
    }
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    failures = []
    if stats.outcomes.get("unclear") or stats.outcomes.get("connect_refused"):
        failures.append("requests without a complete answer or a clear error")
    if not clean:
        failures.append("blocks not all back in the pool, or requests still running")
    if rss1 > rss0 * 1.10:
        failures.append(f"VmRSS {rss1 / 1024:.1f} MiB is more than 10% over {rss0 / 1024:.1f} MiB")
    if panics:
        failures.append("panic in the server log")
    if code != 0:
        failures.append(f"afm exited {code} on SIGTERM")
    print("load_test: " + ("PASS" if not failures else "FAIL: " + "; ".join(failures)))
    return 1 if failures else 0


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--afm", default=str(ROOT / "target/release/afm"))
    p.add_argument("--model", default=str(ROOT / "models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    p.add_argument("--clients", type=int, default=200)
    p.add_argument("--duration", type=float, default=60)
    p.add_argument("--concurrent", type=int, default=8)
    p.add_argument("--max-waiting", type=int, default=64)
    p.add_argument("--kv-memory", default="64M")
    p.add_argument("--max-context", type=int, default=2048)
    p.add_argument("--warmup", type=float, default=20, help="seconds of warm-up before the baseline")
    p.add_argument("--deadline", type=float, default=180, help="client-side seconds without progress")
    p.add_argument("--log", default="/tmp/afm_load_test.log")
    p.add_argument("--json")
    args = p.parse_args()
    for path in (args.afm, args.model):
        if not os.path.exists(path):
            sys.exit(f"missing {path} (cargo build --release -p afm; bash scripts/fetch_models.sh smollm2)")
    sys.exit(asyncio.run(run(args)))


if __name__ == "__main__":
    main()
