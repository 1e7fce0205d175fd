"""`kvrecover serve-demo`: one prefill, two decode servers and the proxy on loopback.

Each server is a `kvrecover serve` child process sharing a KV folder (the demo's
engine flags, those of `EngineArgs`, are passed on to every server); the proxy
listens on `--port`. The demo sends one request through the proxy, prints it with
copy-paste commands, and serves until Ctrl-C (`--once`: exits after the request).
Children are always stopped on the way out.
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvrecover.options import option, validate

START_TIMEOUT_S = 600.0
DEMO_PROMPT = "The capital of France is"


@dataclass
class DemoArgs:
    """The flags of `kvrecover serve-demo` besides the engine's (which every server gets)."""

    port: int = option(8000, "the proxy's port", int, minimum=0, maximum=65535)
    workdir: Path | None = option(
        None, "folder for the KV store and the server logs (default: a temp dir)", Path,
        nullable=True, metavar="DIR")
    once: bool = option(
        False, "exit after the demo request instead of serving until Ctrl-C", bool)

    def __post_init__(self) -> None:
        validate(self)


def add_demo_parser(commands: Any) -> None:
    """Register `kvrecover serve-demo` on the CLI's subparsers."""
    from kvrecover.config import EngineArgs
    from kvrecover.options import add_record_flags

    demo = commands.add_parser(
        "serve-demo", help="start one prefill, two decode servers and the proxy on loopback")
    add_record_flags(demo, EngineArgs, DemoArgs, skip=("kv_transfer_config",))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _transfer(store: Path, role: str) -> str:
    return json.dumps({"kv_connector": "SharedStorageConnector", "kv_role": role,
                       "kv_connector_extra_config": {"shared_storage_path": str(store)}})


def run_demo(args: argparse.Namespace) -> int:
    """Start the servers and the proxy, send one request, serve until interrupted."""
    import httpx

    from kvrecover.config import engine_args_from_namespace
    from kvrecover.options import from_namespace

    demo = from_namespace(DemoArgs, args)
    workdir = demo.workdir or Path(tempfile.mkdtemp(prefix="kvrecover-demo-"))
    store = workdir / "kv"
    store.mkdir(parents=True, exist_ok=True)
    engine = engine_args_from_namespace(args).to_argv()  # every server gets the same engine
    roles = [("prefill", "kv_producer"), ("decode-1", "kv_consumer"),
             ("decode-2", "kv_consumer")]
    children: list[tuple[str, subprocess.Popen, str]] = []

    def spawn(name: str, argv: list[str], port: int) -> str:
        with open(workdir / f"{name}.log", "wb") as log:  # the child keeps its own handle
            proc = subprocess.Popen(
                [sys.executable, "-m", "kvrecover", *argv, "--port", str(port)],
                stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        children.append((name, proc, url))
        return url

    try:
        urls = {name: spawn(name, ["serve", *engine, "--kv-transfer-config",
                                   _transfer(store, role)], _free_port())
                for name, role in roles}
        print(f"kvrecover serve-demo: starting 3 servers (logs in {workdir}) ...", flush=True)
        _wait_healthy(children, httpx)
        proxy_url = spawn("proxy", ["proxy", "--prefill", urls["prefill"], "--decode",
                                    urls["decode-1"], urls["decode-2"]], demo.port)
        _wait_healthy(children, httpx)
        for name, _, url in children:
            print(f"  {name:9s} {url}")
        body = {"prompt": DEMO_PROMPT, "max_tokens": 16, "temperature": 0}
        answer = httpx.post(f"{proxy_url}/v1/completions", json=body, timeout=300)
        answer.raise_for_status()
        print(f"\n{DEMO_PROMPT!r} -> {answer.json()['choices'][0]['text']!r} "
              f"(decoded by {answer.headers['x-kvrecover-decode-instance']})")
        if demo.once:
            return 0
        print(f"\nTry:\n  curl {proxy_url}/v1/completions -H 'Content-Type: application/json' "
              f"-d '{json.dumps(body)}'\n  curl {proxy_url}/metrics")
        print("\nServing; Ctrl-C stops everything.", flush=True)
        while all(proc.poll() is None for _, proc, _ in children):
            time.sleep(1.0)
        dead = [name for name, proc, _ in children if proc.poll() is not None]
        print(f"kvrecover serve-demo: {', '.join(dead)} exited; stopping", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        for _, proc, _ in children:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for _, proc, _ in children:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()


def _wait_healthy(children: list[tuple[str, subprocess.Popen, str]], httpx: Any) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    pending = {url: (name, proc) for name, proc, url in children}
    while pending:
        if time.monotonic() > deadline:
            raise ValueError(f"{', '.join(n for n, _ in pending.values())} did not start "
                             f"within {START_TIMEOUT_S:.0f}s")
        for url, (name, proc) in list(pending.items()):
            if proc.poll() is not None:
                raise ValueError(f"{name} exited with {proc.returncode}; see its log")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    del pending[url]
            except httpx.HTTPError:
                pass
        time.sleep(0.3)
