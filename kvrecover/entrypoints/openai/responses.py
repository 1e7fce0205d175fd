"""The one writer of OpenAI answers: completions and chat completions, whole or streamed.

The server (from its engine's deltas) and the proxy (from its upstream pieces) both
answer through `OpenAIResponse`, so a client gets the same format from either: a
whole answer; or server-sent events in OpenAI's chunk format, each chunk carrying
the new text (and, with `return_token_ids`, the new token ids and, on the first, the
prompt's), the last one the finish reason; with `stream_options.include_usage` a
chunk with empty `choices` and the `usage` follows (`continuous_usage_stats`, vLLM's,
also puts the usage so far on every chunk), then `data: [DONE]`. An error after the
first chunk ends the stream with an error event and without `[DONE]`, so no client
takes it for a success.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvrecover.entrypoints.openai.http import internal_error
from kvrecover.entrypoints.openai.logprobs import join_logprobs
from kvrecover.entrypoints.openai.protocol import ApiError
from kvrecover.entrypoints.openai.tools import ToolAnswer

logger = logging.getLogger(__name__)

COMPLETION_OBJECT = "text_completion"  # a whole completion and its chunks alike
CHAT_OBJECT = "chat.completion"
CHAT_CHUNK_OBJECT = "chat.completion.chunk"
DONE_EVENT = "data: [DONE]\n\n"


class Fragment(Protocol):
    """What one step added to one choice of the answer (the server's `Chunk`, the
    proxy's `Piece`): `logprobs` is the choice's OpenAI `logprobs` object for these
    tokens (None when not asked for), `prompt_logprobs` vLLM's (on a first fragment)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: dict[str, Any] | None
    prompt_logprobs: list[Any] | None


class Progress(Protocol):
    """How far a request got, for its `usage`: the prompt and the output tokens so far."""

    @property
    def prompt_token_ids(self) -> list[int] | None: ...

    @property
    def num_output_tokens(self) -> int: ...


def usage(progress: Progress) -> dict[str, int]:
    """OpenAI's `usage` object of a request."""
    prompt_tokens = len(progress.prompt_token_ids or [])
    completion_tokens = progress.num_output_tokens
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


@dataclass
class _Choice:
    """One choice of a whole answer, gathered from its fragments."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish: str | None = None
    logprobs: dict[str, Any] | None = None
    prompt_logprobs: list[Any] | None = None
    logprob_parts: list[dict[str, Any] | None] = field(default_factory=list)

    def add(self, fragment: Fragment) -> None:
        self.text += fragment.text
        self.token_ids.extend(fragment.token_ids)
        self.finish = fragment.finish_reason or self.finish
        self.logprob_parts.append(fragment.logprobs)
        if fragment.prompt_logprobs is not None:
            self.prompt_logprobs = fragment.prompt_logprobs


def sse_event(body: dict[str, Any]) -> str:
    """One server-sent event carrying `body` as JSON."""
    return f"data: {json.dumps(body)}\n\n"


@dataclass
class OpenAIResponse:
    """Writes one request's answer as the client asked: completions or chat (`chat`),
    with or without token ids, with the usage where `stream_options` asks for it.
    `progress` is read when a usage is written, so it counts what was sent by then."""

    chat: bool
    model: str
    progress: Progress
    return_token_ids: bool = False
    final_usage: bool = False  # stream_options.include_usage: a last chunk with the usage
    continuous_usage: bool = False  # stream_options.continuous_usage_stats (vLLM's)
    request_id: str = ""  # default: "chatcmpl-<hex>" or "cmpl-<hex>"
    created: int = field(default_factory=lambda: int(time.time()))
    # A chat request with tools: choice 0's calls' writer (each other choice of `n`
    # gets a fresh one of the same request and parser: its text is parsed on its own).
    tools: ToolAnswer | None = None
    # The server's: a P2P producer's reference to the prompt's kept blocks (vLLM's
    # `kv_transfer_params`), read when the answer (or a chunk with a finish reason) is
    # written; it goes at the top level of the body, or of that chunk.
    kv_transfer_params: Callable[[], dict[str, Any] | None] | None = None
    _choice_tools: dict[int, ToolAnswer] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.request_id:
            self.request_id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"

    def _tool_answer(self, index: int) -> ToolAnswer | None:
        """The tool-call writer of choice `index` (None: the request has no tools)."""
        if self.tools is None or index == 0:
            return self.tools
        answer = self._choice_tools.get(index)
        if answer is None:
            answer = self._choice_tools[index] = ToolAnswer(self.tools.request, self.tools.parser)
        return answer

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.request_id, "object": kind, "created": self.created,
                "model": self.model}

    def _add_prompt_ids(self, body: dict[str, Any], choice: dict[str, Any]) -> None:
        # vLLM's place for them: on the body of a chat answer, on the choice of a completion.
        (body if self.chat else choice)["prompt_token_ids"] = self.progress.prompt_token_ids

    def chunk(self, fragment: Fragment, first: bool, first_of_choice: bool | None = None
              ) -> dict[str, Any]:
        """One streamed chunk; the first of a choice opens the assistant's message
        (chat); the `first` of the stream carries the prompt's token ids (with
        `return_token_ids`)."""
        opens = first if first_of_choice is None else first_of_choice
        choice: dict[str, Any]
        if self.chat:
            finish = fragment.finish_reason
            delta = {"content": fragment.text}
            tools = self._tool_answer(fragment.index)
            if tools is not None:
                delta = tools.delta(fragment.text, final=finish is not None)
                finish = tools.finish_reason(finish)
            if opens:
                delta = {"role": "assistant", **delta}
            choice = {"index": fragment.index, "delta": delta, "logprobs": fragment.logprobs,
                      "finish_reason": finish}
        else:
            choice = {"index": fragment.index, "text": fragment.text,
                      "logprobs": fragment.logprobs, "finish_reason": fragment.finish_reason}
        body = {**self._head(CHAT_CHUNK_OBJECT if self.chat else COMPLETION_OBJECT),
                "choices": [choice]}
        if fragment.prompt_logprobs is not None:
            (body if self.chat else choice)["prompt_logprobs"] = fragment.prompt_logprobs
        if self.return_token_ids:
            choice["token_ids"] = fragment.token_ids
            if first:
                self._add_prompt_ids(body, choice)
        if fragment.finish_reason is not None:
            self._add_kv_transfer_params(body)
        if self.continuous_usage:
            body["usage"] = usage(self.progress)
        return body

    def _add_kv_transfer_params(self, body: dict[str, Any]) -> None:
        params = None if self.kv_transfer_params is None else self.kv_transfer_params()
        if params is not None:
            body["kv_transfer_params"] = params

    def usage_chunk(self) -> dict[str, Any]:
        """The last chunk of a stream with `include_usage`: no choices, the usage."""
        return {**self._head(CHAT_CHUNK_OBJECT if self.chat else COMPLETION_OBJECT),
                "choices": [], "usage": usage(self.progress)}

    def whole(self, text: str, token_ids: list[int], finish_reason: str | None,
              logprobs: dict[str, Any] | None = None,
              prompt_logprobs: list[Any] | None = None) -> dict[str, Any]:
        """The body of a non-streamed answer of one choice."""
        return self.whole_choices([_Choice(0, text, token_ids, finish_reason, logprobs,
                                           prompt_logprobs)])

    def whole_choices(self, choices: list[_Choice]) -> dict[str, Any]:
        """The body of a non-streamed answer of several choices (in index order); with
        `tools` each choice's message carries its own parsed tool calls."""
        body: dict[str, Any] = {**self._head(CHAT_OBJECT if self.chat else COMPLETION_OBJECT),
                                "choices": []}
        for gathered in sorted(choices, key=lambda c: c.index):
            choice: dict[str, Any]
            finish = gathered.finish
            if self.chat:
                message = {"role": "assistant", "content": gathered.text}
                tools = self._tool_answer(gathered.index)
                if tools is not None:
                    message = tools.message(gathered.text)
                    finish = tools.finish_reason(finish)
                choice = {"index": gathered.index, "message": message,
                          "logprobs": gathered.logprobs, "finish_reason": finish}
            else:
                choice = {"index": gathered.index, "text": gathered.text,
                          "logprobs": gathered.logprobs, "finish_reason": finish}
            if gathered.prompt_logprobs is not None:
                (body if self.chat else choice)["prompt_logprobs"] = gathered.prompt_logprobs
            if self.return_token_ids:
                self._add_prompt_ids(body, choice)
                choice["token_ids"] = gathered.token_ids
            body["choices"].append(choice)
        body["usage"] = usage(self.progress)
        self._add_kv_transfer_params(body)
        return body

    async def collect(self, fragments: AsyncGenerator[Fragment, None]) -> dict[str, Any]:
        """The whole answer of `fragments` (per choice: texts, token ids and logprobs
        joined, the last finish reason given); `fragments` is closed on the way out."""
        choices: dict[int, _Choice] = {}
        async with aclosing(fragments):
            async for fragment in fragments:
                gathered = choices.setdefault(fragment.index, _Choice(fragment.index))
                gathered.add(fragment)
        for gathered in choices.values():
            gathered.logprobs = join_logprobs(gathered.logprob_parts)
        return self.whole_choices(list(choices.values()) or [_Choice(0)])

    async def events(self, fragments: AsyncGenerator[Fragment, None]) -> AsyncIterator[str]:
        """The server-sent events of `fragments`: a chunk for each, the usage chunk when
        asked for, `[DONE]`; an error (an `ApiError`, or any exception as a 500
        `internal_error`) ends the stream with an error event and no `[DONE]`.
        `fragments` is closed on the way out (a client that left included)."""
        first = True
        opened: set[int] = set()
        try:
            async with aclosing(fragments):
                async for fragment in fragments:
                    yield sse_event(self.chunk(fragment, first, fragment.index not in opened))
                    opened.add(fragment.index)
                    first = False
        except ApiError as error:
            yield sse_event(error.body())
            return
        except Exception as error:  # a bug after the 200 was sent: end with an error event
            logger.exception("streaming %s failed", self.request_id)
            yield sse_event(internal_error(error).body())
            return
        if self.final_usage:
            yield sse_event(self.usage_chunk())
        yield DONE_EVENT
