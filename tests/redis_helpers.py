"""Redis test helpers: a private redis-server, the network faults the tests inject
(a proxy that breaks a load, one that trickles its replies, a server that never answers),
and large sealed entries with the peak memory a call allocates (the copy-free save tests)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
import torch

from kvrecover.kv_layout import KVCacheLayout


class RedisServer:
    """A private redis-server on 127.0.0.1 (a free port) and a unix socket, in its own folder."""

    def __init__(self, password: str | None = None) -> None:
        # A short folder: unix socket paths are limited to ~100 bytes.
        self.folder = Path(tempfile.mkdtemp(prefix="kvr-redis-"))
        self.socket = self.folder / "redis.sock"
        self.password = password
        self.port = 0
        self.process = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def unix_url(self) -> str:
        return f"unix://{self.socket}"

    def start(self, keep_port: bool = False) -> RedisServer:
        """Start (or restart, on the same port with `keep_port`); waits until it answers."""
        for _ in range(5):  # the free port may be taken between probing and binding
            if not keep_port or not self.port:
                self.port = free_port()
            command = [shutil.which("redis-server"), "--port", str(self.port), "--bind",
                       "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(self.folder),
                       "--unixsocket", str(self.socket), "--unixsocketperm", "700",
                       "--daemonize", "no", "--loglevel", "warning"]
            if self.password:
                command += ["--requirepass", self.password]
            self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL)
            if self._wait_ready():
                return self
            self.stop()
        raise RuntimeError("redis-server did not start")

    def _wait_ready(self) -> bool:
        client = redis.Redis(host="127.0.0.1", port=self.port, password=self.password,
                             socket_timeout=1, socket_connect_timeout=1)
        for _ in range(200):  # up to ~10 s
            if self.process.poll() is not None:
                return False
            try:
                if client.ping():
                    return True
            except redis.RedisError:
                time.sleep(0.05)
        return False

    def client(self) -> redis.Redis:
        """A plain client of this server (for the tests' own checks)."""
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password,
                           socket_timeout=5)

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 10 s)."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self.process = None

    def kill(self) -> None:
        """SIGKILL: the server vanishes mid-whatever it was doing."""
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=10)
            self.process = None

    def cleanup(self) -> None:
        """Stop the server and remove its folder."""
        self.stop()
        shutil.rmtree(self.folder, ignore_errors=True)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listened on a moment ago."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def require_redis_server() -> None:
    """Skip without a redis-server binary, except in CI, where that is a failure."""
    if shutil.which("redis-server"):
        return
    if os.environ.get("CI") == "true":
        pytest.fail("redis-server is not installed but CI=true: scripts/bootstrap.sh installs it "
                    "(apt-get install -y redis-server)")
    pytest.skip("redis-server is not installed (apt-get install -y redis-server, or run "
                "scripts/bootstrap.sh as root)")


class _LoopbackListener:
    """A TCP listener on a free 127.0.0.1 port that hands each accepted connection to
    `_serve` on a background thread; `stop` closes it and every socket it tracks."""

    def __init__(self) -> None:
        self.port = free_port()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._listener.settimeout(0.1)
        self._stopping = threading.Event()
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        while not self._stopping.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self._serve(client)

    def _track(self, *sockets: socket.socket) -> None:
        with self._lock:
            self._sockets += sockets

    def _serve(self, client: socket.socket) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        self._stopping.set()
        _close(self._listener)
        with self._lock:
            for sock in self._sockets:
                _close(sock)


class _UpstreamRelay(_LoopbackListener):
    """A listener that connects each client to the redis-server at `upstream_port` and
    runs `_relays(client, upstream)`'s two pumps (client to server, server to client)."""

    upstream_port: int

    def _serve(self, client: socket.socket) -> None:
        try:
            upstream = connect_upstream(self.upstream_port)
        except OSError:
            client.close()
            return
        self._track(client, upstream)
        for pump, args in self._relays(client, upstream):
            threading.Thread(target=pump, args=args, daemon=True).start()

    def _relays(self, client: socket.socket, upstream: socket.socket
                ) -> list[tuple[Callable[..., None], tuple]]:
        raise NotImplementedError


class FaultyProxy(_UpstreamRelay):
    """Forwards TCP between clients and a redis-server on 127.0.0.1. The first time a
    client sends GETRANGE (a block load), `on_load` runs before the bytes go on:
    "kill" kills the server (the load's connection drops mid-load), "blackhole"
    swallows that and all later traffic while keeping the sockets open (the load
    times out). The fault is in place before any client's later bytes go on, so no
    load, on any connection, is answered after the first one was seen."""

    def __init__(self, upstream_port: int, on_load: str, kill: Callable[[], None] | None = None):
        if on_load not in ("kill", "blackhole"):
            raise ValueError(f"on_load must be 'kill' or 'blackhole', got {on_load!r}")
        self.upstream_port = upstream_port
        self.on_load = on_load
        self.kill = kill
        self.triggered = threading.Event()
        self.blackholed = False
        # Held from seeing a client's bytes until they went on (or were swallowed): another
        # connection's load can never slip through between the trigger and the fault.
        self._fault_lock = threading.Lock()
        super().__init__()

    def _relays(self, client: socket.socket, upstream: socket.socket
                ) -> list[tuple[Callable[..., None], tuple]]:
        return [(self._pump, (client, upstream, True)), (self._pump, (upstream, client, False))]

    def _pump(self, source: socket.socket, target: socket.socket, from_client: bool) -> None:
        try:
            while not self._stopping.is_set():
                data = source.recv(1 << 16)
                if not data:
                    break
                if from_client:
                    with self._fault_lock:
                        self._forward_request(data, target)
                elif not self.blackholed:  # else swallowed, like everything after the trigger
                    target.sendall(data)
        except OSError:
            pass
        if not self.blackholed:
            for sock in (source, target):
                _close(sock)

    def _forward_request(self, data: bytes, upstream: socket.socket) -> None:
        """Send a client's bytes on, unless the fault swallows them; the first load
        triggers the fault first (the caller holds `_fault_lock`)."""
        if b"GETRANGE" in data and not self.triggered.is_set():
            self.triggered.set()
            if self.on_load == "kill":
                self.kill()
            else:
                self.blackholed = True
        if not self.blackholed:  # else the peer waits for an answer that never comes
            upstream.sendall(data)


class TricklingProxy(_UpstreamRelay):
    """Forwards TCP between clients and a redis-server on 127.0.0.1; once a client has
    sent GETRANGE (a block load) on a connection, the server's replies on it come one
    byte every `delay_s`: each socket read stays inside any socket timeout while the
    whole reply takes hours. Counts the trickled connections and how many of them the
    client has closed."""

    def __init__(self, upstream_port: int, delay_s: float = 0.3) -> None:
        self.upstream_port = upstream_port
        self.delay_s = delay_s
        self.trickled = 0  # connections whose replies trickle
        self.closed_by_client = 0  # of those, how many the client closed
        super().__init__()

    def _relays(self, client: socket.socket, upstream: socket.socket
                ) -> list[tuple[Callable[..., None], tuple]]:
        trickling = threading.Event()
        return [(self._requests, (client, upstream, trickling)),
                (self._replies, (upstream, client, trickling))]

    def _requests(self, client: socket.socket, upstream: socket.socket,
                  trickling: threading.Event) -> None:
        try:
            while not self._stopping.is_set():
                data = client.recv(1 << 16)
                if not data:
                    break
                if b"GETRANGE" in data and not trickling.is_set():
                    with self._lock:
                        self.trickled += 1
                    trickling.set()  # before the request goes on: its reply trickles
                upstream.sendall(data)
        except OSError:
            pass
        if trickling.is_set() and not self._stopping.is_set():
            with self._lock:
                self.closed_by_client += 1
        for sock in (client, upstream):
            _close(sock)

    def _replies(self, upstream: socket.socket, client: socket.socket,
                 trickling: threading.Event) -> None:
        try:
            while not self._stopping.is_set():
                data = upstream.recv(1 << 16)
                if not data:
                    break
                if not trickling.is_set():
                    client.sendall(data)
                    continue
                for index in range(len(data)):
                    if self._stopping.wait(self.delay_s):
                        return
                    client.sendall(data[index : index + 1])
        except OSError:
            pass


class SilentServer(_LoopbackListener):
    """Accepts TCP connections on 127.0.0.1 and never sends a byte."""

    def __init__(self) -> None:
        self.connections = 0
        super().__init__()

    def _serve(self, client: socket.socket) -> None:
        self.connections += 1
        self._track(client)  # held open, never answered


def connect_upstream(port: int) -> socket.socket:
    """A connection to the server on 127.0.0.1:`port` (5 s to connect); reads on it then
    wait as long as the server is silent: a proxy never drops an idle connection itself."""
    upstream = socket.create_connection(("127.0.0.1", port), timeout=5)
    upstream.settimeout(None)
    return upstream


def _close(sock: socket.socket) -> None:
    """Close `sock` so that the peer sees it at once, even while another thread is
    blocked reading it (a bare close() leaves that connection open until the read
    returns)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # never connected, or already shut down
    try:
        sock.close()
    except OSError:
        pass


LARGE_LAYOUT = KVCacheLayout("test-model-large", torch.float32, 16, 4, 8, 128)  # 512 KiB entries


def sealed_entries(store: Any, count: int) -> list[tuple[bytes, Any]]:
    """`count` (key, sealed entry) pairs of `store`, entry i filled with the value i."""
    entries = []
    for index in range(count):
        key = bytes([index]) * 16
        entry, payload = store.new_entry()
        payload.fill_(float(index))
        entries.append((key, store.seal(key, entry)))
    return entries


def peak_allocation(call: Callable[[], Any]) -> int:
    """The peak of the bytes Python allocated while `call()` ran (tracemalloc)."""
    tracemalloc.start()
    try:
        call()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
