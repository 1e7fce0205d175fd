"""A bug in one request's handler (issue #29): the client gets a 500 `internal_error` in
OpenAI's format (or, after a stream's 200, an error event), the engine request is
aborted, and the server goes on serving. The server runs in this process (uvicorn on
a thread, on 127.0.0.1), so that a handler can be made to fail."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
import uvicorn
from conftest import build_tiny_model
from serving_utils import add_chat_template, free_port

from kvrecover import LLM
from kvrecover.entrypoints.server.app import ServerConfig, build_app
from kvrecover.entrypoints.server.chat_template import ChatTemplate
from kvrecover.entrypoints.server.detokenizer import IncrementalDetokenizer
from kvrecover.entrypoints.server.engine_loop import EngineLoop

WAIT_S = 60.0
BODY = {"prompt": "the capital of france is", "max_tokens": 30, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model_dir = add_chat_template(build_tiny_model(tmp_path_factory.mktemp("errors_model"),
                                                   seed=3))
    loop = EngineLoop(lambda: LLM(str(model_dir)))
    loop.start(timeout=WAIT_S)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(loop, ServerConfig("tiny")),
                                           host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + WAIT_S
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", loop
    finally:
        server.should_exit = True
        thread.join(WAIT_S)
        loop.stop()


def completion(url: str, **changes) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={**BODY, **changes}, timeout=WAIT_S)


def wait_idle(loop: EngineLoop):
    """The loop's snapshot once no request is left running or waiting."""
    deadline = time.monotonic() + WAIT_S
    while True:
        snapshot = asyncio.run(loop.snapshot())
        if snapshot.num_running == snapshot.num_waiting == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert (snapshot.num_running, snapshot.num_waiting, snapshot.kv_cache_usage) == (0, 0, 0.0)
    return snapshot


def assert_idle_and_serving(url: str, loop: EngineLoop, token_ids: list[int]) -> None:
    wait_idle(loop)
    assert loop.alive and httpx.get(f"{url}/health", timeout=10).status_code == 200
    assert completion(url).json()["choices"][0]["token_ids"] == token_ids


def fail_after(calls: int):
    """An IncrementalDetokenizer.update that raises on its `calls`-th call."""
    real_update = IncrementalDetokenizer.update
    count = {"n": 0}

    def update(self, token_ids, final_text=None):
        count["n"] += 1
        if count["n"] == calls:
            raise RuntimeError("simulated detokenizer bug")
        return real_update(self, token_ids, final_text)
    return update


def test_a_failing_detokenizer_is_a_json_500_and_the_request_is_aborted(served, monkeypatch):
    url, loop = served
    want = completion(url).json()["choices"][0]["token_ids"]
    generated_before = asyncio.run(loop.snapshot()).stats["generation_tokens"]
    monkeypatch.setattr(IncrementalDetokenizer, "update", fail_after(3))
    response = completion(url)
    monkeypatch.undo()
    assert response.status_code == 500, response.text
    error = response.json()["error"]
    assert error["type"] == "internal_error"
    assert "simulated detokenizer bug" in error["message"]
    # Aborted on its third token, not run to max_tokens (30) for nobody.
    generated = wait_idle(loop).stats["generation_tokens"] - generated_before
    assert generated < 10
    assert_idle_and_serving(url, loop, want)


def test_a_stream_that_fails_after_its_200_ends_with_an_error_event(served, monkeypatch):
    url, loop = served
    want = completion(url).json()["choices"][0]["token_ids"]
    monkeypatch.setattr(IncrementalDetokenizer, "update", fail_after(3))
    with httpx.stream("POST", f"{url}/v1/completions", json={**BODY, "stream": True},
                      timeout=WAIT_S) as response:
        assert response.status_code == 200
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    monkeypatch.undo()
    assert "[DONE]" not in events
    last = json.loads(events[-1])
    assert last["error"]["type"] == "internal_error"
    assert "simulated detokenizer bug" in last["error"]["message"]
    assert_idle_and_serving(url, loop, want)


def test_a_failing_chat_template_is_a_json_500(served, monkeypatch):
    """Not the template rejecting the chat (a 400): the renderer itself breaking."""
    url, loop = served
    want = completion(url).json()["choices"][0]["token_ids"]

    def broken(self, messages, tools=None):
        raise TypeError("simulated renderer bug")

    monkeypatch.setattr(ChatTemplate, "prompt_token_ids", broken)
    response = httpx.post(f"{url}/v1/chat/completions", timeout=WAIT_S, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    monkeypatch.undo()
    assert response.status_code == 500, response.text
    assert response.json()["error"]["type"] == "internal_error"
    assert_idle_and_serving(url, loop, want)
