"""A TieredConnector with NIXL first and a shared-storage store behind it (issue 42
item 4): the producer serves pulls and saves into the store; a consumer pulls, falls
through to the store for what the pull failed, and recomputes what both lost. Token ids
are always those of a run without a connector; on Llama and on Gemma 3 (windowed and
full KV cache groups: every group's blocks go through both tiers)."""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from conftest import require_nixl
from test_nixl_connector import (  # noqa: F401 - kill_producers: an autouse fixture
    BAD_REFERENCES,
    Producer,
    consume,
    count_checks,
    kill_producers,
    load_id,
    no_connector,
    staged_pulls,
    tampered,
    tiny_model,
)

from kvrecover.kv_transfer.p2p.pull_reads import PullReader
from kvrecover.kv_transfer.p2p.staging import StagingBuffer

require_nixl()

STORE_BLOCKS = "kv_tier1_loaded_blocks"


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def model(request, tiny_llama, tmp_path_factory) -> Path:
    return tiny_model(request.param, tiny_llama, tmp_path_factory)


@pytest.fixture
def producer(model, tmp_path):
    """A tiered producer (NIXL + the folder tmp_path/store), killed at teardown."""
    return Producer(model, store=tmp_path / "store")


@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
def test_a_pull_comes_first(model, tmp_path, producer, async_load):
    run = consume(model, producer.references, async_load=async_load,
                  store=tmp_path / "store")
    assert run.ids == no_connector(model)
    assert run.pulled == run.stats["kv_tier0_loaded_blocks"] == sum(run.full_pulls)
    assert run.stats.get(STORE_BLOCKS, 0) == 0 and run.stats["kv_load_failed_blocks"] == 0
    assert producer.finish() == 0


@pytest.mark.parametrize("fault,model,async_load", [
    ("unknown request", "llama", False), ("unknown request", "gemma3", True),
    ("dead producer", "llama", True), ("dead producer", "gemma3", False)],
    indirect=["model"], ids=load_id)  # every pair of values once: each starts a producer
def test_a_failed_pull_falls_through_to_the_store(model, tmp_path, producer, fault,
                                                 async_load):
    references = producer.references
    if fault == "dead producer":
        producer.kill()
    else:
        references = tampered(references, BAD_REFERENCES[fault])
    run = consume(model, references, async_load=async_load, store=tmp_path / "store")
    assert run.ids == no_connector(model)
    lost = sum(run.full_pulls) if fault == "dead producer" else run.full_pulls[0]
    assert run.stats[STORE_BLOCKS] == lost and run.stats["kv_tier0_failed_blocks"] == lost
    assert run.pulled == sum(run.full_pulls) - lost
    assert run.stats["kv_load_failed_blocks"] == 0


@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
def test_what_both_tiers_lost_is_recomputed(model, tmp_path, producer, async_load):
    producer.kill()
    shutil.rmtree(tmp_path / "store")
    run = consume(model, producer.references, async_load=async_load,
                  store=tmp_path / "store")
    assert run.ids == no_connector(model)
    assert run.stats.get(STORE_BLOCKS, 0) == 0 and run.pulled == 0
    assert run.stats["kv_load_failed_blocks"] >= sum(run.full_pulls)


@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
def test_a_retry_after_a_failed_pull_goes_past_the_released_reference(
        tiny_llama, tmp_path, monkeypatch, async_load):
    """The first prompt's first pulled block fails its checksum and the store behind
    NIXL is empty: the load fails in part. Asked again (async), the pull tier claims
    nothing from the reference it released already: no second check, the block is
    recomputed, the token ids are exact."""
    producer = Producer(tiny_llama)
    handle = producer.references[0]["remote_request_id"]
    install = PullReader.install

    def first_block_wrong(self: PullReader, items: list, buffer: StagingBuffer,
                          fence: Any) -> set[int]:
        blocks, rows = staged_pulls(self, items, buffer)
        for (pull, _, _), pull_rows in zip(items, rows):
            if pull.reference.request_id == handle:
                blocks[0, 0, pull_rows[0], 0] ^= 0xFF
        return install(self, items, buffer, fence)

    monkeypatch.setattr(PullReader, "install", first_block_wrong)
    checks = count_checks(monkeypatch)
    run = consume(tiny_llama, producer.references, async_load=async_load,
                  store=tmp_path / "empty")
    assert run.ids == no_connector(tiny_llama)
    assert run.pulled == sum(run.full_pulls) - 1
    assert run.stats["kv_tier0_failed_blocks"] == 1 and run.stats.get(STORE_BLOCKS, 0) == 0
    assert run.stats["kv_load_failed_blocks"] == 1
    assert checks == Counter(r["remote_request_id"] for r in producer.references)
    assert producer.finish() == 0
