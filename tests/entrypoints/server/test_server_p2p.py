"""P2P over the HTTP API, as vLLM serves it: a `kvrecover serve` producer (NixlConnector,
kv_producer) answers with the prompt's `kv_transfer_params` (top level of the body, or of
the streamed chunk with the finish reason); a consumer server given them in the request
body pulls the blocks and answers the token ids it answers without them. A malformed
reference is a 400 naming `kv_transfer_params`."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from conftest import build_tiny_model, require_nixl
from serving_utils import add_chat_template, free_port, metric, serve

pytestmark = pytest.mark.slow  # separate processes

require_nixl()

# Long enough for several full blocks of 8 tokens.
PROMPT = ("the quick brown fox jumps over the lazy dog and the capital of france is paris; "
          "disaggregated serving splits prefill from decode, and blocks move between them")
ENGINE = ("--device", "cpu", "--block-size", "8", "--num-kv-blocks", "128",
          "--served-model-name", "tiny")


def transfer(role: str, **extra) -> str:
    return json.dumps({"kv_connector": "NixlConnector", "kv_role": role,
                       "kv_connector_extra_config": extra})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return add_chat_template(build_tiny_model(tmp_path_factory.mktemp("p2p_model"), seed=3))


@pytest.fixture(scope="module")
def servers(model_dir, tmp_path_factory):
    """(producer, consumer): two servers on loopback, started together."""
    logs = tmp_path_factory.mktemp("p2p_logs")
    producer = serve(logs, model_dir, *ENGINE, "--kv-transfer-config",
                     transfer("kv_producer", side_channel_port=free_port(), lease_s=60),
                     name="producer")
    # No prefix caching on the consumer: each request with a reference pulls the whole
    # prompt, and its answer without one is computed from scratch.
    consumer = serve(logs, model_dir, *ENGINE, "--no-enable-prefix-caching",
                     "--kv-transfer-config",
                     transfer("kv_consumer", load_timeout_s=10), name="consumer")
    try:
        yield producer.wait_healthy(), consumer.wait_healthy()
    finally:
        producer.kill()
        consumer.kill()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def reference_of(url: str, prompt: str = PROMPT) -> dict:
    """A producer's reference for `prompt` (one prefill: max_tokens=1), via the SDK."""
    answer = client(url).completions.create(model="tiny", prompt=prompt, max_tokens=1,
                                            temperature=0)
    params = answer.model_extra["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_block_ids"], params
    return params


def greedy_ids(url: str, extra_body: dict | None = None) -> list[int]:
    answer = client(url).completions.create(
        model="tiny", prompt=PROMPT, max_tokens=8, temperature=0,
        extra_body={"return_token_ids": True, **(extra_body or {})})
    return answer.choices[0].model_extra["token_ids"]


def test_a_consumer_given_the_producers_reference_answers_the_same_tokens(servers):
    producer, consumer = servers
    want = greedy_ids(consumer.url)
    before = metric(consumer.url, "kvrecover_kv_nixl_pulled_blocks_total")
    params = reference_of(producer.url)
    assert greedy_ids(consumer.url, {"kv_transfer_params": params}) == want
    pulled = metric(consumer.url, "kvrecover_kv_nixl_pulled_blocks_total") - before
    assert pulled == len(params["remote_block_ids"])
    assert metric(consumer.url, "kvrecover_kv_load_failed_blocks_total") == 0
    # A second use of the same reference is refused by the producer (already released):
    # the blocks are recomputed, the answer is the same.
    assert greedy_ids(consumer.url, {"kv_transfer_params": params}) == want
    assert metric(consumer.url, "kvrecover_kv_load_failed_blocks_total") > 0


def test_chat_takes_and_gives_kv_transfer_params(servers):
    producer, consumer = servers
    messages = [{"role": "user", "content": PROMPT}]
    answer = client(producer.url).chat.completions.create(
        model="tiny", messages=messages, max_tokens=1, temperature=0)
    params = answer.model_extra["kv_transfer_params"]
    assert params["do_remote_prefill"] is True

    def chat(extra_body: dict) -> str | None:
        return client(consumer.url).chat.completions.create(
            model="tiny", messages=messages, max_tokens=6, temperature=0,
            extra_body=extra_body).choices[0].message.content

    want = chat({})
    assert chat({"kv_transfer_params": params}) == want


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streamed_answer_carries_kv_transfer_params_on_its_finish_chunk(servers, path):
    producer, _ = servers
    body = {"model": "tiny", "max_tokens": 3, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": PROMPT}]
    else:
        body["prompt"] = PROMPT
    chunks = []
    with httpx.stream("POST", producer.url + path, json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    carrying = [c for c in chunks if "kv_transfer_params" in c]
    assert len(carrying) == 1, chunks
    assert carrying[0]["choices"][0]["finish_reason"] is not None
    assert carrying[0]["kv_transfer_params"]["do_remote_prefill"] is True
    # The SDK sees it too.
    streamed = client(producer.url).completions.create(
        model="tiny", prompt=PROMPT, max_tokens=2, temperature=0, stream=True)
    last = [c for c in streamed if c.choices and c.choices[0].finish_reason][-1]
    assert last.model_extra["kv_transfer_params"]["remote_block_ids"]


def test_a_consumers_answer_has_no_kv_transfer_params(servers):
    _, consumer = servers
    answer = httpx.post(consumer.url + "/v1/completions", timeout=60, json={
        "prompt": PROMPT, "max_tokens": 2, "temperature": 0}).json()
    assert "kv_transfer_params" not in answer


@pytest.mark.parametrize("params, named", [
    ({"do_remote_prefill": True, "remote_port": "x"}, "kv_transfer_params."),
    ({"do_remote_prefill": True, "remote_engine_id": "e", "remote_request_id": "r",
      "remote_block_ids": [1], "remote_host": "127.0.0.1", "remote_port": "x", "tp_size": 1,
      "kv_fingerprint": "f"}, "kv_transfer_params.remote_port"),
    ("a string", "kv_transfer_params"),
])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_malformed_reference_is_a_400_naming_kv_transfer_params(servers, path, params, named):
    _, consumer = servers
    body = {"max_tokens": 2, "kv_transfer_params": params}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": PROMPT}]
    else:
        body["prompt"] = PROMPT
    response = httpx.post(consumer.url + path, json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "kv_transfer_params" and named in error["message"], error
    assert "x-kvrecover-ignored-fields" not in response.headers
    with pytest.raises(openai.BadRequestError):
        client(consumer.url).completions.create(
            model="tiny", prompt=PROMPT, max_tokens=2,
            extra_body={"kv_transfer_params": {"do_remote_prefill": True, "remote_port": "x"}})


def test_an_idle_producer_keeps_stepping_until_the_lease_ends(model_dir, tmp_path):
    """A producer whose only work is kept blocks keeps stepping (it serves pulls and lets
    leases end) while no request runs; that it does not spin meanwhile is
    test_engine_loop_sends.py's."""
    producer = serve(tmp_path, model_dir, *ENGINE, "--kv-transfer-config",
                     transfer("kv_producer", side_channel_port=free_port(), lease_s=1.5),
                     name="producer").wait_healthy()
    try:
        reference = reference_of(producer.url)  # kept, pulled by nobody
        assert metric(producer.url, "kvrecover_kv_cache_usage_ratio") > 0
        deadline = time.monotonic() + 15  # past the lease the engine loop's steps free them
        while metric(producer.url, "kvrecover_kv_cache_usage_ratio") > 0:
            assert time.monotonic() < deadline, "the lease never ended"
            time.sleep(0.1)
        # Counted as the lease frees them: every block the reference named.
        assert metric(producer.url, "kvrecover_kv_nixl_lease_freed_blocks_total") == \
            len(reference["remote_block_ids"])
        assert httpx.get(producer.url + "/health", timeout=10).status_code == 200
    finally:
        producer.kill()
