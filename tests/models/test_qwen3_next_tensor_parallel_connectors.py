"""A hybrid's recurrent states through a store connector at tensor_parallel_size 2: each
rank stores and loads its own heads' state entries under its own layout fingerprint
(as its KV blocks, DESIGN rule 9); a consumer at size 2 decodes Hugging Face's tokens;
a missing or corrupt state on rank 1 only (rank 0's intact) rolls the request back on
every rank and the output stays exact (sync and async), or with the `fail` policy ends
that request alone."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import break_stored_file, hf_greedy, storage_transfer
from test_qwen3_next_connectors import last_boundary_key
from test_qwen3_next_vs_hf import FAMILIES, GREEDY, MAX_NEW, PROMPTS, build_hybrid, generate

from kvrecover import LLM, KVTransferConfig
from kvrecover.kv_transfer.stores.block_store import BlockStore

BLOCK = 4
BROKEN_PROMPT = 2  # the longest prompt: its state breaks on rank 1


def hybrid_llm(folder: Path, transfer: KVTransferConfig) -> LLM:
    return LLM(str(folder), block_size=BLOCK, device="cpu", max_num_batched_tokens=12,
               enable_prefix_caching=False, kv_transfer_config=transfer,
               tensor_parallel_size=2)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build_hybrid(tmp_path_factory.mktemp("qwen3_5_tp_store"), **FAMILIES["qwen3_5"])


@pytest.fixture(scope="module")
def reference(model) -> list[list[int]]:
    return hf_greedy(model, PROMPTS, MAX_NEW)


@pytest.fixture(scope="module")
def filled_store(model, tmp_path_factory) -> tuple[Path, object]:
    """(a store a size-2 producer filled, the producer's resolved config)."""
    root = tmp_path_factory.mktemp("tp_hybrid_store")
    with hybrid_llm(model, storage_transfer(root, "kv_producer")) as producer:
        generate(producer)
        config = producer.engine.config
    return root, config


def state_file(config, root: Path, rank: int, prompt: list[int]) -> Path:
    return BlockStore(root, config.rank_layout(rank)).path(last_boundary_key(prompt))


def test_a_consumer_at_size_2_loads_every_ranks_state_and_decodes_hf_tokens(
        model, filled_store, reference):
    root, config = filled_store
    for rank in (0, 1):  # each rank stored its own heads' state, under its own key
        assert all(state_file(config, root, rank, p).is_file() for p in PROMPTS)
    assert state_file(config, root, 0, PROMPTS[0]) != state_file(config, root, 1, PROMPTS[0])
    with hybrid_llm(model, storage_transfer(root, "kv_consumer")) as consumer:
        assert generate(consumer) == reference
        assert consumer.stats["prompt_tokens_external"] > 0
        assert consumer.stats["kv_load_failed_blocks"] == 0


@pytest.mark.parametrize("kind", ["missing", "corrupt"])
@pytest.mark.parametrize("async_load", [False, True])
def test_a_broken_state_on_one_rank_rolls_back_every_rank(model, filled_store, reference,
                                                          tmp_path, kind, async_load):
    root, config = filled_store
    store = tmp_path / "store"
    shutil.copytree(root, store)
    broken = state_file(config, store, 1, PROMPTS[BROKEN_PROMPT])
    assert state_file(config, store, 0, PROMPTS[BROKEN_PROMPT]).is_file()
    break_stored_file(broken, kind)
    transfer = storage_transfer(store, "kv_consumer", async_load=async_load, load_timeout_s=5.0)
    with hybrid_llm(model, transfer) as consumer:
        assert generate(consumer) == reference
        assert consumer.stats["kv_load_recomputed_tokens"] > 0


def test_with_the_fail_policy_only_the_request_whose_rank_1_state_broke_ends(
        model, filled_store, reference, tmp_path):
    root, config = filled_store
    store = tmp_path / "store"
    shutil.copytree(root, store)
    state_file(config, store, 1, PROMPTS[BROKEN_PROMPT]).unlink()
    transfer = storage_transfer(store, "kv_consumer", load_timeout_s=5.0)
    transfer.kv_load_failure_policy = "fail"
    with hybrid_llm(model, transfer) as consumer:
        outputs = consumer.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    for index, output in enumerate(outputs):
        if index == BROKEN_PROMPT:
            assert output.outputs[0].finish_reason == "error"
        else:
            assert output.outputs[0].token_ids == reference[index]
