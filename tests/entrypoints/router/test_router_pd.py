"""kvrecover behind vllm-router (vLLM's P/D router, the real binary): the router sends each
request to the prefill instance with max_tokens=1 and `kv_transfer_params`
(do_remote_decode), then to a decode instance with the prefill's answer's
`kv_transfer_params`; the decode pulls the blocks over NIXL. What the client gets through
the router, via the official `openai` SDK, equals what one instance answers alone."""

from __future__ import annotations

import pytest
from conftest import build_tiny_model, require_nixl
from router_helpers import (
    ENGINE,
    NO_PREFIX_CACHE,
    PROMPT,
    Router,
    consumer,
    producer,
    required_router_binary,
    sdk,
    serve_nixl,
)
from serving_utils import add_chat_template, metric

pytestmark = pytest.mark.slow  # separate processes

require_nixl()

# Several full blocks of 8 tokens.
MESSAGES = [{"role": "user", "content": PROMPT}]
PULLED = "kvrecover_kv_nixl_pulled_blocks_total"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """(router, prefill, decodes): one prefill and two decode instances behind a router.
    The decodes keep no prefix cache: a request without a reference is computed whole."""
    binary = required_router_binary()
    model_dir = add_chat_template(build_tiny_model(tmp_path_factory.mktemp("model"), seed=3))
    logs = tmp_path_factory.mktemp("router_logs")
    instances = serve_nixl(logs, model_dir, (*ENGINE, *NO_PREFIX_CACHE), {
        "prefill": producer(), "decode0": consumer(), "decode1": consumer()})
    prefill, decodes = instances["prefill"], [instances["decode0"], instances["decode1"]]
    router = None
    try:
        router = Router(binary, [prefill.url], [d.url for d in decodes],
                        logs / "router.log").wait_healthy()
        yield router, prefill, decodes
    finally:
        if router is not None:
            router.kill()
        for process in (prefill, *decodes):
            process.kill()


def pulled(decodes) -> float:
    """Blocks the decodes pulled; none of their pulls ever failed (a reference the router
    forwards at once is still pulled: the producer waits for the step holding it)."""
    failed = sum(metric(d.url, "kvrecover_kv_load_failed_blocks_total") for d in decodes)
    assert failed == 0, "a pull failed"
    return sum(metric(d.url, PULLED) for d in decodes)


SAMPLING = [
    pytest.param({"temperature": 0}, id="greedy"),
    pytest.param({"temperature": 1.0, "top_p": 0.9, "seed": 7}, id="seeded"),
]


@pytest.mark.parametrize("sampling", SAMPLING)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completions_through_the_router_equal_one_instance(fleet, sampling, stream):
    router, _, decodes = fleet

    def complete(url: str) -> tuple[str, list[int]]:
        kwargs = dict(model="tiny", prompt=PROMPT, max_tokens=8, stream=stream,
                      extra_body={"return_token_ids": True}, **sampling)
        answer = sdk(url).completions.create(**kwargs)
        if not stream:
            choice = answer.choices[0]
            return choice.text, choice.model_extra["token_ids"]
        text, ids = "", []
        for chunk in answer:
            for choice in chunk.choices:
                text += choice.text
                ids += choice.model_extra.get("token_ids") or []
        return text, ids

    want = complete(decodes[0].url)
    assert len(want[1]) == 8
    for _ in range(2):  # round robin: both decode instances
        before = pulled(decodes)
        assert complete(router.url) == want
        assert pulled(decodes) > before, "the decode pulled nothing: no P/D happened"


@pytest.mark.parametrize("sampling", SAMPLING)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_through_the_router_equals_one_instance(fleet, sampling, stream):
    router, _, decodes = fleet

    def chat(url: str) -> tuple[str, list[int]]:
        answer = sdk(url).chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=8, stream=stream,
            extra_body={"return_token_ids": True}, **sampling)
        if not stream:
            choice = answer.choices[0]
            return choice.message.content or "", choice.model_extra["token_ids"]
        text, ids = "", []
        for chunk in answer:
            for choice in chunk.choices:
                text += choice.delta.content or ""
                ids += choice.model_extra.get("token_ids") or []
        return text, ids

    want = chat(decodes[0].url)
    assert len(want[1]) == 8
    for _ in range(2):
        before = pulled(decodes)
        assert chat(router.url) == want
        assert pulled(decodes) > before


def test_completion_logprobs_through_the_router_equal_one_instance(fleet):
    router, _, decodes = fleet

    def logprobs(url: str):
        answer = sdk(url).completions.create(model="tiny", prompt=PROMPT, max_tokens=6,
                                                temperature=0, logprobs=3)
        return answer.choices[0].logprobs.model_dump()

    want = logprobs(decodes[0].url)
    # Keyed by text, so tokens that decode alike share an entry: at most 3.
    assert len(want["tokens"]) == 6 and all(want["top_logprobs"])
    assert logprobs(router.url) == want


def test_chat_logprobs_through_the_router_equal_one_instance(fleet):
    router, _, decodes = fleet

    def logprobs(url: str):
        answer = sdk(url).chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True,
            top_logprobs=2)
        return answer.choices[0].logprobs.model_dump()

    want = logprobs(decodes[0].url)
    assert len(want["content"]) == 6 and len(want["content"][0]["top_logprobs"]) == 2
    assert logprobs(router.url) == want


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_the_answer_is_named_by_the_routers_request_id(fleet, chat):
    """vllm-router sends prefill and decode one X-Request-Id naming both; the decode's
    answer (what the client gets) is named by it, as vLLM names it."""
    router, prefill, decodes = fleet
    api = sdk(router.url)
    if chat:
        answer_id = api.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2,
                                                temperature=0).id
    else:
        answer_id = api.completions.create(model="tiny", prompt=PROMPT, max_tokens=2,
                                           temperature=0).id
    prefix = "chatcmpl" if chat else "cmpl"
    named = f"{prefix}-___prefill_addr_{prefill.url.removeprefix('http://')}___decode_addr_"
    assert answer_id.startswith(named), answer_id
    assert any(f"{d.url.removeprefix('http://')}_" in answer_id for d in decodes), answer_id


def test_the_router_lists_the_model(fleet):
    router, _, _ = fleet
    assert [m.id for m in sdk(router.url).models.list()] == ["tiny"]
