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

The store never raises for a store failure: a refused or dropped connection, a
timeout or an error reply makes every block of the call missing (reads, lookups)
or failed (writes), and the caller turns that into invalid blocks or a counted
save failure. After such a failure the store answers "unavailable" at once for
`timeout_s` instead of waiting on a dead server again; then it tries again.

The password (from the URL or KVRECOVER_REDIS_PASSWORD) stays inside the
redis-py connection pool; `repr` and every message show the URL without it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvrecover.kv_layout import KVCacheLayout
from kvrecover.kv_transfer.base import SETTING_LABEL
from kvrecover.kv_transfer.block_store import BlockCodec, BlockLoadError
from kvrecover.options import option, validate

logger = logging.getLogger(__name__)

PASSWORD_ENV = "KVRECOVER_REDIS_PASSWORD"
URL_SCHEMES = ("redis", "rediss", "unix", "valkey", "valkeys")


def redact_url(url: str) -> str:
    """The URL with any password replaced by `***` (for messages and repr)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def _url_problem(url: str) -> str | None:
    return None if urlsplit(url).scheme in URL_SCHEMES else "a URL"


def _shown_url(url: object) -> str:
    return repr(redact_url(str(url)))


@dataclass(frozen=True)
class RedisSettings:
    """Where and how to reach the server (keys of `kv_connector_extra_config`); no
    password appears in `repr` nor in an error message."""

    url: str = option(
        "redis://127.0.0.1:6379/0", "redis://[user:password@]host:port/db, rediss://..., "
        "unix:///path.sock (valkey:// and valkeys:// are aliases)", str, check=_url_problem,
        shown=_shown_url, describe="a redis://, rediss://, unix://, valkey:// or valkeys:// URL")
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
        url = settings.url
        if url.startswith("valkey"):  # the same protocol under its fork's name
            url = "redis" + url.removeprefix("valkey")
        options = dict(
            max_connections=settings.max_connections,
            timeout=settings.timeout_s,  # waiting for a free pooled connection
            socket_timeout=settings.timeout_s,
            socket_connect_timeout=settings.timeout_s,
            retry=Retry(NoBackoff(), 0),  # a failure is reported, never retried here
            driver_info=None,  # no CLIENT SETINFO round trips per new connection
        )
        password = settings.password or os.environ.get(PASSWORD_ENV) or None
        if password and urlsplit(url).password is None:
            options["password"] = password
        pool = redis.BlockingConnectionPool.from_url(url, **options)
        self.client = redis.Redis(connection_pool=pool)
        self._lock = threading.Lock()
        self._unavailable_until = 0.0

    def __repr__(self) -> str:
        return f"RedisBlockStore({self.settings.redacted_url!r}, prefix={self.settings.key_prefix!r})"

    def redis_key(self, key: bytes) -> bytes:
        """The Redis key of a block."""
        return self._key_head + key.hex().encode()

    # ----- availability --------------------------------------------------------------------
    def _available(self) -> bool:
        return time.monotonic() >= self._unavailable_until

    def _failed(self, operation: str, error: Exception) -> None:
        if isinstance(error, (redis.ConnectionError, redis.TimeoutError)):
            with self._lock:
                self._unavailable_until = time.monotonic() + self.settings.timeout_s
        logger.warning("Redis %s at %s failed: %s", operation, self.settings.redacted_url,
                       _describe(error))

    # ----- the batched store interface -------------------------------------------------------
    def exists_many(self, keys: list[bytes]) -> list[bool]:
        """Whether each key is stored; all False when the store cannot answer."""
        if not keys or not self._available():
            return [False] * len(keys)
        try:
            pipeline = self.client.pipeline(transaction=False)
            for key in keys:
                pipeline.exists(self.redis_key(key))
            return [bool(found) for found in pipeline.execute()]
        except Exception as error:
            self._failed("lookup", error)
            return [False] * len(keys)

    def read_many(self, keys: list[bytes]) -> list[bytes | BlockLoadError]:
        """Each key's raw entry (one pipelined round trip), or why it cannot be had."""
        if not keys:
            return []
        if not self._available():
            return [BlockLoadError("Redis store unavailable after a recent failure")] * len(keys)
        try:
            pipeline = self.client.pipeline(transaction=False)
            for key in keys:  # never more than an entry and one byte: sizes are checked first
                pipeline.getrange(self.redis_key(key), 0, self.entry_nbytes)
            values = pipeline.execute()
        except Exception as error:
            self._failed("read", error)
            failure = BlockLoadError(f"Redis read failed: {_describe(error)}")
            return [failure] * len(keys)
        return [self._checked_size(value) for value in values]

    def _checked_size(self, value: bytes) -> bytes | BlockLoadError:
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
        if not self._available():
            return len(entries)
        ttl_ms = None if self.settings.ttl_s is None else max(1, int(self.settings.ttl_s * 1000))
        try:
            pipeline = self.client.pipeline(transaction=False)
            for key, entry in entries:
                pipeline.set(self.redis_key(key), entry, px=ttl_ms)
            replies = pipeline.execute(raise_on_error=False)
        except Exception as error:
            self._failed("write", error)
            return len(entries)
        failures = [reply for reply in replies if isinstance(reply, Exception)]
        if failures:
            logger.debug("Redis refused %d block write(s): %s", len(failures), failures[0])
        return len(failures)

    def close(self) -> None:
        """Close every pooled connection."""
        self.client.connection_pool.disconnect()


def _describe(error: Exception) -> str:
    """An error message safe to log (redis-py messages name host and port, never a password)."""
    return f"{type(error).__name__}: {error}"
