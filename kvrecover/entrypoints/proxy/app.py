"""`kvrecover proxy`: OpenAI endpoints in front of prefill and decode instances.

Routing, failover and migration live in `request.py`; this module is the
HTTP side: it parses the client's request, answers in the client's format
(streamed or not, completions or chat; written by `openai/responses.py`, as the
server writes it) whatever instance produced the tokens,
and sends no status line before the first token is known, so a request no
instance could serve is a plain 503, never a 200 that ends badly. Everything it
forwards was checked first (`checks.py`); even a bug of its own is an
OpenAI-format 500 (or an error event in a started stream), never plain text. A client that
leaves (streamed or not) has its upstream request closed, so the instance aborts
it; with `stream_options.include_usage` the stream ends with a usage chunk. The
decode instance's `x-kvrecover-ignored-fields` header (the request's unknown fields)
comes with the answer, whole or streamed.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncGenerator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import generate_latest
from starlette.background import BackgroundTask

from kvrecover.entrypoints.openai.http import install_error_handlers, read_json_body
from kvrecover.entrypoints.openai.interleave import interleave
from kvrecover.entrypoints.openai.protocol import (
    IGNORED_FIELDS_HEADER,
    ApiError,
    parse_stream_usage,
)
from kvrecover.entrypoints.openai.responses import OpenAIResponse
from kvrecover.entrypoints.openai.shapes import ModelList, ShapeError, load_json, parse_shape
from kvrecover.entrypoints.openai.tools import ToolAnswer, ToolRequest
from kvrecover.entrypoints.proxy.checks import Piece
from kvrecover.entrypoints.proxy.config import ProxyConfig
from kvrecover.entrypoints.proxy.instances import InstancePool, ProxyMetrics
from kvrecover.entrypoints.proxy.request import (
    CHAT,
    COMPLETIONS,
    ProxiedChoices,
    ProxiedRequest,
    ProxyContext,
    choice_bodies,
)
from kvrecover.entrypoints.proxy.upstream import Rejected, classify_error

FORWARDED_HEADERS = ("authorization",)
DISCONNECT_POLL_S = 0.5  # how often a request not yet answered checks for its client


def build_proxy_app(config: ProxyConfig) -> FastAPI:
    """The proxy's FastAPI app; it checks instance health while it runs."""
    metrics = ProxyMetrics()
    pool = InstancePool(config.prefill, config.decode, metrics)
    holder: dict[str, ProxyContext] = {}

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        timeout = httpx.Timeout(config.timeout, connect=min(config.timeout, 5.0))
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            holder["context"] = ProxyContext(pool, metrics, client, config.max_retries)
            await pool.check_all(client, timeout=5.0)
            checker = asyncio.create_task(pool.health_loop(client, config.health_check_interval))
            try:
                yield
            finally:
                checker.cancel()

    app = FastAPI(title="kvrecover proxy", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)

    install_error_handlers(app)

    @app.exception_handler(Rejected)
    async def rejected(_request: Request, error: Rejected):
        return Response(error.body, status_code=error.status, media_type="application/json")

    @app.get("/health")
    async def health():
        states = {i.url: ("up" if i.up else "down") for i in pool.all}
        status = 200 if any(i.up for i in pool.all) else 503
        return JSONResponse({"status": "ok" if status == 200 else "no instance up",
                             "instances": states}, status_code=status)

    @app.get("/metrics")
    async def proxy_metrics():
        return Response(generate_latest(metrics.registry),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(request: Request):
        client = holder["context"].client
        for instance in pool.decode_candidates():
            try:
                response = await client.get(f"{instance.url}/v1/models",
                                            headers=_forwarded(request))
            except httpx.HTTPError:
                continue
            if response.status_code != 200:
                error = classify_error(instance, response.status_code, response.content)
                if isinstance(error, Rejected):  # e.g. a wrong API key
                    raise error
                continue
            try:
                parse_shape(ModelList, load_json(response.content))
            except ShapeError:
                continue
            return Response(response.content, media_type="application/json")
        raise ApiError(503, "no instance is up", "service_unavailable", code=503)

    async def generate(request: Request, path: str):
        body = await read_json_body(request, config.max_body_bytes)
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        usage = parse_stream_usage(body)
        choices = [ProxiedRequest(holder["context"], path, choice_body, _forwarded(request))
                   for choice_body in choice_bodies(body)]
        # Until a streamed response starts (Starlette watches the client from then
        # on), a client that leaves cancels the work, which closes the upstream
        # request, so the instance aborts it and frees its blocks.
        answer = asyncio.ensure_future(respond(choices, path, body, usage))
        try:
            while True:
                done, _ = await asyncio.wait({answer}, timeout=DISCONNECT_POLL_S)
                if done:
                    return answer.result()
                if await request.is_disconnected():
                    answer.cancel()
                    with contextlib.suppress(asyncio.CancelledError, ApiError, Rejected):
                        await answer
                    return Response(status_code=499)  # nobody reads it: the client left
        finally:
            answer.cancel()  # a no-op once it is done; else this handler was cancelled

    async def respond(choices: list[ProxiedRequest], path: str, body: dict[str, Any],
                      usage: tuple[bool, bool]) -> Response:
        async def close() -> None:
            for proxied in choices:
                await proxied.close()

        try:
            await choices[0].prefill()  # the other choices find its KV (or compute it)
            firsts = []
            for index, proxied in enumerate(choices):
                if index:  # the reference is pulled once: the other choices compute
                    proxied.prompt_token_ids = choices[0].prompt_token_ids
                    proxied.handoff.drop()
                firsts.append(await proxied.open_decode())
        except BaseException:
            await close()
            raise
        # Every choice's text is parsed on its own (with the parser that choice 0's
        # instance named: the instances serve one checkpoint).
        tools = ToolRequest.of(body.get("tools"), body.get("tool_choice")) \
            if path == CHAT else None
        writer = OpenAIResponse(path == CHAT, body.get("model") or firsts[0].model or "",
                                ProxiedChoices(choices), bool(body.get("return_token_ids")),
                                *usage, request_id=f"proxy-{uuid.uuid4().hex}",
                                tools=None if tools is None else
                                ToolAnswer(tools, choices[0].tool_call_parser))
        upstream = choices[0].decode_stream
        headers = {"x-kvrecover-decode-instance": upstream.instance.url}
        ignored = upstream.response.headers.get(IGNORED_FIELDS_HEADER)
        if ignored:  # the client's unknown fields, as the instance named them
            headers[IGNORED_FIELDS_HEADER] = ignored
        pieces = interleave([_chain(index, first, proxied.pieces(first)) for index, (proxied, first)
                             in enumerate(zip(choices, firsts))])
        if body.get("stream"):
            return StreamingResponse(writer.events(pieces), headers=headers,
                                     media_type="text/event-stream",
                                     background=BackgroundTask(close))
        try:
            return JSONResponse(await writer.collect(pieces), headers=headers)
        finally:
            await pieces.aclose()
            await close()  # `pieces` may not have started: then aclose ran nothing

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, COMPLETIONS)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, CHAT)

    return app


def _forwarded(request: Request) -> dict[str, str]:
    return {name: request.headers[name] for name in FORWARDED_HEADERS if name in request.headers}


async def _chain(
    index: int, first: Piece, rest: AsyncGenerator[Piece, None]
) -> AsyncGenerator[Piece, None]:
    """Choice `index`'s pieces: `first`, then `rest`."""
    try:
        first.index = index
        yield first
        async for piece in rest:
            piece.index = index
            yield piece
    finally:
        await rest.aclose()
