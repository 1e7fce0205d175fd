"""NixlConnector on hybrid (recurrent-state) models, Qwen3-Next and Qwen3.5: a kept
prompt keeps its linear-attention state at the last loadable boundary, the consumer pulls
it with the blocks in one READ, verifies and installs it, and decodes the token ids of a
run without a connector; a state that is missing or fails its checksum rolls the request
back and recomputes it, same tokens (`kv_transfer/p2p/states.py`, DESIGN rules 8 and 10)."""

from __future__ import annotations

import copy
import time
from pathlib import Path

import pytest
from conftest import require_nixl
from models.test_qwen3_next_vs_hf import FAMILIES, build_hybrid
from test_nixl_connector import (  # noqa: F401 - kill_producers: every test's producers die
    PARAMS,
    PROMPTS,
    Producer,
    consume,
    consumer_config,
    kill_producers,
    no_connector,
    with_references,
)

from kvrecover import LLM
from kvrecover.kv_transfer.p2p import pull_reads

require_nixl()

# 61 and 45 tokens (test_nixl_connector.PROMPTS), blocks of 8: states at blocks 7 and 5.
CLAIMED_BLOCKS = 7 + 5


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5"])
def hybrid(request, tmp_path_factory) -> Path:
    return build_hybrid(tmp_path_factory.mktemp(request.param), **FAMILIES[request.param])


class HybridProducer(Producer):
    """A producer of a hybrid: its end also says how many states it still keeps."""

    def finish_with_states(self) -> tuple[int, int]:
        """Close its stdin; (prompts, states) it still held (bounded wait)."""
        out, _ = self.process.communicate("", timeout=30)
        counts = {line.split()[0]: int(line.split()[1]) for line in out.splitlines()
                  if line.startswith(("HELD ", "STATES "))}
        return counts["HELD"], counts["STATES"]


    def counts(self) -> tuple[int, int]:
        """(prompts, states) it holds now."""
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write("COUNT\n")
        self.process.stdin.flush()
        counts = {}
        for line in self.process.stdout:  # other lines are the libraries' logs
            if line.startswith(("HELD ", "STATES ")):
                counts[line.split()[0]] = int(line.split()[1])
                if "HELD" in counts:
                    return counts["HELD"], counts["STATES"]
        raise AssertionError("the producer ended")


def tampered_state(references: list[dict], state_block: int) -> list[dict]:
    """The references, the first one's state boundary moved to `state_block`."""
    result = copy.deepcopy(references)
    result[0]["kv_state_block"] = state_block
    return result


def test_the_references_name_each_prompts_state_boundary(hybrid):
    producer = HybridProducer(hybrid)
    assert [r["kv_state_block"] for r in producer.references] == [7, 5]
    producer.kill()


@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
def test_a_pull_of_blocks_and_state_is_exact_and_frees_both(hybrid, async_load):
    producer = HybridProducer(hybrid)
    run = consume(hybrid, producer.references, async_load=async_load)
    assert run.ids == no_connector(hybrid)
    assert run.stats["prompt_tokens_external"] == CLAIMED_BLOCKS * 8
    assert run.pulled == CLAIMED_BLOCKS == sum(run.full_pulls)
    assert run.stats["kv_load_failed_blocks"] == 0
    assert producer.finish_with_states() == (0, 0)  # released: nothing stays pinned


@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
def test_a_dead_producer_is_recomputed_exactly(hybrid, async_load):
    producer = HybridProducer(hybrid)
    producer.kill()
    run = consume(hybrid, producer.references, async_load=async_load)
    assert run.ids == no_connector(hybrid)
    assert run.pulled == 0 and run.stats["kv_load_failed_blocks"] >= CLAIMED_BLOCKS


@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
def test_a_reference_to_a_boundary_without_a_state_is_recomputed(hybrid, async_load):
    """The first reference says the state is at block 3 (the producer keeps it at 7): the
    claim ends at 3, its blocks are read but no state comes, so the request rolls back
    to 0 and recomputes; the second prompt pulls as usual."""
    producer = HybridProducer(hybrid)
    run = consume(hybrid, tampered_state(producer.references, 3), async_load=async_load)
    assert run.ids == no_connector(hybrid)
    assert run.stats["prompt_tokens_external"] == 5 * 8  # the second prompt's only
    assert run.stats["kv_load_failed_blocks"] >= 1
    assert run.stats["kv_load_recomputed_tokens"] >= 3 * 8
    assert producer.finish_with_states() == (0, 0)  # both released all the same


def test_an_expired_lease_frees_the_blocks_and_state_and_is_recomputed(hybrid):
    producer = HybridProducer(hybrid, lease_s=1.0)
    time.sleep(2.0)  # past the lease: the subject of the test, as test_nixl_connector's
    run = consume(hybrid, producer.references)
    assert run.ids == no_connector(hybrid) and run.pulled == 0
    assert producer.finish_with_states() == (0, 0)


def test_a_state_past_what_the_prompt_loads_claims_nothing(hybrid):
    """The 61-token prompt's reference (state at block 7) on the 45-token prompt (5 blocks
    loadable): the claim cannot end at the state, so nothing is claimed."""
    producer = HybridProducer(hybrid)
    run = consume(hybrid, [None, producer.references[0]])
    assert run.ids == no_connector(hybrid)
    assert run.stats["prompt_tokens_external"] == 0 and run.pulled == 0
    producer.kill()


def test_a_state_that_fails_its_checksum_is_recomputed(hybrid, monkeypatch):
    """A byte of each pulled state flipped in the staging buffer: its checksum fails, the
    requests roll back to 0 and recompute (their KV blocks verified all the same)."""
    real = pull_reads.verify

    def flipped(state, rows):
        rows.reshape(-1)[state.nbytes // 2] ^= 0x5A
        return real(state, rows)

    monkeypatch.setattr(pull_reads, "verify", flipped)
    producer = HybridProducer(hybrid)
    run = consume(hybrid, producer.references)
    assert run.ids == no_connector(hybrid)
    assert run.pulled == CLAIMED_BLOCKS  # the blocks passed; the states did not
    assert run.stats["kv_load_failed_blocks"] == 2  # each claim's last block
    assert run.stats["kv_load_recomputed_tokens"] >= CLAIMED_BLOCKS * 8
    assert producer.finish_with_states() == (0, 0)


def test_policy_fail_ends_only_the_request_whose_state_failed(hybrid):
    producer = HybridProducer(hybrid)
    run = consume(hybrid, tampered_state(producer.references, 3), policy="fail")
    assert run.outputs[0].outputs[0].finish_reason == "error"
    assert run.outputs[0].error_type == "kv_load_failed"
    assert run.ids[1] == no_connector(hybrid)[1] and run.outputs[1].error is None
    producer.kill()


def test_a_failed_state_rolls_back_to_a_checkpoint_the_consumer_holds(hybrid, monkeypatch):
    """The consumer computed the first prompt's first 33 tokens before (checkpoints at
    its block boundaries, 8 to 32): that prompt's pull claims blocks 4 to 6 only, its
    state fails, and it resumes from the checkpoint at 32, not 0; same tokens."""
    real = pull_reads.verify

    def flipped(state, rows):
        rows.reshape(-1)[0] ^= 0x5A
        return real(state, rows)

    monkeypatch.setattr(pull_reads, "verify", flipped)
    producer = HybridProducer(hybrid)
    transfer = consumer_config(False, "recompute", None)
    llm = LLM(str(hybrid), device="cpu", block_size=8, num_kv_blocks=128,
              kv_transfer_config=transfer)
    llm.generate([{"prompt_token_ids": PROMPTS[0][:33]}], PARAMS)
    before = dict(llm.stats)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                           with_references(producer.references))
    after = llm.stats
    llm.close()
    assert [o.outputs[0].token_ids for o in outputs] == no_connector(hybrid)
    grew = {k: after.get(k, 0) - before.get(k, 0) for k in (
        "prefix_cache_hit_tokens", "prompt_tokens_external", "kv_load_failed_blocks",
        "kv_load_recomputed_tokens", "prompt_tokens_computed")}
    # Recomputed: from the rollback point to the prompt's end, 61 - 32 and 45 - 0 (from 0
    # the first would be 61); computed adds each request's 5 decode steps.
    assert grew == {"prefix_cache_hit_tokens": 32, "prompt_tokens_external": 0,
                    "kv_load_failed_blocks": 2, "kv_load_recomputed_tokens": 29 + 45,
                    "prompt_tokens_computed": 29 + 5 + 45 + 5}, grew
    assert producer.finish_with_states() == (0, 0)


def test_a_prompt_whose_state_finds_no_slot_keeps_no_blocks(hybrid):
    """max_held_states=1: the first prompt keeps its blocks and state; the second's state
    finds no slot, so its blocks (of no use without the state) are freed at once, not
    at the end of the lease, and a consumer given its reference recomputes it."""
    if hybrid.name.startswith("qwen3_5"):
        pytest.skip("the state pool is the connector's: one hybrid family covers it")
    producer = HybridProducer(hybrid, engine={"nixl": {"max_held_states": 1}})
    deadline = time.monotonic() + 10
    while (held := producer.counts()) != (1, 1) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert held == (1, 1)
    run = consume(hybrid, producer.references)
    assert run.ids == no_connector(hybrid)
    assert run.pulled == 7  # the first prompt's; the second's reference is refused
    assert run.stats["kv_load_failed_blocks"] == 5
    assert producer.finish_with_states() == (0, 0)
