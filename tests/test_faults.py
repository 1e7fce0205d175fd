"""FaultInjectionConnector (kv_transfer/faults.py) against a real store: hung and
corrupted reads end as invalid blocks that are recomputed, with exactly the
no-connector output. Connectors that misbehave in other ways (raise, lie, never
finish): tests/test_connector_faults.py."""

from __future__ import annotations

import logging
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
from kvrecover.kv_transfer.storage_check import check_entry


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
    if async_load:
        # A waiting request asks again (retry limit 1); the fault hits position 2 of the new,
        # shorter load, which only the 5-block prompt still has.
        assert stats["prompt_tokens_external"] == KV_BLOCK * (4 + 4 + 3)
    else:
        assert stats["prompt_tokens_external"] == KV_BLOCK * 2 * len(KV_PROMPTS)
    # The store itself is intact: the damage was in flight.
    assert all(check_entry(p) is None for p in block_files(tmp_path / "store"))
