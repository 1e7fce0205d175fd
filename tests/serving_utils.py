"""Helpers for the serving tests: real `kvrecover serve` / `proxy` processes on free
loopback ports, always killed, and a tiny checkpoint that has a chat template."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

START_TIMEOUT_S = 180.0  # two cores shared by several engineers: starts can be slow
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)


def free_port() -> int:
    """A loopback port that nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


PEER_BIN = Path.home() / ".cache" / "kvrecover-peer" / "clients-venv" / "bin"


def client_binary(name: str) -> Path | None:
    """A real client's executable `name` (lm_eval, vllm-router) from
    $KVRECOVER_CLIENTS_BIN (./test.sh's .clients-venv), the peer clients' venv or PATH."""
    for folder in (os.environ.get("KVRECOVER_CLIENTS_BIN"), str(PEER_BIN)):
        if folder and (Path(folder) / name).is_file():
            return Path(folder) / name
    found = shutil.which(name)
    return Path(found) if found else None


def required_client_binary(name: str, missing: str) -> Path:
    """`client_binary(name)`; without it the calling test is skipped with `missing`,
    except under CI (CI=true), where it fails: CI installs every real client."""
    found = client_binary(name)
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail(missing)
        pytest.skip(missing)
    return found


def add_chat_template(model_dir: Path) -> Path:
    """Give a tiny checkpoint a (simple) chat template."""
    path = model_dir / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    path.write_text(json.dumps(config))
    return model_dir


class Process:
    """One spawned `python -m kvrecover ...` listening on `url`."""

    def __init__(self, argv: list[str], port: int, log_path: Path, env: dict | None = None,
                 program: list[str] | None = None):
        """`argv` after `program` (default: `python -m kvrecover`)."""
        self.argv = argv
        self.name = argv[0] if program is None else Path(program[0]).name
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        full_env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
        self._log = open(log_path, "wb")
        command = program or [sys.executable, "-m", "kvrecover"]
        self.proc = subprocess.Popen([*command, *argv], stdout=self._log,
                                     stderr=subprocess.STDOUT, env=full_env)

    def wait_healthy(self, timeout: float = START_TIMEOUT_S) -> Process:
        """Block until GET /health is 200; fail with the log when it never is."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n"
                                   f"{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.kill()
        raise RuntimeError(f"{self.name} not healthy after {timeout}s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-4000:]

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Stop the process (SIGKILL by default) and reap it."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)
        self._log.close()


def serve(tmp: Path, model_dir: Path, *extra: str, env: dict | None = None,
          name: str = "serve", port: int | None = None) -> Process:
    """Start `kvrecover serve` on the tiny model (on a free port unless `port` is
    given); not yet waited for."""
    port = port or free_port()
    argv = ["serve", "--model", str(model_dir), "--port", str(port), *extra]
    return Process(argv, port, tmp / f"{name}-{port}.log", env)


@contextlib.contextmanager
def served(tmp: Path, model_dir: Path, *extra: str) -> Iterator[Process]:
    """`serve(tmp, model_dir, *extra)`, healthy, killed on the way out (a module-scoped
    server fixture is `with served(...) as process: yield process`)."""
    process = serve(tmp, model_dir, *extra)
    try:
        yield process.wait_healthy()
    finally:
        process.kill()


def metric(url: str, name: str, labels: str = "") -> float:
    """One sample of a Prometheus metric from `url`/metrics (0 when absent)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    key = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(key + " "):
            return float(line.split()[-1])
    return 0.0


def request_bytes(port: int, path: str, body: dict) -> bytes:
    """A complete HTTP/1.1 POST of `body` as JSON, for a raw socket."""
    payload = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n")
    return head.encode() + payload


def long_request(path: str, stream: bool, max_tokens: int) -> dict:
    """A greedy request to `path` that runs `max_tokens` tokens unless aborted."""
    fields = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream}
    if path == "/v1/completions":
        return {"prompt": "the capital of france is", **fields}
    return {"messages": [{"role": "user", "content": "the capital of france is"}], **fields}


def wait_until_idle(url: str, timeout: float = 60.0) -> None:
    """Block until the server has no request running or waiting."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metric(url, "kvrecover_num_requests_running") == 0 and \
                metric(url, "kvrecover_num_requests_waiting") == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"requests still running or waiting after {timeout}s")


@contextlib.contextmanager
def in_process_server(model_dir: Path, **config: Any) -> Iterator[str]:
    """`kvrecover serve`'s app on a thread of this process (uvicorn on a free loopback
    port; no second torch to import): yields its URL. `config` goes to `ServerConfig`."""
    import uvicorn

    from kvrecover import LLM
    from kvrecover.entrypoints.server.app import ServerConfig, build_app
    from kvrecover.entrypoints.server.engine_loop import EngineLoop

    loop = EngineLoop(lambda: LLM(str(model_dir)))
    loop.start(timeout=START_TIMEOUT_S)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(
        build_app(loop, ServerConfig(config.pop("model_name", "tiny"), **config)),
        host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(START_TIMEOUT_S)
        loop.stop()
