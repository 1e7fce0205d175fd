"""`kvrecover serve` against hostile input (issue #29): bad strings in every text field
and bodies it cannot parse are a 400 in OpenAI's error format naming the field, never
a plain-text 500 or a dead engine loop; after each, /health is 200 and a normal
request still gets its exact tokens."""

from __future__ import annotations

import json

import httpx
import pytest
from conftest import build_tiny_model
from serving_utils import add_chat_template, served

pytestmark = pytest.mark.slow  # a separate server process

MAX_MODEL_LEN = 128  # short, so that a fuzzed max_tokens cannot keep the server busy
SURROGATE = "abc \ud800 def"  # valid JSON ("\ud800"), not Unicode text
NUL = "abc \x00 def"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return add_chat_template(build_tiny_model(tmp_path_factory.mktemp("inputs_model"), seed=3))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    with served(logs, model_dir, "--max-model-len", str(MAX_MODEL_LEN)) as process:
        yield process


@pytest.fixture(scope="module")
def normal_token_ids(server) -> list[int]:
    """What a normal request gets before any bad input reached the server."""
    return normal_request(server.url)


def normal_request(url: str) -> list[int]:
    response = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "prompt": "the capital of france is", "max_tokens": 4, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None):
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param, error


def assert_still_serving(url: str, normal_token_ids: list[int]) -> None:
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    assert normal_request(url) == normal_token_ids


def post(url: str, path: str, body: bytes | dict) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{url}{path}", content=content, timeout=60,
                      headers={"content-type": "application/json"})


COMPLETION = {"max_tokens": 3, "temperature": 0}
CHAT = {"max_tokens": 3, "temperature": 0}
BAD_STRINGS = [
    ("/v1/completions", {"prompt": SURROGATE, **COMPLETION}, "prompt"),
    ("/v1/completions", {"prompt": SURROGATE, "stream": True, **COMPLETION}, "prompt"),
    ("/v1/completions", {"prompt": [SURROGATE], **COMPLETION}, "prompt"),
    ("/v1/completions", {"prompt": NUL, **COMPLETION}, "prompt"),
    ("/v1/completions", {"prompt": [NUL], "stream": True, **COMPLETION}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "stop": SURROGATE, **COMPLETION}, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop": ["ok", "\udfff"], **COMPLETION}, "stop[1]"),
    ("/v1/completions", {"prompt": [5, 6, 7], "resumed_output_tokens": 1,
                         "resumed_output_text": "\ud800", **COMPLETION}, "resumed_output_text"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": SURROGATE}], **CHAT},
     "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "be brief"},
                                           {"role": "user", "content": NUL}],
                              "stream": True, **CHAT}, "messages[1].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "fine"}, {"type": "text", "text": SURROGATE}]}], **CHAT},
     "messages[0].content[1].text"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "stop": [SURROGATE], **CHAT}, "stop[0]"),
    ("/v1/completions", {"prompt": "hi", "model": SURROGATE, **COMPLETION}, None),  # a 404
]


@pytest.mark.parametrize("path,body,param", BAD_STRINGS)
def test_bad_strings_are_a_400_naming_the_field(server, normal_token_ids, path, body, param):
    response = post(server.url, path, body)
    if param is None:
        assert response.status_code == 404 and response.json()["error"]["param"] == "model"
    else:
        assert_openai_error(response, 400, param)
        message = response.json()["error"]["message"]
        assert "lone surrogate" in message or "NUL character" in message
    assert_still_serving(server.url, normal_token_ids)


NESTED = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
UNPARSABLE = [
    ("/v1/completions", NESTED),  # RecursionError in json.loads
    ("/v1/chat/completions", b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": ' + b"7" * 5000 + b"}"),  # digit limit
    ("/v1/completions", b'{"prompt": "caf\xe9"}'),  # Latin-1, not UTF-8
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}'),
    ("/v1/completions", b'{"prompt": "hi"'),
    ("/v1/completions", b""),
    ("/v1/completions", b"[1, 2]"),
    ("/v1/completions", b'"a string"'),
    ("/v1/completions", b"null"),
    ("/v1/chat/completions", b"12"),
    ("/v1/chat/completions", b"true"),
]


@pytest.mark.parametrize("path,body", UNPARSABLE, ids=range(len(UNPARSABLE)))
def test_a_body_the_server_cannot_parse_is_a_400(server, normal_token_ids, path, body):
    assert_openai_error(post(server.url, path, body), 400)
    assert_still_serving(server.url, normal_token_ids)


def test_json_nested_but_parseable_is_a_4xx(server, normal_token_ids):
    """Depths json.loads still takes reach validation and the error message."""
    for depth in (50, 500, 900):
        for field in ("prompt", "stop", "logprobs", "stream_options"):
            nested = "[" * depth + "]" * depth
            body = f'{{"prompt": "hi", "max_tokens": 2, "{field}": {nested}}}'.encode()
            response = post(server.url, "/v1/completions", body)
            assert 400 <= response.status_code < 500, (depth, field, response.text)
            assert response.json()["error"]["type"] == "invalid_request_error"
    assert_still_serving(server.url, normal_token_ids)


def prompt_tokens(url: str, path: str, body: dict) -> int:
    response = post(url, path, {**body, "max_tokens": 1})
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens"]


@pytest.mark.parametrize("path,field", [("/v1/completions", "max_tokens"),
                                        ("/v1/chat/completions", "max_tokens"),
                                        ("/v1/chat/completions", "max_completion_tokens")])
@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_past_the_context_is_a_400(server, normal_token_ids, path, field, stream):
    """As vLLM: max_tokens (or max_completion_tokens) plus the prompt beyond max_model_len
    is a 400 naming the field, the value and the limit; exactly the room left is served."""
    base = {"prompt": "the capital of france is"} if path == "/v1/completions" else \
        {"messages": [{"role": "user", "content": "hello there"}]}
    base = {**base, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    room = MAX_MODEL_LEN - prompt_tokens(server.url, path, base)
    for value in (2**63, room + 1):
        response = post(server.url, path, {**base, field: value, "stream": stream})
        assert_openai_error(response, 400, field)
        message = response.json()["error"]["message"]
        assert f"{field}={value}" in message and f"{MAX_MODEL_LEN} tokens" in message, message
    response = post(server.url, path, {**base, field: room})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert (len(choice["token_ids"]), choice["finish_reason"]) == (room, "length")
    assert_still_serving(server.url, normal_token_ids)
