"""Helpers for the vllm-router tests: the real `vllm-router` binary (vLLM's P/D router)
on a free loopback port in front of `kvrecover serve` instances over NIXL, always killed."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from serving_utils import Process, free_port

# One prompt of several blocks, and the engine flags, of every P/D fleet in these tests.
PROMPT = ("the quick brown fox jumps over the lazy dog and the capital of france is paris; "
          "disaggregated serving splits prefill from decode, and blocks move between them")
ENGINE = ("--device", "cpu", "--block-size", "8", "--num-kv-blocks", "128",
          "--served-model-name", "tiny")
NO_PREFIX_CACHE = ("--no-enable-prefix-caching",)  # every pull reads the whole prompt
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


class Router(Process):
    """One `vllm-router --vllm-pd-disaggregation` process in front of `prefill` and
    `decode` URLs, round robin on both sides, listening on `url`."""

    def __init__(self, binary: Path, prefill: list[str], decode: list[str], log_path: Path,
                 *extra: str):
        port = free_port()
        argv = ["--vllm-pd-disaggregation", "--host", "127.0.0.1", "--port", str(port),
                "--prometheus-port", str(free_port()), "--policy", "round_robin",
                "--log-level", "debug", *extra]
        for url in prefill:
            argv += ["--prefill", url]
        for url in decode:
            argv += ["--decode", url]
        super().__init__(argv, port, log_path, program=[str(binary)])
