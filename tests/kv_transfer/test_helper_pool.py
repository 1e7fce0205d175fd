"""The reader helper threads every load of a connector shares (`helper_pool`): loads start
no helper thread of their own, and a load's caller never moves on while one of its
helpers still runs."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import xxhash

from kvrecover.config import KVTransferConfig
from kvrecover.kv_layout import KVCacheLayout
from kvrecover.kv_transfer.base import KVConnectorRole
from kvrecover.kv_transfer.stores import staged_io
from kvrecover.kv_transfer.stores.block_store import BlockStore
from kvrecover.kv_transfer.stores.helper_pool import HelperPool
from kvrecover.kv_transfer.stores.shared_storage import (
    BlockTransfer,
    SharedStorageConnector,
    StorageConnectorMetadata,
)

LOADS, PER_LOAD = 4, 4


def test_finish_waits_for_a_running_helper_and_voids_the_queued_ones():
    pool = HelperPool()
    started, release, calls = threading.Event(), threading.Event(), []

    def work() -> None:
        calls.append(threading.current_thread().name)
        started.set()
        release.wait(10)

    finish = pool.run(1, work)
    assert started.wait(10)
    finisher = threading.Thread(target=finish)
    finisher.start()
    finisher.join(0.2)
    assert finisher.is_alive()  # the helper still runs: finish waits for it
    release.set()
    finisher.join(10)
    assert not finisher.is_alive() and calls == ["kv-io-0"]
    stale = pool.run(1, lambda: calls.append("late"))
    stale()  # closed before a pool thread took it (or after it ran): either way it is over
    pool.close()
    assert calls in (["kv-io-0"], ["kv-io-0", "late"])


def test_concurrent_async_loads_start_no_helper_threads_of_their_own(tmp_path, monkeypatch):
    layout = KVCacheLayout("pool-test", torch.float32, 4, 2, 2, 8)
    monkeypatch.setattr(staged_io, "CHUNK_BYTES", layout.block_nbytes)  # a chunk per row
    num_blocks = 1 + LOADS * PER_LOAD
    caches = [torch.zeros(2, num_blocks, 4, 2, 8) for _ in range(layout.num_layers)]
    store = BlockStore(tmp_path, layout)
    keys = [xxhash.xxh3_128_digest(bytes([i])) for i in range(LOADS * PER_LOAD)]
    generator = torch.Generator().manual_seed(0)
    blocks = [torch.randn(store.block_shape, generator=generator) for _ in keys]
    for key, block in zip(keys, blocks):
        store.write(key, block)
    config = KVTransferConfig("SharedStorageConnector", "kv_consumer", {
        "shared_storage_path": str(tmp_path), "io_threads": 3, "async_load": True})
    worker = SharedStorageConnector(config, KVConnectorRole.WORKER, layout)
    worker.register_kv_caches(caches)
    started: list[str] = []
    start = threading.Thread.start

    def counted_start(thread):
        started.append(thread.name)
        return start(thread)

    def load_all() -> None:
        worker.bind_connector_metadata(StorageConnectorMetadata(loads=[
            BlockTransfer(f"r{r}", list(range(1 + r * PER_LOAD, 1 + (r + 1) * PER_LOAD)),
                          keys[r * PER_LOAD : (r + 1) * PER_LOAD], is_async=True)
            for r in range(LOADS)]))
        worker.start_load_kv(caches)
        worker.clear_connector_metadata()
        pending = {f"r{r}" for r in range(LOADS)}
        for _ in range(1000):
            if not pending:
                break
            for load in list(worker._async_loads.values()):
                load.future.result(timeout=10)
            pending -= worker.get_finished(set())[1] or set()
        assert not pending and not worker.get_block_ids_with_load_errors()

    try:
        load_all()  # the pool's threads start here, once
        monkeypatch.setattr(threading.Thread, "start", counted_start)
        for cache in caches:
            cache.zero_()
        load_all()
    finally:
        monkeypatch.undo()
        worker.shutdown()
    # One reader for the step's async loads (read as one batch), and no helper thread.
    assert started == ["kv-load-r0"]
    for block_id, block in enumerate(blocks, start=1):
        assert torch.equal(torch.stack([cache[:, block_id] for cache in caches]), block)


@pytest.mark.parametrize("threads", [1, 4])
def test_read_rows_on_a_pool_reads_every_row_once(threads):
    pool = HelperPool()
    seen: list[int] = []
    lock = threading.Lock()

    def read_row(position: int) -> int:
        with lock:
            seen.append(position)
        return position

    try:
        results = staged_io.read_rows(20, read_row, threading.Event(), threads, 2, pool=pool)
    finally:
        pool.close()
    assert results == list(range(20)) and sorted(seen) == list(range(20))


def test_close_joins_the_pool_threads():
    """No pool thread outlives `close` (one left inside torch at interpreter teardown
    aborts the process)."""
    others = set(threading.enumerate())  # other tests' pools may still be open
    pool = HelperPool()
    finish = pool.run(3, lambda: time.sleep(0.05))
    finish()
    threads = [t for t in threading.enumerate()
               if t.name.startswith("kv-io-") and t not in others]
    assert threads
    pool.close()
    assert not any(t.is_alive() for t in threads)
