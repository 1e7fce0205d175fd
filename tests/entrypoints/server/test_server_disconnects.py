"""Clients of `kvrecover serve` that leave (issue #29): a request whose client closed
the connection is aborted within a step, streamed or not, and memory stays flat over
many rounds of such clients. Real HTTP clients on 127.0.0.1: a raw socket that closes
right after sending its request."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from conftest import build_tiny_model
from serving_utils import (
    add_chat_template,
    long_request,
    metric,
    request_bytes,
    serve,
    wait_until_idle,
)

pytestmark = pytest.mark.slow  # a separate server process

MAX_TOKENS = 1000  # what a request left running would generate (max_model_len is 1024)
# Tokens a request may still generate after its client left: the steps until the
# server notices and the engine thread takes the abort (one step, plus slack for a
# loaded machine). Left running, it would be MAX_TOKENS.
MAX_TOKENS_AFTER_LEAVING = 60


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return add_chat_template(build_tiny_model(tmp_path_factory.mktemp("leave_model"), seed=3))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    process = serve(tmp_path_factory.mktemp("logs"), model_dir)
    try:
        process.wait_healthy()
        # The first chat request loads the chat template (seconds): done here, so that a
        # client leaving at once is not still in its handler when the next test starts.
        chat = long_request("/v1/chat/completions", stream=False, max_tokens=1)
        assert httpx.post(f"{process.url}/v1/chat/completions", json=chat,
                          timeout=120).status_code == 200
        yield process
    finally:
        process.kill()


def send_and_leave(url: str, port: int, path: str, body: dict, when: str) -> float:
    """Send one request on a raw socket and close it: at once, once the server runs
    it, or once the first bytes of the answer arrived (`when`). Returns the server's
    generated-token count just before the close."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(request_bytes(port, path, body))
        if when == "once-running":
            deadline = time.monotonic() + 60
            while metric(url, "kvrecover_num_requests_running") == 0:
                assert time.monotonic() < deadline, "the request never started"
                time.sleep(0.01)
        elif when == "mid-stream":
            assert sock.recv(1)
        generated = metric(url, "kvrecover_generation_tokens_total")
    return generated


def aborted(url: str, endpoint: str) -> float:
    return metric(url, "kvrecover_requests_total", f'endpoint="{endpoint}",outcome="aborted"')


# (stream, when the client leaves); a non-streamed answer has no bytes before it is
# complete, and a client that leaves at once may be gone before its body is read.
LEAVING = {"not-streamed-at-once": (False, "at-once"),
           "not-streamed-once-running": (False, "once-running"),
           "streamed-at-once": (True, "at-once"),
           "streamed-mid-stream": (True, "mid-stream")}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stream, when", LEAVING.values(), ids=LEAVING.keys())
def test_a_client_that_leaves_is_aborted_within_a_step(server, path, stream, when):
    endpoint = "completions" if path == "/v1/completions" else "chat"
    wait_until_idle(server.url)
    aborted_before = aborted(server.url, endpoint)
    generated_before = metric(server.url, "kvrecover_generation_tokens_total")
    generated_at_leaving = send_and_leave(server.url, server.port, path,
                                          long_request(path, stream, MAX_TOKENS), when)
    wait_until_idle(server.url)
    generated = metric(server.url, "kvrecover_generation_tokens_total")
    assert generated - generated_before < MAX_TOKENS  # not run to length
    assert generated - generated_at_leaving < MAX_TOKENS_AFTER_LEAVING, \
        f"{generated - generated_at_leaving} tokens after the client left"
    if when != "at-once":  # it reached the engine: it must count as aborted
        deadline = time.monotonic() + 10
        while aborted(server.url, endpoint) == aborted_before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert aborted(server.url, endpoint) == aborted_before + 1
    assert metric(server.url, "kvrecover_kv_cache_usage_ratio") == 0
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_clients_that_stay_get_their_whole_answer(server):
    """The disconnect watch never takes a client that stays for one that left."""
    for stream in (False, True):
        body = long_request("/v1/completions", stream, max_tokens=40)
        with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60,
                          json=body) as response:
            assert response.status_code == 200
            text = b"".join(response.iter_bytes()).decode()
        if stream:
            chunks = [json.loads(line[6:]) for line in text.splitlines()
                      if line.startswith("data: {")]
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
            assert text.rstrip().endswith("data: [DONE]")
        else:
            assert json.loads(text)["usage"]["completion_tokens"] == 40
