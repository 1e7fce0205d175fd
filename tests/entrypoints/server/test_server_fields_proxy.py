"""Issue 41 item 4's fields through `kvrecover proxy` (one in-process server as both
its prefill and its decode instance). The proxy's prefill request
(`max_tokens=1`) drops `min_tokens`; a `guided_*` grammar may end a request early; the
instance's `x-kvrecover-ignored-fields` header reaches the client."""

from __future__ import annotations

import httpx
import openai
import pytest
from conftest import build_tiny_model
from serving_utils import Process, add_chat_template, free_port, in_process_server
from structured_helpers import CHOICES

from kvrecover.entrypoints.openai.protocol import IGNORED_FIELDS_HEADER

pytestmark = pytest.mark.slow  # a server and a proxy process

PROMPT = "the capital of france is paris and the capital of china is"


@pytest.fixture(scope="module")
def urls(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fields_proxy")
    model_dir = add_chat_template(build_tiny_model(tmp / "model", seed=3))
    with in_process_server(model_dir) as server_url:
        port = free_port()
        proxy = Process(["proxy", "--prefill", server_url, "--decode", server_url,
                         "--port", str(port)], port, tmp / "proxy.log")
        try:
            yield server_url, proxy.wait_healthy().url
        finally:
            proxy.kill()


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def ids(url: str, max_tokens: int = 8, **extra) -> list[int]:
    got = sdk(url).completions.create(model="tiny", prompt=PROMPT, max_tokens=max_tokens,
                                      temperature=0,
                                      extra_body={"return_token_ids": True, **extra})
    assert max_tokens == 8 or got.choices[0].finish_reason == "stop"
    return got.choices[0].model_extra["token_ids"]


def test_fields_the_proxy_passes_through(urls):
    server, proxy = urls
    for extra in ({"min_p": 0.2}, {"include_stop_str_in_output": True},
                  {"guided_choice": CHOICES}):
        assert ids(proxy, **extra) == ids(server, **extra)


def test_min_tokens_through_the_proxy(urls):
    server, proxy = urls
    assert ids(proxy, min_tokens=5) == ids(server, min_tokens=5)


def test_a_guided_request_that_ends_early_under_ignore_eos(urls):
    server, proxy = urls
    extra = {"guided_choice": CHOICES, "ignore_eos": True, "max_tokens": 60}
    assert ids(proxy, **extra) == ids(server, **extra)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path,request_body", [
    ("/v1/completions", {"prompt": PROMPT}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}]}),
])
def test_the_ignored_fields_header_through_the_proxy(urls, stream, path, request_body):
    server, proxy = urls
    body = {**request_body, "model": "tiny", "max_tokens": 4, "temperature": 0,
            "stream": stream, "zeta_field": 1, "alpha field": True}
    for url in (server, proxy):
        with httpx.stream("POST", f"{url}{path}", json=body, timeout=120) as response:
            response.read()
            assert response.status_code == 200, response.text
            assert response.headers[IGNORED_FIELDS_HEADER] == "alpha%20field,zeta_field"
    plain = {k: v for k, v in body.items() if k not in ("zeta_field", "alpha field")}
    response = httpx.post(f"{proxy}{path}", json=plain, timeout=120)
    assert response.status_code == 200 and IGNORED_FIELDS_HEADER not in response.headers
