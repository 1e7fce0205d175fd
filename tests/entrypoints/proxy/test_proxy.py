"""`kvrecover proxy` in front of real prefill and decode processes: exact output,
failover before the first byte, migration after a SIGKILL mid-stream, prefill
instances decoding when no decode instance is left, a 503 when nothing is, and
health checks that mark instances down and back up."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest
from conftest import build_tiny_model
from serving_utils import Process, add_chat_template, free_port, metric, serve

from kvrecover import LLM, SamplingParams

pytestmark = pytest.mark.slow  # separate processes

PROMPT = "the capital of france is paris and the capital of china is beijing. the capital of"
WAIT_S = 60.0
KILL_ATTEMPTS = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return add_chat_template(build_tiny_model(tmp_path_factory.mktemp("proxy_model"), seed=4))


@pytest.fixture(scope="module")
def reference(model_dir):
    return LLM(str(model_dir))


def transfer(store, role: str) -> str:
    return json.dumps({"kv_connector": "SharedStorageConnector", "kv_role": role,
                       "kv_connector_extra_config": {"shared_storage_path": str(store)}})


class Cluster:
    """One prefill and two decode instances sharing a KV folder, and proxies."""

    def __init__(self, tmp, model_dir) -> None:
        self.tmp, self.model_dir = tmp, model_dir
        self.store = tmp / "kv"
        self.store.mkdir()
        self.processes: list[Process] = []
        self.prefill = self.spawn("kv_producer", "prefill")
        self.decode = [self.spawn("kv_consumer", f"decode{i}") for i in range(2)]
        for process in [self.prefill, *self.decode]:
            process.wait_healthy()

    def spawn(self, role: str, name: str, port: int | None = None) -> Process:
        process = serve(self.tmp, self.model_dir, "--kv-transfer-config",
                        transfer(self.store, role), name=name, port=port)
        self.processes.append(process)
        return process

    def proxy(self, health_interval: float, timeout: float = 30) -> Process:
        port = free_port()
        argv = ["proxy", "--prefill", self.prefill.url,
                "--decode", *[d.url for d in self.decode], "--port", str(port),
                "--health-check-interval", str(health_interval), "--timeout", str(timeout)]
        process = Process(argv, port, self.tmp / f"proxy-{port}.log")
        self.processes.append(process)
        return process.wait_healthy()

    def restart(self, process: Process) -> None:
        """A new decode instance in place of `process` (killed), on its port."""
        index = self.decode.index(process)
        self.decode[index] = self.spawn("kv_consumer", f"decode{index}-restarted",
                                        port=process.port).wait_healthy()

    def close(self) -> None:
        for process in self.processes:
            process.kill()


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    cluster = Cluster(tmp_path_factory.mktemp("cluster"), model_dir)
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def fresh_cluster(model_dir, tmp_path):
    cluster = Cluster(tmp_path, model_dir)
    try:
        yield cluster
    finally:
        cluster.close()


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def completion(url: str, max_tokens: int, stream: bool = False) -> tuple[str, list[int], str]:
    """Greedy completion of PROMPT through `url`: text, token ids, decode instance."""
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream": stream}
    if not stream:
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=WAIT_S)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        return choice["text"], choice["token_ids"], response.headers["x-kvrecover-decode-instance"]
    text, token_ids = [], []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=WAIT_S) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text.append(choice["text"])
                token_ids.extend(choice["token_ids"])
        instance = response.headers["x-kvrecover-decode-instance"]
    return "".join(text), token_ids, instance


def expected(reference, max_tokens: int):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    output = reference.generate([PROMPT], params)[0].outputs[0]
    return output.text, output.token_ids


def proxy_count(proxy: Process, name: str, instance: Process, role: str) -> float:
    return metric(proxy.url, f"kvrecover_proxy_{name}_total",
                  f'instance="{instance.url}",role="{role}"')


def read_stream(url: str, path: str, body: dict, on_open=None) -> tuple[dict, bool]:
    """Per choice index: text, token ids, logprobs joined, finish reason; and whether
    the stream ended with [DONE]."""
    choices: dict[int, dict] = {}
    done = False
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=WAIT_S) as response:
        assert response.status_code == 200
        if on_open is not None:
            on_open(response)
        for line in response.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                assert chunk["object"] == ("chat.completion.chunk" if "/chat/" in path
                                           else "text_completion")
                for choice in chunk["choices"]:
                    got = choices.setdefault(choice["index"], {
                        "text": [], "token_ids": [], "logprobs": [], "finish": None})
                    got["text"].append(choice["delta"]["content"] if "delta" in choice
                                       else choice["text"])
                    got["token_ids"].extend(choice["token_ids"])
                    if choice["logprobs"] is not None:
                        got["logprobs"].append(choice["logprobs"])
                    got["finish"] = choice["finish_reason"] or got["finish"]
    for got in choices.values():
        got["text"] = "".join(got["text"])
    return choices, done


def read_killing_the_decode(cluster, proxy: Process, read):
    """`read(on_open)`'s result and the decode instance `on_open(response)` SIGKILLed
    (the one of `cluster.decode` that `response` names), which the proxy must have
    migrated. On a busy machine the tiny model can send every token before the signal
    lands, leaving nothing to migrate: then `cluster.restart` starts the instance again
    on its port and the request is repeated, at most KILL_ATTEMPTS times."""
    killed: list[Process] = []

    def on_open(response) -> None:
        killed.append(next(d for d in cluster.decode
                           if d.url == response.headers["x-kvrecover-decode-instance"]))
        killed[-1].kill(signal.SIGKILL)

    for attempt in range(KILL_ATTEMPTS):
        before = sum(proxy_count(proxy, "migrations", d, "decode") for d in cluster.decode)
        result = read(on_open)
        assert len(killed) == attempt + 1, "the stream never opened"
        if sum(proxy_count(proxy, "migrations", d, "decode") for d in cluster.decode) > before:
            return result, killed[-1]
        cluster.restart(killed[-1])
    raise AssertionError(f"the decode instance sent its whole stream before its SIGKILL "
                         f"{KILL_ATTEMPTS} times: nothing was migrated")


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_prefill_then_decode_matches_generate(cluster, reference, model_dir):
    proxy = cluster.proxy(health_interval=1.0)
    want = expected(reference, 10)
    for stream in (False, True):
        text, token_ids, instance = completion(proxy.url, 10, stream)
        assert (text, token_ids) == want
        assert instance in [d.url for d in cluster.decode]
    external = sum(metric(d.url, "kvrecover_prompt_tokens_external_total")
                   for d in cluster.decode)
    assert external >= 16  # the decode instances loaded the prefill's KV
    assert proxy_count(proxy, "requests", cluster.prefill, "prefill") == 2

    messages = [{"role": "user", "content": "the capital of france is"}]
    ids = chat_prompt_ids(model_dir, messages)
    want_chat = reference.generate([{"prompt_token_ids": ids}],
                                   SamplingParams(temperature=0, max_tokens=6))[0].outputs[0]
    client = sdk(proxy.url)
    got = client.chat.completions.create(model=str(model_dir), messages=messages, max_tokens=6,
                                         temperature=0, extra_body={"return_token_ids": True})
    assert got.choices[0].message.content == want_chat.text
    assert got.choices[0].model_extra["token_ids"] == want_chat.token_ids
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=str(model_dir), messages=messages, max_tokens=6, temperature=0, stream=True)]
    assert "".join(pieces) == want_chat.text


def test_bad_request_is_passed_through_not_retried(cluster):
    proxy = cluster.proxy(health_interval=1.0)
    response = httpx.post(f"{proxy.url}/v1/completions", json={"prompt": "hi", "top_p": 7},
                          timeout=WAIT_S)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "top_p"
    bad_json = httpx.post(f"{proxy.url}/v1/completions", content=b"{oops", timeout=WAIT_S)
    assert bad_json.status_code == 400
    assert httpx.get(f"{proxy.url}/health", timeout=10).status_code == 200
    for decode in cluster.decode:
        assert proxy_count(proxy, "failovers", decode, "decode") == 0


def test_client_disconnect_through_the_proxy_frees_the_decode_request(cluster):
    proxy = cluster.proxy(health_interval=1.0)
    aborted = 'endpoint="completions",outcome="aborted"'

    def total_aborted() -> float:
        return sum(metric(d.url, "kvrecover_requests_total", aborted) for d in cluster.decode)

    def generated() -> float:
        return sum(metric(d.url, "kvrecover_generation_tokens_total")
                   for d in cluster.decode)

    before, generated_before = total_aborted(), generated()
    body = {"prompt": PROMPT, "max_tokens": 900, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{proxy.url}/v1/completions", json=body,
                      timeout=WAIT_S) as response:
        assert response.status_code == 200
        assert next(line for line in response.iter_lines() if line.startswith("data: "))
    wait_for(lambda: total_aborted() == before + 1, "the decode instance to abort")
    wait_for(lambda: all(metric(d.url, "kvrecover_num_requests_running") == 0
                         for d in cluster.decode), "the running count to return to 0")
    assert generated() - generated_before < 900  # stopped early, not run to length


def test_client_disconnect_of_a_non_streamed_request_aborts_it_upstream(cluster):
    """A client that leaves before a non-streamed answer: the proxy closes its
    upstream request, so the decode instance aborts it (running count back to 0)."""
    proxy = cluster.proxy(health_interval=1.0)
    aborted = 'endpoint="completions",outcome="aborted"'

    def total_aborted() -> float:
        return sum(metric(d.url, "kvrecover_requests_total", aborted) for d in cluster.decode)

    def running() -> float:
        return sum(metric(d.url, "kvrecover_num_requests_running") for d in cluster.decode)

    before = total_aborted()
    body = json.dumps({"prompt": PROMPT + " and", "max_tokens": 900, "temperature": 0,
                       "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=WAIT_S) as client:
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
                       b"content-type: application/json\r\n"
                       + f"content-length: {len(body)}\r\n\r\n".encode() + body)
        wait_for(lambda: running() == 1, "the decode instance to run the request")
    wait_for(lambda: total_aborted() == before + 1, "the decode instance to abort")
    wait_for(lambda: running() == 0, "the running count to return to 0")


def test_streamed_usage_through_the_proxy_only_with_include_usage(cluster, model_dir):
    proxy = cluster.proxy(health_interval=1.0)
    client = sdk(proxy.url)
    plain = list(client.completions.create(model=str(model_dir), prompt=PROMPT, max_tokens=5,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True}))
    assert plain and all(chunk.usage is None for chunk in plain)
    messages = [{"role": "user", "content": PROMPT}]
    calls = [lambda **kw: client.completions.create(prompt=PROMPT, **kw),
             lambda **kw: client.chat.completions.create(messages=messages, **kw)]
    for create in calls:
        chunks = list(create(model=str(model_dir), max_tokens=5, temperature=0, stream=True,
                             stream_options={"include_usage": True},
                             extra_body={"ignore_eos": True}))
        last = chunks[-1]
        assert last.choices == [] and last.usage.completion_tokens == 5
        assert last.usage.prompt_tokens > 0
        assert all(chunk.usage is None for chunk in chunks[:-1])
        assert chunks[-2].choices[0].finish_reason == "length"
    response = httpx.post(f"{proxy.url}/v1/completions", timeout=WAIT_S, json={
        "prompt": "hi", "stream_options": {"include_usage": True}})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "stream_options"


def test_failover_then_prefill_decodes_then_503_then_back_up(fresh_cluster, reference):
    cluster = fresh_cluster
    slow_checks = cluster.proxy(health_interval=600)  # sees failures only by trying
    fast_checks = cluster.proxy(health_interval=0.3)
    first, second = cluster.decode
    want = expected(reference, 8)

    first.kill(signal.SIGTERM)  # stopped before the request
    text, token_ids, instance = completion(slow_checks.url, 8)
    assert (text, token_ids, instance) == (*want, second.url)
    assert proxy_count(slow_checks, "failovers", first, "decode") == 1

    second.kill(signal.SIGTERM)  # no decode instance left: the prefill instance decodes
    text, token_ids, instance = completion(slow_checks.url, 8, stream=True)
    assert (text, token_ids, instance) == (*want, cluster.prefill.url)
    assert proxy_count(slow_checks, "failovers", second, "decode") == 1

    cluster.prefill.kill(signal.SIGTERM)  # nothing left: a clear 503
    for stream in (False, True):
        body = {"prompt": PROMPT, "max_tokens": 4, "stream": stream}
        response = httpx.post(f"{slow_checks.url}/v1/completions", json=body, timeout=WAIT_S)
        assert response.status_code == 503
        assert response.json()["error"]["type"] == "service_unavailable"
    assert metric(slow_checks.url, "kvrecover_proxy_unavailable_total") == 2

    wait_for(lambda: httpx.get(f"{fast_checks.url}/health", timeout=5).status_code == 503,
             "the health checks to mark every instance down")
    revived = cluster.spawn("kv_consumer", "decode0", port=first.port).wait_healthy()
    wait_for(lambda: metric(fast_checks.url, "kvrecover_proxy_instance_up",
                    f'instance="{revived.url}",role="decode"') == 1,
             "the health checks to mark the revived instance up")
    text, token_ids, instance = completion(fast_checks.url, 8)  # prefill down: decode computes
    assert (text, token_ids, instance) == (*want, revived.url)


def test_silent_decode_instance_times_out_and_fails_over(fresh_cluster, reference):
    cluster = fresh_cluster
    proxy = cluster.proxy(health_interval=600, timeout=2)
    first, second = cluster.decode
    first.proc.send_signal(signal.SIGSTOP)  # accepts connections, never answers
    try:
        for stream in (False, True):
            text, token_ids, instance = completion(proxy.url, 8, stream)
            assert (text, token_ids, instance) == (*expected(reference, 8), second.url)
        assert proxy_count(proxy, "failovers", first, "decode") == 2
    finally:
        first.proc.send_signal(signal.SIGCONT)


def chat_prompt_ids(model_dir, messages) -> list[int]:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(model_dir))
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return hf.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("endpoint,sampling", [("completions", "greedy"), ("chat", "greedy"),
                                               ("completions", "seeded"), ("chat", "seeded")])
def test_decode_killed_mid_stream_is_migrated_with_identical_tokens(fresh_cluster, reference,
                                                                     model_dir, endpoint,
                                                                     sampling):
    """Greedy, and seeded sampling (the continuation resumes the per-token seeds),
    continue token for token as if undisturbed."""
    cluster = fresh_cluster
    proxy = cluster.proxy(health_interval=600)
    max_tokens = 400
    knobs = {"temperature": 0} if sampling == "greedy" else \
        {"temperature": 0.9, "top_k": 30, "seed": 17}
    body = {"max_tokens": max_tokens, "ignore_eos": True, "return_token_ids": True,
            "stream": True, **knobs}
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **knobs)
    if endpoint == "chat":
        messages = [{"role": "user", "content": PROMPT}]
        body["messages"] = messages
        prompt = {"prompt_token_ids": chat_prompt_ids(model_dir, messages)}
    else:
        body["prompt"] = PROMPT
        prompt = PROMPT
    output = reference.generate([prompt], params)[0].outputs[0]
    want = (output.text, output.token_ids)
    if sampling == "seeded":
        greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        assert output.token_ids != reference.generate([prompt], greedy)[0].outputs[0].token_ids
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    (choices, done), serving = read_killing_the_decode(
        cluster, proxy, lambda on_open: read_stream(proxy.url, path, body, on_open))
    assert done and list(choices) == [0] and choices[0]["finish"] == "length"
    assert (choices[0]["text"], choices[0]["token_ids"]) == want
    assert proxy_count(proxy, "migrations", serving, "decode") == 1
    other = next(d for d in cluster.decode if d is not serving)
    assert 0 < metric(other.url, "kvrecover_generation_tokens_total") < max_tokens


def test_serve_demo_starts_everything_and_answers(model_dir, tmp_path):
    port = free_port()
    result = subprocess.run(
        [sys.executable, "-m", "kvrecover", "serve-demo", "--model", str(model_dir), "--once",
         "--port", str(port), "--workdir", str(tmp_path)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "decoded by http://127.0.0.1:" in result.stdout
    assert f"proxy     http://127.0.0.1:{port}" in result.stdout
    with pytest.raises(httpx.ConnectError):  # everything was stopped on the way out
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)


def test_kv_load_failed_on_a_decode_instance_fails_over(model_dir, tmp_path, reference):
    store = tmp_path / "kv"
    store.mkdir()
    failing = json.dumps({
        "kv_connector": "FaultInjectionConnector", "kv_role": "kv_consumer",
        "kv_load_failure_policy": "fail",
        "kv_connector_extra_config": {
            "inner_connector": "SharedStorageConnector", "shared_storage_path": str(store),
            "faults": [{"requests": "all", "blocks": "all", "kind": "missing"}]}})
    prefill = serve(tmp_path, model_dir, "--kv-transfer-config", transfer(store, "kv_producer"),
                    name="prefill")
    bad = serve(tmp_path, model_dir, "--kv-transfer-config", failing, name="bad")
    good = serve(tmp_path, model_dir, "--kv-transfer-config", transfer(store, "kv_consumer"),
                 name="good")
    processes = [prefill, bad, good]
    try:
        for process in processes:
            process.wait_healthy()
        port = free_port()
        proxy = Process(["proxy", "--prefill", prefill.url, "--decode", bad.url, good.url,
                         "--port", str(port), "--health-check-interval", "600"],
                        port, tmp_path / "proxy.log")
        processes.append(proxy)
        proxy.wait_healthy()
        for stream in (False, True):
            text, token_ids, instance = completion(proxy.url, 8, stream)
            assert (text, token_ids, instance) == (*expected(reference, 8), good.url)
        assert proxy_count(proxy, "failovers", bad, "decode") == 2
        assert metric(bad.url, "kvrecover_kv_load_failed_requests_total") == 2
    finally:
        for process in processes:
            process.kill()


@pytest.mark.parametrize("argv,message", [
    (["proxy"], "at least one --prefill or --decode URL"),
    (["proxy", "--decode", "http://127.0.0.1:1", "--max-retries", "-1"], "max_retries"),
])
def test_bad_serving_flags_are_clean_errors(capsys, argv, message):
    from kvrecover.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvrecover: error: ") and message in err


def test_bad_serve_engine_flags_are_argparse_errors(capsys):
    """serve parses engine flags like every other command (EngineArgs): usage + one line."""
    from kvrecover.cli import main

    with pytest.raises(SystemExit) as info:
        main(["serve", "--kv-transfer-config", "{oops"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "kvrecover serve: error: argument --kv-transfer-config" in err
    assert "not valid JSON" in err and "Traceback" not in err


def corrupting_relay(real: Process, keep: int, corrupt, vocab_size: int):
    """A decode instance that relays `real` (its /health too, so it reports the real
    vocab_size) but replaces the stream's event number `keep` by
    `corrupt(event, vocab_size)`."""
    from fake_upstream import FakeUpstream, Reply, sse

    def handler(method: str, path: str, body):
        if method == "GET":
            response = httpx.get(f"{real.url}{path}", timeout=WAIT_S)
            return Reply(response.status_code, response.content)
        events = []
        with httpx.stream("POST", f"{real.url}{path}", json=body, timeout=WAIT_S) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                if len(events) > keep:
                    break
        return sse(events[:keep] + [corrupt(json.loads(events[keep]), vocab_size)])

    return FakeUpstream(handler)


def with_first_choice(event: dict, key: str, value) -> str:
    event["choices"][0][key] = value
    return json.dumps(event)


@pytest.mark.parametrize("keep,corrupt", [
    (0, lambda event, vocab: "[1, 2]"),
    (3, lambda event, vocab: "null"),
    (0, lambda event, vocab: with_first_choice(event, "token_ids", [10**30])),
    (3, lambda event, vocab: with_first_choice(event, "token_ids", [vocab])),
    (3, lambda event, vocab: with_first_choice(event, "finish_reason", "length")),
], ids=["wrong shape first", "null mid-stream", "10**30 first", "vocab_size mid-stream",
        "early length"])
def test_an_instance_sending_invalid_events_is_failed_over_or_migrated(cluster, reference,
                                                                       model_dir, tmp_path,
                                                                       keep, corrupt):
    """Real instances behind the proxy, the first decode instance corrupting one event
    of a real stream: the client still gets the undisturbed output, streamed or not.
    `vocab_size` as a token id is caught only through the real server's /health."""
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    relay = corrupting_relay(cluster.decode[0], keep, corrupt, vocab_size)
    port = free_port()
    proxy = Process(["proxy", "--prefill", cluster.prefill.url, "--decode", relay.url,
                     *[d.url for d in cluster.decode], "--port", str(port),
                     "--health-check-interval", "0.2"], port, tmp_path / "proxy.log")
    try:
        proxy.wait_healthy()
        for stream in (False, True):
            wait_for(lambda: metric(proxy.url, "kvrecover_proxy_instance_up",
                                    f'instance="{relay.url}",role="decode"') == 1,
                     "the relay to be up")
            text, token_ids, _ = completion(proxy.url, 8, stream)
            assert (text, token_ids) == expected(reference, 8)
        assert relay.requests  # the relay was tried first, both times
    finally:
        proxy.kill()
        relay.close()
