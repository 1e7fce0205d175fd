"""KV connectors per rank at tensor_parallel_size 2 (DESIGN rule 9): each rank stores and
loads its own shard; a failure on one rank only fails those blocks for every rank, and
the recovered output is exactly a failure-free size-2 run's."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import (
    KV_BLOCK,
    KV_PROMPTS,
    break_stored_file,
    greedy_token_ids,
    make_kv_llm,
    storage_transfer,
)

from kvrecover.kv_layout import update_block_hashes
from kvrecover.kv_transfer.stores.block_store import BlockStore

MAX_TOKENS = 4
BROKEN_PROMPT = 0  # the prompt whose rank-1 shard breaks; the others load fine


def run(model: Path, store: Path, *, size: int = 2, async_load: bool = False,
        policy: str = "recompute", recompute: str = "prefix", **extra):
    transfer = storage_transfer(store, "kv_consumer", async_load=async_load,
                                load_timeout_s=5.0, **extra)
    transfer.kv_load_failure_policy = policy
    transfer.kv_load_recompute = recompute
    llm = make_kv_llm(model, transfer, tensor_parallel_size=size)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in KV_PROMPTS],
                               _params())
        return outputs, llm.stats, llm.engine.config
    finally:
        llm.close()


def _params():
    from kvrecover import SamplingParams

    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def size_2_store(tiny_llama, tmp_path_factory):
    """(store filled by a size-2 producer, a failure-free size-2 consumer's token ids,
    the resolved config of that consumer)."""
    root = tmp_path_factory.mktemp("tp_store")
    with make_kv_llm(tiny_llama, storage_transfer(root, "kv_producer"),
                     tensor_parallel_size=2) as producer:
        greedy_token_ids(producer, KV_PROMPTS, 1)
    outputs, stats, config = run(tiny_llama, root)
    assert stats["prompt_tokens_external"] > 0 and stats["kv_load_failed_blocks"] == 0
    return root, ids(outputs), config


def rank_block_files(config, root: Path, rank: int, prompt: list[int]) -> list[Path]:
    """The stored block files of `prompt` that rank `rank` loads, in chain order."""
    keys: list[bytes] = []
    update_block_hashes(keys, prompt, KV_BLOCK)
    store = BlockStore(root, config.rank_layout(rank))
    return [store.path(key) for key in keys]


def broken_copy(size_2_store, target: Path, kind: str) -> Path:
    """A copy of the store in which rank 1's middle block of BROKEN_PROMPT is missing or
    corrupt (rank 0's copy of that block is intact)."""
    root, _, config = size_2_store
    shutil.copytree(root, target)
    path = rank_block_files(config, target, 1, KV_PROMPTS[BROKEN_PROMPT])[1]
    rank_0_path = rank_block_files(config, target, 0, KV_PROMPTS[BROKEN_PROMPT])[1]
    assert path.is_file() and rank_0_path.is_file() and path.parent != rank_0_path.parent
    break_stored_file(path, kind)
    return target


def test_each_rank_stores_its_own_shard_and_another_size_misses(size_2_store, tiny_llama):
    root, _, config = size_2_store
    folders = sorted(p.name for p in root.iterdir() if p.is_dir())
    assert folders == sorted({config.rank_layout(0).fingerprint,
                              config.rank_layout(1).fingerprint})
    _, stats, _ = run(tiny_llama, root, size=1)
    assert stats["prompt_tokens_external"] == 0  # stored at size 2: a miss at size 1


@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("kind", ["missing", "corrupt"])
def test_one_ranks_failed_load_is_recomputed_exactly(size_2_store, tiny_llama, tmp_path,
                                                     kind, async_load):
    store = broken_copy(size_2_store, tmp_path / "store", kind)
    outputs, stats, _ = run(tiny_llama, store, async_load=async_load)
    assert ids(outputs) == size_2_store[1]
    assert stats["kv_load_failed_blocks"] >= 1
    assert stats["kv_load_recovered_requests"] >= 1  # async: once more on its retry (rule 6)


@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
def test_scope_blocks_recomputes_only_the_block_one_rank_lost(size_2_store, tiny_llama,
                                                              tmp_path, async_load):
    """Rule 9 under scope "blocks": the block is invalid for every rank, and only it (and,
    after a sync load, the tokens its step computed on top of it) is recomputed."""
    store = broken_copy(size_2_store, tmp_path / "store", "missing")
    outputs, stats, _ = run(tiny_llama, store, async_load=async_load, recompute="blocks")
    assert ids(outputs) == size_2_store[1]
    prompt = KV_PROMPTS[BROKEN_PROMPT]
    tail = 0 if async_load else len(prompt) - (len(prompt) - 1) // KV_BLOCK * KV_BLOCK
    assert stats["kv_load_failed_blocks"] == 1
    assert stats["kv_load_recomputed_tokens"] == KV_BLOCK + tail


@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("kind", ["missing", "corrupt"])
def test_one_ranks_failed_load_under_policy_fail_fails_only_that_request(
        size_2_store, tiny_llama, tmp_path, kind, async_load):
    store = broken_copy(size_2_store, tmp_path / "store", kind)
    outputs, stats, _ = run(tiny_llama, store, async_load=async_load, policy="fail")
    broken = outputs[BROKEN_PROMPT]
    assert broken.outputs[0].finish_reason == "error" and broken.error_type == "kv_load_failed"
    assert broken.outputs[0].token_ids == []
    for index, output in enumerate(outputs):
        if index != BROKEN_PROMPT:
            assert output.outputs[0].token_ids == size_2_store[1][index]
    assert stats["kv_load_failed_requests"] == 1


CONNECTOR_MODULE = '''
from kvrecover.kv_transfer.stores.shared_storage import SharedStorageConnector


class RankOneMisbehaves(SharedStorageConnector):
    """On rank 1's worker role only: {what}."""

    def _rank_one(self):
        return self.layout.tensor_parallel_rank == 1 and self.role.name == "WORKER"

    def start_load_kv(self, kv_caches):
        if self._rank_one() and {raises}:
            raise RuntimeError("rank 1's store is unreachable")
        return super().start_load_kv(kv_caches)

    def get_block_ids_with_load_errors(self):
        invalid = super().get_block_ids_with_load_errors()
        if self._rank_one() and not {raises}:
            return None  # outside the contract
        return invalid
'''


@pytest.mark.parametrize("misbehaviour", ["raises", "returns_none"])
@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
def test_a_connector_failing_on_one_rank_only_fails_its_loads_everywhere(
        size_2_store, tiny_llama, tmp_path, misbehaviour, async_load):
    module = tmp_path / "rank_one_connector.py"
    raises = misbehaviour == "raises"
    module.write_text(CONNECTOR_MODULE.format(what=misbehaviour, raises=raises))
    root = size_2_store[0]
    transfer = storage_transfer(root, "kv_consumer", connector="RankOneMisbehaves",
                                module_path=str(module), async_load=async_load,
                                load_timeout_s=5.0)
    with make_kv_llm(tiny_llama, transfer, tensor_parallel_size=2) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in KV_PROMPTS], _params())
        stats = llm.stats
    assert ids(outputs) == size_2_store[1]
    assert stats["kv_connector_errors"] >= 1
    assert stats["kv_load_failed_blocks"] >= 1
    assert stats["kv_load_recovered_requests"] >= 1
