"""`kvrecover serve`: the OpenAI-compatible HTTP server of one engine.

Routes: `GET /health` (200 only while the engine loop is alive), `GET /v1/models`,
`POST /v1/completions`, `POST /v1/chat/completions`, `GET /metrics`. With an API
key, every `/v1/*` route needs `Authorization: Bearer KEY`. Bodies are read with
a size cap and parsed by hand, so a body it cannot parse (invalid JSON or UTF-8,
nesting past the parser's limit, an integer past Python's digit limit), an
oversized body and every bad field get OpenAI's error format with a 4xx, and the
server keeps serving; an unexpected error in a handler is a 500 `internal_error` in
the same format.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

from kvrecover.entrypoints.server.chat_template import ChatTemplate
from kvrecover.entrypoints.server.engine_loop import EngineLoop
from kvrecover.entrypoints.server.generation import ClientGone
from kvrecover.entrypoints.openai.http import install_error_handlers
from kvrecover.entrypoints.server.metrics import ServerMetrics
from kvrecover.entrypoints.server.serving import (
    ServingState,
    create_chat_completion,
    create_completion,
)
from kvrecover.entrypoints.openai.protocol import ApiError

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 << 20  # a request body larger than this is a 413


@dataclass
class ServerConfig:
    """HTTP-side settings of `kvrecover serve`."""

    model_name: str
    api_key: str | None = None
    max_body_bytes: int = MAX_BODY_BYTES


def build_app(loop: EngineLoop, config: ServerConfig) -> FastAPI:
    """The FastAPI app serving the started engine `loop`."""
    from kvrecover.tokenizer import Tokenizer

    engine = loop.llm.engine
    state = ServingState(loop, ServerMetrics(), config.model_name, Tokenizer(engine.model_dir),
                         ChatTemplate(engine.model_dir), engine.max_model_len)
    app = FastAPI(title="kvrecover", docs_url=None, redoc_url=None, openapi_url=None)
    created = int(time.time())

    @app.middleware("http")
    async def require_api_key(request: Request, call_next):
        if config.api_key and request.url.path.startswith("/v1"):
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {config.api_key}".encode()):
                error = ApiError(401, "missing or wrong API key (Authorization: Bearer KEY)",
                                 "authentication_error", code="invalid_api_key")
                return JSONResponse(error.body(), status_code=401)
        return await call_next(request)

    install_error_handlers(app)

    @app.exception_handler(ClientGone)
    async def client_gone(_request: Request, _error: ClientGone):
        return Response(status_code=499)  # nobody reads it: the client has left

    @app.get("/health")
    async def health():
        if not loop.alive:
            return JSONResponse({"status": "engine loop stopped"}, status_code=503)
        # The limits let `kvrecover proxy` reject impossible token ids and finish reasons.
        return {"status": "ok", "vocab_size": engine.model_config.vocab_size,
                "max_model_len": state.max_model_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": config.model_name, "object": "model", "created": created,
            "owned_by": "kvrecover", "max_model_len": state.max_model_len}]}

    @app.get("/metrics")
    async def metrics():
        snapshot = await loop.snapshot()
        return Response(state.metrics.render(snapshot),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_json_body(request, config.max_body_bytes)
        return await create_completion(state, request, body)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read_json_body(request, config.max_body_bytes)
        return await create_chat_completion(state, request, body)

    return app


async def read_json_body(request: Request, max_body_bytes: int) -> Any:
    """The JSON body, read with a size cap; a 413 or 400 otherwise."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
        raise ApiError(413, f"the request body has {declared} bytes; the limit is "
                            f"{max_body_bytes}", code="request_too_large")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body_bytes:
                raise ApiError(413, f"the request body is over the limit of "
                                    f"{max_body_bytes} bytes", code="request_too_large")
            chunks.append(chunk)
    except ClientDisconnect as error:  # it left before its body was in
        raise ClientGone("the client left while sending its request") from error
    try:
        return json.loads(b"".join(chunks))
    except (ValueError, RecursionError) as error:
        # ValueError: invalid JSON or UTF-8, an integer past Python's digit limit;
        # RecursionError: nesting deeper than the parser's recursion limit.
        reason = "nested too deeply" if isinstance(error, RecursionError) else str(error)
        raise ApiError(400, f"the request body is not valid JSON: {reason}",
                       code="invalid_json") from error
