"""Migration with a grammar (issue 27): a decode instance SIGKILLed mid-stream while a
JSON schema (or a tool_choice that forces one) is active; the instance that continues
replays the tokens already sent through a fresh matcher, so the client's stream equals
the undisturbed one and parses."""

from __future__ import annotations

import json

import httpx
import pytest
from structured_helpers import schema_errors
from test_proxy import (  # noqa: F401
    WAIT_S,
    chat_prompt_ids,
    fresh_cluster,
    model_dir,
    read_killing_the_decode,
    reference,
)

from kvrecover import SamplingParams
from kvrecover.structured.params import StructuredOutputsParams

pytestmark = pytest.mark.slow  # separate processes

# Long enough (about 130 tokens) that the kill lands mid-stream; bounded, so random
# weights complete it.
SCORES_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "pattern": "^[a-z]{3,6}$"},
                   "scores": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                         "maximum": 9},
                              "minItems": 40, "maxItems": 40}},
    "required": ["name", "scores"], "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "record", "parameters": SCORES_SCHEMA}}]
PROMPT = "the capital of france is paris and the capital of china is beijing. the capital of"


def stream_through(cluster, path: str, body: dict):
    """(text or argument text, token ids, finish reason, proxy, the decode instance
    killed): the client's stream, the decode instance SIGKILLed as soon as it starts."""
    proxy = cluster.proxy(health_interval=600)

    def read(on_open):
        text, token_ids, finish = [], [], None
        with httpx.stream("POST", f"{proxy.url}{path}", json=body, timeout=WAIT_S) as response:
            assert response.status_code == 200, response.read()
            on_open(response)
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                choice = json.loads(line[6:])["choices"][0]
                if "delta" in choice:
                    for call in choice["delta"].get("tool_calls") or []:
                        assert call["index"] == 0
                        text.append(call["function"].get("arguments") or "")
                else:
                    text.append(choice["text"])
                token_ids.extend(choice["token_ids"])
                finish = choice["finish_reason"] or finish
        return "".join(text), token_ids, finish

    (text, token_ids, finish), serving = read_killing_the_decode(cluster, proxy, read)
    return text, token_ids, finish, proxy, serving


def test_a_json_schema_completion_migrates_exactly(fresh_cluster, reference):  # noqa: F811
    spec = StructuredOutputsParams(json=SCORES_SCHEMA)
    want = reference.generate([PROMPT], SamplingParams(
        temperature=0, max_tokens=300, structured_outputs=spec))[0].outputs[0]
    body = {"prompt": PROMPT, "max_tokens": 300, "temperature": 0, "stream": True,
            "return_token_ids": True,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "scores", "schema": SCORES_SCHEMA}}}
    text, token_ids, finish, proxy, serving = stream_through(fresh_cluster, "/v1/completions",
                                                             body)
    assert (text, token_ids, finish) == (want.text, want.token_ids, "stop")
    assert schema_errors(json.loads(text), SCORES_SCHEMA) == []
    assert_migrated(fresh_cluster, proxy, serving)


def test_a_forced_tool_call_migrates_exactly(fresh_cluster, reference, model_dir):  # noqa: F811
    messages = [{"role": "user", "content": PROMPT}]
    spec = StructuredOutputsParams(json=SCORES_SCHEMA)
    prompt = {"prompt_token_ids": chat_prompt_ids(model_dir, messages)}
    want = reference.generate([prompt], SamplingParams(
        temperature=0, max_tokens=300, structured_outputs=spec))[0].outputs[0]
    body = {"messages": messages, "tools": TOOLS, "max_tokens": 300, "temperature": 0,
            "tool_choice": {"type": "function", "function": {"name": "record"}},
            "stream": True, "return_token_ids": True}
    arguments, token_ids, finish, proxy, serving = stream_through(
        fresh_cluster, "/v1/chat/completions", body)
    assert (arguments, token_ids, finish) == (want.text, want.token_ids, "tool_calls")
    assert schema_errors(json.loads(arguments), SCORES_SCHEMA) == []
    assert_migrated(fresh_cluster, proxy, serving)


def assert_migrated(cluster, proxy, serving) -> None:
    from serving_utils import metric

    assert metric(proxy.url, "kvrecover_proxy_migrations_total",
                  f'instance="{serving.url}",role="decode"') == 1
    other = next(d for d in cluster.decode if d is not serving)
    assert metric(other.url, "kvrecover_generation_tokens_total") > 0


def test_auto_tool_calls_through_the_proxy_use_the_instances_parser(tmp_path):
    """The proxy asks for the raw text and parses it with the parser the instance names."""
    from conftest import build_tiny_model
    from serving_utils import Process, free_port, in_process_server
    from structured_helpers import CALL_TEXT, HERMES_TEMPLATE, MESSAGES, with_template
    from structured_helpers import TOOLS as WEATHER_TOOLS

    qwen_dir = with_template(build_tiny_model(tmp_path / "qwen", model_type="qwen2", seed=2),
                              HERMES_TEMPLATE)
    force = {"structured_outputs": {"choice": [CALL_TEXT["hermes"]]}}
    body = {"messages": MESSAGES, "tools": WEATHER_TOOLS, "max_tokens": 200, "temperature": 0,
            **force}
    with in_process_server(qwen_dir) as url:
        port = free_port()
        proxy = Process(["proxy", "--decode", url, "--port", str(port)], port,
                        tmp_path / "proxy.log").wait_healthy()
        try:
            direct = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=WAIT_S).json()
            proxied = httpx.post(f"{proxy.url}/v1/chat/completions", json=body,
                                 timeout=WAIT_S).json()
            with httpx.stream("POST", f"{proxy.url}/v1/chat/completions", timeout=WAIT_S,
                              json={**body, "stream": True}) as response:
                events = [json.loads(line[6:]) for line in response.iter_lines()
                          if line.startswith("data: {")]
        finally:
            proxy.kill()
    want = direct["choices"][0]
    assert want["finish_reason"] == "tool_calls"
    got = proxied["choices"][0]
    assert got["finish_reason"] == "tool_calls" and got["message"]["content"] is None
    strip = [{**call, "id": None} for call in want["message"]["tool_calls"]]
    assert [{**call, "id": None} for call in got["message"]["tool_calls"]] == strip
    deltas = [call for event in events for call in
              event["choices"][0]["delta"].get("tool_calls") or []]
    assert [(d["function"]["name"], d["function"]["arguments"]) for d in deltas] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in strip]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_json_schema_with_logprobs_penalties_and_n_migrates_exactly(
        fresh_cluster, reference):  # noqa: F811
    """Both choices of a seeded n=2 request under a JSON schema, with logprobs and the
    three penalties, give the undisturbed stream when their decode instance is killed:
    each choice's continuation replays its tokens through its own matcher and counts
    them for its penalties."""
    from test_proxy import read_stream
    from test_proxy_sampling import PENALTIES, assert_same_logprobs, flat_logprobs

    spec = StructuredOutputsParams(json=SCORES_SCHEMA)
    knobs = {"temperature": 0.9, "top_k": 30, "seed": 17}
    offline = reference.generate([PROMPT], SamplingParams(
        max_tokens=300, n=2, logprobs=1, structured_outputs=spec, **PENALTIES, **knobs))[0]
    body = {"prompt": PROMPT, "max_tokens": 300, "stream": True, "return_token_ids": True,
            "n": 2, "logprobs": 1, **PENALTIES, **knobs,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "scores", "schema": SCORES_SCHEMA}}}
    cluster = fresh_cluster
    proxy = cluster.proxy(health_interval=600)
    undisturbed, done = read_stream(proxy.url, "/v1/completions", body)
    assert done
    assert [undisturbed[i]["token_ids"] for i in (0, 1)] == \
        [c.token_ids for c in offline.outputs]
    (migrated, done), serving = read_killing_the_decode(
        cluster, proxy, lambda on_open: read_stream(proxy.url, "/v1/completions", body, on_open))
    assert done
    for index in (0, 1):
        got, want = migrated[index], undisturbed[index]
        assert (got["text"], got["token_ids"], got["finish"]) == \
            (want["text"], want["token_ids"], "stop")
        assert schema_errors(json.loads(got["text"]), SCORES_SCHEMA) == []
        assert_same_logprobs(flat_logprobs(got["logprobs"], False),
                             flat_logprobs(want["logprobs"], False))
        assert len(flat_logprobs(got["logprobs"], False)) == len(want["token_ids"])
    assert_migrated(cluster, proxy, serving)


def test_required_tool_calls_of_n_choices_through_the_proxy_are_parsed_per_choice(tmp_path):
    """n=2 with tool_choice required: the proxy splits the choices and parses each one's
    raw text on its own, giving the instance's own answer."""
    from conftest import build_tiny_model
    from serving_utils import Process, free_port, in_process_server
    from structured_helpers import HERMES_TEMPLATE, MESSAGES, with_template
    from structured_helpers import TOOLS as WEATHER_TOOLS

    qwen_dir = with_template(build_tiny_model(tmp_path / "qwen", model_type="qwen2", seed=2),
                              HERMES_TEMPLATE)
    body = {"messages": MESSAGES, "tools": WEATHER_TOOLS, "tool_choice": "required",
            "max_tokens": 150, "temperature": 1.0, "seed": 5, "n": 2}
    with in_process_server(qwen_dir) as url:
        port = free_port()
        proxy = Process(["proxy", "--decode", url, "--port", str(port)], port,
                        tmp_path / "proxy.log").wait_healthy()
        try:
            direct = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=WAIT_S).json()
            proxied = httpx.post(f"{proxy.url}/v1/chat/completions", json=body,
                                 timeout=WAIT_S).json()
        finally:
            proxy.kill()

    def calls(answer):
        return [[(c["function"]["name"], json.loads(c["function"]["arguments"]))
                 for c in choice["message"]["tool_calls"]] for choice in answer["choices"]]

    assert [c["finish_reason"] for c in proxied["choices"]] == ["tool_calls", "tool_calls"]
    assert calls(proxied) == calls(direct)
    assert calls(proxied)[0] != calls(proxied)[1]
