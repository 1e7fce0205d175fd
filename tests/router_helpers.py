"""Helpers for the vllm-router tests: the real `vllm-router` binary (vLLM's P/D router)
on a free loopback port in front of `kvrecover serve` instances over NIXL, always killed."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
from serving_utils import Process, free_port, required_client_binary, serve

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


def producer(**extra) -> dict:
    """`nixl_transfer` arguments of a prefill instance: its own side channel port, a 60 s
    lease."""
    return {"role": "kv_producer", "side_channel_port": free_port(), "lease_s": 60, **extra}


def consumer(policy: str = "recompute", faulty: bool = False, **extra) -> dict:
    """`nixl_transfer` arguments of a decode instance (load_timeout_s 10)."""
    return {"role": "kv_consumer", "policy": policy, "faulty": faulty, "load_timeout_s": 10,
            **extra}


def serve_nixl(logs: Path, model_dir: Path, engine: tuple[str, ...],
               instances: dict[str, dict]) -> dict[str, Process]:
    """`kvrecover serve` instances by name, each with the NixlConnector of its
    `nixl_transfer` arguments (`producer()`, `consumer()`), all healthy; those started
    are killed if one fails to start."""
    processes = {}
    try:
        for name, transfer in instances.items():
            processes[name] = serve(logs, model_dir, *engine, "--kv-transfer-config",
                                    nixl_transfer(**transfer), name=name)
        for process in processes.values():
            process.wait_healthy()
    except BaseException:
        for process in processes.values():
            process.kill()
        raise
    return processes


def sdk(url: str) -> openai.OpenAI:
    """The official client for `url`, no retries."""
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def completion(url: str, stream: bool, max_tokens: int = 8,
               path: str = "/v1/completions") -> tuple[int, list[int], str]:
    """(status, token ids, error text) of a greedy request for PROMPT via `url` (a
    completion, or a chat at /v1/chat/completions); a streamed 200 must end in [DONE]."""
    request = {"model": "tiny", "max_tokens": max_tokens, "temperature": 0, "stream": stream,
               "return_token_ids": True, "ignore_eos": True}
    if path == "/v1/completions":
        request["prompt"] = PROMPT
    else:
        request["messages"] = [{"role": "user", "content": PROMPT}]
    with httpx.stream("POST", f"{url}{path}", json=request, timeout=60) as response:
        if response.status_code != 200:
            return response.status_code, [], response.read().decode()
        if not stream:
            return 200, json.loads(response.read())["choices"][0]["token_ids"], ""
        ids, done = streamed_token_ids(response)
        assert done, "a stream without [DONE]"
        return 200, ids, ""


def streamed_token_ids(response: httpx.Response) -> tuple[list[int], bool]:
    """The token ids of a streamed answer's choices, and whether it ended with [DONE]."""
    ids: list[int] = []
    done = False
    for line in response.iter_lines():
        if line == "data: [DONE]":
            done = True
        elif line.startswith("data: "):
            for choice in json.loads(line[6:])["choices"]:
                ids += choice.get("token_ids") or []
    return ids, done


def served_requests(url: str) -> float:
    """Generation requests `url` finished, whatever their endpoint and outcome."""
    lines = httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
    return sum(float(line.split()[-1]) for line in lines
               if line.startswith("kvrecover_requests_total{"))


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
