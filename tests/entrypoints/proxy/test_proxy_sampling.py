"""Migration with logprobs, penalties and `n` active: a decode instance SIGKILLed
mid-stream, and the client's stream is the undisturbed one (tokens, text, logprobs,
every choice), as the offline API computes it."""

from __future__ import annotations

import pytest
from conftest import build_tiny_model
from serving_utils import add_chat_template
from test_proxy import (
    PROMPT,
    Cluster,
    chat_prompt_ids,
    read_killing_the_decode,
    read_stream,
)

from kvrecover import LLM, SamplingParams

pytestmark = pytest.mark.slow  # separate processes

MAX_TOKENS = 300
PENALTIES = {"presence_penalty": 0.8, "frequency_penalty": 0.3, "repetition_penalty": 1.1}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return add_chat_template(build_tiny_model(tmp_path_factory.mktemp("proxy_model"), seed=4))


@pytest.fixture(scope="module")
def reference(model_dir):
    return LLM(str(model_dir))


@pytest.fixture
def fresh_cluster(model_dir, tmp_path):
    cluster = Cluster(tmp_path, model_dir)
    try:
        yield cluster
    finally:
        cluster.close()


def flat_logprobs(parts: list[dict], chat: bool) -> list[tuple]:
    """(token text, logprob, top token texts) per token."""
    if chat:
        return [(e["token"], e["logprob"], [t["token"] for t in e["top_logprobs"]])
                for part in parts for e in part["content"]]
    return [(token, logprob, sorted(top)) for part in parts
            for token, logprob, top in zip(part["tokens"], part["token_logprobs"],
                                           part["top_logprobs"])]


def assert_same_logprobs(got: list[tuple], want: list[tuple]) -> None:
    assert [(t, top) for t, _, top in got] == [(t, top) for t, _, top in want]
    assert max(abs(a - b) for (_, a, _), (_, b, _) in zip(got, want)) < 1e-4


@pytest.mark.parametrize("endpoint,n,knobs", [
    ("completions", 1, {"temperature": 0, "logprobs": 2}),
    ("chat", 1, {"temperature": 0, "logprobs": True, "top_logprobs": 2}),
    ("completions", 2, {"temperature": 0.9, "top_k": 30, "seed": 17, "logprobs": 1}),
])
def test_migration_keeps_penalties_logprobs_and_choices(fresh_cluster, reference, model_dir,
                                                        endpoint, n, knobs):
    cluster = fresh_cluster
    proxy = cluster.proxy(health_interval=600)
    chat = endpoint == "chat"
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"max_tokens": MAX_TOKENS, "ignore_eos": True, "return_token_ids": True,
            "stream": True, "n": n, **PENALTIES, **knobs}
    if chat:
        messages = [{"role": "user", "content": PROMPT}]
        body["messages"] = messages
        prompt = {"prompt_token_ids": chat_prompt_ids(model_dir, messages)}
    else:
        body["prompt"] = PROMPT
        prompt = PROMPT
    undisturbed, done = read_stream(proxy.url, path, body)
    assert done and sorted(undisturbed) == list(range(n))
    offline = reference.generate([prompt], SamplingParams(
        max_tokens=MAX_TOKENS, ignore_eos=True, n=n, logprobs=2, **PENALTIES,
        **{k: v for k, v in knobs.items() if k in ("temperature", "top_k", "seed")}))[0]
    assert [undisturbed[i]["token_ids"] for i in range(n)] == \
        [c.token_ids for c in offline.outputs]
    (migrated, done), _ = read_killing_the_decode(
        cluster, proxy, lambda on_open: read_stream(proxy.url, path, body, on_open))
    assert done
    for index in range(n):
        got, want = migrated[index], undisturbed[index]
        assert (got["text"], got["token_ids"], got["finish"]) == \
            (want["text"], want["token_ids"], "length")
        assert_same_logprobs(flat_logprobs(got["logprobs"], chat),
                             flat_logprobs(want["logprobs"], chat))
        assert len(flat_logprobs(got["logprobs"], chat)) == MAX_TOKENS  # none twice
    if not chat:
        offsets = [o for part in migrated[0]["logprobs"] for o in part["text_offset"]]
        assert offsets == [o for part in undisturbed[0]["logprobs"] for o in part["text_offset"]]
