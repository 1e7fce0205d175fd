"""Talking to one instance: a streamed generation request, read as `Piece`s.

`open_stream` returns only once the instance sent its first piece, so every way
an instance can fail before that (refused, timed out, 5xx, `kv_load_failed`, a
stream that ends at once) is a `Retryable` the proxy fails over on, and a 4xx
about the request itself is a `Rejected` that goes back to the client unchanged.
After the first piece, a broken stream raises `StreamBroken` (the proxy
migrates the request).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx

from kvrecover.entrypoints.proxy_instances import Instance


@dataclass
class Piece:
    """What one upstream chunk added."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    prompt_token_ids: list[int] | None = None  # on the first chunk
    model: str | None = None


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
    """The stream ended, errored or stalled after its first piece."""


class UpstreamStream:
    """An open streamed generation on one instance."""

    def __init__(self, instance: Instance, response: httpx.Response, chat: bool) -> None:
        self.instance = instance
        self.response = response
        self.chat = chat
        self._lines = response.aiter_lines()

    async def next_piece(self) -> Piece:
        """The next piece; StreamBroken when the stream fails or ends early."""
        try:
            async for line in self._lines:
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    raise StreamBroken("the stream ended without a finish reason")
                event = json.loads(data)
                if "error" in event:
                    raise StreamBroken(f"the instance reported: {event['error']}")
                return _piece(event, self.chat)
        except (httpx.HTTPError, json.JSONDecodeError, KeyError, IndexError) as error:
            raise StreamBroken(f"{type(error).__name__}: {error}") from error
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
                      body: dict[str, Any], headers: dict[str, str]) -> tuple[UpstreamStream, Piece]:
    """Start a streamed request and wait for its first piece."""
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
    stream = UpstreamStream(instance, response, chat=path.endswith("chat/completions"))
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
                    body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
    """A non-streamed request; Retryable or Rejected unless it answers 200 with JSON."""
    try:
        response = await client.post(f"{instance.url}{path}", json=body, headers=headers)
    except httpx.TransportError as error:
        connect_failed = isinstance(error, (httpx.ConnectError, httpx.ConnectTimeout))
        raise Retryable(f"{instance.url}: {type(error).__name__}: {error}",
                        connect_failed) from error
    if response.status_code != 200:
        raise classify_error(instance, response.status_code, response.content)
    try:
        return response.json()
    except json.JSONDecodeError as error:
        raise Retryable(f"{instance.url}: the answer is not JSON") from error


def classify_error(instance: Instance, status: int, content: bytes) -> Exception:
    """Retryable for 5xx, 429 and kv_load_failed; Rejected for other 4xx."""
    try:
        error_type = json.loads(content).get("error", {}).get("type")
    except (json.JSONDecodeError, AttributeError):
        error_type = None
    if status >= 500 or status == 429 or error_type == "kv_load_failed":
        return Retryable(f"{instance.url}: HTTP {status} ({error_type})")
    return Rejected(status, content)


async def _read_and_close(response: httpx.Response) -> bytes:
    try:
        return await response.aread()
    except httpx.HTTPError:
        return b""
    finally:
        await response.aclose()


def _piece(event: dict[str, Any], chat: bool) -> Piece:
    choice = event["choices"][0]
    if chat:
        text = (choice.get("delta") or {}).get("content") or ""
        prompt_ids = event.get("prompt_token_ids")
    else:
        text = choice.get("text") or ""
        prompt_ids = choice.get("prompt_token_ids")
    return Piece(text, list(choice.get("token_ids") or []), choice.get("finish_reason"),
                 prompt_ids, event.get("model"))
