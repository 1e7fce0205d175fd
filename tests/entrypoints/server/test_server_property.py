"""A property of `kvrecover serve` (issue #29): whatever JSON value lands in whatever
request field, the answer is a 2xx or a 4xx (never a 5xx, never a dropped connection,
never a stream that ends in an internal error), and afterwards the server is healthy
and a normal request gets its exact tokens. Hypothesis draws the values (bounded and
derandomized, so CI runs the same examples every time)."""

from __future__ import annotations

import json

import httpx
import pytest
from conftest import build_tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serving_utils import add_chat_template, served

pytestmark = pytest.mark.slow  # a separate server process

MAX_MODEL_LEN = 64  # a drawn max_tokens cannot keep the server busy for long
EXAMPLES = 40  # per endpoint
BASES = {
    "/v1/completions": {"prompt": "the capital of france is", "max_tokens": 3,
                        "temperature": 0},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hello there"}],
                             "max_tokens": 3, "temperature": 0},
}
SHARED_FIELDS = ["model", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
                 "ignore_eos", "stream", "stream_options", "return_token_ids", "n",
                 "logprobs", "max_tokens", "an_unknown_field", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "min_tokens", "logit_bias",
                 "allowed_token_ids", "bad_words", "prompt_logprobs"]
FIELDS = {
    "/v1/completions": SHARED_FIELDS + ["prompt", "echo", "suffix", "resumed_output_tokens",
                                        "resumed_output_text"],
    "/v1/chat/completions": SHARED_FIELDS + ["messages", "max_completion_tokens", "top_logprobs",
                                             "messages.0", "messages.0.role",
                                             "messages.0.content"],
}

# Any JSON value: text with surrogates and NULs, integers past 64 bits, NaN and the
# infinities (Python's json reads them), nested lists and objects. Text is often one of
# the known troublemakers, which random text reaches only by luck.
NASTY_TEXT = ["abc \ud800 def", "\udfff", "a\x00b", "", " ", "\ufffd", "\U0001f98a",
              "<s>", "</s>", "{{ raise }}", "{% for %}", "\n\n", "x" * 300]
texts = st.sampled_from(NASTY_TEXT) | st.text(st.characters(), max_size=12)
scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.integers(-3, 300)
           | st.floats(allow_nan=True, allow_infinity=True) | texts)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.lists(texts, max_size=4)
                           | st.dictionaries(st.sampled_from(["type", "text", "role",
                                                              "content", "x"]), inner,
                                             max_size=4),
                           max_leaves=12)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = add_chat_template(build_tiny_model(tmp_path_factory.mktemp("fuzz_model"),
                                                   seed=3))
    logs = tmp_path_factory.mktemp("logs")
    with served(logs, model_dir, "--max-model-len", str(MAX_MODEL_LEN)) as process:
        yield process


def normal_request(url: str) -> list[int]:
    response = httpx.post(f"{url}/v1/completions", timeout=60, json={
        **BASES["/v1/completions"], "ignore_eos": True, "return_token_ids": True})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def with_value(body: dict, field: str, value) -> dict:
    """`body` with `field` (dotted: "messages.0.role") set to `value`; unchanged when
    an earlier change left no such path."""
    changed = json.loads(json.dumps(body))
    *path, last = field.split(".")
    try:
        target = changed
        for part in path:
            target = target[int(part)] if isinstance(target, list) else target[part]
        target[int(last) if isinstance(target, list) else last] = value
    except (KeyError, IndexError, TypeError):
        return body
    return changed


def check_answer(url: str, path: str, body: dict) -> None:
    content = json.dumps(body).encode()  # NaN and Infinity as Python's json writes them
    response = httpx.post(f"{url}{path}", content=content, timeout=60,
                          headers={"content-type": "application/json"})
    assert response.status_code < 500, (body, response.text)
    if response.status_code >= 400:
        assert response.json()["error"]["type"], response.text
    elif body.get("stream") is True:
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        errors = [json.loads(e)["error"] for e in events if e.startswith('{"error"')]
        assert not errors and events[-1] == "[DONE]", (body, response.text)
    else:
        assert response.json()["choices"], response.text


@pytest.mark.parametrize("path", list(BASES))
def test_any_json_in_any_field_is_answered_2xx_or_4xx(server, path):
    want = normal_request(server.url)
    values = st.one_of(st.sampled_from(NASTY_TEXT), st.lists(texts, min_size=1, max_size=2),
                       json_values)
    changes = st.lists(st.tuples(st.sampled_from(FIELDS[path]), values),
                       min_size=1, max_size=3)

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(changes)
    def property_holds(drawn):
        body = BASES[path]
        for field, value in drawn:
            body = with_value(body, field, value)
        check_answer(server.url, path, body)

    property_holds()
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    assert normal_request(server.url) == want
