"""FaultInjectionConnector (kv_transfer/faults.py) against a real store: hung and
corrupted reads end as invalid blocks that are recomputed, with exactly the
no-connector output. Connectors that misbehave in other ways (raise, lie, never
finish): tests/engine/test_connector_faults.py."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
from conftest import (
    KV_BLOCK,
    KV_LOADABLE,
    KV_PROMPTS,
    block_files,
    copy_store,
    kv_generate,
    make_kv_llm,
    no_connector_ids,
    storage_transfer,
)

from kvrecover.kv_transfer.faults import FaultInjectionConnector
from kvrecover.kv_transfer.stores.storage_check import check_entry


def fault_transfer(store: Path, faults: list[dict], **extra):
    return storage_transfer(store, "kv_consumer", "FaultInjectionConnector", faults=faults,
                            **extra)


@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
def test_a_hung_load_ends_at_its_deadline_and_recovers(tiny_llama, pristine_store, tmp_path,
                                                       monkeypatch, async_load):
    # Each injected hang waits on the load's cancellation event for up to 10 x load_timeout_s,
    # then gives up by itself. Record, for every hung read, whether the load's deadline had
    # cancelled it when it ended: the deadline must end each hang, not the hang's own limit.
    ended_by_deadline: list[bool] = []
    filter_read = FaultInjectionConnector._filter_read

    def recording_filter_read(self, request_id, block_id, key, raw, cancelled):
        try:
            return filter_read(self, request_id, block_id, key, raw, cancelled)
        except TimeoutError:
            ended_by_deadline.append(cancelled.is_set())
            raise

    monkeypatch.setattr(FaultInjectionConnector, "_filter_read", recording_filter_read)
    copy_store(pristine_store, tmp_path / "store")
    faults = [{"requests": "first", "blocks": "middle", "kind": "hang"}]
    llm = make_kv_llm(tiny_llama, fault_transfer(tmp_path / "store", faults,
                                                 async_load=async_load, load_timeout_s=0.5))
    outputs = kv_generate(llm, KV_PROMPTS)
    assert outputs == no_connector_ids(tiny_llama)
    # An abandoned read wakes on its cancellation on its own thread, possibly after
    # generate returned: wait for it (bounded: 100 x 50 ms, well below the hang's limit).
    for _ in range(100):
        if ended_by_deadline:
            break
        time.sleep(0.05)
    assert ended_by_deadline and all(ended_by_deadline), ended_by_deadline
    stats = llm.stats
    assert stats["kv_load_failed_blocks"] > 0
    assert stats["kv_load_recovered_requests"] >= 1
    # The first loading request hung: at most its blocks before the hung one count as loaded.
    others = KV_BLOCK * sum(KV_LOADABLE[1:])
    assert others <= stats["prompt_tokens_external"] <= others + KV_BLOCK * (KV_LOADABLE[0] // 2)


@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
def test_a_corrupted_read_is_caught_by_the_checksum(tiny_llama, pristine_store, tmp_path,
                                                    caplog, async_load):
    copy_store(pristine_store, tmp_path / "store")
    faults = [{"requests": "all", "blocks": [2], "kind": "corrupt"}]
    llm = make_kv_llm(tiny_llama, fault_transfer(tmp_path / "store", faults,
                                                 async_load=async_load, load_timeout_s=2.0))
    with caplog.at_level(logging.WARNING):
        outputs = kv_generate(llm, KV_PROMPTS)
    assert outputs == no_connector_ids(tiny_llama)
    assert "payload checksum mismatch" in caplog.text
    stats = llm.stats
    assert stats["kv_load_recovered_requests"] >= len(KV_PROMPTS)
    assert stats["kv_load_failed_requests"] == 0
    # Async, a waiting request asks again (retry limit 1): block 2 stays bad, so the retry
    # fails there too and each prompt keeps its first two blocks, as sync.
    assert stats["prompt_tokens_external"] == KV_BLOCK * 2 * len(KV_PROMPTS)
    # The store itself is intact: the damage was in flight.
    assert all(check_entry(p) is None for p in block_files(tmp_path / "store"))


@pytest.mark.parametrize("kind", ["missing", "error", "corrupt"])
@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
def test_every_failed_block_is_nan_even_where_the_cache_held_the_right_kv(tmp_path, kind,
                                                                           async_load):
    # The luck a skipped recompute could ride on: the cache blocks a load fails into
    # already hold exactly the stored KV (say, left there by an earlier request).
    import torch
    from conftest import make_layout

    from kvrecover import KVTransferConfig
    from kvrecover.kv_transfer.base import KVConnectorRole
    from kvrecover.kv_transfer.faults import FaultMetadata
    from kvrecover.kv_transfer.stores.block_store import BlockStore
    from kvrecover.kv_transfer.stores.shared_storage import BlockTransfer, StorageConnectorMetadata

    layout = make_layout()
    store = BlockStore(tmp_path, layout)
    generator = torch.Generator().manual_seed(0)
    caches = [torch.randn((2, 8, layout.block_size, layout.num_kv_heads, layout.head_dim),
                          generator=generator) for _ in range(layout.num_layers)]
    block_ids, keys = [2, 3, 5], [bytes([i]) * 16 for i in range(3)]
    for block_id, key in zip(block_ids, keys):
        store.write(key, torch.stack([cache[:, block_id] for cache in caches]))
    expected = [cache.clone() for cache in caches]
    config = KVTransferConfig("FaultInjectionConnector", "kv_consumer", {
        "shared_storage_path": str(tmp_path), "async_load": async_load})
    worker = FaultInjectionConnector(config, KVConnectorRole.WORKER, layout)
    worker.register_kv_caches(caches)
    transfer = BlockTransfer("r", block_ids, keys, is_async=async_load)
    worker.bind_connector_metadata(FaultMetadata(StorageConnectorMetadata(loads=[transfer]),
                                                 {"r": {3: kind}}))
    worker.start_load_kv(caches)
    invalid: set[int] = set()
    if async_load:
        for _ in range(500):  # bounded: a local load of three blocks ends at once
            _, done = worker.get_finished(set())
            invalid |= worker.get_block_ids_with_load_errors()
            if done:
                break
            time.sleep(0.01)
    else:
        # Poisoned before the forward pass reads the cache: check before the step ends.
        for cache in caches:
            assert cache[:, 3].isnan().all() and cache[:, 5].isnan().all()
        worker.get_finished(set())
        invalid = worker.get_block_ids_with_load_errors()
    worker.clear_connector_metadata()
    worker.shutdown()
    assert invalid == {3, 5}  # the faulted block and the one after it
    for cache, before in zip(caches, expected):
        assert torch.equal(cache[:, 2], before[:, 2])  # loaded before the fault
        assert cache[:, 3].isnan().all() and cache[:, 5].isnan().all()
        assert torch.equal(cache[:, [0, 1, 4, 6, 7]], before[:, [0, 1, 4, 6, 7]])


def test_reads_the_injector_leaves_alone_take_the_fast_path(tiny_llama, pristine_store, tmp_path,
                                                           monkeypatch):
    # A fault on one block must not send every other read of the load through raw bytes
    # (a fresh buffer per entry, a copy more): the 0%-failure rows of bench_recovery.py
    # would then measure a slower load than the plain connector's.
    from kvrecover.kv_transfer.stores.block_store import BlockStore

    raw_reads: list[bytes] = []
    read_raw = BlockStore.read_raw

    def counted_read_raw(store, key):
        raw_reads.append(key)
        return read_raw(store, key)

    monkeypatch.setattr(BlockStore, "read_raw", counted_read_raw)
    copy_store(pristine_store, tmp_path / "store")
    faults = [{"requests": "first", "blocks": [1], "kind": "corrupt"}]
    llm = make_kv_llm(tiny_llama, fault_transfer(tmp_path / "store", faults))
    outputs = kv_generate(llm, KV_PROMPTS)
    assert outputs == no_connector_ids(tiny_llama)
    stats = llm.stats
    assert stats["kv_load_failed_blocks"] > 0  # the corrupt block was read raw and caught
    assert len(raw_reads) == 1  # and it alone
    assert stats["prompt_tokens_external"] >= KV_BLOCK * sum(KV_LOADABLE[1:])
