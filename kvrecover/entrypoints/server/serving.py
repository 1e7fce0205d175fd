"""`/v1/completions` and `/v1/chat/completions`: request -> Generation -> response.

Both wait for the first token (or the error) before answering; the answer, whole or
streamed, is written by `openai/responses.py` (the format the proxy writes too). A
streamed answer sends a chunk without new text only to a client that asked for
token ids (or when it opens the stream or carries the finish reason).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from kvrecover.entrypoints.openai.protocol import (
    TOOL_CALL_PARSER_HEADER,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    parse_request,
)
from kvrecover.entrypoints.openai.responses import OpenAIResponse
from kvrecover.entrypoints.openai.structured import structured_outputs_of
from kvrecover.entrypoints.openai.tools import ToolAnswer, ToolRequest
from kvrecover.entrypoints.server.chat_template import ChatTemplate
from kvrecover.entrypoints.server.detokenizer import IncrementalDetokenizer
from kvrecover.entrypoints.server.engine_loop import EngineLoop
from kvrecover.entrypoints.server.generation import Delta, Generation
from kvrecover.entrypoints.server.metrics import ServerMetrics
from kvrecover.sampling import SamplingParams, resumed_request_seed
from kvrecover.structured.params import StructuredOutputsParams
from kvrecover.tokenizer import Tokenizer


@dataclass
class ServingState:
    """What the generation endpoints share."""

    loop: EngineLoop
    metrics: ServerMetrics
    model_name: str
    tokenizer: Tokenizer
    chat_template: ChatTemplate
    max_model_len: int


def _check_model(state: ServingState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise ApiError(404, f"model {model!r} does not exist; this server serves "
                            f"{state.model_name!r}", code="model_not_found", param="model")


async def create_completion(state: ServingState, http: Request, body: Any) -> Response:
    """Answer one `/v1/completions` request."""
    request = parse_request(CompletionRequest, body)
    _check_model(state, request.model)
    final_usage, continuous_usage = request.stream_usage()
    prompt = request.engine_prompt()
    params = request.sampling_params(request.max_new_tokens())
    grammar = structured_outputs_of(request.response_format, request.structured_outputs)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    detokenizer = IncrementalDetokenizer(state.tokenizer, request.stop_strings())
    resumed = request.resumed_token_ids()
    if resumed:
        detokenizer.resume(resumed, request.resumed_output_text)
        if params.seed is not None:  # continue the original's per-token seeds
            params = replace(params, seed=resumed_request_seed(params.seed, len(resumed)))
        if grammar is not None:  # the grammar resumes where the first instance left it
            grammar = replace(grammar, replay_prompt_tokens=len(resumed))
    await _compile(state, grammar, _grammar_field(request))
    params = replace(params, structured_outputs=grammar)
    generation = await _start(state, http, request_id, prompt, params, detokenizer,
                              "completions")
    writer = OpenAIResponse(False, state.model_name, generation, request.return_token_ids,
                            final_usage, continuous_usage, request_id)
    return await _answer(generation, writer, request.stream)


async def create_chat_completion(state: ServingState, http: Request, body: Any) -> Response:
    """Answer one `/v1/chat/completions` request."""
    request = parse_request(ChatCompletionRequest, body)
    _check_model(state, request.model)
    final_usage, continuous_usage = request.stream_usage()
    conversation = request.conversation()
    tools = ToolRequest.of(request.tools, request.tool_choice)
    grammar = structured_outputs_of(request.response_format, request.structured_outputs)
    answer = None
    headers = {}
    forced = tools is not None and tools.grammar() is not None
    if tools is not None:
        parser = await asyncio.to_thread(state.chat_template.tool_parser)
        if request.raw_tool_calls:  # the proxy writes the calls: tell it how to parse them
            headers[TOOL_CALL_PARSER_HEADER] = parser or ""
        else:
            answer = ToolAnswer(tools, parser)
        grammar = _tool_grammar(tools, grammar)
    prompt_ids = await asyncio.to_thread(state.chat_template.prompt_token_ids, conversation,
                                         None if tools is None else tools.template_tools())
    room = max(1, state.max_model_len - len(prompt_ids))
    params = request.sampling_params(request.max_new_tokens(room))
    await _compile(state, grammar, "tool_choice" if forced else _grammar_field(request))
    params = replace(params, structured_outputs=grammar)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    detokenizer = IncrementalDetokenizer(state.tokenizer, request.stop_strings())
    generation = await _start(state, http, request_id, {"prompt_token_ids": prompt_ids},
                              params, detokenizer, "chat")
    writer = OpenAIResponse(True, state.model_name, generation, request.return_token_ids,
                            final_usage, continuous_usage, request_id, tools=answer)
    return await _answer(generation, writer, request.stream, headers)


def _grammar_field(request: CompletionRequest | ChatCompletionRequest) -> str:
    return "response_format" if request.response_format is not None else "structured_outputs"


async def _compile(state: ServingState, grammar: StructuredOutputsParams | None,
                   field: str) -> None:
    """Compile the request's grammar on a worker thread (the engine thread then finds it
    cached); one that does not compile is a 400 naming `field`."""
    if grammar is None:
        return
    try:
        await asyncio.to_thread(state.loop.llm.compile_grammar, grammar)
    except ValueError as error:
        raise ApiError(400, str(error), param=field) from error


def _tool_grammar(tools: ToolRequest, grammar: StructuredOutputsParams | None
                  ) -> StructuredOutputsParams | None:
    """The request's grammar: `tool_choice`'s (required, a named function) or its own."""
    forced = tools.grammar()
    if forced is None:
        return grammar
    if grammar is not None:
        raise ApiError(400, "tool_choice 'required' or a named function cannot be combined "
                            "with response_format or structured_outputs", param="tool_choice")
    return forced


async def _start(state: ServingState, http: Request, request_id: str,
                 prompt: str | dict[str, list[int]], params: SamplingParams,
                 detokenizer: IncrementalDetokenizer, endpoint: str) -> Generation:
    generation = Generation(state.loop, request_id, prompt, params, detokenizer,
                            http.receive, state.metrics, endpoint)
    await generation.first()
    return generation


async def _answer(generation: Generation, writer: OpenAIResponse, stream: bool,
                  headers: dict[str, str] | None = None) -> Response:
    if not stream:
        return JSONResponse(await writer.collect(generation.deltas()), headers=headers)
    # Once streaming, Starlette watches for the disconnect and cancels the events;
    # watching here too would race it for the same ASGI message.
    generation.stop_watching()
    deltas = _worth_sending(generation.deltas(), writer.return_token_ids)
    return StreamingResponse(writer.events(deltas), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", **(headers or {})},
                             background=BackgroundTask(generation.close))


async def _worth_sending(deltas: AsyncGenerator[Delta, None],
                         with_token_ids: bool) -> AsyncGenerator[Delta, None]:
    """The deltas a streamed answer sends: the first, the last, and those with new
    text (or, for a client that asked for token ids, every one)."""
    first = True
    async with aclosing(deltas):
        async for delta in deltas:
            if first or delta.text or with_token_ids or delta.finish_reason:
                yield delta
            first = False
