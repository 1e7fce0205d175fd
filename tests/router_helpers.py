"""Helpers for the vllm-router tests: the real `vllm-router` binary (vLLM's P/D router)
on a free loopback port in front of `kvrecover serve` instances over NIXL, always killed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from serving_utils import START_TIMEOUT_S, free_port

PEER_BIN = Path.home() / ".cache" / "kvrecover-peer" / "clients-venv" / "bin"
MISSING = ("vllm-router is not installed (scripts/setup_vllm_router.sh, which ./test.sh runs, "
           "installs it)")


def router_binary() -> Path | None:
    """`vllm-router` from $KVRECOVER_CLIENTS_BIN, the peer clients' venv or PATH."""
    for folder in (os.environ.get("KVRECOVER_CLIENTS_BIN"), str(PEER_BIN)):
        if folder and (Path(folder) / "vllm-router").is_file():
            return Path(folder) / "vllm-router"
    found = shutil.which("vllm-router")
    return Path(found) if found else None


def required_router_binary() -> Path:
    """`router_binary()`; without it the calling test is skipped, except under CI
    (CI=true), where it fails."""
    found = router_binary()
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail(MISSING)
        pytest.skip(MISSING)
    return found


def nixl_transfer(role: str, policy: str = "recompute", faulty: bool = False, **extra) -> str:
    """A `--kv-transfer-config` for the NixlConnector in `role`; `faulty`: every pull's
    blocks all fail (the FaultInjectionConnector around it)."""
    connector = "NixlConnector"
    if faulty:
        extra = {"inner_connector": connector,
                 "faults": [{"requests": "all", "blocks": "all", "kind": "error"}], **extra}
        connector = "FaultInjectionConnector"
    return json.dumps({"kv_connector": connector, "kv_role": role,
                       "kv_load_failure_policy": policy, "kv_connector_extra_config": extra})


class Router:
    """One `vllm-router --vllm-pd-disaggregation` process in front of `prefill` and
    `decode` URLs, round robin on both sides, listening on `url`."""

    def __init__(self, binary: Path, prefill: list[str], decode: list[str], log_path: Path,
                 *extra: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        argv = [str(binary), "--vllm-pd-disaggregation", "--host", "127.0.0.1",
                "--port", str(self.port), "--prometheus-port", str(free_port()),
                "--policy", "round_robin", "--log-level", "debug", *extra]
        for url in prefill:
            argv += ["--prefill", url]
        for url in decode:
            argv += ["--decode", url]
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_healthy(self, timeout: float = START_TIMEOUT_S) -> Router:
        """Block until the router's GET /health is 200; fail with its log if never."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm-router exited with {self.proc.returncode}:\n"
                                   f"{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.kill()
        raise RuntimeError(f"vllm-router not healthy after {timeout}s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-4000:]

    def kill(self) -> None:
        """Stop the router and reap it."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=15)
        self._log.close()
