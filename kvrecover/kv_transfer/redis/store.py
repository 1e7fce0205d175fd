"""RedisBlockStore: KV blocks as Redis values, one key per block, batched round trips.

Key: `<key_prefix><layout fingerprint>:<block hash hex>`, so KV of another model
or layout is simply a miss; value: the `block_store` framing (header, checksums,
raw payload), verified by `parse` like a file would be. Every call is one round
trip however many blocks it covers: `exists_many` is a pipeline of EXISTS,
`read_many` a pipeline of GETRANGE, `write_many` a pipeline of SET (with an expiry
when `ttl_s` is set).

Stored values are untrusted (DESIGN.md, Trust): a read asks for at most one byte
more than an entry of this layout has, so a hostile multi-megabyte value costs a
block's worth of memory and is rejected by its size, never read whole.

`timeout_s` bounds each call as a whole: waiting for a pooled connection,
connecting, sending and reading the whole reply together, however the server paces
its bytes (redis-py's own socket timeout bounds each socket read only, so a server
trickling one byte at a time would pass it forever). The calls run on redis-py's
asyncio client, on one event-loop thread for every store of the process
(`kv-redis-io`), under `asyncio.timeout` (`wait_for` on Python 3.10): a call past
it is cancelled there, and redis-py closes the connection it was reading (a reply
cut in the middle is never handed to the next call); no thread stays blocked on a
slow server. Nothing ever waits on that thread itself: a garbage collection there
can run an engine's finalizer, whose `close` then only schedules the disconnect.

The store never raises for a store failure: a refused or dropped connection, a
timeout or an error reply makes every block it covers missing (reads, lookups) or
failed (writes), and the caller turns that into invalid blocks or a counted save
failure. After such a failure the store answers "unavailable" at once for
`timeout_s` instead of waiting on a dead server again; then it tries again. (A
cluster, `cluster_store`, does all this per node.)

The password (from the URL or KVRECOVER_REDIS_PASSWORD) stays inside the
redis-py connection pool; `repr` and every message show the URL without it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import urlsplit

import redis
import redis.asyncio
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from kvrecover.kv_layout import KVCacheLayout
from kvrecover.kv_transfer.base import SETTING_LABEL
from kvrecover.kv_transfer.redis.urls import TLS_OPTIONS, redact_url, url_problem
from kvrecover.kv_transfer.redis.writes import chunked_writes
from kvrecover.kv_transfer.stores.block_store import BlockCodec, BlockLoadError
from kvrecover.options import option, validate

logger = logging.getLogger(__name__)

PASSWORD_ENV = "KVRECOVER_REDIS_PASSWORD"
SERVER = ""  # the name of the one server in the per-node bookkeeping
LOOP_GRACE_S = 5.0  # beyond timeout_s, how long a caller waits for the I/O loop itself
T = TypeVar("T")
QueueCommand = Callable[[Any, int], Any]  # (pipeline, i): queue the command of the i-th key

_loop_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_closing: set[asyncio.Task] = set()  # disconnects scheduled from the loop's own thread


def io_loop() -> asyncio.AbstractEventLoop:
    """The event loop every Redis store of this process runs its calls on (started on
    first use, on the daemon thread `kv-redis-io`)."""
    global _loop
    with _loop_lock:
        if _loop is None or _loop.is_closed():
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="kv-redis-io", daemon=True).start()
        return _loop


def _shown_url(url: object) -> str:
    return repr(redact_url(str(url)))


@dataclass(frozen=True)
class RedisSettings:
    """Where and how to reach the server (keys of `kv_connector_extra_config`); no
    password appears in `repr` nor in an error message."""

    url: str = option(
        "redis://127.0.0.1:6379/0", "redis://[user:password@]host:port/db, rediss://..., "
        "unix:///path.sock, or a cluster: redis+cluster://[user:password@]host:port[,host:port"
        "...] (its seed nodes; rediss+cluster:// for TLS; valkey:// is an alias of redis://); "
        "TLS options in the query: rediss://...?ssl_ca_certs=/path/ca.crt&ssl_certfile=...",
        str, check=url_problem, shown=_shown_url,
        describe="a redis://, rediss://, unix://, valkey:// or valkeys:// URL, or "
        "redis+cluster://host:port[,host:port...] (rediss+cluster:// for TLS, whose query may "
        f"set only {', '.join(TLS_OPTIONS)})")
    key_prefix: str = option("kvrecover:", "prepended to every key", str)
    ttl_s: float | None = option(
        None, "expiry of stored blocks in seconds (None: never expire)", float, nullable=True,
        above=0, maximum=1e9, describe="None or a number of seconds > 0")
    timeout_s: float = option(
        5.0, "bound on connecting, on each round trip and on waiting for a pooled "
        "connection", float, above=0, maximum=1e9, describe="a number of seconds > 0")
    max_connections: int = option(16, "connection pool size per connector instance", int,
                                  minimum=1)
    password: str | None = field(default=None, repr=False)  # not a setting: from the URL or env

    def __post_init__(self) -> None:
        validate(self, SETTING_LABEL)

    @property
    def redacted_url(self) -> str:
        """The URL as it may be shown."""
        return redact_url(self.url)

    def __repr__(self) -> str:
        return (f"RedisSettings(url={self.redacted_url!r}, key_prefix={self.key_prefix!r}, "
                f"ttl_s={self.ttl_s!r}, timeout_s={self.timeout_s!r}, "
                f"max_connections={self.max_connections!r})")


class RedisBlockStore(BlockCodec):
    """Batched, verified KV block storage in one Redis (or Valkey) database."""

    def __init__(self, layout: KVCacheLayout, settings: RedisSettings) -> None:
        super().__init__(layout)
        self.settings = settings
        self._key_head = f"{settings.key_prefix}{layout.fingerprint}:".encode()
        self._password = settings.password or os.environ.get(PASSWORD_ENV) or None
        self._loop = io_loop()
        self._lock = threading.Lock()
        self._unavailable_until: dict[str, float] = {}  # node name -> monotonic time
        self._connect()

    def _connect(self) -> None:
        """Create the client (`self.client`) of the server the settings name."""
        settings = self.settings
        url = settings.url
        if url.startswith("valkey"):  # the same protocol under its fork's name
            url = "redis" + url.removeprefix("valkey")
        options = dict(
            max_connections=settings.max_connections,
            # Each part's own bound; `_call` bounds the whole call by timeout_s as well.
            timeout=settings.timeout_s,  # waiting for a free pooled connection
            socket_timeout=settings.timeout_s,
            socket_connect_timeout=settings.timeout_s,
            # One reconnect for a pooled connection the server closed while it sat idle (an
            # asyncio connection may not have seen the close yet); `_call`'s bound covers it.
            retry=Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)),
            driver_info=None,  # no CLIENT SETINFO round trips per new connection
        )
        if self._password and urlsplit(url).password is None:
            options["password"] = self._password
        self.pool = redis.asyncio.BlockingConnectionPool.from_url(url, **options)
        # (set here: from_url takes the connection class from the URL's scheme)
        self.pool.connection_class = chunked_writes(self.pool.connection_class)
        self.client: Any = redis.asyncio.Redis(connection_pool=self.pool)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.settings.redacted_url!r}, prefix={self.settings.key_prefix!r})"

    def redis_key(self, key: bytes) -> bytes:
        """The Redis key of a block."""
        return self._key_head + key.hex().encode()

    # ----- availability, per node (one, here) -----------------------------------------------
    def _available(self, node: str) -> bool:
        return time.monotonic() >= self._unavailable_until.get(node, 0.0)

    def _failed(self, operation: str, node: str, error: BaseException) -> None:
        """Note a failed call to `node`: one that could not reach it is not tried again
        for timeout_s."""
        if isinstance(error, (redis.ConnectionError, redis.TimeoutError)):
            with self._lock:
                self._unavailable_until[node] = time.monotonic() + self.settings.timeout_s
        where = self.settings.redacted_url + (f" (node {node})" if node else "")
        logger.warning("Redis %s at %s failed: %s", operation, where, _describe(error))

    # ----- one call, bounded as a whole ------------------------------------------------------
    def _on_io_thread(self) -> bool:
        try:
            return asyncio.get_running_loop() is self._loop
        except RuntimeError:  # no loop runs on this thread
            return False

    async def _bounded(self, operation: Callable[[], Awaitable[T]],
                       timeout_s: float | None = None) -> T:
        timeout_s = self.settings.timeout_s if timeout_s is None else timeout_s
        if sys.version_info >= (3, 11):
            async with asyncio.timeout(timeout_s):
                return await operation()
        return await asyncio.wait_for(operation(), timeout_s)  # (Python 3.10)

    def _call(self, operation: Callable[[], Awaitable[T]], timeout_s: float | None = None) -> T:
        """Run `operation()` on the I/O loop and wait for it; past `timeout_s` (default:
        the setting) in all it is cancelled (redis-py then closes the connection it used)
        and redis.TimeoutError raised. Any thread may call this but the loop's own
        (RuntimeError at once there: waiting would block the loop it waits for)."""
        timeout_s = self.settings.timeout_s if timeout_s is None else timeout_s
        if self._on_io_thread():
            raise RuntimeError("a Redis call cannot wait on the Redis I/O thread itself")
        future = asyncio.run_coroutine_threadsafe(self._bounded(operation, timeout_s), self._loop)
        try:
            return future.result(timeout_s + LOOP_GRACE_S)
        # The call's own timeout, or (never expected) a stuck loop; before Python 3.11
        # asyncio's and concurrent.futures' TimeoutError were classes of their own.
        except (TimeoutError, asyncio.TimeoutError, concurrent.futures.TimeoutError):
            future.cancel()
            raise redis.TimeoutError(f"no whole reply within timeout_s={timeout_s:g}") from None

    def _results(self, operation: str, keys: list[bytes], queue: QueueCommand) -> list[Any]:
        """One pipelined round trip of `queue(pipeline, i)` (the command of the Redis key
        `keys[i]`) for every key: per key its reply, or the exception that stands for it
        (never raises for a store failure)."""
        if not self._available(SERVER):
            return [redis.ConnectionError("Redis store unavailable after a recent failure")
                    ] * len(keys)

        async def run() -> list[Any]:
            pipeline = self.client.pipeline(transaction=False)
            for index in range(len(keys)):
                queue(pipeline, index)
            return await pipeline.execute(raise_on_error=False)

        try:
            return self._call(run)
        except Exception as error:
            self._failed(operation, SERVER, error)
            return [error] * len(keys)

    # ----- the batched store interface -------------------------------------------------------
    def exists_many(self, keys: list[bytes]) -> list[bool]:
        """Whether each key is stored; False where the store cannot answer."""
        if not keys:
            return []
        names = [self.redis_key(key) for key in keys]
        replies = self._results("lookup", names, lambda pipeline, i: pipeline.exists(names[i]))
        return [not isinstance(found, Exception) and bool(found) for found in replies]

    def read_many(self, keys: list[bytes]) -> list[bytes | BlockLoadError]:
        """Each key's raw entry (one pipelined round trip), or why it cannot be had."""
        if not keys:
            return []
        # Never more than an entry and one byte: sizes are checked first.
        end = self.entry_nbytes
        names = [self.redis_key(key) for key in keys]
        values = self._results("read", names,
                               lambda pipeline, i: pipeline.getrange(names[i], 0, end))
        return [self._checked_size(value) for value in values]

    def _checked_size(self, value: bytes | Exception) -> bytes | BlockLoadError:
        if isinstance(value, Exception):
            return BlockLoadError(f"Redis read failed: {_describe(value)}")
        if not value:  # GETRANGE of a missing key is empty
            return BlockLoadError("entry is gone (evicted, expired or deleted since the lookup)")
        if len(value) > self.entry_nbytes:
            return BlockLoadError(f"entry is larger than the {self.entry_nbytes} bytes of this "
                                  "layout's blocks")
        return value

    def write_many(self, entries: list[tuple[bytes, memoryview]]) -> int:
        """Store each (key, encoded entry) in one pipelined round trip; returns how many
        failed."""
        if not entries:
            return 0
        ttl_ms = None if self.settings.ttl_s is None else max(1, int(self.settings.ttl_s * 1000))
        names = [self.redis_key(key) for key, _ in entries]
        replies = self._results("write", names, lambda pipeline, i: pipeline.set(
            names[i], entries[i][1], px=ttl_ms))
        failures = [reply for reply in replies if isinstance(reply, Exception)]
        if failures:
            logger.debug("Redis refused %d block write(s): %s", len(failures), failures[0])
        return len(failures)

    def close(self) -> None:
        """Close every pooled connection (bounded by timeout_s; a failure is logged). On the
        I/O thread (a finalizer that a garbage collection ran there) it only schedules that."""
        if self._on_io_thread():
            task = self._loop.create_task(self._disconnect_later())
            _closing.add(task)  # the loop holds tasks weakly
            task.add_done_callback(_closing.discard)
            return
        try:
            self._call(self._disconnect)
        except Exception as error:
            logger.warning("closing the Redis pool of %s failed: %s", self.settings.redacted_url,
                           _describe(error))

    async def _disconnect(self) -> None:
        """Close the client's connections."""
        await self.pool.disconnect()

    async def _disconnect_later(self) -> None:
        try:
            await self._bounded(self._disconnect)
        except Exception as error:
            logger.warning("closing the Redis pool of %s failed: %s", self.settings.redacted_url,
                           _describe(error))


def _describe(error: BaseException) -> str:
    """An error message safe to log (redis-py messages name host and port, never a password)."""
    return f"{type(error).__name__}: {error}"
