"""entrypoints/openai/responses.py: the one writer of OpenAI answers that the server and
the proxy share. Exact bodies, the shapes the proxy accepts, and how a stream ends."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

import pytest

from kvrecover.entrypoints.openai.protocol import ApiError
from kvrecover.entrypoints.openai.responses import DONE_EVENT, OpenAIResponse
from kvrecover.entrypoints.openai.shapes import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    parse_shape,
)


@dataclass
class Fragment:
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    index: int = 0
    logprobs: dict | None = None
    prompt_logprobs: list | None = None


@dataclass
class Progress:
    prompt_token_ids: list[int] | None = field(default_factory=lambda: [5, 6, 7])
    num_output_tokens: int = 0


FRAGMENTS = [Fragment("Hel", [11]), Fragment("", [12]), Fragment("lo", [13], "stop")]


async def fragments(items, progress: Progress, error: Exception | None = None):
    for item in items:
        progress.num_output_tokens += len(item.token_ids)
        yield item
    if error is not None:
        raise error


def stream(writer: OpenAIResponse, error: Exception | None = None) -> list[str]:
    async def run():
        return [e async for e in writer.events(fragments(FRAGMENTS, writer.progress, error))]
    return asyncio.run(run())


def writer(chat: bool, **settings) -> OpenAIResponse:
    return OpenAIResponse(chat, "tiny", Progress(), request_id="id-1", created=1700, **settings)


def test_a_whole_completion_with_token_ids():
    answer = writer(False, return_token_ids=True)
    answer.progress.num_output_tokens = 3
    body = answer.whole("Hello", [11, 12, 13], "stop")
    assert body == {
        "id": "id-1", "object": "text_completion", "created": 1700, "model": "tiny",
        "choices": [{"index": 0, "text": "Hello", "logprobs": None, "finish_reason": "stop",
                     "prompt_token_ids": [5, 6, 7], "token_ids": [11, 12, 13]}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}}
    parse_shape(Completion, body)


def test_a_whole_chat_answer_puts_the_prompt_ids_on_the_body():
    answer = writer(True, return_token_ids=True)
    body = asyncio.run(answer.collect(fragments(FRAGMENTS, answer.progress)))
    assert body["object"] == "chat.completion"
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Hello"},
                                "logprobs": None, "finish_reason": "stop",
                                "token_ids": [11, 12, 13]}]
    assert body["prompt_token_ids"] == [5, 6, 7]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    parse_shape(ChatCompletion, body)


def test_a_plain_chat_stream_opens_the_message_once_and_ends_with_done():
    events = stream(writer(True))
    assert events[-1] == DONE_EVENT
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert [c["choices"][0]["delta"] for c in chunks] == [
        {"role": "assistant", "content": "Hel"}, {"content": ""}, {"content": "lo"}]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "stop"]
    assert all("usage" not in c and "token_ids" not in c["choices"][0] for c in chunks)
    for chunk in chunks:
        parse_shape(ChatCompletionChunk, chunk)


def test_a_completion_stream_with_usage_every_chunk_and_at_the_end():
    events = stream(writer(False, return_token_ids=True, final_usage=True,
                           continuous_usage=True))
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert [c["choices"][0]["token_ids"] for c in chunks[:-1]] == [[11], [12], [13]]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == [5, 6, 7]
    assert "prompt_token_ids" not in chunks[1]["choices"][0]
    assert [c["usage"]["completion_tokens"] for c in chunks] == [1, 2, 3, 3]
    assert chunks[-1]["choices"] == [] and chunks[-1]["object"] == "text_completion"
    for chunk in chunks:
        parse_shape(Completion, chunk)


@pytest.mark.parametrize("error, message", [
    (ApiError(503, "the instance died", "service_unavailable"), "the instance died"),
    (RuntimeError("a bug"), "internal error: RuntimeError: a bug"),
])
def test_an_error_mid_stream_ends_with_an_error_event_and_no_done(error, message):
    events = stream(writer(False, final_usage=True), error)
    assert DONE_EVENT not in events
    last = json.loads(events[-1][6:])
    assert last["error"]["message"] == message
    assert len(events) == len(FRAGMENTS) + 1  # no usage chunk after an error


def test_request_ids_by_kind():
    assert OpenAIResponse(False, "m", Progress()).request_id.startswith("cmpl-")
    assert OpenAIResponse(True, "m", Progress()).request_id.startswith("chatcmpl-")


def test_choices_interleave_and_a_whole_answer_joins_each_choices_logprobs():
    def part(tokens: list[str], values: list[float]) -> dict:
        return {"tokens": tokens, "token_logprobs": values,
                "top_logprobs": [{t: v} for t, v in zip(tokens, values)],
                "text_offset": [0] * len(tokens)}
    items = [Fragment("a", [1], None, 0, part(["a"], [-1.0])),
             Fragment("x", [7], None, 1, part(["x"], [-2.0])),
             Fragment("b", [2], "length", 0, part(["b"], [-0.5])),
             Fragment("y", [8], "stop", 1, part(["y"], [-0.25]))]
    answer = writer(False)
    body = asyncio.run(answer.collect(fragments(items, answer.progress)))
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert [c["text"] for c in body["choices"]] == ["ab", "xy"]
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "stop"]
    assert body["choices"][1]["logprobs"]["token_logprobs"] == [-2.0, -0.25]
    assert body["usage"]["completion_tokens"] == 4
    parse_shape(Completion, body)
    chat = writer(True)
    events = asyncio.run(_events(chat, items))
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    # Each choice opens its own assistant message, once.
    assert [("role" in c["choices"][0]["delta"], c["choices"][0]["index"]) for c in chunks] == \
        [(True, 0), (True, 1), (False, 0), (False, 1)]


async def _events(answer: OpenAIResponse, items) -> list[str]:
    return [e async for e in answer.events(fragments(items, answer.progress))]
