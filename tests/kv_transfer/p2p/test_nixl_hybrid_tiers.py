"""A TieredConnector of NIXL first and a shared-storage store behind it, on a hybrid
(Qwen3-Next, recurrent-state) model (issue 42): the claim ends where a tier has the
state; the pulled state is installed when it verified, else the store's at the same
boundary, else the request rolls back and recomputes. Token ids always equal a run
without a connector, sync and async; a live producer ends holding nothing."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import pytest
from conftest import require_nixl
from models.test_qwen3_next_vs_hf import FAMILIES, build_hybrid
from test_nixl_connector import (  # noqa: F401 - kill_producers: every test's producers die
    PROMPTS,
    consume,
    consumer_config,
    kill_producers,
    no_connector,
    with_references,
)
from test_nixl_hybrid import CLAIMED_BLOCKS, HybridProducer

from kvrecover import LLM
from kvrecover.kv_layout import hash_block_tokens
from kvrecover.kv_transfer.p2p import pull_reads
from kvrecover.kv_transfer.stores.state_entries import state_key

require_nixl()

ASYNC = pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory) -> Path:
    return build_hybrid(tmp_path_factory.mktemp("qwen3_next"), **FAMILIES["qwen3_next"])


@pytest.fixture(scope="module")
def dead_producer(hybrid, tmp_path_factory) -> tuple[list[dict], Path]:
    """A tiered producer's references and store, the producer killed (its references
    point nowhere)."""
    store = tmp_path_factory.mktemp("store")
    producer = HybridProducer(hybrid, store=store)
    references = producer.references
    producer.kill()
    return references, store


@ASYNC
def test_the_pull_comes_first_and_a_bad_pulled_state_falls_through_to_the_store(
        hybrid, tmp_path, monkeypatch, async_load):
    """The first pulled state to be verified has a byte flipped: that request takes the
    store's state at the same boundary, the other the pulled one; every block is
    pulled, nothing is recomputed, and the producer frees both prompts and states."""
    real, calls = pull_reads.verify, itertools.count()

    def first_flipped(state, rows):
        if next(calls) == 0:
            rows.reshape(-1)[state.nbytes // 2] ^= 0x5A
        return real(state, rows)

    monkeypatch.setattr(pull_reads, "verify", first_flipped)
    producer = HybridProducer(hybrid, store=tmp_path / "store")
    run = consume(hybrid, producer.references, async_load=async_load,
                  store=tmp_path / "store")
    assert run.ids == no_connector(hybrid)
    assert run.stats["prompt_tokens_external"] == CLAIMED_BLOCKS * 8
    assert run.pulled == run.stats["kv_tier0_loaded_blocks"] == CLAIMED_BLOCKS
    assert run.stats["kv_tier0_loaded_states"] == run.stats["kv_tier1_loaded_states"] == 1
    assert run.stats.get("kv_tier1_loaded_blocks", 0) == 0
    assert run.stats["kv_load_failed_blocks"] == 0
    assert producer.finish_with_states() == (0, 0)


@ASYNC
def test_a_dead_producer_falls_through_to_the_stores_blocks_and_states(
        hybrid, dead_producer, async_load):
    references, store = dead_producer
    run = consume(hybrid, references, async_load=async_load, store=store)
    assert run.ids == no_connector(hybrid)
    assert run.pulled == 0 and run.stats["kv_tier0_failed_blocks"] == CLAIMED_BLOCKS
    assert run.stats["kv_tier1_loaded_blocks"] == CLAIMED_BLOCKS
    assert run.stats["kv_tier1_loaded_states"] == 2
    assert run.stats["kv_load_failed_blocks"] == 0


@ASYNC
def test_what_both_tiers_lost_is_recomputed(hybrid, dead_producer, tmp_path, async_load):
    references, _ = dead_producer
    run = consume(hybrid, references, async_load=async_load, store=tmp_path / "empty")
    assert run.ids == no_connector(hybrid)
    assert run.pulled == 0 and run.stats.get("kv_tier1_loaded_blocks", 0) == 0
    assert run.stats.get("kv_tier1_loaded_states", 0) == 0
    assert run.stats["kv_load_failed_blocks"] >= CLAIMED_BLOCKS


def state_at(prompt: list[int], boundary: int) -> str:
    """The hex store key of the prompt's recurrent state at this block boundary (blocks
    of 8)."""
    block_hash = None
    for start in range(0, boundary * 8, 8):
        block_hash = hash_block_tokens(block_hash, prompt[start : start + 8])
    assert block_hash is not None
    return state_key(block_hash).hex()


@ASYNC
def test_a_bad_pulled_state_resumes_from_the_stores_earlier_state(
        hybrid, tmp_path, monkeypatch, async_load):
    """Every pulled state fails and the store lost the states at the claims' ends (7 and
    5) but keeps those every K = 4 blocks: both requests resume from the store's state
    at block 4 (token 32), not 0; same tokens."""
    real = pull_reads.verify

    def flipped(state, rows):
        rows.reshape(-1)[0] ^= 0x5A
        return real(state, rows)

    monkeypatch.setattr(pull_reads, "verify", flipped)
    store = tmp_path / "store"
    producer = HybridProducer(hybrid, store=store, engine={"state_interval_blocks": 4})
    ends = {state_at(PROMPTS[0], 7), state_at(PROMPTS[1], 5)}
    lost = [path for path in store.rglob("*.kvblock") if any(key in path.name for key in ends)]
    assert len(lost) >= 2
    for path in lost:
        path.unlink()
    transfer = dataclasses.replace(consumer_config(async_load, "recompute", store),
                                   state_interval_blocks=4)
    llm = LLM(str(hybrid), device="cpu", block_size=8, num_kv_blocks=128,
              kv_transfer_config=transfer)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                           with_references(producer.references))
    llm.close()
    assert [o.outputs[0].token_ids for o in outputs] == no_connector(hybrid)
    stats = llm.stats
    assert stats["kv_tier0_loaded_blocks"] == CLAIMED_BLOCKS
    assert stats["kv_tier1_loaded_states"] == 2 and stats.get("kv_tier0_loaded_states", 0) == 0
    # Each claim's last block fails (async: the waiting request asks again and claims
    # nothing from the reference it released; the store serves up to its state at 4).
    assert stats["kv_load_failed_blocks"] == 2
    # Computed from token 32 on (29 + 13 prompt tokens, and sync the decode steps), not
    # from 0 (61 + 45).
    assert stats["prompt_tokens_computed"] <= (61 - 32) + (45 - 32) + 2 * 5 < 61 + 45, stats
    assert producer.finish_with_states() == (0, 0)
