"""Migration with issue 41's fields: `min_p` and `include_stop_str_in_output` (with a stop
string and `min_tokens`) and chat `echo` go with a request a decode instance SIGKILLed
mid-stream, so the client's stream is exactly what one instance answers alone (the
stop string once, at the end; the echoed text once, at the start)."""

from __future__ import annotations

import pytest
from test_proxy import (  # noqa: F401
    PROMPT,
    fresh_cluster,
    model_dir,
    read_killing_the_decode,
    read_stream,
)

pytestmark = pytest.mark.slow  # separate processes

MAX_TOKENS = 300
# Never in the output; long, so an instance holds back its last 19 characters.
ABSENT_STOP = "@@@@@@@@@@@@@@@@@@@@"


def late_stop(text: str) -> str:
    """A stop string whose first occurrence starts past 60% of `text`."""
    for start in range(int(len(text) * 0.6), len(text) - 4):
        stop = text[start:start + 4]
        if text.find(stop) == start and stop.strip():
            return stop
    raise AssertionError(f"no late stop string in {text!r}")


def migrated(cluster, path: str, body: dict) -> dict:
    """Choice 0 of `body` through a new proxy, its decode instance SIGKILLed once the
    stream starts; checks that the proxy migrated it."""
    proxy = cluster.proxy(health_interval=600)
    (choices, done), _ = read_killing_the_decode(
        cluster, proxy, lambda on_open: read_stream(proxy.url, path, body, on_open))
    assert done and list(choices) == [0]
    return choices[0]


def test_min_p_and_include_stop_str_migrate_exactly(fresh_cluster):  # noqa: F811
    single = fresh_cluster.decode[0].url
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "temperature": 0.9, "seed": 11, "min_p": 0.05, "min_tokens": 20,
            "return_token_ids": True, "stream": True}
    unstopped = read_stream(single, "/v1/completions", body)[0][0]
    assert len(unstopped["token_ids"]) == MAX_TOKENS
    stop = late_stop(unstopped["text"])
    body.update(stop=[stop, ABSENT_STOP], include_stop_str_in_output=True)
    want = read_stream(single, "/v1/completions", body)[0][0]
    assert want["finish"] == "stop" and want["text"].endswith(stop)
    assert want["text"] == unstopped["text"][:unstopped["text"].find(stop) + len(stop)]
    got = migrated(fresh_cluster, "/v1/completions", body)
    assert (got["text"], got["token_ids"], got["finish"]) == \
        (want["text"], want["token_ids"], want["finish"])


def test_a_chat_echo_migrates_without_a_second_echo(fresh_cluster):  # noqa: F811
    single = fresh_cluster.decode[0].url
    echoed = "the capital of china is"
    body = {"messages": [{"role": "user", "content": PROMPT},
                         {"role": "assistant", "content": echoed}],
            "echo": True, "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0,
            "stop": ABSENT_STOP, "return_token_ids": True, "stream": True}
    want = read_stream(single, "/v1/chat/completions", body)[0][0]
    assert want["text"].startswith(echoed) and want["finish"] == "length"
    got = migrated(fresh_cluster, "/v1/chat/completions", body)
    assert (got["text"], got["token_ids"], got["finish"]) == \
        (want["text"], want["token_ids"], want["finish"])
    assert got["text"].count(echoed) == want["text"].count(echoed)
