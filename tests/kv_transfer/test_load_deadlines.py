"""Every store load is bounded by its deadline as a whole, sync or async, whatever the
transport does (issue #29, class 3): a Redis that trickles its replies one byte at a
time (each socket read inside redis-py's socket timeout), a folder whose reads are stuck
(a hung NFS mount), and tiers over such a folder. Past the deadline the blocks are
invalid and recomputed: outputs equal an engine without a connector, token for token,
and nothing is left blocked: timed-out Redis connections are closed, stuck file reads
are bounded in number.

Each engine runs on a daemon thread joined with a hard limit, so a load that is not
bounded fails the test instead of hanging it.
"""

from __future__ import annotations

import threading
import time

import pytest
from conftest import (
    KV_BLOCK,
    KV_PROMPTS,
    copy_store,
    kv_generate,
    make_kv_llm,
    no_connector_ids,
    storage_transfer,
)

from kvrecover import KVTransferConfig
from kvrecover.kv_transfer.base import KVConnectorRole
from kvrecover.kv_transfer.stores.block_store import BlockStore
from kvrecover.kv_transfer.stores.reader_threads import (
    MAX_ABANDONED_READS,
    ReadCancel,
    ReadTimedOut,
)
from kvrecover.kv_transfer.stores.shared_storage import (
    BlockTransfer,
    SharedStorageConnector,
    StorageConnectorMetadata,
)

HARD_LIMIT_S = 60.0  # the join that turns a hang into a failure
ENGINE_BOUND_S = 20.0  # generate, loads that hit their deadlines included (a busy machine)
LOAD_TIMEOUT_S = 1.0


def timed_generate(llm, prompts=KV_PROMPTS) -> tuple[list[list[int]], float]:
    """Greedy ids of the prompts and the seconds generate took; fails if it hangs."""
    outcome: dict = {}

    def work() -> None:
        start = time.monotonic()
        outcome["ids"] = kv_generate(llm, prompts)
        outcome["seconds"] = time.monotonic() - start

    worker = threading.Thread(target=work, daemon=True)
    worker.start()
    worker.join(HARD_LIMIT_S)
    assert not worker.is_alive(), f"generate still blocked after {HARD_LIMIT_S:.0f} s"
    assert "ids" in outcome, "generate raised"
    return outcome["ids"], outcome["seconds"]


def new_threads(before: set[threading.Thread], prefix: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t not in before and t.name.startswith(prefix)]


def wait_until(condition, seconds: float) -> bool:
    give_up = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > give_up:
            return False
        time.sleep(0.05)
    return True


def assert_recovered(llm) -> None:
    stats = llm.stats
    assert stats["kv_load_failed_blocks"] > 0
    assert stats["kv_load_recovered_requests"] >= 1
    assert stats["kv_load_failed_requests"] == 0
    assert stats["prompt_tokens_external"] == 0  # no read ever finished


# ----- a trickling Redis --------------------------------------------------------------
@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
def test_a_trickling_redis_ends_each_load_at_its_deadline(tiny_llama, redis_server, async_load):
    from redis_helpers import TricklingProxy

    producer = make_kv_llm(tiny_llama, KVTransferConfig(
        "RedisConnector", "kv_producer", {"url": redis_server.url}))
    kv_generate(producer, KV_PROMPTS, max_tokens=1)
    producer.close()
    proxy = TricklingProxy(redis_server.port)
    timeout_s = 1.0
    llm = make_kv_llm(tiny_llama, KVTransferConfig("RedisConnector", "kv_consumer", {
        "url": proxy.url, "timeout_s": timeout_s, "async_load": async_load}))
    before = set(threading.enumerate())
    try:
        ids, seconds = timed_generate(llm)
        # Nothing stays blocked on the trickle: every trickled connection is closed by
        # the client (discarded, never pooled mid-reply) and no load thread lingers.
        assert wait_until(lambda: proxy.closed_by_client == proxy.trickled, timeout_s + 5), (
            f"{proxy.trickled - proxy.closed_by_client} trickled connection(s) still open")
        assert wait_until(lambda: not new_threads(before, "kv-load"), timeout_s + 5)
    finally:
        proxy.stop()
        llm.close()
    assert proxy.trickled >= 1  # the loads did go through the trickle
    assert ids == no_connector_ids(tiny_llama)
    assert seconds < ENGINE_BOUND_S
    assert_recovered(llm)


# ----- a folder whose reads are stuck ---------------------------------------------------
@pytest.fixture
def stuck_reads(monkeypatch):
    """Every entry read of a folder store blocks (as on a hung NFS mount) until the test
    ends or calls `release()`; yields the keys of the reads that got stuck."""
    release = threading.Event()
    stuck = StuckReads()
    open_entry = BlockStore._open_entry

    def hanging_open_entry(self, key):
        stuck.append(key)
        release.wait(HARD_LIMIT_S * 2)
        return open_entry(self, key)

    monkeypatch.setattr(BlockStore, "_open_entry", hanging_open_entry)
    stuck.release = release.set
    yield stuck
    release.set()


class StuckReads(list):
    """The keys of the reads that got stuck; `release()` lets them go on."""

    release = staticmethod(lambda: None)


def folder_and_tiers(kind: str, store, async_load: bool) -> KVTransferConfig:
    if kind == "folder":
        return storage_transfer(store, "kv_consumer", async_load=async_load,
                                load_timeout_s=LOAD_TIMEOUT_S)
    tiers = [{"kv_connector": "SharedStorageConnector",
              "kv_connector_extra_config": {"shared_storage_path": str(store)}}]
    return KVTransferConfig("TieredConnector", "kv_consumer", {
        "connectors": tiers, "async_load": async_load, "load_timeout_s": LOAD_TIMEOUT_S})


@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("kind", ["folder", "tiers"])
def test_a_stuck_folder_read_ends_each_load_at_its_deadline(tiny_llama, pristine_store, tmp_path,
                                                            stuck_reads, kind, async_load):
    copy_store(pristine_store, tmp_path / "store")
    llm = make_kv_llm(tiny_llama, folder_and_tiers(kind, tmp_path / "store", async_load))
    try:
        ids, seconds = timed_generate(llm)
        num_stuck = len(stuck_reads)
    finally:
        stuck_reads.release()  # (else closing waits for the stuck threads, a while)
        llm.close()
    assert num_stuck  # the loads did get stuck
    assert ids == no_connector_ids(tiny_llama)
    assert seconds < ENGINE_BOUND_S
    assert_recovered(llm)
    # A store that hangs for good does not collect a thread per load: past the cap no read
    # starts; reads already running when it is reached (at most one per request) may still
    # be abandoned after it. The cap alone: test_stuck_reads_are_bounded_in_number_then_fail_at_once.
    assert num_stuck <= MAX_ABANDONED_READS + len(KV_PROMPTS)


def test_stuck_reads_are_bounded_in_number_then_fail_at_once(layout_cpu_caches, tmp_path,
                                                             stuck_reads):
    layout, caches = layout_cpu_caches
    store = BlockStore(tmp_path, layout)
    keys = [bytes([i]) * 16 for i in range(3)]
    for key in keys:
        store.write(key, caches[0].new_zeros(store.block_shape))
    config = KVTransferConfig("SharedStorageConnector", "kv_consumer", {
        "shared_storage_path": str(tmp_path), "load_timeout_s": 0.05})
    worker = SharedStorageConnector(config, KVConnectorRole.WORKER, layout)
    worker.register_kv_caches(caches)
    loads = 3 * MAX_ABANDONED_READS
    try:
        for index in range(loads):
            is_async = index % 2 == 1
            transfer = BlockTransfer(f"r{index}", [1, 2, 3], keys, is_async=is_async)
            worker.bind_connector_metadata(StorageConnectorMetadata(loads=[transfer]))
            start = time.monotonic()
            worker.start_load_kv(caches)
            assert time.monotonic() - start < 5  # a sync load waits for its deadline only
            if is_async:
                time.sleep(0.06)  # past its deadline
                _, done = worker.get_finished(set())
                assert done == {f"r{index}"}
            assert worker.get_block_ids_with_load_errors() == {1, 2, 3}
            worker.clear_connector_metadata()
    finally:
        worker.shutdown()
    assert 1 <= len(stuck_reads) <= MAX_ABANDONED_READS


def test_an_abandoned_read_never_writes_the_cache_after_its_deadline(layout_cpu_caches, tmp_path,
                                                                    stuck_reads, monkeypatch):
    """A sync load into a CPU cache copies each block in itself: once its deadline has
    passed, a read that comes unstuck must not overwrite what the engine put there since
    (here NaN, as the fault injector does to failed blocks)."""
    layout, caches = layout_cpu_caches
    store = BlockStore(tmp_path, layout)
    keys = [bytes([i]) * 16 for i in range(3)]
    for key in keys:
        store.write(key, caches[0].new_ones(store.block_shape))
    copies = []  # the reads that got as far as copying into the cache
    write_unless_set = ReadCancel.write_unless_set

    def spied(self, write):
        copies.append(self)
        return write_unless_set(self, write)

    monkeypatch.setattr(ReadCancel, "write_unless_set", spied)
    config = KVTransferConfig("SharedStorageConnector", "kv_consumer", {
        "shared_storage_path": str(tmp_path), "load_timeout_s": 0.05})
    worker = SharedStorageConnector(config, KVConnectorRole.WORKER, layout)
    worker.register_kv_caches(caches)
    assert worker._paged.direct
    try:
        worker.bind_connector_metadata(StorageConnectorMetadata(
            loads=[BlockTransfer("r", [1, 2, 3], keys)]))
        worker.start_load_kv(caches)
        assert worker.get_block_ids_with_load_errors() == {1, 2, 3}
        for cache in caches:
            cache[:, 1:4].fill_(float("nan"))
        stuck_reads.release()
        assert wait_until(lambda: copies, 10)  # the read came unstuck and tried to copy
    finally:
        worker.shutdown()  # joins the abandoned read
    assert all(cache[:, 1:4].isnan().all() for cache in caches)


def test_a_cancel_waits_for_the_copy_in_progress_and_refuses_later_ones():
    cancel, copying, finish, order = ReadCancel(), threading.Event(), threading.Event(), []

    def slow_copy() -> str:
        copying.set()
        finish.wait(10)
        order.append("copied")
        return "done"

    copier = threading.Thread(target=lambda: order.append(cancel.write_unless_set(slow_copy)))
    copier.start()
    assert copying.wait(10)
    canceller = threading.Thread(target=lambda: (cancel.set(), order.append("cancelled")))
    canceller.start()
    canceller.join(0.2)
    assert canceller.is_alive() and not cancel.is_set()  # set() waits for the copy
    finish.set()
    copier.join(10)
    canceller.join(10)
    assert order == ["copied", "done", "cancelled"] and cancel.is_set()
    with pytest.raises(ReadTimedOut):
        cancel.write_unless_set(lambda: order.append("late copy"))
    assert "late copy" not in order


@pytest.fixture
def layout_cpu_caches():
    import torch
    from conftest import make_layout

    layout = make_layout(block_size=KV_BLOCK // 4)
    caches = [torch.zeros((2, 8, layout.block_size, layout.num_kv_heads, layout.head_dim))
              for _ in range(layout.num_layers)]
    return layout, caches
