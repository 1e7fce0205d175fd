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
import logging
import time
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvrecover.entrypoints.openai.http import install_error_handlers, read_json_body
from kvrecover.entrypoints.openai.protocol import MAX_BODY_BYTES, ApiError
from kvrecover.entrypoints.openai.tool_parsers import PARSERS
from kvrecover.entrypoints.server.chat_template import AUTO_PARSER, ChatTemplate
from kvrecover.entrypoints.server.engine_loop import EngineLoop
from kvrecover.entrypoints.server.metrics import ServerMetrics
from kvrecover.entrypoints.server.serving import (
    ServingState,
    create_chat_completion,
    create_completion,
)
from kvrecover.options import REQUIRED, option, redacted, validate

logger = logging.getLogger(__name__)


@dataclass
class ServerConfig:
    """HTTP-side settings of one server's app (`kvrecover serve` builds it from its
    flags, `ServeArgs`; tests build it directly)."""

    model_name: str = option(REQUIRED, "the model name clients send and /v1/models lists",
                             str, check=lambda name: None if name else "a non-empty name")
    api_key: str | None = option(
        None, "the key every /v1/* request must send as 'Authorization: Bearer KEY'", str,
        nullable=True, shown=redacted, repr=False)
    max_body_bytes: int = option(MAX_BODY_BYTES, "a request body larger than this is a 413",
                                 int, minimum=1)
    tool_call_parser: str = option(
        AUTO_PARSER, "how `auto` tool calls are parsed: from the chat template and model "
        "family, or hermes (Qwen) / llama3_json (Llama 3)", str,
        choices=(AUTO_PARSER, *PARSERS))

    def __post_init__(self) -> None:
        validate(self)


def build_app(loop: EngineLoop, config: ServerConfig) -> FastAPI:
    """The FastAPI app serving the started engine `loop`."""
    from kvrecover.tokenizer import Tokenizer

    engine = loop.llm.engine
    state = ServingState(loop, ServerMetrics(), config.model_name, Tokenizer(engine.model_dir),
                         ChatTemplate(engine.model_dir, config.tool_call_parser),
                         engine.max_model_len)
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
        return Response(state.metrics.render(snapshot, loop.alive),
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
