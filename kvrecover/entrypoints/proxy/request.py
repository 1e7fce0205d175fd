"""One client request through the proxy: prefill, decode with failover, migration.

1. Prefill: the request with `max_tokens=1` and vLLM's `kv_transfer_params`
   (`do_remote_decode`) goes to a prefill instance, which computes the prompt's KV
   and keeps it (a store, or held for a pull: then its answer's reference goes
   with the decode request, `handoff.py`). A failing prefill instance is retried on
   another; with none left the request goes straight to decode (which computes
   the prompt itself).
2. Decode: the request, streamed with `return_token_ids`, goes to the least
   loaded decode instance. Until its first piece arrives nothing has reached the
   client, so any failure (refused, timeout, 5xx, `kv_load_failed`) moves it to
   the next decode instance, then to the prefill instances; none left is a 503.
3. Migration: an instance that dies mid-stream has the request continued on
   another one as a completion of prompt + tokens already sent, with the rest of
   `max_tokens` (and `resumed_output_tokens` / `resumed_output_text`, so its text
   continues the first one's, its penalties and `min_tokens` count the tokens sent
   as output, and its logprobs come in the client's shape). Greedy and seeded
   requests continue token for token as if undisturbed (the instance resumes a
   seeded request's per-token seeds at `resumed_output_tokens`); unseeded sampling
   continues afresh. A request's grammar (`response_format`, `structured_outputs`,
   or the one its `tool_choice` forces) goes with it: the instance replays the
   resumed tokens through a fresh matcher before it samples. A request of `n`
   choices is `n` requests of one (choice i seeded `choice_seed(seed, i)`, as an
   instance seeds it), each migrated alone.
Every step is bounded by `max_retries`. An instance whose answer is of the wrong
shape or impossible for the request (`checks.py`) counts as failed: at
step 1 it is skipped, at step 2 failed over, at step 3 migrated away from.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

import httpx

from kvrecover.entrypoints.openai.protocol import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    TOOL_CALL_PARSER_HEADER,
    ApiError,
)
from kvrecover.entrypoints.openai.tools import continuation_structured_outputs
from kvrecover.entrypoints.proxy.checks import (
    Piece,
    RequestLimits,
    StreamCheck,
    prefill_prompt_ids,
)
from kvrecover.entrypoints.proxy.handoff import PREFILL_TRANSFER_PARAMS, KVHandoff
from kvrecover.entrypoints.proxy.instances import Instance, InstancePool, ProxyMetrics
from kvrecover.entrypoints.proxy.upstream import (
    Retryable,
    StreamBroken,
    UpstreamStream,
    open_stream,
    post_json,
)
from kvrecover.sampling import MAX_N, choice_seed

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
# What a continuation keeps of the original request (besides the prompt). Penalties
# count the resumed tokens as output (`resumed_output_tokens`), as does `min_tokens`.
# `echo` is not kept: the echoed text reached the client with the first piece.
CONTINUATION_KEYS = ("model", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                     "stop_token_ids", "include_stop_str_in_output", "ignore_eos",
                     "presence_penalty", "frequency_penalty", "repetition_penalty",
                     "min_tokens", "logit_bias", "allowed_token_ids", "bad_words",
                     "response_format", "structured_outputs", "guided_json", "guided_regex",
                     "guided_choice", "guided_grammar")
# What the prefill request (`max_tokens=1`) leaves out: fields that conflict with it
# (a `min_tokens` above 1 is a 400) or that only the client's answer needs.
PREFILL_DROPPED_KEYS = ("stream_options", "max_completion_tokens", "min_tokens")
UNBOUNDED_MAX_TOKENS = 1 << 30  # a continuation's bound on an instance of unknown max_model_len


@dataclass
class ProxyContext:
    """What every proxied request shares."""

    pool: InstancePool
    metrics: ProxyMetrics
    client: httpx.AsyncClient
    max_retries: int


class ProxiedRequest:
    """Drives one generation request across the instances."""

    def __init__(self, context: ProxyContext, path: str, body: dict[str, Any],
                 headers: dict[str, str]) -> None:
        self.context = context
        self.path = path
        self.handoff, self.body = KVHandoff.of(body)
        self.headers = headers
        self.prompt_token_ids: list[int] | None = None
        self.generated: list[int] = []
        self.sent_text: list[str] = []  # what reached the client (for a continuation)
        self.stream: UpstreamStream | None = None
        self.max_tokens = self._max_tokens()
        self.limits = RequestLimits.of(body, self.max_tokens)
        self.echoed = echoed_text(path, body)

    def _max_tokens(self) -> int | None:
        body = self.body
        if self.path == COMPLETIONS:
            value = body.get("max_tokens")
            return DEFAULT_COMPLETION_MAX_TOKENS if value is None else value
        value = body.get("max_completion_tokens")
        return body.get("max_tokens") if value is None else value

    async def prefill(self) -> None:
        """Have a prefill instance compute and keep the prompt's KV (best effort); none
        when the client brought its own reference."""
        if self.handoff.from_client:
            return
        body = {**self.body, "max_tokens": 1, "stream": False, "return_token_ids": True,
                "kv_transfer_params": PREFILL_TRANSFER_PARAMS}
        if self.path == CHAT and self.body.get("tools") is not None:
            body["raw_tool_calls"] = True  # its answer is read for the prompt ids alone
        for key in PREFILL_DROPPED_KEYS:
            body.pop(key, None)
        context = self.context
        for instance in context.pool.prefill_candidates()[:context.max_retries + 1]:
            context.metrics.count(context.metrics.requests, instance)
            instance.in_flight += 1
            try:
                answer = await post_json(context.client, instance, self.path, body, self.headers)
                self.prompt_token_ids = prefill_prompt_ids(answer, self.path == CHAT, instance)
                self.handoff.take_prefill_answer(answer)
            except ValueError as error:  # an answer of the wrong shape
                self._failed(instance, Retryable(f"{instance.url}: {error}"),
                             context.metrics.retries)
                continue
            except Retryable as error:
                self._failed(instance, error, context.metrics.retries)
                continue
            finally:
                instance.in_flight -= 1
            return

    async def open_decode(self) -> Piece:
        """Start decoding somewhere; its first piece (an ApiError 503 when nowhere). A
        chat with tools asks for the model's raw text (`raw_tool_calls`): the proxy writes
        the tool calls itself (`tool_call_parser`), whichever instances produced it."""
        body = {**self.body, "stream": True, "return_token_ids": True}
        if self.path == CHAT and self.body.get("tools") is not None:
            body["raw_tool_calls"] = True
        body.pop("stream_options", None)
        first = await self._open(self.path, body)
        self._absorb(first)
        return first

    @property
    def tool_call_parser(self) -> str | None:
        """The tool-call parser the decode instance named for its raw tool-call text."""
        return self.decode_stream.response.headers.get(TOOL_CALL_PARSER_HEADER) or None

    @property
    def num_output_tokens(self) -> int:
        """Tokens taken for the client so far (what `usage` counts)."""
        return len(self.generated)

    @property
    def decode_stream(self) -> UpstreamStream:
        """The open decode stream (`open_decode` opened it; a migration reopens it)."""
        if self.stream is None:
            raise RuntimeError("no decode stream is open: call open_decode first")
        return self.stream

    async def pieces(self, first: Piece) -> AsyncGenerator[Piece, None]:
        """The pieces for the client after `first`, migrating when the instance dies."""
        migrations = 0
        piece = first
        try:
            while piece.finish_reason is None:
                try:
                    piece = await self.decode_stream.next_piece()
                except StreamBroken:
                    dead = self.decode_stream.instance
                    await self._release()
                    self.context.pool.mark(dead, False)
                    self.context.metrics.count(self.context.metrics.migrations, dead)
                    if migrations >= self.context.max_retries:
                        raise ApiError(503, f"{dead.url} died mid-stream and the request could "
                                            "not be continued within the retry limit",
                                       "service_unavailable", code=503) from None
                    migrations += 1
                    piece = await self._continue()
                self._absorb(piece)
                yield piece
        finally:
            await self._release()

    async def _continue(self) -> Piece:
        if self.prompt_token_ids is None:
            raise ApiError(503, "the decode instance died before the prompt was known",
                           "service_unavailable", code=503)
        remaining = None if self.max_tokens is None else self.max_tokens - len(self.generated)
        if remaining is not None and remaining <= 0:
            return Piece("", [], "length")
        body = {key: self.body[key] for key in CONTINUATION_KEYS if key in self.body}
        if self.path == CHAT:  # a tool_choice that forces a grammar keeps forcing it
            forced = continuation_structured_outputs(self.body)
            if forced is not None:
                body["structured_outputs"] = forced
        body.update(prompt=self.prompt_token_ids + self.generated, max_tokens=remaining,
                    stream=True, return_token_ids=True,
                    resumed_output_tokens=len(self.generated),
                    resumed_output_text=self._sent_output_text())
        body.update(self._continued_logprobs())
        piece = await self._open(COMPLETIONS, body, continuation=True)
        piece.prompt_token_ids = None  # the continuation's prompt is not the client's
        piece.prompt_logprobs = None  # nor are its prompt logprobs (the first piece had them)
        return piece

    def _sent_output_text(self) -> str:
        """The output text that reached the client, without the echoed text the first
        piece began with (`echo`): the continuation's text continues the output. An echo
        the proxy cannot spell (a token-id prompt) stays; the instance then resumes after
        all the resumed tokens' text, so nothing is sent twice."""
        sent = "".join(self.sent_text)
        if self.echoed and sent.startswith(self.echoed):
            return sent[len(self.echoed):]
        return sent

    def _continued_logprobs(self) -> dict[str, Any]:
        """The logprobs a continuation (a completion) asks for: the client's, in the
        client's shape (a chat's through kvrecover's `chat_logprobs`)."""
        if self.path == COMPLETIONS:
            logprobs = self.body.get("logprobs")
            return {} if logprobs is None else {"logprobs": logprobs}
        if self.body.get("logprobs") is not True:
            return {}
        return {"logprobs": self.body.get("top_logprobs") or 0, "chat_logprobs": True}

    async def _open(self, path: str, body: dict[str, Any], continuation: bool = False) -> Piece:
        """The first piece of `body` on the first decode candidate that serves it. A
        continuation of a request without max_tokens (`max_tokens: None`) asks each
        instance for the room its max_model_len leaves (an instance refuses more)."""
        context = self.context
        errors = []
        for instance in context.pool.decode_candidates()[:context.max_retries + 1]:
            sent = body
            if continuation and body.get("max_tokens") is None:
                room = self._room_on(instance, len(body["prompt"]))
                if room <= 0:
                    return Piece("", [], "length")  # the context is full
                sent = {**body, "max_tokens": room}
            if not continuation:
                sent = self.handoff.for_attempt(sent, instance.role)
            context.metrics.count(context.metrics.requests, instance)
            instance.in_flight += 1
            check = StreamCheck(self.limits, instance, self.prompt_token_ids, self.generated,
                                continuation)
            try:
                self.stream, first = await open_stream(context.client, instance, path, sent,
                                                       self.headers, check)
            except Retryable as error:
                instance.in_flight -= 1
                errors.append(str(error))
                self.handoff.attempt_failed(instance.role, error.connect_failed)
                self._failed(instance, error, context.metrics.failovers)
                continue
            except BaseException:
                instance.in_flight -= 1
                raise
            self.handoff.drop()
            return first
        context.metrics.unavailable.inc()
        tried = "; ".join(errors) if errors else "every instance is marked down"
        raise ApiError(503, f"no instance could serve the request ({tried})",
                       "service_unavailable", code=503)

    @staticmethod
    def _room_on(instance: Instance, prompt_tokens: int) -> int:
        if instance.max_model_len is None:
            return UNBOUNDED_MAX_TOKENS
        return instance.max_model_len - prompt_tokens

    def _failed(self, instance: Instance, error: Retryable, counter: Any) -> None:
        self.context.metrics.count(counter, instance)
        if error.connect_failed:
            self.context.pool.mark(instance, False)

    def _absorb(self, piece: Piece) -> None:
        if piece.prompt_token_ids is not None and self.prompt_token_ids is None:
            self.prompt_token_ids = list(piece.prompt_token_ids)
        self.generated.extend(piece.token_ids)
        self.sent_text.append(piece.text)

    async def close(self) -> None:
        """Close the upstream stream, if one is open (idempotent). Called after a
        streamed response, which may never have started reading the pieces."""
        await self._release()

    async def _release(self) -> None:
        if self.stream is not None:
            stream, self.stream = self.stream, None
            stream.instance.in_flight -= 1
            await stream.close()



def echoed_text(path: str, body: dict[str, Any]) -> str | None:
    """The text an instance puts before the output under `echo` (None: none, or none the
    proxy can spell): a completion's text prompt; a chat's last message when it is the
    assistant's (its content, text parts joined), as the server echoes it."""
    if body.get("echo") is not True:
        return None
    if path == COMPLETIONS:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        return prompt if isinstance(prompt, str) else None
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not isinstance(messages[-1], dict) \
            or messages[-1].get("role") != "assistant":
        return None
    content = messages[-1].get("content")
    if isinstance(content, list):
        parts = [p.get("text") if isinstance(p, dict) else None for p in content]
        texts = [t for t in parts if isinstance(t, str)]
        return "".join(texts) if len(texts) == len(parts) else None
    return content if isinstance(content, str) else None


def choice_bodies(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The requests of one choice each that a request of `n` choices becomes: choice i
    seeded `choice_seed(seed, i)`, as an instance seeds it. An `n` the instance would
    refuse (out of range) is passed on as it is (the instance answers the 400)."""
    n = body.get("n")
    if not isinstance(n, int) or isinstance(n, bool) or not 1 < n <= MAX_N:
        return [body]
    seed = body.get("seed")
    if not isinstance(seed, int) or isinstance(seed, bool):
        return [{**body, "n": 1} for _ in range(n)]
    return [{**body, "n": 1, "seed": choice_seed(seed, i)} for i in range(n)]


class ProxiedChoices:
    """The usage of an answer of several proxied choices: one prompt, all their outputs."""

    def __init__(self, choices: list[ProxiedRequest]) -> None:
        self.choices = choices

    @property
    def prompt_token_ids(self) -> list[int] | None:
        return self.choices[0].prompt_token_ids

    @property
    def num_output_tokens(self) -> int:
        return sum(c.num_output_tokens for c in self.choices)
