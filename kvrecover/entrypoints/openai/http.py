"""OpenAI-format error responses shared by the server and the proxy."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvrecover.entrypoints.openai.protocol import ApiError

MAX_DETAIL_CHARS = 300  # of an unexpected error's own message, in a 500's body


def internal_error(error: BaseException) -> ApiError:
    """The 500 `internal_error` that an unexpected exception is answered with."""
    detail = f"{type(error).__name__}: {error}"[:MAX_DETAIL_CHARS]
    return ApiError(500, f"internal error: {detail}", "internal_error")


def install_error_handlers(app: FastAPI) -> None:
    """Answer `ApiError`, Starlette's own HTTP errors (404, 405, ...) and any other
    exception a handler raises (a 500 `internal_error`: never Starlette's plain-text
    500) as `{"error": {...}}` bodies; both apps call this once when they are built."""

    @app.exception_handler(Exception)
    async def unexpected_error(_request: Request, error: Exception):
        # Starlette re-raises it after this response, so the server log has the trace.
        return JSONResponse(internal_error(error).body(), status_code=500)

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, error: ApiError):
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, error: StarletteHTTPException):
        error_type = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        body = ApiError(error.status_code, str(error.detail), error_type).body()
        return JSONResponse(body, status_code=error.status_code)
