"""One HTTP generation request against the engine loop.

`Generation.first()` waits for the request's first token (or its error) before
any response is sent, so an error, a KV load failure included, is always a
plain HTTP error and never a stream that starts with 200. `deltas()` then yields
text and token deltas until the request finishes, stops on a `stop` string, or
the client goes away; in every case that is not a normal finish the engine
request is aborted so its blocks are freed.

Until a streamed response starts (and for the whole of a non-streamed one) a
watcher task waits on the connection's ASGI `receive` for `http.disconnect`: a
client that leaves is aborted at once, so within one engine step, whether or not
outputs keep arriving. A started stream is watched by Starlette instead (both
reading `receive` would race for the one disconnect message).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from starlette.types import Receive

from kvrecover.entrypoints.openai.http import ClientGone
from kvrecover.entrypoints.openai.protocol import ApiError
from kvrecover.entrypoints.server.detokenizer import IncrementalDetokenizer
from kvrecover.entrypoints.server.engine_loop import EngineLoop, OutputStream
from kvrecover.entrypoints.server.metrics import ServerMetrics
from kvrecover.outputs import RequestOutput, TokenLogprob
from kvrecover.sampling import SamplingParams

# HTTP status of each engine error type. A KV load failure is 503: the instance is
# healthy but could not serve this request; a proxy fails over to another one.
ERROR_STATUS = {"invalid_request_error": 400, "kv_load_failed": 503, "internal_error": 500}


@dataclass
class Delta:
    """What one step added to a request (one choice of it)."""

    text: str
    token_ids: list[int]
    finish_reason: str | None  # set on the last delta
    logprobs: list[TokenLogprob] | None = None  # one per new token, when asked for


class Generation:
    """Drives one request: submit, wait for the first output, then stream deltas."""

    def __init__(self, loop: EngineLoop, request_id: str, prompt: str | dict,
                 params: SamplingParams, detokenizer: IncrementalDetokenizer,
                 receive: Receive | None,
                 metrics: ServerMetrics, endpoint: str,
                 stream: OutputStream | None = None, index: int = 0) -> None:
        self.loop = loop
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.detokenizer = detokenizer
        self._receive = receive  # the connection's ASGI receive, its body already read
        self._watcher: asyncio.Task | None = None
        self.client_gone = False
        self.metrics = metrics
        self.endpoint = endpoint
        self.prompt_token_ids: list[int] = []
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self.index = index  # the choice this generation is, of the request's `n`
        self.num_sent_tokens = 0
        self.finish_reason: str | None = None
        # A P2P producer's reference to the prompt's kept blocks (vLLM's field), set
        # from the finished output.
        self.kv_transfer_params: dict | None = None
        self._stream: OutputStream | None = stream  # None: `first` adds the request
        self._pending: RequestOutput | None = None
        self._arrival = time.monotonic()
        self._first_token_at: float | None = None
        self._recorded = False

    async def first(self) -> None:
        """Submit (unless the stream was given: one choice of a request added with
        `EngineLoop.add_choices`) and wait until the first output; an engine error is
        an ApiError."""
        if self._stream is None:
            self._stream = self.loop.add(self.request_id, self.prompt, self.params)
        if self._receive is not None:  # after the add: the abort must follow it
            self._watcher = asyncio.create_task(
                self._watch_disconnect(self._receive, self._stream))
        try:
            output = await self._next()
        except BaseException:  # the client left (or the handler was cancelled) first
            self.close()
            raise
        if output.error is not None:
            self.stop_watching()
            raise self._error(output)
        self.prompt_token_ids = list(output.prompt_token_ids)
        self.prompt_logprobs = output.prompt_logprobs
        self._pending = output

    async def deltas(self) -> AsyncGenerator[Delta, None]:
        """The request's deltas after `first()`; the last carries the finish reason."""
        if self._pending is None:
            raise RuntimeError("deltas() needs first() to have returned")
        try:
            output = self._pending
            while True:
                delta = self._delta(output)
                if delta.finish_reason is not None:
                    self._record("ok")
                    yield delta
                    return
                if delta.text or delta.token_ids:
                    yield delta
                output = await self._next()
                if output.error is not None:
                    raise self._error(output)
        finally:
            self.close()

    @property
    def num_output_tokens(self) -> int:
        """Output tokens handed out so far (what `usage` counts)."""
        return self.num_sent_tokens

    def stop_watching(self) -> None:
        """Stop the disconnect watcher; called when a streamed response starts, whose
        disconnect Starlette watches (idempotent)."""
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None

    def close(self) -> None:
        """Abort the engine request unless it already ended (idempotent). Called when
        the deltas stop early, and after a streamed response, which may never have
        started reading them (the client left at once)."""
        self.stop_watching()
        if not self._recorded:
            self.loop.abort(self.request_id)
            self._record("aborted")

    async def _watch_disconnect(self, receive: Receive, stream: OutputStream) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass  # the body was read: nothing else but the disconnect can come
        self._watcher = None  # finished: nothing to cancel
        self.client_gone = True
        self.close()
        stream.wake()  # a handler waiting for the next output sees it now

    def _error(self, output: RequestOutput) -> ApiError:
        self._record("error")
        error_type = output.error_type or "internal_error"
        message = output.error or f"the request failed ({error_type})"
        return ApiError(ERROR_STATUS.get(error_type, 500), message, error_type, code=error_type)

    def _delta(self, output: RequestOutput) -> Delta:
        completion = output.outputs[0]
        token_ids = completion.token_ids
        if token_ids and self._first_token_at is None:
            self._first_token_at = time.monotonic()
        new_tokens = token_ids[self.num_sent_tokens:]
        logprobs = None if completion.logprobs is None else \
            completion.logprobs[self.num_sent_tokens:len(token_ids)]
        self.num_sent_tokens = max(self.num_sent_tokens, len(token_ids))
        text = self.detokenizer.update(token_ids, completion.text if output.finished else None)
        finish = completion.finish_reason if output.finished else None
        if output.finished and output.kv_transfer_params is not None:
            self.kv_transfer_params = output.kv_transfer_params
        if self.detokenizer.stopped and not output.finished:
            self.loop.abort(self.request_id)
            finish = "stop"
        elif self.detokenizer.stopped:
            finish = "stop"
        self.finish_reason = finish
        return Delta(text, new_tokens, finish, logprobs)

    async def _next(self) -> RequestOutput:
        stream = self._stream
        output = await stream.get() if stream is not None and not self.client_gone else None
        if output is None:  # woken by the watcher
            raise ClientGone(self.request_id)
        return output

    def _record(self, outcome: str) -> None:
        if self._recorded:
            return
        self._recorded = True
        ttft = None if self._first_token_at is None else self._first_token_at - self._arrival
        self.metrics.observe_request(self.endpoint, outcome, ttft,
                                     time.monotonic() - self._arrival, self.num_sent_tokens)
