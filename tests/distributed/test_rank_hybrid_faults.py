"""A hybrid (Qwen3.5: Gated DeltaNet + full attention) at tensor_parallel_size 2 with a
store whose entries break on one rank, or at different boundaries on different ranks
(issue 41 item 2, DESIGN rules 8 and 9).

Each rank stores its own heads' KV and recurrent states (a state at every block boundary
here, `state_interval_blocks=1`). A failure on one rank fails its blocks for every rank;
the ranks resume from one point that every rank holds, so the output equals a
failure-free size-2 run's, and under policy "fail" only the broken prompt ends.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
from conftest import KV_BLOCK, KV_PROMPTS, break_stored_file, make_kv_llm, storage_transfer

from kvrecover import SamplingParams
from kvrecover.kv_layout import update_block_hashes
from kvrecover.kv_transfer.stores.block_store import BlockStore
from kvrecover.kv_transfer.stores.state_entries import state_key

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
from test_qwen3_next_vs_hf import FAMILIES, build_hybrid  # noqa: E402

PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
BROKEN = 0  # the prompt whose entries break (70 tokens: 4 loadable blocks)


def transfer(store: Path, role: str, **extra):
    config = storage_transfer(store, role, load_timeout_s=5.0, **extra)
    config.state_interval_blocks = 1
    return config


def run(model: Path, store: Path, *, async_load: bool = False, policy: str = "recompute"):
    consumer = transfer(store, "kv_consumer", async_load=async_load)
    consumer.kv_load_failure_policy = policy
    with make_kv_llm(model, consumer, tensor_parallel_size=2) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in KV_PROMPTS], PARAMS)
        assert llm.engine.check_health() is None  # the engine stays up
        return outputs, llm.stats


def ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """(model, store filled by a size-2 producer, a failure-free size-2 run's ids, the
    resolved config)."""
    model = build_hybrid(tmp_path_factory.mktemp("qwen3_5"), **FAMILIES["qwen3_5"])
    store = tmp_path_factory.mktemp("tp_hybrid_store")
    with make_kv_llm(model, transfer(store, "kv_producer"), tensor_parallel_size=2) as llm:
        llm.generate([{"prompt_token_ids": p} for p in KV_PROMPTS], PARAMS)
    with make_kv_llm(model, tensor_parallel_size=2) as llm:
        baseline = ids(llm.generate([{"prompt_token_ids": p} for p in KV_PROMPTS], PARAMS))
        config = llm.engine.config
    outputs, stats = run(model, store)
    assert ids(outputs) == baseline and stats["prompt_tokens_external"] > 0
    assert stats["kv_load_failed_blocks"] == 0
    return model, store, baseline, config


def entry(config, root: Path, rank: int, what: str, block: int) -> Path:
    """Rank `rank`'s stored file of BROKEN's block `block` ("kv") or of the state at the
    end of that block ("state")."""
    keys: list[bytes] = []
    update_block_hashes(keys, KV_PROMPTS[BROKEN], KV_BLOCK)
    key = keys[block] if what == "kv" else state_key(keys[block])
    path = BlockStore(root, config.rank_layout(rank)).path(key)
    assert path.is_file(), path
    return path


def broken_store(stored, target: Path, breaks: list[tuple[int, str, int, str]]) -> Path:
    """A copy of the store with each (rank, "kv" or "state", block, kind) broken."""
    _, root, _, config = stored
    shutil.copytree(root, target)
    for rank, what, block, kind in breaks:
        break_stored_file(entry(config, target, rank, what, block), kind)
    return target


CASES = {
    # One rank's KV entry inside the load: the others hold no state to resume from there.
    "rank1-kv-1-corrupt": [(1, "kv", 1, "corrupt")],
    "rank1-kv-2-missing": [(1, "kv", 2, "missing")],
    "rank1-kv-3-corrupt": [(1, "kv", 3, "corrupt")],
    # States invalid at different boundaries on different ranks (the load's end state on
    # rank 1, an earlier resume state on rank 0), with a KV block on rank 0 too.
    "states-at-different-boundaries": [(1, "state", 3, "corrupt"), (0, "state", 1, "corrupt"),
                                       (0, "kv", 2, "corrupt")],
}


@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("case", list(CASES))
def test_one_rank_breaking_recovers_exactly(stored, tmp_path, case, async_load):
    model, _, baseline, _ = stored
    store = broken_store(stored, tmp_path / "store", CASES[case])
    outputs, stats = run(model, store, async_load=async_load)
    assert [o.error for o in outputs] == [None] * len(KV_PROMPTS)
    assert ids(outputs) == baseline
    assert stats["kv_load_failed_blocks"] >= 1 and stats["kv_load_failed_requests"] == 0


@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
def test_policy_fail_ends_only_the_broken_prompt(stored, tmp_path, async_load):
    model, _, baseline, _ = stored
    store = broken_store(stored, tmp_path / "store", CASES["rank1-kv-1-corrupt"])
    outputs, stats = run(model, store, async_load=async_load, policy="fail")
    assert outputs[BROKEN].outputs[0].finish_reason == "error"
    assert outputs[BROKEN].error_type == "kv_load_failed"
    assert [o.error for i, o in enumerate(outputs) if i != BROKEN] == [None] * 2
    assert [t for i, t in enumerate(ids(outputs)) if i != BROKEN] == \
        [t for i, t in enumerate(baseline) if i != BROKEN]
    assert stats["kv_load_failed_requests"] == 1
