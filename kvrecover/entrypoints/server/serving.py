"""`/v1/completions` and `/v1/chat/completions`: request -> Generation -> response.

Both wait for the first token of every choice (or the error) before answering; the
answer, whole or streamed, is written by `openai/responses.py` (the format the proxy
writes too), its `n` choices interleaved (`choices.py`). A streamed answer sends a
chunk without new text only to a client that asked for token ids or logprobs (or
when it opens a choice or carries its finish reason). A completion with `echo` puts
the prompt (and, with `logprobs`, the prompt tokens' logprobs) before the output.
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

from kvrecover.entrypoints.openai.interleave import interleave
from kvrecover.entrypoints.openai.logprobs import LogprobsFormatter
from kvrecover.entrypoints.openai.protocol import (
    TOOL_CALL_PARSER_HEADER,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    check_context,
    ignored_fields,
    ignored_fields_header,
    parse_request,
)
from kvrecover.entrypoints.openai.responses import OpenAIResponse
from kvrecover.entrypoints.openai.structured import structured_outputs_of
from kvrecover.entrypoints.openai.tools import ToolAnswer, ToolRequest
from kvrecover.entrypoints.server.chat_template import ChatTemplate
from kvrecover.entrypoints.server.choices import (
    ChoicesProgress,
    Chunk,
    EchoedPrompt,
    choice_chunks,
)
from kvrecover.entrypoints.server.detokenizer import IncrementalDetokenizer
from kvrecover.entrypoints.server.engine_loop import EngineLoop
from kvrecover.entrypoints.server.generation import Generation
from kvrecover.entrypoints.server.metrics import ServerMetrics
from kvrecover.outputs import choice_request_id
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


def _request_ids(http: Request, prefix: str) -> tuple[str, str]:
    """(the answer's `id`, the engine's request id). As in vLLM, a client's (a router's)
    `X-Request-Id` header names the request: the answer's id is `PREFIX-VALUE` (vllm-router
    sends the prefill and the decode one value, so their logs and answers correlate). The
    engine's id adds a random suffix: two requests sent with one value never collide."""
    given = http.headers.get("x-request-id")
    if not given:
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        return request_id, request_id
    answer_id = f"{prefix}-{given}"
    return answer_id, f"{answer_id}-{uuid.uuid4().hex[:8]}"


def _check_model(state: ServingState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise ApiError(404, f"model {model!r} does not exist; this server serves "
                            f"{state.model_name!r}", code="model_not_found", param="model")


async def create_completion(state: ServingState, http: Request, body: Any) -> Response:
    """Answer one `/v1/completions` request."""
    request = parse_request(CompletionRequest, body)
    headers = ignored_fields_header(ignored_fields(CompletionRequest, body))
    _check_model(state, request.model)
    final_usage, continuous_usage = request.stream_usage()
    prompt = request.engine_prompt()
    if request.max_tokens is not None:
        prompt_tokens = len(prompt["prompt_token_ids"]) if isinstance(prompt, dict) else \
            len(await asyncio.to_thread(state.tokenizer.encode, prompt, "prompt"))
        check_context("max_tokens", request.max_tokens, prompt_tokens, state.max_model_len)
    params = request.sampling_params(request.max_new_tokens())
    grammar, grammar_field = _grammar_of(request)
    answer_id, request_id = _request_ids(http, "cmpl")
    resumed = request.resumed_token_ids()
    resumed_text = request.resumed_output_text if resumed else ""
    if resumed:
        params = replace(params, resumed_output_tokens=len(resumed))
        if params.seed is not None:  # continue the original's per-token seeds
            params = replace(params, seed=resumed_request_seed(params.seed, len(resumed)))
        if grammar is not None:  # the grammar resumes where the first instance left it
            grammar = replace(grammar, replay_prompt_tokens=len(resumed))
    await _compile(state, grammar, grammar_field)
    params = replace(params, structured_outputs=grammar)
    generations = await _start(state, http, request_id, prompt, params, request.stop_strings(),
                               "completions", resumed, resumed_text,
                               request.include_stop_str_in_output)
    echo = None
    if request.echo:
        prompt_ids = generations[0].prompt_token_ids
        text = prompt if isinstance(prompt, str) else state.tokenizer.decode(prompt_ids)
        echo = EchoedPrompt(text, request.logprobs is not None)
    # A continuation's text offsets go on from the tokens it resumes (as undisturbed).
    offset = sum(len(t) for t in state.tokenizer.token_texts(resumed)) if resumed else 0
    chunks = [choice_chunks(g, _formatter(state, params, request.chat_logprobs, offset), echo,
                            request.prompt_logprobs is not None) for g in generations]
    progress = ChoicesProgress(generations)
    writer = OpenAIResponse(False, state.model_name, progress, request.return_token_ids,
                            final_usage, continuous_usage, answer_id,
                            kv_transfer_params=progress.kv_transfer_params)
    return await _answer(generations, interleave(chunks), writer, request.stream, headers)


async def create_chat_completion(state: ServingState, http: Request, body: Any) -> Response:
    """Answer one `/v1/chat/completions` request."""
    request = parse_request(ChatCompletionRequest, body)
    headers = ignored_fields_header(ignored_fields(ChatCompletionRequest, body))
    _check_model(state, request.model)
    final_usage, continuous_usage = request.stream_usage()
    conversation = request.conversation()
    tools = ToolRequest.of(request.tools, request.tool_choice)
    grammar, grammar_field = _grammar_of(request)
    answer = None
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
    field, max_tokens = request.max_tokens_field()
    check_context(field, max_tokens, len(prompt_ids), state.max_model_len)
    room = max(1, state.max_model_len - len(prompt_ids))
    params = request.sampling_params(request.max_new_tokens(room), field)
    await _compile(state, grammar, "tool_choice" if forced else grammar_field)
    params = replace(params, structured_outputs=grammar)
    answer_id, request_id = _request_ids(http, "chatcmpl")
    generations = await _start(state, http, request_id, {"prompt_token_ids": prompt_ids},
                               params, request.stop_strings(), "chat",
                               include_stop=request.include_stop_str_in_output)
    echoed = request.echoed_text(conversation)
    echo = None if echoed is None else EchoedPrompt(echoed, False)
    chunks = [choice_chunks(g, _formatter(state, params, True), echo,
                            request.prompt_logprobs is not None) for g in generations]
    progress = ChoicesProgress(generations)
    writer = OpenAIResponse(True, state.model_name, progress, request.return_token_ids,
                            final_usage, continuous_usage, answer_id, tools=answer,
                            kv_transfer_params=progress.kv_transfer_params)
    return await _answer(generations, interleave(chunks), writer, request.stream, headers)


def _grammar_of(request: CompletionRequest | ChatCompletionRequest
                ) -> tuple[StructuredOutputsParams | None, str]:
    """The request's grammar and the field that asked for it (`response_format`,
    `structured_outputs` or a `guided_*` one): a bad spec is a 400 naming that field."""
    response_format, structured_outputs, field = request.structured_fields()
    try:
        return structured_outputs_of(response_format, structured_outputs), \
            field or "structured_outputs"
    except ApiError as error:
        if field is not None and field.startswith("guided_"):
            error.param = field
            error.message = f"{field}: {error.message}"
        raise


async def _compile(state: ServingState, grammar: StructuredOutputsParams | None,
                   field: str) -> None:
    """Compile the request's grammar on a worker thread (the engine thread then finds it
    cached); one that does not compile is a 400 naming `field`."""
    if grammar is None:
        return
    try:
        await asyncio.to_thread(state.loop.llm.compile_grammar, grammar)
    except ValueError as error:
        message = f"{field}: {error}" if field.startswith("guided_") else str(error)
        raise ApiError(400, message, param=field) from error


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


def _formatter(state: ServingState, params: SamplingParams, chat: bool,
               text_offset: int = 0) -> LogprobsFormatter | None:
    if params.logprobs is None and params.prompt_logprobs is None:
        return None
    return LogprobsFormatter(state.tokenizer.token_texts, chat, text_offset)


async def _start(state: ServingState, http: Request, request_id: str,
                 prompt: str | dict[str, list[int]], params: SamplingParams,
                 stop: list[str], endpoint: str, resumed: list[int] | None = None,
                 resumed_text: str = "", include_stop: bool = False) -> list[Generation]:
    """Submit the request and wait for every choice's first output (or the error)."""
    streams = state.loop.add_choices(request_id, prompt, params) if params.n > 1 else [None]
    generations = []
    for index, stream in enumerate(streams):
        detokenizer = IncrementalDetokenizer(state.tokenizer, stop, include_stop)
        if resumed:
            detokenizer.resume(resumed, resumed_text)
        generations.append(Generation(
            state.loop, choice_request_id(request_id, index, params.n), prompt, params,
            detokenizer, http.receive if index == 0 else None, state.metrics, endpoint,
            stream, index))
    try:
        for generation in generations:
            await generation.first()
    except BaseException:
        for generation in generations:
            generation.close()
        raise
    return generations


async def _answer(generations: list[Generation], chunks: AsyncGenerator[Chunk, None],
                  writer: OpenAIResponse, stream: bool,
                  headers: dict[str, str] | None = None) -> Response:
    if not stream:
        return JSONResponse(await writer.collect(chunks), headers=headers)
    # Once streaming, Starlette watches for the disconnect and cancels the events;
    # watching here too would race it for the same ASGI message.
    for generation in generations:
        generation.stop_watching()

    def close() -> None:
        for generation in generations:
            generation.close()

    return StreamingResponse(writer.events(_worth_sending(chunks, writer.return_token_ids)),
                             media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", **(headers or {})},
                             background=BackgroundTask(close))


async def _worth_sending(chunks: AsyncGenerator[Chunk, None],
                         with_token_ids: bool) -> AsyncGenerator[Chunk, None]:
    """The chunks a streamed answer sends: each choice's first and last, and those with
    new text or logprobs (or, for a client that asked for token ids, every one)."""
    opened: set[int] = set()
    async with aclosing(chunks):
        async for chunk in chunks:
            if chunk.index not in opened or chunk.text or with_token_ids or \
                    chunk.finish_reason or chunk.logprobs:
                yield chunk
            opened.add(chunk.index)
