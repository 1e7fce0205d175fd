"""`/v1/completions` and `/v1/chat/completions`: request -> Generation -> response.

Both wait for the first token (or the error) before answering; a streamed answer
is server-sent events in OpenAI's chunk format, each chunk carrying the new text
(and, with `return_token_ids`, the new token ids), the last one the finish reason;
with `stream_options.include_usage` a chunk with empty `choices` and the `usage`
follows (as in OpenAI and vLLM; without it no chunk has a usage), then
`data: [DONE]`. An error after the first token ends the stream with an error
event and without `[DONE]`, so no client takes it for a success.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from kvrecover.entrypoints.server.chat_template import ChatTemplate
from kvrecover.entrypoints.server.detokenizer import IncrementalDetokenizer
from kvrecover.entrypoints.server.engine_loop import EngineLoop
from kvrecover.entrypoints.server.generation import Delta, Generation
from kvrecover.entrypoints.openai.http import internal_error
from kvrecover.entrypoints.server.metrics import ServerMetrics
from kvrecover.entrypoints.openai.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    parse_request,
)
from kvrecover.sampling import resumed_request_seed

logger = logging.getLogger(__name__)


@dataclass
class ServingState:
    """What the generation endpoints share."""

    loop: EngineLoop
    metrics: ServerMetrics
    model_name: str
    tokenizer: Any
    chat_template: ChatTemplate
    max_model_len: int


def _check_model(state: ServingState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise ApiError(404, f"model {model!r} does not exist; this server serves "
                            f"{state.model_name!r}", code="model_not_found", param="model")


async def create_completion(state: ServingState, http: Request, body: Any):
    """Answer one `/v1/completions` request."""
    request = parse_request(CompletionRequest, body)
    _check_model(state, request.model)
    final_usage, continuous_usage = request.stream_usage()
    prompt = request.engine_prompt()
    params = request.sampling_params(request.max_new_tokens())
    request_id = f"cmpl-{uuid.uuid4().hex}"
    detokenizer = IncrementalDetokenizer(state.tokenizer, request.stop_strings())
    resumed = request.resumed_token_ids()
    if resumed:
        detokenizer.resume(resumed, request.resumed_output_text)
        if params.seed is not None:  # continue the original's per-token seeds
            params = replace(params, seed=resumed_request_seed(params.seed, len(resumed)))
    generation = await _start(state, http, request_id, prompt, params, detokenizer,
                              "completions")
    created = int(time.time())

    def chunk(delta: Delta, first: bool) -> dict:
        choice = {"index": 0, "text": delta.text, "logprobs": None,
                  "finish_reason": delta.finish_reason}
        if request.return_token_ids:
            choice["token_ids"] = delta.token_ids
            if first:
                choice["prompt_token_ids"] = generation.prompt_token_ids
        body = {"id": request_id, "object": "text_completion", "created": created,
                "model": state.model_name, "choices": [choice]}
        if continuous_usage:
            body["usage"] = _usage(generation)
        return body

    if request.stream:
        usage = _usage_chunk(generation, "text_completion", created, state) \
            if final_usage else None
        return _sse(generation, chunk, request.return_token_ids, usage)
    text, token_ids = await _collect(generation)
    choice = {"index": 0, "text": text, "logprobs": None,
              "finish_reason": generation.finish_reason}
    if request.return_token_ids:
        choice["prompt_token_ids"] = generation.prompt_token_ids
        choice["token_ids"] = token_ids
    return JSONResponse({"id": request_id, "object": "text_completion", "created": created,
                         "model": state.model_name, "choices": [choice],
                         "usage": _usage(generation)})


async def create_chat_completion(state: ServingState, http: Request, body: Any):
    """Answer one `/v1/chat/completions` request."""
    request = parse_request(ChatCompletionRequest, body)
    _check_model(state, request.model)
    final_usage, continuous_usage = request.stream_usage()
    conversation = request.conversation()
    prompt_ids = await asyncio.to_thread(state.chat_template.prompt_token_ids, conversation)
    room = max(1, state.max_model_len - len(prompt_ids))
    params = request.sampling_params(request.max_new_tokens(room))
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    detokenizer = IncrementalDetokenizer(state.tokenizer, request.stop_strings())
    generation = await _start(state, http, request_id, {"prompt_token_ids": prompt_ids},
                              params, detokenizer, "chat")
    created = int(time.time())

    def chunk(delta: Delta, first: bool) -> dict:
        message = {"role": "assistant", "content": delta.text} if first else \
            {"content": delta.text}
        choice = {"index": 0, "delta": message, "logprobs": None,
                  "finish_reason": delta.finish_reason}
        if request.return_token_ids:
            choice["token_ids"] = delta.token_ids
        body = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                "model": state.model_name, "choices": [choice]}
        if first and request.return_token_ids:
            body["prompt_token_ids"] = generation.prompt_token_ids
        if continuous_usage:
            body["usage"] = _usage(generation)
        return body

    if request.stream:
        usage = _usage_chunk(generation, "chat.completion.chunk", created, state) \
            if final_usage else None
        return _sse(generation, chunk, request.return_token_ids, usage)
    text, token_ids = await _collect(generation)
    choice = {"index": 0, "message": {"role": "assistant", "content": text},
              "logprobs": None, "finish_reason": generation.finish_reason}
    body = {"id": request_id, "object": "chat.completion", "created": created,
            "model": state.model_name, "choices": [choice], "usage": _usage(generation)}
    if request.return_token_ids:
        choice["token_ids"] = token_ids
        body["prompt_token_ids"] = generation.prompt_token_ids
    return JSONResponse(body)


async def _start(state: ServingState, http: Request, request_id: str, prompt: Any,
                 params: Any, detokenizer: IncrementalDetokenizer, endpoint: str) -> Generation:
    generation = Generation(state.loop, request_id, prompt, params, detokenizer,
                            http.receive, state.metrics, endpoint)
    await generation.first()
    return generation


async def _collect(generation: Generation) -> tuple[str, list[int]]:
    text: list[str] = []
    token_ids: list[int] = []
    async for delta in generation.deltas():
        text.append(delta.text)
        token_ids.extend(delta.token_ids)
    return "".join(text), token_ids


def _usage(generation: Generation) -> dict[str, int]:
    prompt_tokens = len(generation.prompt_token_ids)
    completion_tokens = generation.num_sent_tokens
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _usage_chunk(generation: Generation, kind: str, created: int,
                 state: ServingState) -> Callable[[], dict]:
    """The last chunk of a stream with `include_usage`: no choices, the usage."""
    return lambda: {"id": generation.request_id, "object": kind, "created": created,
                    "model": state.model_name, "choices": [], "usage": _usage(generation)}


def _sse(generation: Generation, chunk, with_token_ids: bool,
         usage_chunk: Callable[[], dict] | None) -> StreamingResponse:
    """Chunks without text are sent only to clients that asked for token ids; the
    usage chunk, when asked for, comes after the finish reason."""
    # Once streaming, Starlette watches for the disconnect and cancels `events`;
    # watching here too would race it for the same ASGI message.
    generation.stop_watching()

    async def events() -> AsyncIterator[str]:
        first = True
        try:
            async for delta in generation.deltas():
                if not (first or delta.text or with_token_ids or delta.finish_reason):
                    continue
                yield f"data: {json.dumps(chunk(delta, first))}\n\n"
                first = False
        except ApiError as error:
            yield f"data: {json.dumps(error.body())}\n\n"
            return
        except Exception as error:  # a bug after the 200 was sent: end with an error event
            logger.exception("streaming %s failed", generation.request_id)
            yield f"data: {json.dumps(internal_error(error).body())}\n\n"
            return
        if usage_chunk is not None:
            yield f"data: {json.dumps(usage_chunk())}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"},
                             background=BackgroundTask(generation.close))
