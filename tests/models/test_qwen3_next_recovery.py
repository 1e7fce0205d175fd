"""Recovery of a hybrid (Qwen3-Next) request whose KV or recurrent state fails to load
(rule 8): it rolls back to the last block boundary whose KV and state are all valid
(the state held at exactly that boundary, else 0) and gives the connector-free tokens
(policy `recompute`), or only it ends (`fail`). Faults come from FaultInjectionConnector
plans targeting KV blocks or the state entry."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import storage_transfer
from test_qwen3_next_connectors import hybrid_llm
from test_qwen3_next_vs_hf import FAMILIES, PROMPTS, build_hybrid, generate

from kvrecover import KVTransferConfig, SamplingParams


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build_hybrid(tmp_path_factory.mktemp("qwen3_next"), **FAMILIES["qwen3_next"])


@pytest.fixture(scope="module")
def baseline(model) -> list[list[int]]:
    return generate(hybrid_llm(model))


@pytest.fixture(scope="module")
def pristine_store(model, tmp_path_factory) -> Path:
    store = tmp_path_factory.mktemp("store")
    producer = hybrid_llm(model, storage_transfer(store, "kv_producer"))
    generate(producer)
    producer.close()
    return store


@pytest.fixture
def store(pristine_store, tmp_path) -> Path:
    copy = tmp_path / "store"
    shutil.copytree(pristine_store, copy)
    return copy


def faulty(store: Path, target: str, kind: str, blocks: str = "middle", policy: str = "recompute",
           async_load: bool = False) -> KVTransferConfig:
    faults = [{"requests": "first", "blocks": blocks, "kind": kind, "target": target}]
    transfer = storage_transfer(store, "kv_consumer", "FaultInjectionConnector", faults=faults,
                                async_load=async_load)
    transfer.kv_load_failure_policy = policy
    return transfer


@pytest.mark.parametrize("async_load", [False, True])
@pytest.mark.parametrize("kind", ["missing", "error", "corrupt"])
@pytest.mark.parametrize("target", ["kv", "state"])
def test_recompute_matrix(model, store, baseline, target, kind, async_load):
    llm = hybrid_llm(model, faulty(store, target, kind, async_load=async_load))
    assert generate(llm) == baseline
    assert llm.stats["kv_load_failed_blocks"] > 0
    assert llm.stats["kv_load_recovered_requests"] > 0


@pytest.mark.parametrize("async_load", [False, True])
@pytest.mark.parametrize("kind", ["missing", "error", "corrupt"])
@pytest.mark.parametrize("target", ["kv", "state"])
def test_fail_policy_matrix(model, store, baseline, target, kind, async_load):
    """Only the first loading request (the first prompt) ends with an error."""
    llm = hybrid_llm(model, faulty(store, target, kind, policy="fail", async_load=async_load))
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                           SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert [o.outputs[0].finish_reason for o in outputs] == ["error", "length", "length"]
    assert [o.outputs[0].token_ids for o in outputs[1:]] == baseline[1:]
    assert llm.stats["kv_load_failed_requests"] == 1


@pytest.mark.parametrize("target", ["kv", "state"])
def test_the_rollback_point_is_a_held_checkpoint_not_0(model, store, baseline, target):
    """The consumer computed the 24-token prefix of the long prompt itself (prefix caching
    keeps checkpoints at its boundaries); the long prompt hits it, loads tokens 24-40
    from the store, and that load's last block (or its state) fails: the request rolls
    back to 24, not 0, and computes the tokens after it, with the same tokens."""
    prompt = PROMPTS[2]
    llm = hybrid_llm(model, faulty(store, target, "missing", blocks="last"),
                     enable_prefix_caching=True)
    generate(llm, [prompt[:24]])
    computed = llm.stats["prompt_tokens_computed"]
    assert generate(llm, [prompt]) == [baseline[2]]
    assert llm.stats["kv_load_failed_blocks"] > 0 and llm.stats["prefix_cache_hit_tokens"] == 24
    # Tokens 24-41, plus the one the step of the failed load computed (then voided); a
    # rollback to 0 would compute all 41 again.
    assert llm.stats["prompt_tokens_computed"] - computed == len(prompt) - 24 + 1


@pytest.mark.parametrize("async_load", [False, True])
@pytest.mark.parametrize("target", ["kv", "state"])
def test_shared_prefixes_recover_with_their_own_states(model, tmp_path, target, async_load):
    """Two prompts share 24 tokens, both stored; the first one's load fails while the
    other's succeeds in the same batch, with prefix caching on: each request rolls back
    or resumes on its own state slot, and both give the connector-free tokens."""
    shared = PROMPTS[2][:24]
    prompts = [shared + PROMPTS[1][:9], shared + PROMPTS[0] + PROMPTS[1][9:20]]
    expected = generate(hybrid_llm(model), prompts)
    store = tmp_path / "store"
    generate(hybrid_llm(model, storage_transfer(store, "kv_producer")), prompts)
    llm = hybrid_llm(model, faulty(store, target, "corrupt", async_load=async_load),
                     enable_prefix_caching=True)
    assert generate(llm, prompts) == expected
    assert llm.stats["kv_load_failed_blocks"] > 0
    assert generate(llm, prompts) == expected  # and again, from the checkpoints they left
