"""RedisBlockStore on its own: the batched calls, the entry buffers, and how it fails."""

from __future__ import annotations

import time

import pytest
import torch
from redis_helpers import LARGE_LAYOUT, SilentServer, peak_allocation, sealed_entries

from kvrecover.kv_layout import KVCacheLayout
from kvrecover.kv_transfer.redis.store import (
    RedisBlockStore,
    RedisSettings,
    io_loop,
    redact_url,
)
from kvrecover.kv_transfer.stores.block_store import BlockLoadError

LAYOUT = KVCacheLayout("test-model", torch.float32, 4, 2, 2, 8)
KEYS = [bytes([i]) * 16 for i in range(5)]


def random_block(seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn((LAYOUT.num_layers, *LAYOUT.block_shape), generator=generator)


def store_at(url: str, **settings) -> RedisBlockStore:
    return RedisBlockStore(LAYOUT, RedisSettings(url=url, **settings))


def test_batched_round_trip(redis_server):
    store = store_at(redis_server.url)
    blocks = [random_block(i) for i in range(len(KEYS))]
    assert store.exists_many(KEYS) == [False] * 5
    assert store.write_many([(key, store.encode(key, block))
                             for key, block in zip(KEYS[:3], blocks)]) == 0
    assert store.exists_many(KEYS) == [True, True, True, False, False]
    raws = store.read_many(KEYS)
    for key, block, raw in zip(KEYS[:3], blocks, raws):
        assert torch.equal(store.parse(key, raw).tensor, block)
    assert all(isinstance(raw, BlockLoadError) and "gone" in str(raw) for raw in raws[3:])
    # One key per block, under the prefix and the layout fingerprint.
    assert sorted(redis_server.client().keys("*")) == sorted(store.redis_key(k) for k in KEYS[:3])
    assert store.redis_key(KEYS[0]) == f"kvrecover:{LAYOUT.fingerprint}:{KEYS[0].hex()}".encode()


def test_entries_are_gathered_in_place_and_recycled(redis_server):
    store = store_at(redis_server.url)
    block = random_block(7)
    entry, payload = store.new_entry()
    payload.copy_(block)
    sealed = store.seal(KEYS[0], entry)
    assert bytes(sealed) == bytes(store.encode(KEYS[0], block))
    assert torch.equal(store.parse(KEYS[0], bytes(sealed)).tensor, block)
    store.recycle([(KEYS[0], sealed)])
    again, _ = store.new_entry()
    assert again is entry  # reused, not a fresh (page-faulting) buffer
    store.recycle([(KEYS[0], b"not made by new_entry")])  # ignored
    assert store.new_entry()[0] is not entry


def test_a_batch_of_large_entries_is_sent_without_copying_it_whole(redis_server):
    """A pipeline of SETs goes to the socket entry by entry, from the entries' own memory
    (redis-py's asyncio writer joined the whole batch into one bytes and buffered it:
    half the synchronous client's save rate, issue 29)."""
    store = RedisBlockStore(LARGE_LAYOUT, RedisSettings(url=redis_server.url))
    entries = sealed_entries(store, 16)
    assert store.write_many(entries[:1]) == 0  # connected before measuring
    failed: list[int] = []
    peak = peak_allocation(lambda: failed.append(store.write_many(entries)))
    assert failed == [0]
    assert peak < 3 * store.entry_nbytes, f"{peak} bytes allocated to send 16 entries"
    assert store.read_many([entries[-1][0]]) == [bytes(entries[-1][1])]


def test_a_silent_server_costs_one_timeout_then_is_skipped_for_a_while():
    server = SilentServer()
    try:
        store = store_at(server.url, timeout_s=0.3)
        (result,) = store.read_many(KEYS[:1])
        assert isinstance(result, BlockLoadError) and "Timeout" in str(result)
        connections = server.connections
        assert connections == 1
        # Within timeout_s of the failure nothing is tried: no connection, no waiting.
        assert store.exists_many(KEYS) == [False] * 5
        assert store.write_many([(KEYS[0], store.encode(KEYS[0], random_block(0)))]) == 1
        (result,) = store.read_many(KEYS[:1])
        assert "unavailable" in str(result)
        assert server.connections == connections
    finally:
        server.stop()


def test_closing_on_the_io_thread_neither_blocks_it_nor_leaks_the_pool(own_redis_server):
    """A garbage collection on `kv-redis-io` may run an engine's finalizer there, which
    closes its stores: that close must not wait for the loop it is blocking (which froze
    every store of the process for timeout_s + LOOP_GRACE_S). A server of its own: the
    connection count must not move with other tests' stores closing meanwhile."""
    redis_server = own_redis_server()
    store, other = store_at(redis_server.url, timeout_s=1.0), store_at(redis_server.url)
    assert store.write_many([(KEYS[0], store.encode(KEYS[0], random_block(0)))]) == 0
    assert other.exists_many(KEYS[:1]) == [True]
    admin = redis_server.client()
    clients = admin.info("clients")["connected_clients"]
    took: list[float] = []

    def close_there() -> None:
        start = time.monotonic()
        store.close()
        took.append(time.monotonic() - start)

    io_loop().call_soon_threadsafe(close_there)
    start = time.monotonic()
    assert other.exists_many(KEYS[:1]) == [True]  # the loop goes on serving the others
    assert time.monotonic() - start < 0.5 and took and took[0] < 0.5
    for _ in range(100):  # bounded: 100 x 20 ms
        if admin.info("clients")["connected_clients"] == clients - 1:
            break
        time.sleep(0.02)
    assert admin.info("clients")["connected_clients"] == clients - 1  # the pool did close


def test_an_error_reply_fails_the_writes_without_cooling_down(redis_server):
    store = store_at(redis_server.url)
    client = redis_server.client()
    client.config_set("maxmemory", 1)  # every write is refused with an OOM error reply
    try:
        assert store.write_many([(key, store.encode(key, random_block(0))) for key in KEYS]) == 5
    finally:
        client.config_set("maxmemory", 0)
    assert store.write_many([(KEYS[0], store.encode(KEYS[0], random_block(0)))]) == 0


@pytest.mark.parametrize("url, shown", [
    ("redis://:secret@host:6379/0", "redis://:***@host:6379/0"),
    ("redis://user:secret@host:6379/0", "redis://user:***@host:6379/0"),
    ("redis://host:6379/0", "redis://host:6379/0"),
    ("unix:///tmp/redis.sock", "unix:///tmp/redis.sock"),
])
def test_redact_url(url, shown):
    assert redact_url(url) == shown


def test_settings_repr_hides_the_password():
    settings = RedisSettings(url="redis://:secret@host:1/0", password="secret")
    assert "secret" not in repr(settings)
    assert "secret" not in repr(RedisBlockStore(LAYOUT, settings))


@pytest.mark.parametrize("query", ["socket_timeout=60", "max_connections=1",
                                   "socket_connect_timeout=9&ssl_cert_reqs=none", "timeout=3"])
def test_a_url_query_may_not_override_the_store_bounds(query):
    with pytest.raises(ValueError, match="kv_connector_extra_config"):
        RedisSettings(url=f"rediss://host:6379/0?{query}")


def test_a_url_query_may_carry_tls_options():
    settings = RedisSettings(url="rediss://host:6379/0?ssl_cert_reqs=none&ssl_ca_certs=/ca.crt")
    assert settings.url.endswith("ssl_ca_certs=/ca.crt")
