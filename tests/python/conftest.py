"""Fixtures for the API suite: a server on the scripted fake engine (always), and afm itself
on a real model (SmolLM2-135M from models/, when present).

Binaries: $AFM_FAKE_SERVER / $AFM_BIN, else target/{release,debug}/..., else built with cargo.
"""

import json
import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import openai
import pytest

ROOT = Path(__file__).resolve().parents[2]
# $AFM_TEST_MODEL: another model with SmolLM2's tokenizer for the live tests (on a GPU machine,
# its shape with random weights: scripts/gpu_live_tests.sh).
SMOLLM2 = Path(os.environ.get("AFM_TEST_MODEL",
                              ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"))


def _binary(env: str, rel: str, build: list[str]) -> Path:
    if os.environ.get(env):
        return Path(os.environ[env])
    for profile in ("release", "debug"):
        path = ROOT / "target" / profile / rel
        if path.exists():
            return path
    subprocess.run(["cargo", "build", *build], cwd=ROOT, check=True)
    return ROOT / "target" / "debug" / rel


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(base: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"server at {base} not healthy after {timeout}s")


class Server:
    def __init__(self, base: str, proc: subprocess.Popen):
        self.base = base
        self.proc = proc

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base + "/v1", api_key="unused", max_retries=0, **kw)

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(self.base + path, timeout=10) as r:
            return json.loads(r.read())

    def post(self, path: str, body: bytes | dict) -> tuple[int, dict, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, method="POST",
                                     headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, dict(r.headers), json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers), json.loads(e.read())


def _start(cmd: list[str], base: str, timeout: float) -> Server:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _wait_healthy(base, proc, timeout)
    except RuntimeError:
        proc.kill()
        err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
        raise RuntimeError(f"{' '.join(cmd)} failed: {err[-2000:]}")
    return Server(base, proc)


@pytest.fixture(scope="session")
def fake():
    binary = _binary("AFM_FAKE_SERVER", "examples/fake_server",
                     ["-p", "afm-server", "--example", "fake_server"])
    port = _free_port()
    server = _start([str(binary), "--port", str(port), "--max-body", "100000"],
                    f"http://127.0.0.1:{port}", 60)
    yield server
    server.proc.terminate()
    server.proc.wait(10)


@pytest.fixture(scope="session")
def real():
    if not SMOLLM2.exists():
        pytest.skip(f"{SMOLLM2} not fetched (scripts/fetch_models.sh smollm2)")
    binary = _binary("AFM_BIN", "afm", ["-p", "afm"])
    port = _free_port()
    cmd = [str(binary), "mlx", "-m", str(SMOLLM2), "-p", str(port), "--max-context", "2048"]
    # $AFM_SERVER_ARGS: more flags for the live server, e.g. "--device cuda" on a GPU machine.
    cmd += os.environ.get("AFM_SERVER_ARGS", "").split()
    server = _start(cmd, f"http://127.0.0.1:{port}", 300)
    yield server
    server.proc.terminate()
    server.proc.wait(10)
