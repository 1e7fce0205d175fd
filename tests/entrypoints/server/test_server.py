"""`kvrecover serve` as a real process: OpenAI SDK clients get exactly what
`LLM.generate` produces; bad input is a 4xx; KV load failures are recomputed or,
under policy fail, an HTTP error of type kv_load_failed; disconnects free requests."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
from conftest import build_tiny_model
from serving_utils import add_chat_template, metric, serve, served

from kvrecover import LLM, KVTransferConfig, SamplingParams

pytestmark = pytest.mark.slow  # separate processes

PROMPTS = [
    "the quick brown fox jumps over the lazy dog. hello, my name is",
    "the capital of france is",
    "disaggregated serving splits prefill from decode; blocks fail, we",
]
LONG_PROMPT = ("the capital of france is paris and the capital of china is beijing. " * 3).strip()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return add_chat_template(build_tiny_model(tmp_path_factory.mktemp("serve_model"), seed=3))


@pytest.fixture(scope="module")
def reference(model_dir):
    return LLM(str(model_dir))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    with served(logs, model_dir, "--served-model-name", "tiny") as process:
        yield process


def client(url: str, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=kwargs.pop("api_key", "unused"),
                         max_retries=0, timeout=60, **kwargs)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens)


def stream_completion(sdk: openai.OpenAI, extra_body: dict | None = None,
                      **kwargs) -> tuple[str, list[int], str]:
    text, token_ids, finish = [], [], None
    extra_body = {**(extra_body or {}), "return_token_ids": True}
    for chunk in sdk.completions.create(stream=True, extra_body=extra_body, **kwargs):
        choice = chunk.choices[0]
        text.append(choice.text)
        token_ids.extend(choice.model_extra["token_ids"])
        finish = choice.finish_reason or finish
    return "".join(text), token_ids, finish


def test_completions_match_generate(server, reference):
    sdk = client(server.url)
    expected = reference.generate(PROMPTS, greedy(12))
    for prompt, want in zip(PROMPTS, expected):
        got = sdk.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                     extra_body={"return_token_ids": True})
        choice = got.choices[0]
        assert choice.model_extra["token_ids"] == want.outputs[0].token_ids
        assert choice.model_extra["prompt_token_ids"] == want.prompt_token_ids
        assert choice.text == want.outputs[0].text
        assert choice.finish_reason == want.outputs[0].finish_reason
        assert got.usage.completion_tokens == len(want.outputs[0].token_ids)

        text, token_ids, finish = stream_completion(sdk, model="tiny", prompt=prompt,
                                                    max_tokens=12, temperature=0)
        assert (text, token_ids, finish) == (want.outputs[0].text, want.outputs[0].token_ids,
                                             want.outputs[0].finish_reason)


def test_token_id_prompt_and_seeded_sampling_match_generate(server, reference):
    sdk = client(server.url)
    ids = reference.get_tokenizer().encode(PROMPTS[0])
    params = SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=10, ignore_eos=True)
    want = reference.generate([{"prompt_token_ids": ids}], params)[0].outputs[0].token_ids
    got = sdk.completions.create(model="tiny", prompt=ids, max_tokens=10, temperature=0.8,
                                 seed=7, extra_body={"top_k": 20, "ignore_eos": True,
                                                     "return_token_ids": True})
    assert got.choices[0].model_extra["token_ids"] == want


def test_resumed_seeded_request_continues_the_undisturbed_samples(server, reference):
    """What the proxy sends after a migration: prompt + the k tokens already sent,
    `resumed_output_tokens=k`, the same seed: the rest of the undisturbed sample."""
    sdk = client(server.url)
    ids = reference.get_tokenizer().encode(PROMPTS[2])
    params = SamplingParams(temperature=0.9, top_k=30, seed=5, max_tokens=12, ignore_eos=True)
    want = reference.generate([{"prompt_token_ids": ids}], params)[0].outputs[0].token_ids
    for k in (3, 8):
        got = sdk.completions.create(model="tiny", prompt=ids + want[:k], max_tokens=12 - k,
                                     temperature=0.9, seed=5, extra_body={
                                         "top_k": 30, "ignore_eos": True,
                                         "return_token_ids": True, "resumed_output_tokens": k})
        assert got.choices[0].model_extra["token_ids"] == want[k:]


def test_chat_matches_generate(server, reference, model_dir):
    from transformers import AutoTokenizer

    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": "the capital of france is"}]
    hf = AutoTokenizer.from_pretrained(str(model_dir))
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt_ids = hf.encode(text, add_special_tokens=False)
    want = reference.generate([{"prompt_token_ids": prompt_ids}], greedy(10))[0].outputs[0]
    sdk = client(server.url)
    got = sdk.chat.completions.create(model="tiny", messages=messages, max_tokens=10,
                                      temperature=0, extra_body={"return_token_ids": True})
    assert got.model_extra["prompt_token_ids"] == prompt_ids
    assert got.choices[0].model_extra["token_ids"] == want.token_ids
    assert got.choices[0].message.content == want.text
    assert got.choices[0].message.role == "assistant"

    pieces, token_ids, roles = [], [], []
    for chunk in sdk.chat.completions.create(model="tiny", messages=messages, max_tokens=10,
                                             temperature=0, stream=True,
                                             extra_body={"return_token_ids": True}):
        pieces.append(chunk.choices[0].delta.content or "")
        roles.append(chunk.choices[0].delta.role)
        token_ids.extend(chunk.choices[0].model_extra["token_ids"])
    assert "".join(pieces) == want.text
    assert token_ids == want.token_ids
    assert roles[0] == "assistant"


def test_streamed_usage_only_with_include_usage(server, model_dir):
    """OpenAI's (and vLLM's) rule: no usage in any chunk unless
    `stream_options.include_usage`, which adds a last chunk with no choices."""
    sdk = client(server.url)
    messages = [{"role": "user", "content": PROMPTS[1]}]
    calls = {"completions": lambda **kw: sdk.completions.create(prompt=PROMPTS[1], **kw),
             "chat": lambda **kw: sdk.chat.completions.create(messages=messages, **kw)}
    for endpoint, create in calls.items():
        plain = list(create(model="tiny", max_tokens=5, temperature=0, stream=True,
                            extra_body={"ignore_eos": True}))
        assert plain and all(chunk.usage is None for chunk in plain), endpoint
        assert plain[-1].choices[0].finish_reason == "length"

        chunks = list(create(model="tiny", max_tokens=5, temperature=0, stream=True,
                             stream_options={"include_usage": True},
                             extra_body={"ignore_eos": True}))
        last = chunks[-1]
        assert last.choices == [] and last.usage is not None, endpoint
        assert last.usage.completion_tokens == 5
        assert last.usage.total_tokens == last.usage.prompt_tokens + 5
        assert all(chunk.usage is None for chunk in chunks[:-1])
        assert chunks[-2].choices[0].finish_reason == "length"

        continuous = list(create(model="tiny", max_tokens=5, temperature=0, stream=True,
                                 stream_options={"include_usage": True,
                                                 "continuous_usage_stats": True},
                                 extra_body={"ignore_eos": True}))
        assert [c.usage.completion_tokens for c in continuous if c.choices][-1] == 5
        assert continuous[-1].choices == [] and continuous[-1].usage.completion_tokens == 5

    response = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "prompt": "hi", "stream_options": {"include_usage": True}})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "stream_options"


def test_stop_string_truncates_and_is_never_streamed(server, reference):
    want = reference.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=16,
                                                           ignore_eos=True))[0].outputs[0]
    stop = want.text[len(want.text) // 2:][:3]
    assert stop and stop in want.text
    expected = want.text[:want.text.find(stop)]
    sdk = client(server.url)
    got = sdk.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=16, temperature=0,
                                 stop=[stop], extra_body={"ignore_eos": True})
    assert got.choices[0].text == expected
    assert got.choices[0].finish_reason == "stop"
    text, _, finish = stream_completion(sdk, model="tiny", prompt=PROMPTS[0], max_tokens=16,
                                        temperature=0, stop=stop,
                                        extra_body={"ignore_eos": True})
    assert (text, finish) == (expected, "stop")


def test_concurrent_clients_get_the_same_tokens_as_one_at_a_time(server):
    prompts = [f"{PROMPTS[i % 3]} {i}" for i in range(16)]
    sdk = client(server.url)

    def run(prompt: str) -> list[int]:
        got = sdk.completions.create(model="tiny", prompt=prompt, max_tokens=12,
                                     temperature=0, extra_body={"return_token_ids": True,
                                                                "ignore_eos": True})
        return got.choices[0].model_extra["token_ids"]

    sequential = [run(p) for p in prompts]
    concurrent: dict[int, list[int]] = {}
    threads = [threading.Thread(target=lambda i=i: concurrent.__setitem__(i, run(prompts[i])))
               for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert [concurrent.get(i) for i in range(16)] == sequential


MALFORMED = [
    ("/v1/completions", b"{not json", 400),
    ("/v1/completions", b"[1, 2]", 400),
    ("/v1/completions", json.dumps({"max_tokens": 4}).encode(), 400),
    ("/v1/completions", json.dumps({"prompt": "hi", "model": "gpt-9"}).encode(), 404),
    ("/v1/completions", json.dumps({"prompt": "hi", "max_tokens": "four"}).encode(), 400),
    ("/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 0}).encode(), 400),
    ("/v1/completions", json.dumps({"prompt": "hi", "temperature": -1}).encode(), 400),
    ("/v1/completions", json.dumps({"prompt": "hi", "top_p": 0}).encode(), 400),
    ("/v1/completions", json.dumps({"prompt": "hi", "top_k": 0}).encode(), 400),
    ("/v1/completions", json.dumps({"prompt": "hi", "n": 17}).encode(), 400),  # above MAX_N
    ("/v1/completions", json.dumps({"prompt": "", "max_tokens": 2}).encode(), 400),
    ("/v1/completions", json.dumps({"prompt": [1, 99999]}).encode(), 400),
    ("/v1/completions", json.dumps({"prompt": ["a", "b"]}).encode(), 400),
    ("/v1/completions", json.dumps({"prompt": "word " * 2000}).encode(), 400),  # > max_model_len
    ("/v1/completions", json.dumps({"prompt": "word " * 2000, "stream": True}).encode(), 400),
    ("/v1/completions", b'{"prompt": "' + b"x" * (5 << 20) + b'"}', 413),
    ("/v1/chat/completions", json.dumps({"messages": []}).encode(), 400),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "wizard",
                                                       "content": "hi"}]}).encode(), 400),
    ("/v1/chat/completions", json.dumps({"messages": "hi"}).encode(), 400),
    ("/v1/nothing", b"{}", 404),
]


@pytest.mark.parametrize("path,body,status", MALFORMED)
def test_malformed_requests_get_their_4xx_and_the_server_stays_up(server, path, body, status):
    response = httpx.post(f"{server.url}{path}", content=body, timeout=60,
                          headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"] and error["code"]
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_models_and_metrics(server):
    models = client(server.url).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    for name in ("kvrecover_num_requests_running", "kvrecover_num_requests_waiting",
                 "kvrecover_kv_cache_usage_ratio", "kvrecover_time_to_first_token_seconds",
                 "kvrecover_time_per_output_token_seconds", "kvrecover_e2e_request_latency_seconds",
                 "kvrecover_kv_load_failed_blocks_total"):
        assert name in text


def test_client_disconnect_mid_stream_aborts_the_request(server):
    aborted_before = metric(server.url, "kvrecover_requests_total",
                            'endpoint="completions",outcome="aborted"')
    generated_before = metric(server.url, "kvrecover_generation_tokens_total")
    body = {"prompt": PROMPTS[1], "max_tokens": 1000, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if metric(server.url, "kvrecover_num_requests_running") == 0 and metric(
                server.url, "kvrecover_requests_total",
                'endpoint="completions",outcome="aborted"') == aborted_before + 1:
            break
        time.sleep(0.1)
    assert metric(server.url, "kvrecover_num_requests_running") == 0
    assert metric(server.url, "kvrecover_num_requests_waiting") == 0
    assert metric(server.url, "kvrecover_requests_total",
                  'endpoint="completions",outcome="aborted"') == aborted_before + 1
    generated = metric(server.url, "kvrecover_generation_tokens_total")
    assert generated - generated_before < 1000  # stopped early, not run to length
    assert metric(server.url, "kvrecover_kv_cache_usage_ratio") == 0


def test_api_key_is_required_on_v1(model_dir, tmp_path):
    process = serve(tmp_path, model_dir, env={"KVRECOVER_API_KEY": "sesame"})
    try:
        process.wait_healthy()
        denied = httpx.post(f"{process.url}/v1/completions", json={"prompt": "hi"}, timeout=30)
        assert denied.status_code == 401
        assert denied.json()["error"]["type"] == "authentication_error"
        with pytest.raises(openai.AuthenticationError):
            client(process.url, api_key="wrong").models.list()
        got = client(process.url, api_key="sesame").completions.create(
            model=str(model_dir), prompt="hi", max_tokens=2, temperature=0)
        assert got.choices[0].finish_reason in ("length", "stop")
        assert httpx.get(f"{process.url}/health", timeout=10).status_code == 200
    finally:
        process.kill()


# ----- KV loads through a fault-injecting connector ------------------------------------
def fault_config(store, policy: str) -> str:
    return json.dumps({
        "kv_connector": "FaultInjectionConnector", "kv_role": "kv_consumer",
        "kv_load_failure_policy": policy,
        "kv_connector_extra_config": {
            "inner_connector": "SharedStorageConnector", "shared_storage_path": str(store),
            "faults": [{"requests": "all", "blocks": "all", "kind": "missing"}]},
    })


@pytest.fixture(scope="module")
def stored_kv(model_dir, tmp_path_factory):
    """The KV of LONG_PROMPT stored by a producer, and its undisturbed greedy output."""
    store = tmp_path_factory.mktemp("kv_store")
    producer = LLM(str(model_dir), kv_transfer_config=KVTransferConfig(
        "SharedStorageConnector", "kv_producer", {"shared_storage_path": str(store)}))
    output = producer.generate([LONG_PROMPT], greedy(8))[0].outputs[0]
    assert any(store.iterdir())
    return store, output


@pytest.mark.parametrize("stream", [False, True])
def test_kv_load_failure_recompute_gives_identical_output(model_dir, stored_kv, tmp_path, stream):
    store, want = stored_kv
    process = serve(tmp_path, model_dir, "--kv-transfer-config", fault_config(store, "recompute"))
    try:
        sdk = client(process.wait_healthy().url)
        if stream:
            text, token_ids, _ = stream_completion(sdk, model=str(model_dir), prompt=LONG_PROMPT,
                                                   max_tokens=8, temperature=0)
        else:
            choice = sdk.completions.create(model=str(model_dir), prompt=LONG_PROMPT,
                                            max_tokens=8, temperature=0,
                                            extra_body={"return_token_ids": True}).choices[0]
            text, token_ids = choice.text, choice.model_extra["token_ids"]
        assert (text, token_ids) == (want.text, want.token_ids)
        assert metric(process.url, "kvrecover_kv_load_failed_blocks_total") > 0
        assert metric(process.url, "kvrecover_kv_load_recovered_requests_total") == 1
    finally:
        process.kill()


def test_kv_load_failure_policy_fail_is_an_http_error(model_dir, stored_kv, tmp_path):
    store, _ = stored_kv
    process = serve(tmp_path, model_dir, "--kv-transfer-config", fault_config(store, "fail"))
    try:
        url = process.wait_healthy().url
        for stream in (False, True):
            body = {"prompt": LONG_PROMPT, "max_tokens": 8, "temperature": 0, "stream": stream}
            response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            assert response.status_code == 503, response.text
            assert response.json()["error"]["type"] == "kv_load_failed"
        with pytest.raises(openai.APIStatusError) as info:
            client(url).completions.create(model=str(model_dir), prompt=LONG_PROMPT,
                                           max_tokens=8, temperature=0, stream=True)
        assert info.value.status_code == 503
        assert info.value.body["type"] == "kv_load_failed"
        assert metric(url, "kvrecover_kv_load_failed_requests_total") == 3
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    finally:
        process.kill()


# Outputs of the tiny model holding unusual characters: control characters and U+FFFD
# (bytes that are no UTF-8), and with NUL-token bias (190 is byte 0x00) runs of NULs.
UNUSUAL_OUTPUTS = [
    {"prompt": PROMPTS[0]},
    {"prompt": PROMPTS[0], "logit_bias": {"190": 1.2},
     "allowed_token_ids": [363, 71, 274, 326, 244, 380, 11, 80, 260, 288, 190, 138, 225]},
]


@pytest.mark.parametrize("extra", UNUSUAL_OUTPUTS, ids=["plain", "nul"])
def test_stop_strings_cut_from_the_output_match_whatever_they_hold(server, extra):
    """Every substring of 1-4 characters of a 30-token output, as a stop string, gives
    the output up to its first occurrence (streamed and not), and a prefix of its tokens."""
    sdk = client(server.url)
    body = {"model": "tiny", "max_tokens": 30, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **extra}
    whole = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    text, token_ids = whole["choices"][0]["text"], whole["choices"][0]["token_ids"]
    assert len(token_ids) == 30 and "\ufffd" in text
    assert "\x00" in text or extra is UNUSUAL_OUTPUTS[0]
    stops = sorted({text[i:i + n] for n in range(1, 5) for i in range(len(text) - n + 1)})
    fields = {k: v for k, v in body.items() if k not in ("model", "prompt", "max_tokens",
                                                         "temperature", "return_token_ids")}
    for stop in stops:
        want = text[:text.find(stop)]
        got = sdk.completions.create(model="tiny", prompt=extra["prompt"], max_tokens=30,
                                     temperature=0, stop=[stop], extra_body=fields)
        choice = got.choices[0]
        assert (choice.text, choice.finish_reason) == (want, "stop"), repr(stop)
        streamed = stream_completion(sdk, model="tiny", prompt=extra["prompt"], max_tokens=30,
                                     temperature=0, stop=[stop], extra_body=fields)
        assert streamed[::2] == (want, "stop"), repr(stop)
        assert streamed[1] == token_ids[:len(streamed[1])] and streamed[1], repr(stop)
