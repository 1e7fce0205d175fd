"""Recovery scope "blocks" (`engine/recompute_gaps.py`): the gap plan, model-free.

A failed load keeps its valid loaded blocks after a hole; the scheduler recomputes
only the gaps (and, after a sync load, what that step computed after its loaded
prefix), then jumps over the kept blocks. Driven with fabricated runner outputs
(`scheduler_harness.py`): the chunks each step schedules are asserted exactly.
"""

from __future__ import annotations

import pytest
from scheduler_harness import BLOCK, PROMPT, FakeConnector, add, make_scheduler, slice_of, step

from kvrecover import KVTransferConfig
from kvrecover.engine.recompute_gaps import plan_kept_ranges, supports_blocks_scope
from kvrecover.engine.recovery import KVLoadRecovery
from kvrecover.kv_groups import KVCacheGroup

# PROMPT: 21 tokens; the connector offers 20 (blocks 0-4), the last token is computed.
LOADED = 20


@pytest.mark.parametrize("rollback_to, loaded, earlier, bad, kept", [
    (16, (0, 40), [], {4}, [(20, 40)]),  # a hole in the middle
    (8, (0, 40), [], {2, 5, 7}, [(12, 20), (24, 28), (32, 40)]),  # several holes
    (0, (0, 40), [], {0}, [(4, 40)]),  # the first block
    (36, (0, 40), [], {9}, []),  # the last loaded block: nothing after it to keep
    (12, (0, 40), [], {3, 4}, [(20, 40)]),  # adjacent holes: one gap
    (12, (8, 40), [], {3}, [(16, 40)]),  # a load after local prefix hits
    (8, None, [(24, 40)], {2, 7}, [(24, 28), (32, 40)]),  # a new hole in kept blocks
    (8, (0, 41), [], {2}, [(12, 40)]),  # never the last token's block
], ids=["middle", "several", "first", "last", "adjacent", "after-hits", "earlier",
        "last-token"])
def test_plan_kept_ranges(rollback_to, loaded, earlier, bad, kept):
    assert plan_kept_ranges(rollback_to, loaded, earlier, bad, 4, 41) == kept


def test_the_scope_is_validated_like_the_policy():
    with pytest.raises(ValueError, match=r"kv_load_recompute must be one of \('prefix', 'blocks'\)"):
        KVTransferConfig("SharedStorageConnector", kv_load_recompute="holes")
    config = KVTransferConfig.from_json('{"kv_connector": "X", "kv_load_recompute": "blocks"}')
    assert config.kv_load_recompute == "blocks"
    assert KVTransferConfig("X").kv_load_recompute == "prefix"


def chunks_after_failure(bad_positions, *, async_load=False, budget=64, recompute="blocks",
                         groups=None):
    """Load PROMPT (20 tokens), fail the blocks at `bad_positions`, run to the end; returns
    (the chunks scheduled after the failure as (start, length, sample), the request,
    the scheduler)."""
    connector = FakeConnector({"a": [(LOADED, async_load)]})
    scheduler = make_scheduler(connector, budget=budget, recompute=recompute, groups=groups)
    a = add(scheduler, "a", PROMPT, max_tokens=2)
    def bad():
        return {a.block_ids[i] for i in bad_positions}

    if async_load:  # it parks; the failure comes with the load's finished report
        step(scheduler)
        step(scheduler, invalid=bad, finished_recving={"a"})
    else:  # it loads and computes token 20 in one step, which reports the failure
        step(scheduler, invalid=bad)
    chunks = []
    for _ in range(20):
        if not scheduler.has_unfinished():
            break
        output, _ = step(scheduler)
        chunks += [(s.num_computed_tokens, len(s.token_ids), s.sample) for s in output.scheduled]
    assert a.output_token_ids and len(a.output_token_ids) == 2
    return chunks, a, scheduler


def test_async_recomputes_only_the_holes():
    chunks, a, scheduler = chunks_after_failure([1, 3], async_load=True)
    assert chunks[:3] == [(4, 4, False), (12, 4, False), (20, 1, True)]
    assert scheduler.stats.kv_load_recomputed_tokens == 2 * BLOCK  # the holes, no tail
    assert scheduler.stats.prompt_tokens_external == LOADED - 2 * BLOCK
    assert scheduler.stats.prompt_tokens_computed == 2 * BLOCK + 1


@pytest.mark.parametrize("bad, expected", [
    ([2], [(8, 4, False), (20, 1, True)]),  # a hole in the middle
    ([1, 3], [(4, 4, False), (12, 4, False), (20, 1, True)]),  # several holes
    ([0], [(0, 4, False), (20, 1, True)]),  # the first block
    ([4], [(16, 5, True)]),  # the last loaded block: the hole and the tail are one gap
    ([2, 3], [(8, 8, False), (20, 1, True)]),  # adjacent holes
], ids=["middle", "several", "first", "last", "adjacent"])
def test_sync_recomputes_the_holes_and_the_tail(bad, expected):
    chunks, a, scheduler = chunks_after_failure(bad)
    assert chunks[:len(expected)] == expected
    assert chunks[len(expected):] == [(LOADED + 1, 1, True)]  # then it decodes
    stats = scheduler.stats
    # The failed blocks' tokens, and the token its load step computed on top of them.
    assert stats.kv_load_recomputed_tokens == len(bad) * BLOCK + 1
    assert stats.prompt_tokens_external == LOADED - len(bad) * BLOCK
    assert stats.prompt_tokens_computed == 1 + len(bad) * BLOCK + 1
    assert stats.kv_load_recovered_requests == 1 and stats.kv_load_failed_blocks == len(bad)


def test_chunks_never_cross_a_gaps_end():
    chunks, a, scheduler = chunks_after_failure([1, 2, 4], budget=3)
    assert chunks[:5] == [(4, 3, False), (7, 3, False), (10, 2, False),
                          (16, 3, False), (19, 2, True)]
    assert scheduler.stats.kv_load_recomputed_tokens == 3 * BLOCK + 1


def test_scope_prefix_recomputes_everything_after_the_first_hole():
    chunks, a, scheduler = chunks_after_failure([1, 3], recompute="prefix")
    assert chunks[0] == (4, 17, True)
    assert scheduler.stats.kv_load_recomputed_tokens == LOADED + 1 - 4


def test_windowed_models_fall_back_to_prefix():
    groups = (KVCacheGroup(None, (0,)), KVCacheGroup(2 * BLOCK, (1,)))
    chunks, a, scheduler = chunks_after_failure([1, 3], groups=groups)
    prefix_chunks, _, prefix = chunks_after_failure([1, 3], groups=groups, recompute="prefix")
    assert chunks == prefix_chunks and chunks[0][2]  # one chunk to the end, then decodes
    assert (scheduler.stats.kv_load_recomputed_tokens
            == prefix.stats.kv_load_recomputed_tokens > 2 * BLOCK + 1)


def test_hybrid_models_fall_back_to_prefix():
    # Linear-attention layers belong to no KV cache group: the groups alone look full.
    full = (KVCacheGroup(None, (0, 2)),)
    assert supports_blocks_scope(full) and not supports_blocks_scope(full, recurrent=True)
    assert KVLoadRecovery(BLOCK, groups=full, recompute="blocks").keeps_blocks
    assert not KVLoadRecovery(BLOCK, groups=full, recompute="blocks",
                              recurrent_state_at=lambda request, position, first_invalid: True).keeps_blocks


def test_kept_blocks_stay_in_place_and_are_cached_once_passed():
    connector = FakeConnector({"a": [(LOADED, False)]})
    scheduler = make_scheduler(connector, recompute="blocks")
    a = add(scheduler, "a", PROMPT, max_tokens=2)
    step(scheduler, invalid=lambda: {a.block_ids[1]})
    blocks = list(a.block_ids)
    assert (a.num_computed_tokens, a.kept_ranges) == (4, [(8, LOADED)])
    assert a.block_ids == blocks  # rewritten in place, kept blocks untouched
    step(scheduler)  # the gap
    assert (a.num_computed_tokens, a.kept_ranges) == (LOADED, [])
    assert a.num_cached_blocks == LOADED // BLOCK  # the gap and the kept blocks


def test_preemption_drops_the_kept_ranges():
    connector = FakeConnector({"a": [(LOADED, False), (0, False)]})
    scheduler = make_scheduler(connector, recompute="blocks")
    a = add(scheduler, "a", PROMPT, max_tokens=2)
    step(scheduler, invalid=lambda: {a.block_ids[1]})
    assert a.kept_ranges
    scheduler.running.remove(a)
    scheduler._preempt(a)
    assert (a.num_computed_tokens, a.kept_ranges) == (0, [])
    output, _ = step(scheduler)
    # Block 0 is a prefix-cache hit; the connector has nothing now (its second answer).
    assert [(s.num_computed_tokens, len(s.token_ids)) for s in output.scheduled] == [(4, 17)]


def test_policy_fail_keeps_nothing():
    connector = FakeConnector({"a": [(LOADED, False)]})
    scheduler = make_scheduler(connector, policy="fail", recompute="blocks")
    a = add(scheduler, "a", PROMPT)
    step(scheduler, invalid=lambda: {a.block_ids[1]})
    assert a.is_finished and a.error_type == "kv_load_failed" and a.kept_ranges == []
    assert scheduler.stats.kv_load_failed_requests == 1


def test_holes_reported_while_an_async_load_is_in_flight_are_judged_when_it_ends():
    connector = FakeConnector({"a": [(LOADED, True)]})
    scheduler = make_scheduler(connector, recompute="blocks")
    a = add(scheduler, "a", PROMPT, max_tokens=2)
    step(scheduler)
    step(scheduler, invalid={a.block_ids[3]})  # rule 2: remembered, the load may still write
    assert (a.num_computed_tokens, a.kept_ranges) == (LOADED, [])
    step(scheduler, invalid={a.block_ids[1]}, finished_recving={"a"})
    assert (a.num_computed_tokens, a.kept_ranges) == (4, [(8, 12), (16, LOADED)])
    chunks = []
    for _ in range(3):
        output, _ = step(scheduler)
        item = slice_of(output, "a")
        chunks.append((item.num_computed_tokens, len(item.token_ids), item.sample))
    assert chunks == [(4, 4, False), (12, 4, False), (20, 1, True)]
    assert scheduler.stats.kv_load_recomputed_tokens == 2 * BLOCK
