"""Property: whatever a decode instance sends (any JSON value, a chunk with one field
wrong, a cut line, an error status with any body), after any number of true
chunks, the proxy's client gets exactly the good instance's answer: text, token
ids, prompt token ids, finish reason (and [DONE] when streamed). Bounded and
deterministic (hypothesis, derandomized, a few dozen examples per endpoint)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from fake_upstream import (
    VOCAB_SIZE,
    FaithfulModel,
    FakeUpstream,
    InProcessProxy,
    Reply,
    health_reply,
    sse,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.slow  # property tests: 40 hypothesis examples per endpoint

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MODEL = FaithfulModel()
PROPERTY = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=3),
    max_leaves=8)
# Values no instance may send at that place of a chunk (None only where it is invalid).
WRONG_TOKEN_IDS = [["7"], [1.5], [-1], [VOCAB_SIZE], [10**30], None, "x", [True], 7]
WRONG = {
    ("choices",): [[], "x", None, [{}]],
    ("choices", 0, "index"): [1, "0", -1, None],
    ("choices", 0, "token_ids"): WRONG_TOKEN_IDS,
    ("choices", 0, "finish_reason"): ["done", 1, "", "abort", "stop"],  # stop: ignore_eos
    ("object",): ["chat.completion", 1, None],
    ("model",): [5, None],
    ("created",): ["now", -1, 1.5],
    ("id",): [None, 3],
    ("usage",): ["x", {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 3}],
}
WRONG_COMPLETION = {**WRONG, ("choices", 0, "text"): [5, None, ["a"]],
                    ("choices", 0, "prompt_token_ids"): [[VOCAB_SIZE], ["1"], [], [1, 2]]}
WRONG_CHAT = {**WRONG, ("choices", 0, "delta"): [None, "x", 5],
              ("choices", 0, "delta", "content"): [5, ["a"]],
              ("choices", 0, "delta", "role"): ["user", 5],
              ("prompt_token_ids",): [[VOCAB_SIZE], ["1"], [], [1, 2]]}


def replace_at(chunk: Any, path: tuple, value: Any) -> Any:
    chunk = json.loads(json.dumps(chunk))
    holder = chunk
    for key in path[:-1]:
        holder = holder[key]
    holder[path[-1]] = value
    return chunk


@st.composite
def bad_streams(draw, path: str):
    """(keep, bad event or reply, then the rest?) for one request of `path`."""
    max_tokens = draw(st.integers(2, 6))
    keep = draw(st.integers(0, max_tokens - 1))
    wrong = WRONG_CHAT if path == CHAT else WRONG_COMPLETION
    kind = draw(st.sampled_from(["json", "mutated", "cut", "text", "status", "more",
                                 "early length"]))
    if kind == "json":
        bad: Any = json.dumps(draw(json_values))
    elif kind == "mutated":
        field_path = draw(st.sampled_from(sorted(wrong, key=str)))
        bad = ("mutate", field_path, draw(st.sampled_from(wrong[field_path])))
    elif kind == "cut":
        bad = ("cut", draw(st.floats(0.0, 0.99)))
    elif kind == "text":
        bad = draw(st.text(max_size=20))
    elif kind == "status":
        status = draw(st.sampled_from([200, 302, 400, 404, 429, 500, 503]))
        bad = Reply(status, draw(st.binary(max_size=40) | json_values.map(
            lambda v: json.dumps(v).encode())))
    elif kind == "more":  # one token more than max_tokens in the last chunk
        keep = max_tokens - 1
        bad = ("more",)
    else:  # finish_reason "length" before max_tokens
        keep = draw(st.integers(0, max_tokens - 2))
        bad = ("mutate", ("choices", 0, "finish_reason"), "length")
    return max_tokens, keep, bad, draw(st.booleans()), draw(st.booleans())


def bad_reply(plan, path: str, body: dict) -> Reply:
    _, keep, bad, rest, _ = plan
    if isinstance(bad, Reply):
        return bad
    chunks = MODEL.chunks(path, body)
    if isinstance(bad, tuple) and bad[0] == "mutate":
        event = json.dumps(replace_at(chunks[keep], bad[1], bad[2]))
    elif isinstance(bad, tuple) and bad[0] == "cut":
        line = json.dumps(chunks[keep])
        event = line[:int(len(line) * bad[1])]
    elif isinstance(bad, tuple):  # "more"
        event = json.dumps(replace_at(chunks[keep], ("choices", 0, "token_ids"),
                                      chunks[keep]["choices"][0]["token_ids"] + [1]))
    else:
        event = bad
    events = [json.dumps(c) for c in chunks[:keep]] + [event]
    if rest:
        events += [json.dumps(c) for c in chunks[keep + 1:]] + ["[DONE]"]
    return sse(events)


class Plan:
    current: Any = None


@pytest.fixture(scope="module")
def setup():
    good = FakeUpstream(MODEL)
    plan = Plan()

    def handler(method: str, path: str, body: Any) -> Reply:
        return health_reply(method, path) or bad_reply(plan.current, path, body)

    bad = FakeUpstream(handler)
    proxy = InProcessProxy([good.url], [bad.url, good.url])
    yield proxy, plan
    proxy.close()
    bad.close()
    good.close()


def answer_of(proxy: InProcessProxy, path: str, body: dict) -> tuple:
    chat = path == CHAT
    if not body["stream"]:
        response = httpx.post(f"{proxy.url}{path}", json=body, timeout=30)
        assert response.status_code == 200, response.text
        payload = response.json()
        choice = payload["choices"][0]
        prompt = payload["prompt_token_ids"] if chat else choice["prompt_token_ids"]
        text = choice["message"]["content"] if chat else choice["text"]
        return text, choice["token_ids"], prompt, choice["finish_reason"]
    text, token_ids, prompt, finish, done = "", [], None, None, False
    with httpx.stream("POST", f"{proxy.url}{path}", json=body, timeout=30) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                assert "error" not in event, event
                choice = event["choices"][0]
                text += choice["delta"]["content"] if chat else choice["text"]
                token_ids += choice["token_ids"]
                prompt = prompt or (event.get("prompt_token_ids") if chat
                                    else choice.get("prompt_token_ids"))
                finish = choice["finish_reason"] or finish
    assert done
    return text, token_ids, prompt, finish


def check(setup, path: str, plan) -> None:
    proxy, holder = setup
    max_tokens, _, _, _, stream = plan
    holder.current = plan
    proxy.wait_all_up()  # a migration marks the bad instance down for a moment
    body: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                            "return_token_ids": True, "stream": stream}
    if path == CHAT:
        body["messages"] = [{"role": "user", "content": "hello there"}]
    else:
        body["prompt"] = "hello there"
    prompt, output, finish = MODEL.generate(path, body)
    want = ("".join(MODEL.token_text(t) for t in output), output, prompt, finish)
    assert answer_of(proxy, path, body) == want


@PROPERTY
@given(plan=bad_streams(COMPLETIONS))
def test_any_upstream_events_never_change_a_completion(setup, plan):
    check(setup, COMPLETIONS, plan)


@PROPERTY
@given(plan=bad_streams(CHAT))
def test_any_upstream_events_never_change_a_chat_completion(setup, plan):
    check(setup, CHAT, plan)
