"""The proxy forwards nothing it has not checked: upstream events of the wrong
shape, `data: null`, token ids outside the vocabulary and finish reasons that
contradict the request are a failed instance (failover before the first byte,
migration after it), never a 200 with that content and never a bare 500; and
legitimate early stops (stop strings, stop token ids, the context limit) still
pass. Fake instances on 127.0.0.1 (tests/fake_upstream.py), the proxy in-process."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from fake_upstream import (
    MAX_MODEL_LEN,
    VOCAB_SIZE,
    FaithfulModel,
    FakeUpstream,
    InProcessProxy,
    Reply,
    health_reply,
    sse,
)

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MODEL = FaithfulModel()


@dataclass
class Answer:
    """What the client got from the proxy."""

    status: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    done: bool = False  # streamed: ended with [DONE]
    error: dict | None = None  # the error body or error event
    instance: str | None = None


def request_body(path: str, stream: bool, max_tokens: int = 8, **extra: Any) -> dict:
    body: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                            "return_token_ids": True, "stream": stream, **extra}
    if path == CHAT:
        body["messages"] = [{"role": "user", "content": "the capital of france is"}]
    else:
        body["prompt"] = "the capital of france is"
    return body


def ask(proxy: InProcessProxy, path: str, body: dict) -> Answer:
    """Send `body` through the proxy and read the answer as a client would."""
    chat = path == CHAT
    if not body.get("stream"):
        response = httpx.post(f"{proxy.url}{path}", json=body, timeout=30)
        answer = Answer(response.status_code, instance=response.headers.get(
            "x-kvrecover-decode-instance"))
        payload = response.json()  # never plain text, whatever happened
        if response.status_code != 200:
            answer.error = payload["error"]
            return answer
        choice = payload["choices"][0]
        answer.text = choice["message"]["content"] if chat else choice["text"]
        answer.token_ids, answer.finish_reason = choice["token_ids"], choice["finish_reason"]
        return answer
    with httpx.stream("POST", f"{proxy.url}{path}", json=body, timeout=30) as response:
        answer = Answer(response.status_code, instance=response.headers.get(
            "x-kvrecover-decode-instance"))
        if response.status_code != 200:
            response.read()
            answer.error = response.json()["error"]
            return answer
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            assert not answer.done, "nothing may follow [DONE]"
            if line == "data: [DONE]":
                answer.done = True
                continue
            event = json.loads(line[6:])
            if "error" in event:
                answer.error = event["error"]
                continue
            choice = event["choices"][0]
            answer.text += choice["delta"]["content"] if chat else choice["text"]
            answer.token_ids += choice["token_ids"]
            answer.finish_reason = choice["finish_reason"] or answer.finish_reason
    return answer


def truth(path: str, body: dict) -> tuple[str, list[int], str]:
    _, output, finish = MODEL.generate(path, body)
    return "".join(MODEL.token_text(t) for t in output), output, finish


def scripted(events: Callable[[str, dict], list[str]]) -> Callable[[str, str, Any], Reply]:
    """A fake instance whose streams are `events(path, body)`, its prefill answers right."""
    def handler(method: str, path: str, body: Any) -> Reply:
        known = health_reply(method, path)
        if known is not None:
            return known
        if not body.get("stream"):
            return Reply(200, json.dumps(MODEL.whole(path, body)).encode())
        return sse(events(path, body))
    return handler


def prefix_then(bad: str | Callable[[dict], str], keep: int = 2):
    """Events: the first `keep` true chunks, then `bad` (a string or made from the next
    true chunk), then the rest of the truth (which the proxy must not read on)."""
    def events(path: str, body: dict) -> list[str]:
        chunks = MODEL.chunks(path, body)
        tail = bad if isinstance(bad, str) else bad(chunks[keep])
        return [json.dumps(c) for c in chunks[:keep]] + [tail] + \
            [json.dumps(c) for c in chunks[keep + 1:]] + ["[DONE]"]
    return events


@pytest.fixture(scope="module")
def good():
    upstream = FakeUpstream(MODEL)
    yield upstream
    upstream.close()


@pytest.fixture
def cluster(good):
    """A proxy with a scriptable bad decode instance first and the good one second."""
    made: list[Any] = []

    def build(events, decode_good: bool = True, prefill: list[str] | None = None):
        bad = FakeUpstream(scripted(events))
        proxy = InProcessProxy(prefill or [], [bad.url] + ([good.url] if decode_good else []))
        made.extend([proxy, bad])
        return proxy, bad

    yield build
    for thing in made:
        thing.close()


def with_choice(change: Callable[[dict], None]) -> Callable[[dict], str]:
    def make(chunk: dict) -> str:
        chunk = json.loads(json.dumps(chunk))
        change(chunk["choices"][0])
        return json.dumps(chunk)
    return make


def set_key(key: str, value: Any) -> Callable[[dict], None]:
    return lambda choice: choice.__setitem__(key, value)


BEFORE_FIRST_BYTE = {
    "a JSON list": lambda path, body: ["[1, 2]"],
    "choices of strings": lambda path, body: ['{"choices": ["x"]}'],
    "null": lambda path, body: ["null"],
    "a token id of 10**30": lambda path, body: prefix_then(
        with_choice(set_key("token_ids", [10**30])), keep=0)(path, body),
}


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("case", sorted(BEFORE_FIRST_BYTE))
def test_bad_first_event_fails_over(cluster, good, path, stream, case):
    proxy, bad = cluster(BEFORE_FIRST_BYTE[case])
    body = request_body(path, stream)
    answer = ask(proxy, path, body)
    assert answer.status == 200, answer.error
    assert (answer.text, answer.token_ids, answer.finish_reason) == truth(path, body)
    assert answer.instance == good.url
    assert not stream or answer.done
    assert bad.requests  # it was tried first


MID_STREAM = {
    "null": "null",
    "a JSON list": "[1, 2]",
    "choices of strings": '{"choices": ["x"]}',
    "a truncated line": '{"id": "cmpl-fake", "object": "text_com',
    "text of the wrong type": with_choice(set_key("text", 5)),
    "a second choice": with_choice(lambda c: c.__setitem__("index", 1)),
    "token ids of strings": with_choice(set_key("token_ids", ["7"])),
    "a token id of 10**30": with_choice(set_key("token_ids", [10**30])),
    "the vocabulary size as token id": with_choice(set_key("token_ids", [VOCAB_SIZE])),
    "an unknown finish reason": with_choice(set_key("finish_reason", "done")),
    "length after 3 of 8 tokens": with_choice(set_key("finish_reason", "length")),
    "stop with ignore_eos and no stop": with_choice(set_key("finish_reason", "stop")),
}


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("case", sorted(MID_STREAM))
def test_bad_event_mid_stream_is_migrated(cluster, good, path, stream, case):
    bad_event = MID_STREAM[case]
    if path == CHAT and case in ("text of the wrong type",):
        bad_event = with_choice(lambda c: c["delta"].__setitem__("content", 5))
    proxy, bad = cluster(prefix_then(bad_event))
    body = request_body(path, stream)
    answer = ask(proxy, path, body)
    assert answer.status == 200, answer.error
    assert (answer.text, answer.token_ids, answer.finish_reason) == truth(path, body)
    assert not stream or answer.done
    continued = [b for p, b in good.requests if b.get("resumed_output_tokens") == 2]
    assert continued, "the request was not continued on the good instance"


@pytest.mark.parametrize("stream", [False, True])
def test_bad_events_everywhere_are_an_openai_error_not_a_500(cluster, stream):
    proxy, _ = cluster(lambda path, body: ["null"], decode_good=False)
    answer = ask(proxy, COMPLETIONS, request_body(COMPLETIONS, stream))
    assert answer.status == 503 and answer.error["type"] == "service_unavailable"

    proxy, _ = cluster(prefix_then("null"), decode_good=False)
    answer = ask(proxy, COMPLETIONS, request_body(COMPLETIONS, stream))
    if stream:  # the first bytes were sent: the stream ends with an error, no [DONE]
        assert answer.status == 200 and not answer.done
        assert answer.error["type"] == "service_unavailable"
        assert answer.token_ids == truth(COMPLETIONS, request_body(COMPLETIONS, stream))[1][:2]
    else:
        assert answer.status == 503 and answer.error["type"] == "service_unavailable"


def test_a_4xx_without_an_openai_error_body_fails_over(cluster, good):
    def handler(method: str, path: str, body: Any) -> Reply:
        return health_reply(method, path) or Reply(400, b"[1, 2]")

    bad = FakeUpstream(handler)
    proxy = InProcessProxy([], [bad.url, good.url])
    try:
        body = request_body(COMPLETIONS, False)
        answer = ask(proxy, COMPLETIONS, body)
        assert answer.status == 200, answer.error
        assert answer.token_ids == truth(COMPLETIONS, body)[1]
    finally:
        proxy.close()
        bad.close()


def test_a_prefill_answer_of_the_wrong_shape_is_skipped(good):
    def handler(method: str, path: str, body: Any) -> Reply:
        return health_reply(method, path) or Reply(200, b'{"choices": [1, 2]}')

    prefill = FakeUpstream(handler)
    proxy = InProcessProxy([prefill.url], [good.url])
    try:
        body = request_body(COMPLETIONS, True)
        answer = ask(proxy, COMPLETIONS, body)
        assert answer.status == 200, answer.error
        assert answer.token_ids == truth(COMPLETIONS, body)[1]
    finally:
        proxy.close()
        prefill.close()


def stopped_after(count: int, finish: str):
    """Events: the first `count` true chunks, the last of them with `finish`."""
    def events(path: str, body: dict) -> list[str]:
        chunks = json.loads(json.dumps(MODEL.chunks(path, body)[:count]))
        chunks[-1]["choices"][0]["finish_reason"] = finish
        return [json.dumps(c) for c in chunks] + ["[DONE]"]
    return events


@pytest.mark.parametrize("stream", [False, True])
def test_legitimate_early_stops_are_forwarded(cluster, stream):
    """Only what is provably impossible is rejected: a stop string, a stop token id or
    the end of the context ends a request early, and the lone instance's answer stands."""
    body = request_body(COMPLETIONS, stream, max_tokens=20, stop=["zz"])
    proxy, _ = cluster(stopped_after(3, "stop"), decode_good=False)
    answer = ask(proxy, COMPLETIONS, body)
    assert (answer.status, answer.finish_reason) == (200, "stop")
    assert answer.token_ids == truth(COMPLETIONS, body)[1][:3]

    third = truth(COMPLETIONS, body)[1][2]
    body = request_body(COMPLETIONS, stream, max_tokens=20, stop_token_ids=[third])
    proxy, _ = cluster(stopped_after(3, "stop"), decode_good=False)
    answer = ask(proxy, COMPLETIONS, body)
    assert (answer.status, answer.finish_reason) == (200, "stop")

    # A grammar ends a request when complete, under ignore_eos too.
    body = request_body(COMPLETIONS, stream, max_tokens=20,
                        structured_outputs={"regex": "[a-z]{3}"})
    proxy, _ = cluster(stopped_after(3, "stop"), decode_good=False)
    answer = ask(proxy, COMPLETIONS, body)
    assert (answer.status, answer.finish_reason) == (200, "stop")
    assert answer.token_ids == truth(COMPLETIONS, body)[1][:3]

    prompt = list(range(1, MAX_MODEL_LEN - 2))  # room for 3 tokens of the 20 asked
    body = {**request_body(COMPLETIONS, stream, max_tokens=20), "prompt": prompt}
    proxy, _ = cluster(stopped_after(3, "length"), decode_good=False)
    answer = ask(proxy, COMPLETIONS, body)
    assert (answer.status, answer.finish_reason) == (200, "length")
    assert len(answer.token_ids) == 3


def test_a_stop_token_id_that_did_not_stop_is_impossible(cluster, good):
    body = request_body(COMPLETIONS, True, max_tokens=8)
    second = truth(COMPLETIONS, body)[1][1]
    stops = {**body, "stop_token_ids": [second]}
    # The bad instance claims the stop token came and generation went on.
    proxy, _ = cluster(lambda path, request: [json.dumps(c) for c in MODEL.chunks(path, body)])
    answer = ask(proxy, COMPLETIONS, stops)
    assert answer.status == 200 and answer.done
    assert answer.finish_reason == "stop" and answer.token_ids == truth(COMPLETIONS, stops)[1]
    assert len(answer.token_ids) == 2


def test_a_continuation_without_max_tokens_asks_for_the_room_left(cluster, good):
    """A chat without max_tokens, migrated, asks the next instance for no more than its
    max_model_len leaves (an instance answers 400 to more, as vLLM)."""
    body = request_body(CHAT, True)
    del body["max_tokens"]
    good.requests.clear()
    proxy, _ = cluster(prefix_then("null"))
    answer = ask(proxy, CHAT, body)
    assert answer.status == 200 and answer.done, answer.error
    assert (answer.text, answer.token_ids, answer.finish_reason) == truth(CHAT, body)
    continued = [b for p, b in good.requests if b.get("resumed_output_tokens") == 2]
    assert [len(b["prompt"]) + b["max_tokens"] for b in continued] == [MAX_MODEL_LEN]


def silent_health(events) -> Callable[[str, str, Any], Reply]:
    """`scripted(events)` on an instance whose /health names no limits (not kvrecover's)."""
    inner = scripted(events)

    def handler(method: str, path: str, body: Any) -> Reply:
        if method == "GET" and path == "/health":
            return Reply(200, b'{"status": "ok"}')
        return inner(method, path, body)
    return handler


EARLY_ENDS = {  # (instance, request) where the instance ends after 3 of 20 tokens
    "length, its max_model_len unknown": (silent_health(stopped_after(3, "length")), {}),
    "stop before min_tokens": (scripted(stopped_after(3, "stop")),
                               {"ignore_eos": False, "min_tokens": 10}),
}


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("case", sorted(EARLY_ENDS))
def test_an_early_end_nothing_explains_is_migrated_or_an_error(good, path, stream, case):
    """Greedy, max_tokens 20: an instance that ends after 3 tokens with a finish reason
    no limit or stop condition of the request explains is broken. With a good
    instance the request is migrated (the exact tokens); alone, it is an error."""
    handler, extra = EARLY_ENDS[case]
    body = request_body(path, stream, max_tokens=20, **extra)
    for with_good in (True, False):
        good.requests.clear()
        bad = FakeUpstream(handler)
        proxy = InProcessProxy([], [bad.url] + ([good.url] if with_good else []))
        try:
            answer = ask(proxy, path, body)
        finally:
            proxy.close()
            bad.close()
        if with_good:
            assert answer.status == 200, answer.error
            assert (answer.text, answer.token_ids, answer.finish_reason) == truth(path, body)
            assert len(answer.token_ids) == 20
            assert bad.requests and good.requests
        elif stream:  # its first pieces were sent: the stream ends with an error event
            assert answer.status == 200 and not answer.done and answer.error is not None
            assert answer.finish_reason is None
        else:
            assert answer.status == 503 and answer.error["type"] == "service_unavailable"
