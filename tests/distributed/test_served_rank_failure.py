"""`kvrecover serve --tensor-parallel-size 2` behind `kvrecover proxy`: one rank killed
with SIGKILL mid-stream, the proxy migrates the request and the client gets exactly the
undisturbed output; the instance then answers /health with 503 (its rank reaped, no
orphan) and the proxy sends the next request to the next instance, exact again."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from conftest import build_tiny_model
from serving_utils import Process, add_chat_template, free_port, metric, serve

from kvrecover import LLM, SamplingParams

pytestmark = pytest.mark.slow  # separate processes

PROMPT = "the capital of france is paris and the capital of china is beijing. the capital of"
WAIT_S = 60.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return add_chat_template(build_tiny_model(tmp_path_factory.mktemp("tp_proxy_model"), seed=4))


def expected(model_dir, max_tokens: int) -> tuple[str, list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    with LLM(str(model_dir), device="cpu") as llm:
        output = llm.generate([PROMPT], params)[0].outputs[0]
    return output.text, output.token_ids


def rank_pids(instance: Process) -> list[int]:
    """The rank processes a served instance started (its children, by whichever of its
    threads started them)."""
    tasks = Path(f"/proc/{instance.proc.pid}/task")
    return sorted(int(pid) for task in tasks.iterdir()
                  for pid in (task / "children").read_text().split())


def stream_completion(url: str, max_tokens: int, on_first_token=None):
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream": True}
    text, token_ids, finish = [], [], None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=WAIT_S) as response:
        assert response.status_code == 200
        instance = response.headers["x-kvrecover-decode-instance"]
        for line in response.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text.append(choice["text"])
                token_ids.extend(choice["token_ids"])
                finish = choice["finish_reason"] or finish
                if on_first_token is not None:
                    on_first_token()
                    on_first_token = None
    return "".join(text), token_ids, finish, instance


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_killed_rank_is_failed_over_by_the_proxy_with_exact_output(model_dir, tmp_path):
    store = tmp_path / "kv"
    store.mkdir()

    def transfer(role: str) -> str:
        return json.dumps({"kv_connector": "SharedStorageConnector", "kv_role": role,
                           "kv_connector_extra_config": {"shared_storage_path": str(store)}})

    processes = []
    try:
        prefill = serve(tmp_path, model_dir, "--kv-transfer-config", transfer("kv_producer"),
                        name="prefill")
        processes.append(prefill)
        sharded = serve(tmp_path, model_dir, "--kv-transfer-config", transfer("kv_consumer"),
                        "--tensor-parallel-size", "2", name="sharded")
        processes.append(sharded)
        for process in (prefill, sharded):
            process.wait_healthy()
        port = free_port()
        proxy = Process(["proxy", "--prefill", prefill.url, "--decode", sharded.url,
                         "--port", str(port), "--health-check-interval", "600"],
                        port, tmp_path / "proxy.log")
        processes.append(proxy)
        proxy.wait_healthy()
        (rank_pid,) = rank_pids(sharded)
        max_tokens = 300
        want = expected(model_dir, max_tokens)

        text, token_ids, finish, instance = stream_completion(
            proxy.url, max_tokens, on_first_token=lambda: os.kill(rank_pid, signal.SIGKILL))
        assert instance == sharded.url and finish == "length"
        assert (text, token_ids) == want  # migrated to the prefill instance, token for token
        assert metric(proxy.url, "kvrecover_proxy_migrations_total",
                      f'instance="{sharded.url}",role="decode"') == 1

        wait_for(lambda: httpx.get(f"{sharded.url}/health", timeout=5).status_code == 503,
                 "the sharded instance's /health to answer 503")
        assert not Path(f"/proc/{rank_pid}").exists()  # reaped, not a zombie or an orphan
        assert rank_pids(sharded) == []

        text, token_ids, finish, instance = stream_completion(proxy.url, 8)
        assert instance == prefill.url
        assert (text, token_ids) == expected(model_dir, 8)
        # The migration marked the instance down: the proxy goes straight to the next one.
        assert metric(proxy.url, "kvrecover_proxy_instance_up",
                      f'instance="{sharded.url}",role="decode"') == 0
    finally:
        for process in processes:
            process.kill()
