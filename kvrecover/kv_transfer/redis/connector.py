"""RedisConnector: KV blocks shared through a Redis (or Valkey) server.

`BlockStoreConnector`'s logic (which blocks to load and save, sync and async
loads, verification, recovery reporting) over a `RedisBlockStore`, so prefill
and decode on different machines share KV through one server.

Settings (`RedisConnectorSettings`, keys of `kv_connector_extra_config`):
  url              redis://[user:password@]host:port/db, rediss://..., unix:///path.sock
                   (valkey:// and valkeys:// are accepted as aliases); default
                   redis://127.0.0.1:6379/0. A Redis (or Valkey) Cluster:
                   redis+cluster://[user:password@]host:port[,host:port...], its seed
                   nodes (rediss+cluster:// for TLS): a prompt's blocks spread over the
                   nodes, and a lost node costs only its blocks (cluster_store)
  key_prefix       prepended to every key ("kvrecover:")
  ttl_s            expiry of stored blocks in seconds (None: never expire)
  timeout_s        bound on each call to the server as a whole: waiting for a pooled
                   connection, connecting, sending and the whole reply (5); a server
                   that never answers, or trickles, costs a call at most this
  max_connections  connection pool size per connector instance (16)
  async_load       load in a background thread while the request waits (False)
  load_timeout_s   bound on each load as a whole, sync or async; its blocks are invalid
                   after it (3 x timeout_s)
  verify_after_load re-checksum the engine's cache blocks after a load (True)

The password comes from the URL or, when the URL has none, from the environment
variable KVRECOVER_REDIS_PASSWORD; it is never logged nor shown in `repr`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvrecover.kv_transfer.redis.cluster_store import open_redis_store
from kvrecover.kv_transfer.redis.store import RedisBlockStore, RedisSettings
from kvrecover.kv_transfer.stores.store_base import StoreSettings
from kvrecover.kv_transfer.stores.store_connector import BlockStoreConnector


@dataclass(frozen=True, repr=False)  # RedisSettings' repr: the URL without its password
class RedisConnectorSettings(RedisSettings, StoreSettings):
    """RedisConnector's settings: the server's and every store connector's."""


class RedisConnector(BlockStoreConnector):
    """Saves and loads KV blocks through Redis (see module docstring)."""

    settings_class = RedisConnectorSettings

    def _open_store(self) -> RedisBlockStore:
        return open_redis_store(self.layout, self.settings)

    def _default_load_timeout_s(self) -> float:
        # One read call (bounded by timeout_s as a whole), its verification, and room to spare.
        return 3 * self.store.settings.timeout_s

    def __repr__(self) -> str:
        return f"RedisConnector({self.role.value}, {self.store!r})"

    def _close_store(self) -> None:
        self.store.close()  # `shutdown` (LLM.close(), GC, exit) lets the pool's sockets go

    def extra(self) -> dict[str, Any]:
        """The extra config this connector understood (URL without its password)."""
        settings = self.store.settings
        return {
            "url": settings.redacted_url,
            "key_prefix": settings.key_prefix,
            "ttl_s": settings.ttl_s,
            "timeout_s": settings.timeout_s,
            "max_connections": settings.max_connections,
            **super().extra(),
        }
