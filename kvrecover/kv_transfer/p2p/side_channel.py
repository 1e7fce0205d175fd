"""The producer's side channel: one JSON line in, one JSON line out, over TCP.

NIXL moves the KV bytes; everything around them goes through here: the handshake
(agent metadata, where each layer's blocks live, block size, layout fingerprint), the
per-pull check (is this request's reference still held, and what are its blocks'
checksums) and the release (the consumer is done: free the blocks). One request per
connection; every read and write is bounded in size and time, so a peer that hangs
or sends garbage costs one failed call, never a stuck thread.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import socket
import socketserver
import threading
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 << 20  # a handshake of a large model's regions stays far below
CALL_TIMEOUT_S = 5.0

Handler = Callable[[dict[str, Any]], dict[str, Any]]


class SideChannelError(OSError):
    """The peer could not be reached, or answered something that is not a message."""


def _read_line(stream: socket.socket, deadline: float) -> bytes:
    """One message, by `deadline`: a peer that trickles bytes cannot stretch a call."""
    chunks: list[bytes] = []
    size = 0
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the peer's message did not end in time")
        stream.settimeout(left)
        chunk = stream.recv(1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
        if chunk.endswith(b"\n"):
            break
        if size > MAX_MESSAGE_BYTES:
            raise SideChannelError(f"side-channel message over {MAX_MESSAGE_BYTES} bytes")
    return b"".join(chunks)


Address = tuple[socket.AddressFamily, Any]  # a family and its socket address


def _resolve(host: str, port: int, timeout_s: float) -> list[Address]:
    """`host`'s addresses, looked up on a thread of its own when it is a name: the
    system's lookup takes no timeout, and a call must not outlast `timeout_s`."""
    try:
        version = ipaddress.ip_address(host).version
        return [((socket.AF_INET6 if version == 6 else socket.AF_INET), (host, port))]
    except ValueError:
        pass
    found: list[list[Address]] = []
    failed: list[OSError] = []

    def lookup() -> None:
        try:
            info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            found.append([(family, address) for family, _, _, _, address in info])
        except OSError as error:
            failed.append(error)

    thread = threading.Thread(target=lookup, daemon=True, name="kvrecover-nixl-lookup")
    thread.start()
    thread.join(timeout_s)
    if failed:
        raise failed[0]
    if not found:
        raise TimeoutError(f"looking up {host!r} took over {timeout_s:g} s")
    return found[0]


def _connect(addresses: list[Address], deadline: float) -> socket.socket:
    """A connection to the first of `addresses` that takes one by `deadline`."""
    error: OSError = TimeoutError("no time was left to connect")
    for family, address in addresses:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        stream = socket.socket(family, socket.SOCK_STREAM)
        try:
            stream.settimeout(left)
            stream.connect(address)
            return stream
        except OSError as refused:
            stream.close()
            error = refused
    raise error


def call(host: str, port: int, message: dict[str, Any],
         timeout_s: float = CALL_TIMEOUT_S) -> dict[str, Any]:
    """Send `message` to the side channel at host:port and return its answer within
    `timeout_s` in all (name lookup, connection, answer); a SideChannelError when the
    peer is unreachable, too slow or answers garbage."""
    deadline = time.monotonic() + timeout_s
    try:
        with _connect(_resolve(host, port, timeout_s), deadline) as stream:
            stream.sendall(json.dumps(message).encode() + b"\n")
            raw = _read_line(stream, deadline)
    except OSError as error:
        raise SideChannelError(f"side channel {host}:{port}: {error}") from error
    try:
        answer = json.loads(raw)
    except ValueError as error:
        raise SideChannelError(f"side channel {host}:{port} answered garbage") from error
    if not isinstance(answer, dict):
        raise SideChannelError(f"side channel {host}:{port} answered {type(answer).__name__}")
    return answer


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    handler: Handler


class _Connection(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        server: _Server = self.server  # type: ignore[assignment]
        try:
            message = json.loads(_read_line(self.request, time.monotonic() + CALL_TIMEOUT_S))
            if not isinstance(message, dict):
                raise ValueError("a message must be a JSON object")
            answer = server.handler(message)
        except Exception as error:  # a bad peer gets an answer, the server goes on
            answer = {"ok": False, "reason": f"bad request: {error}"}
        try:
            self.request.settimeout(CALL_TIMEOUT_S)
            self.request.sendall(json.dumps(answer).encode() + b"\n")
        except OSError:
            pass


class SideChannelServer:
    """Serves `handler` on host:port in a background thread until `close`."""

    def __init__(self, host: str, port: int, handler: Handler) -> None:
        try:
            self._server = _Server((host, port), _Connection)
        except OSError as error:
            raise OSError(f"the NIXL side channel cannot listen on {host}:{port}: {error} "
                          "(set kv_connector_extra_config side_channel_port)") from error
        self._server.handler = handler
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": 0.05},
                                        name="kvrecover-nixl-side-channel", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop serving and release the port (bounded)."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
