"""Helpers for the vllm-router tests: the real `vllm-router` binary (vLLM's P/D router)
on a free loopback port in front of `kvrecover serve` instances over NIXL, always killed."""

from __future__ import annotations

import json
from pathlib import Path

from serving_utils import Process, free_port, required_client_binary

# One prompt of several blocks, and the engine flags, of every P/D fleet in these tests.
PROMPT = ("the quick brown fox jumps over the lazy dog and the capital of france is paris; "
          "disaggregated serving splits prefill from decode, and blocks move between them")
ENGINE = ("--device", "cpu", "--block-size", "8", "--num-kv-blocks", "128",
          "--served-model-name", "tiny")
NO_PREFIX_CACHE = ("--no-enable-prefix-caching",)  # every pull reads the whole prompt
MISSING = ("vllm-router is not installed (scripts/setup_vllm_router.sh, which ./test.sh runs, "
           "installs it)")


def required_router_binary() -> Path:
    """The vllm-router executable (`required_client_binary`: a skip, or a failure
    under CI, without it)."""
    return required_client_binary("vllm-router", MISSING)


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
