"""RedisClusterBlockStore: the Redis block store over a Redis Cluster (or Valkey cluster).

Keys, values, verification and `timeout_s` mean what they mean for one server
(`store`); the blocks of a prompt spread over the nodes by key slot. Slot
routing is redis-py's (`redis.asyncio.cluster.RedisCluster`, discovered from the
seed nodes of the `redis+cluster://` URL); this module only decides how a node's
failure is contained:

- Each call groups its keys by the node that serves their slot and runs one
  cluster pipeline per node, all at once, each bounded by `timeout_s` on its own. A
  node that refuses, drops or never answers fails only its own keys (missing for a
  lookup, an invalid block for a load, a counted failure for a save): redis-py's
  cluster pipeline raises for the whole pipeline when one node's connection fails,
  so one pipeline over every node would lose the other nodes' answers with it.
- A slot that moves (`MOVED`, `ASK`: resharding, a failover) is followed by redis-py
  inside that node's pipeline, command by command, within the same bound. Its
  slot map is patched per redirect (`reinitialize_steps=0`), never rebuilt by
  closing every node's connections under the other nodes' calls.
- A node that refuses or drops its connection (dead, or failed over) is followed in
  the same call, within the same bound: the slot map is rebuilt (`CLUSTER SLOTS`, the
  failed node asked last) and its keys whose slots another node now serves (a
  promoted replica) run once more there. redis-py alone would not: it rebuilds the
  map only when it retries a whole pipeline, which this store turns off (above).
- After a node fails, the store answers for that node's keys at once ("unavailable")
  for `timeout_s`, then tries again (so it recovers when the node comes back), and
  refreshes the slot map in the background (a silent node's slots too).
- A node restarted empty, or a replica promoted without the newest writes, holds
  fewer keys: a lookup misses them, a load finds them gone (an invalid block); the
  keys the promoted replica has still load.

Run the cluster with `cluster-require-full-coverage no`, so the surviving nodes keep
serving their slots while one is down (see README, "Redis Cluster").
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.cluster import PRIMARY

from kvrecover.kv_layout import KVCacheLayout
from kvrecover.kv_transfer.redis.store import (
    SERVER,
    QueueCommand,
    RedisBlockStore,
    RedisSettings,
    _describe,
)
from kvrecover.kv_transfer.redis.urls import is_cluster_url, parse_cluster_url
from kvrecover.kv_transfer.redis.writes import chunked_writes

logger = logging.getLogger(__name__)

# A call may take 2 x timeout_s and this: discovering the cluster (first call, or after
# no seed node answered) is bounded by timeout_s, then each node's pipeline on its own.
GATHER_GRACE_S = 1.0
DISCOVERY = "discovery"  # the name under which a failed discovery backs off
# What redis-py's cluster client raises (RedisClusterException, SlotNotCoveredError among
# them, is no RedisError).
CLUSTER_ERRORS = (redis.RedisError, redis.RedisClusterException)


class RedisClusterBlockStore(RedisBlockStore):
    """`RedisBlockStore` over a Redis Cluster: one pipeline per node, a node's failure
    costs only its keys (see module docstring)."""

    def _connect(self) -> None:
        settings = self.settings
        parsed = parse_cluster_url(settings.url)
        self.client = RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in parsed.seeds],
            username=parsed.username, password=parsed.password or self._password,
            **parsed.client_options(),  # TLS, and its CA and certificates
            max_connections=settings.max_connections,  # per node
            socket_timeout=settings.timeout_s, socket_connect_timeout=settings.timeout_s,
            # A failed node is this module's to contain: no whole-pipeline retry that
            # closes every node's connections, no slot-map rebuild on MOVED.
            retry=Retry(NoBackoff(), 0), reinitialize_steps=0,
            require_full_coverage=False,  # the slots of a lost node are its keys' failure
            driver_info=None,
        )
        # RedisCluster takes no connection class: every node (the seeds it made, and
        # those discovered later, from these shared kwargs) gets the chunked writes.
        kwargs = self.client.get_connection_kwargs()
        kwargs["connection_class"] = chunked_writes(kwargs["connection_class"])
        for node in self.client.startup_nodes:
            node.connection_class = kwargs["connection_class"]
        self._refresh: asyncio.Task | None = None
        # Discover the nodes now, in the background, while they are (most likely) all up:
        # the first call then finds the slot map ready (or discovers it, bounded, itself).
        asyncio.run_coroutine_threadsafe(self._discover_quietly(), self._loop)

    async def _discover_quietly(self) -> None:
        try:
            await self._bounded(self._initialize)
        except (Exception, asyncio.TimeoutError) as error:
            logger.debug("discovering %s failed: %s", self.settings.redacted_url,
                         _describe(error))

    def _results(self, operation: str, keys: list[bytes], queue: QueueCommand) -> list[Any]:
        """Per key its reply or the exception that stands for it: one pipeline per node,
        concurrently, each within timeout_s; a failed node fails only its keys."""
        results: list[Any] = [None] * len(keys)

        async def run() -> list[Any]:
            try:
                await self._discovered()
            except Exception as error:  # no seed node answered
                return [error] * len(keys)
            by_node: dict[str, list[int]] = {}
            for index, key in enumerate(keys):
                try:
                    node = self.client.get_node_from_key(key)
                except CLUSTER_ERRORS as uncovered:  # a slot no node serves
                    results[index] = uncovered
                    continue
                by_node.setdefault(node.name, []).append(index)
            failures = await asyncio.gather(*(
                self._node_pipeline(name, keys, positions, queue, results)
                for name, positions in by_node.items()))
            for name, failure in zip(by_node, failures):
                if failure is not None:
                    self._failed(operation, name, failure)
                    self._refresh_slots_later(name)
            return results

        try:
            return self._call(run, 2 * self.settings.timeout_s + GATHER_GRACE_S)
        except Exception as error:  # (never expected: each node is bounded on its own)
            self._failed(operation, SERVER, error)
            return [error if result is None else result for result in results]

    async def _discovered(self) -> None:
        """Discover the nodes and slots from the seed nodes unless done (bounded by
        timeout_s); after a failure, raise at once for timeout_s."""
        if not self._available(DISCOVERY):
            raise redis.ConnectionError("no Redis Cluster seed node answered recently")
        try:
            await self._bounded(self._initialize)
        except (Exception, asyncio.TimeoutError) as error:
            with self._lock:
                self._unavailable_until[DISCOVERY] = time.monotonic() + self.settings.timeout_s
            self._failed("discovery", DISCOVERY, error)
            raise redis.ConnectionError(f"Redis Cluster discovery failed: {_describe(error)}"
                                        ) from None

    async def _initialize(self) -> None:
        """redis-py's discovery, which also asks its default node (the first primary it
        lists) for the command table: while that node is down, move it last and ask
        the next (redis-py does so itself only after a failed command)."""
        manager = self.client.nodes_manager
        attempts = max(1, len(self.client.startup_nodes))
        for _ in range(attempts - 1):  # each bounded by its share of timeout_s
            try:
                await self._bounded(self.client.initialize, self.settings.timeout_s / attempts)
                return
            except (redis.ConnectionError, redis.TimeoutError, TimeoutError,
                    asyncio.TimeoutError):
                primaries = manager.get_nodes_by_server_type(PRIMARY)
                if len(primaries) > 1:
                    manager.move_node_to_end_of_cached_nodes(primaries[0].name)
        await self.client.initialize()

    async def _node_pipeline(self, node: str, keys: list[bytes], positions: list[int],
                             queue: QueueCommand, results: list[Any]) -> BaseException | None:
        """One node's keys in one cluster pipeline, and where that node is gone (refused,
        dropped) their retry on their slots' new owner (a promoted replica), all within
        timeout_s; fills their `results` and returns the error that failed the node, if
        one did."""
        if not self._available(node):
            error: BaseException = redis.ConnectionError(
                f"Redis Cluster node {node} unavailable after a recent failure")
            for index in positions:
                results[index] = error
            return None  # already noted when it failed

        async def execute_and_follow() -> BaseException | None:
            failure = await self._pipeline_into(positions, queue, results)
            if isinstance(failure, redis.ConnectionError):
                try:
                    await self._follow_failover(node, keys, positions, queue, results)
                except CLUSTER_ERRORS as error:  # no node answered: the keys keep `failure`
                    logger.debug("following %s after its failure failed: %s", node,
                                 _describe(error))
            return failure

        try:
            return await self._bounded(execute_and_follow)
        except (Exception, asyncio.TimeoutError) as failure:
            error = redis.TimeoutError(
                f"no whole reply within timeout_s={self.settings.timeout_s:g}"
            ) if isinstance(failure, (TimeoutError, asyncio.TimeoutError)) else failure
            for index in positions:
                if results[index] is None or isinstance(results[index], redis.ConnectionError):
                    results[index] = error
            return error

    async def _pipeline_into(self, positions: list[int], queue: QueueCommand,
                             results: list[Any]) -> BaseException | None:
        """The keys at `positions` (one node's) in one cluster pipeline: fills their
        `results`; returns the connection error that failed the node, if one did."""
        pipeline = self.client.pipeline(transaction=False)
        for index in positions:
            queue(pipeline, index)
        try:
            replies = await pipeline.execute(raise_on_error=False)
        except CLUSTER_ERRORS as failure:
            for index in positions:
                results[index] = failure
            return failure
        for index, reply in zip(positions, replies):
            results[index] = reply
        # A node lost mid-reply fails the rest of its commands, each with that error.
        return next((reply for reply in replies
                     if isinstance(reply, (redis.ConnectionError, redis.TimeoutError))), None)

    async def _follow_failover(self, failed_node: str, keys: list[bytes], positions: list[int],
                               queue: QueueCommand, results: list[Any]) -> None:
        """After `failed_node` refused or dropped the keys at `positions`: rebuild the slot
        map (`CLUSTER SLOTS`, `failed_node` asked last) and run the keys whose slot another
        node now serves (a promoted replica) once more, there. What that node lacks is a
        miss, or an invalid block; keys still mapped to `failed_node` keep its error."""
        await self.client.nodes_manager.initialize(last_failed_node_name=failed_node)
        by_node: dict[str, list[int]] = {}
        for index in positions:
            if not isinstance(results[index], redis.ConnectionError):
                continue  # answered before the node went away
            try:
                owner = self.client.get_node_from_key(keys[index]).name
            except CLUSTER_ERRORS:  # its slot is served by no node now
                continue
            if owner != failed_node and self._available(owner):
                by_node.setdefault(owner, []).append(index)
        await asyncio.gather(*(self._pipeline_into(moved, queue, results)
                               for moved in by_node.values()))

    def _refresh_slots_later(self, failed_node: str) -> None:
        """Rebuild the slot map in the background (one refresh at a time, bounded by
        timeout_s), asking `failed_node` last: a promoted replica takes its slots over."""
        if self._refresh is not None and not self._refresh.done():
            return

        async def refresh() -> None:
            try:
                await self._bounded(lambda: self.client.nodes_manager.initialize(
                    last_failed_node_name=failed_node))
            except Exception as error:
                logger.debug("refreshing the slot map of %s failed: %s",
                             self.settings.redacted_url, _describe(error))

        self._refresh = self._loop.create_task(refresh())

    async def _disconnect(self) -> None:
        if self._refresh is not None:
            self._refresh.cancel()
        await self.client.aclose()


def open_redis_store(layout: KVCacheLayout, settings: RedisSettings) -> RedisBlockStore:
    """The store for `settings.url`: a cluster's or one server's."""
    store_class = RedisClusterBlockStore if is_cluster_url(settings.url) else RedisBlockStore
    return store_class(layout, settings)
