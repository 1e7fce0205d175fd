"""OpenAI-format error responses shared by the server and the proxy."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvrecover.entrypoints.protocol import ApiError


def install_error_handlers(app: FastAPI) -> None:
    """Answer `ApiError` and Starlette's own HTTP errors (404, 405, ...) as
    `{"error": {...}}` bodies; both apps call this once when they are built."""

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, error: ApiError):
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, error: StarletteHTTPException):
        error_type = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        body = ApiError(error.status_code, str(error.detail), error_type).body()
        return JSONResponse(body, status_code=error.status_code)
