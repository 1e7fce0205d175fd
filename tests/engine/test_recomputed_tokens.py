"""What a failed load costs in recomputed tokens, sync against async (issue 28, goal 4).

An async load that fails lets its request ask the connector once more
(`kv_load_retry_limit`, 1 by default); the tokens it lost are then loaded again, not
computed. Against a store whose bad entries stay bad, that retry fails at the same
blocks, and the request computes from its first bad block on: exactly what the sync
path computes, less the one token the sync step sampled before its failure was known.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import random_prompts
from scheduler_harness import PROMPT, FakeConnector, add, make_scheduler, run_to_completion, step

from kvrecover import LLM, KVTransferConfig, SamplingParams

BLOCK = 8
PROMPTS = random_prompts(4, [81], 384, seed=3)  # 10 stored blocks each (the last token never)
LOADED = 10 * BLOCK
PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
# Bad block positions per request (the fault injector's load order); request 3 loads whole.
BAD = {0: [2, 5], 1: [0], 2: [6, 7, 8]}
LOST = sum(LOADED - positions[0] * BLOCK for positions in BAD.values())  # 64 + 80 + 32


@pytest.fixture(scope="module")
def stored(tiny_llama, tmp_path_factory) -> tuple[Path, Path, list[list[int]]]:
    """(model, a store holding every prompt's KV, the plain engine's token ids)."""
    store = tmp_path_factory.mktemp("store")
    producer = KVTransferConfig("SharedStorageConnector", "kv_producer",
                                {"shared_storage_path": str(store)})
    with LLM(str(tiny_llama), device="cpu", block_size=BLOCK, enable_prefix_caching=False,
             kv_transfer_config=producer) as llm:
        baseline = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS)
    return tiny_llama, store, [o.outputs[0].token_ids for o in baseline]


def run_with_faults(stored, async_load: bool, bad: dict[int, list[int]] = BAD,
                    kind: str = "missing", recompute: str = "prefix") -> dict[str, int]:
    model, store, baseline = stored
    faults = [{"requests": index, "blocks": positions, "kind": kind}
              for index, positions in bad.items()]
    transfer = KVTransferConfig("FaultInjectionConnector", "kv_consumer", {
        "inner_connector": "SharedStorageConnector", "shared_storage_path": str(store),
        "async_load": async_load, "faults": faults}, kv_load_recompute=recompute)
    with LLM(str(model), device="cpu", block_size=BLOCK, enable_prefix_caching=False,
             kv_transfer_config=transfer) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS)
        assert [o.outputs[0].token_ids for o in outputs] == baseline
        return llm.stats


def test_async_recovery_recomputes_no_more_than_sync(stored):
    sync, async_ = run_with_faults(stored, False), run_with_faults(stored, True)
    # Sync: each failed request also recomputes the token its load step sampled.
    assert sync["kv_load_recomputed_tokens"] == LOST + len(BAD)
    assert sync["kv_load_recovered_requests"] == len(BAD)
    # Async: each failed request retried once and failed again at the same blocks.
    assert async_["kv_load_recovered_requests"] == 2 * len(BAD)
    assert async_["kv_load_recomputed_tokens"] == LOST
    assert async_["kv_load_recomputed_tokens"] <= sync["kv_load_recomputed_tokens"]
    # The model's work says the same: the lost tokens and every prompt's last token, once.
    assert async_["prompt_tokens_computed"] == LOST + len(PROMPTS)
    assert async_["prompt_tokens_computed"] <= sync["prompt_tokens_computed"]
    assert async_["prompt_tokens_external"] == sync["prompt_tokens_external"] == (
        len(PROMPTS) * LOADED - LOST)


# Hole layouts per request (positions among its 10 loaded blocks).
LAYOUTS = {
    "several-first-adjacent-last": {0: [2, 5], 1: [0], 2: [6, 7, 8], 3: [9]},
    "middle": {1: [4]},
    "every-other": {2: [1, 3, 5, 7]},
}


@pytest.mark.parametrize("kind", ["missing", "error", "corrupt"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
def test_scope_blocks_recomputes_exactly_the_failed_blocks(stored, async_load, layout, kind):
    """Scope "blocks": exact ids; recomputed = the failed blocks' tokens, plus after a sync
    load the one token its step computed on top of them; every valid block loads."""
    bad = LAYOUTS[layout]
    stats = run_with_faults(stored, async_load, bad, kind, recompute="blocks")
    failed = sum(len(positions) for positions in bad.values()) * BLOCK
    tail = 0 if async_load else len(bad)
    assert stats["kv_load_recomputed_tokens"] == failed + tail
    assert stats["prompt_tokens_external"] == len(PROMPTS) * LOADED - failed
    assert stats["prompt_tokens_computed"] == failed + len(PROMPTS) + tail
    assert stats["kv_load_failed_requests"] == 0


# ----- the counting rule, model-free (`scheduler_harness.py`) ------------------------------
@pytest.mark.parametrize("retry, fails_again, recomputed", [
    ((12, True), False, 0),  # the retry loads all 12 lost tokens again
    ((4, True), False, 8),  # it loads 8..12; 12..20 are computed
    ((0, False), False, 12),  # the connector has nothing now: 8..20 are computed
    ((12, True), True, 12),  # the retry fails at the same block: 8..20, counted once
], ids=["reloaded", "partly", "nothing", "fails-again"])
def test_tokens_a_retry_loads_again_are_not_counted_recomputed(retry, fails_again, recomputed):
    connector = FakeConnector({"a": [(20, True), retry]})
    scheduler = make_scheduler(connector, retry_limit=1)
    a = add(scheduler, "a", PROMPT)
    step(scheduler)
    bad_block = a.block_ids[2]
    step(scheduler, invalid={bad_block}, finished_recving={"a"})
    assert a.num_computed_tokens == 8 and scheduler.stats.kv_load_recomputed_tokens == 0
    step(scheduler)  # asks the connector again
    assert connector.lookups_of("a") == [0, 8]
    if retry[1]:
        step(scheduler, invalid={bad_block} if fails_again else (), finished_recving={"a"})
    run_to_completion(scheduler)
    assert len(a.output_token_ids) == 3
    assert scheduler.stats.kv_load_recomputed_tokens == recomputed
    assert scheduler.stats.kv_load_recovered_requests == 1 + fails_again
