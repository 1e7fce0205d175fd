"""The HTTP plumbing the server and the proxy share: a capped JSON body reader and
OpenAI-format error responses (every error, a bug included, is an `{"error": {...}}`
body, never Starlette's plain text)."""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from kvrecover.entrypoints.openai.protocol import MAX_BODY_BYTES, ApiError

MAX_DETAIL_CHARS = 300  # of an unexpected error's own message, in a 500's body


class ClientGone(Exception):
    """The client disconnected; its request was (or is being) aborted."""


def internal_error(error: BaseException) -> ApiError:
    """The 500 `internal_error` that an unexpected exception is answered with."""
    detail = f"{type(error).__name__}: {error}"[:MAX_DETAIL_CHARS]
    return ApiError(500, f"internal error: {detail}", "internal_error")


def install_error_handlers(app: FastAPI) -> None:
    """Answer `ApiError`, Starlette's own HTTP errors (404, 405, ...), a client that left
    (a 499 nobody reads) and any other exception a handler raises (a 500
    `internal_error`) in OpenAI's format; both apps call this once when they are built."""

    @app.exception_handler(Exception)
    async def unexpected_error(_request: Request, error: Exception) -> Response:
        # Starlette re-raises it after this response, so the server log has the trace.
        return JSONResponse(internal_error(error).body(), status_code=500)

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, error: ApiError) -> Response:
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(ClientGone)
    async def client_gone(_request: Request, _error: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it: the client has left

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, error: StarletteHTTPException) -> Response:
        error_type = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        body = ApiError(error.status_code, str(error.detail), error_type).body()
        return JSONResponse(body, status_code=error.status_code)


async def read_json_body(request: Request, max_body_bytes: int = MAX_BODY_BYTES) -> Any:
    """The JSON body, read with a size cap; a 413 or 400 otherwise (ClientGone when
    the client leaves before its body is in)."""
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
