"""Talking to one instance: a streamed generation request, read as `Piece`s.

`open_stream` returns only once the instance sent its first piece, so every way
an instance can fail before that (refused, timed out, 5xx, `kv_load_failed`, a
stream that ends at once, an event that is not a valid chunk or fails the
request's `StreamCheck`) is a `Retryable` the proxy fails over on, and a 4xx
about the request itself, with an OpenAI error body, is a `Rejected` that goes
back to the client. After the first piece, a broken stream or an invalid event
raises `StreamBroken` (the proxy migrates the request). Nothing an instance sends
reaches the client before it was parsed and checked here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx

from kvrecover.entrypoints.openai.shapes import ErrorAnswer, ShapeError, load_json, parse_shape
from kvrecover.entrypoints.proxy.checks import Piece, piece_from_event
from kvrecover.entrypoints.proxy.instances import Instance

PieceCheck = Callable[[Piece], None]  # raises ValueError for a piece the proxy must not take


class Retryable(Exception):
    """The instance failed before sending anything; another one may serve the request."""

    def __init__(self, message: str, connect_failed: bool = False) -> None:
        super().__init__(message)
        self.connect_failed = connect_failed


class Rejected(Exception):
    """The instance refused the request itself (a 4xx): the client gets that answer."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status
        self.body = body


class StreamBroken(Exception):
    """The stream ended, errored, stalled or sent an invalid event after its first piece."""


class UpstreamStream:
    """An open streamed generation on one instance; `check` vets every piece."""

    def __init__(self, instance: Instance, response: httpx.Response, chat: bool,
                 check: PieceCheck) -> None:
        self.instance = instance
        self.response = response
        self.chat = chat
        self.check = check
        self._lines = response.aiter_lines()

    async def next_piece(self) -> Piece:
        """The next piece; StreamBroken when the stream fails, ends early or sends
        anything but a valid chunk that passes `check`."""
        try:
            async for line in self._lines:
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    raise StreamBroken("the stream ended without a finish reason")
                event = load_json(data)
                if isinstance(event, dict) and "error" in event:
                    raise StreamBroken(f"the instance reported: {str(event['error'])[:300]}")
                piece = piece_from_event(event, self.chat)
                self.check(piece)
                return piece
        except httpx.HTTPError as error:
            raise StreamBroken(f"{type(error).__name__}: {error}") from error
        except ValueError as error:  # ShapeError, ImpossibleOutput
            raise StreamBroken(f"an invalid event: {error}") from error
        raise StreamBroken("the stream ended without a finish reason")

    async def pieces(self) -> AsyncIterator[Piece]:
        """Pieces until the one with a finish reason."""
        while True:
            piece = await self.next_piece()
            yield piece
            if piece.finish_reason is not None:
                return

    async def close(self) -> None:
        await self.response.aclose()


async def open_stream(client: httpx.AsyncClient, instance: Instance, path: str,
                      body: dict[str, Any], headers: dict[str, str],
                      check: PieceCheck) -> tuple[UpstreamStream, Piece]:
    """Start a streamed request and wait for its first piece (checked by `check`)."""
    request = client.build_request("POST", f"{instance.url}{path}", json=body, headers=headers)
    try:
        response = await client.send(request, stream=True)
    except httpx.TransportError as error:
        connect_failed = isinstance(error, (httpx.ConnectError, httpx.ConnectTimeout))
        raise Retryable(f"{instance.url}: {type(error).__name__}: {error}",
                        connect_failed) from error
    if response.status_code != 200:
        content = await _read_and_close(response)
        raise classify_error(instance, response.status_code, content)
    stream = UpstreamStream(instance, response, path.endswith("chat/completions"), check)
    try:
        first = await stream.next_piece()
    except StreamBroken as error:
        await stream.close()
        raise Retryable(f"{instance.url}: {error}") from error
    except BaseException:  # cancelled (the client left): the instance must see it go
        await stream.close()
        raise
    return stream, first


async def post_json(client: httpx.AsyncClient, instance: Instance, path: str,
                    body: dict[str, Any], headers: dict[str, str]) -> Any:
    """A non-streamed request's JSON answer (not yet checked for shape); Retryable
    or Rejected unless it answers 200 with JSON."""
    try:
        response = await client.post(f"{instance.url}{path}", json=body, headers=headers)
    except httpx.TransportError as error:
        connect_failed = isinstance(error, (httpx.ConnectError, httpx.ConnectTimeout))
        raise Retryable(f"{instance.url}: {type(error).__name__}: {error}",
                        connect_failed) from error
    if response.status_code != 200:
        raise classify_error(instance, response.status_code, response.content)
    try:
        return load_json(response.content)
    except ShapeError as error:
        raise Retryable(f"{instance.url}: the answer is {error}") from error


def classify_error(instance: Instance, status: int, content: bytes) -> Exception:
    """Rejected (with the error re-encoded) for a 4xx about the request that carries
    an OpenAI error body; Retryable for everything else: 5xx, 429, kv_load_failed,
    any other status, a body that is not an OpenAI error."""
    try:
        error = parse_shape(ErrorAnswer, load_json(content))
    except ShapeError:
        return Retryable(f"{instance.url}: HTTP {status} without an OpenAI error body")
    error_type = error.error.type
    if not 400 <= status < 500 or status == 429 or error_type == "kv_load_failed":
        return Retryable(f"{instance.url}: HTTP {status} ({error_type})")
    return Rejected(status, error.model_dump_json().encode())


async def _read_and_close(response: httpx.Response) -> bytes:
    try:
        return await response.aread()
    except httpx.HTTPError:
        return b""
    finally:
        await response.aclose()

