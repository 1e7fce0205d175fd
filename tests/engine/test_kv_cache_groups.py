"""KV cache groups in the engine, without a model: windowed freeing, prefix hits per
group and the rollback point of recovery (rule 8), driven by fabricated outputs."""

from __future__ import annotations

import pytest

from kvrecover.engine.kv_cache_manager import KVCacheManager
from kvrecover.engine.recovery import KVLoadRecovery
from kvrecover.engine.request import Request, RequestStatus
from kvrecover.kv_groups import KVCacheGroup
from kvrecover.kv_layout import NULL_BLOCK_ID
from kvrecover.sampling import SamplingParams
from tests.scheduler_harness import BLOCK, add, make_scheduler, step

WINDOW = 8
GROUPS = (KVCacheGroup(None, (1,)), KVCacheGroup(WINDOW, (0,)))
FULL, WINDOWED = 0, 1


def test_a_long_request_holds_window_blocks_only_and_frees_them_for_others():
    scheduler = make_scheduler(num_blocks=32, budget=8, groups=GROUPS)
    long = add(scheduler, "long", list(range(60)), max_tokens=20)
    other = None
    released: set[int] = set()
    seen: set[int] = set()
    others_blocks: set[int] = set()
    max_windowed = 0
    for _ in range(60):
        step(scheduler)
        if long.is_finished:
            break
        held_full, held_windowed = scheduler.kv_manager.blocks_held(long)
        assert held_full == len(long.block_ids)
        max_windowed = max(max_windowed, held_windowed)
        now = {b for b in long.block_tables[WINDOWED] if b != NULL_BLOCK_ID}
        released |= seen - now
        seen |= now
        if other is None and long.num_computed_tokens >= 40:
            other = add(scheduler, "other", list(range(500, 540)), max_tokens=1)
            released_before_other = set(released)
        if other is not None:
            others_blocks.update(b for table in other.block_tables for b in table)
    assert long.is_finished and long.error is None
    # Window 8, chunks of 8, blocks of 4: at most (8 + 8) / 4 + 1 blocks; 20 in the full group.
    assert max_windowed <= 5
    assert len(long.output_token_ids) == 20
    # The windowed blocks released by the long request served the other one.
    assert released_before_other & others_blocks


def test_released_blocks_make_room_a_full_attention_cache_would_not_have():
    # 26 usable blocks: one 60-token request needs 15 per full group; two groups of full
    # attention would need 30. With the window it fits.
    scheduler = make_scheduler(num_blocks=27, budget=8, groups=GROUPS)
    request = add(scheduler, "a", list(range(56)), max_tokens=4)
    for _ in range(30):
        if request.is_finished:
            break
        step(scheduler)
    assert request.is_finished and request.error is None
    assert scheduler.stats.num_preemptions == 0


def computed_manager(prompt: list[int]) -> tuple[KVCacheManager, Request]:
    manager = KVCacheManager(64, BLOCK, True, GROUPS)
    request = Request("a", None, prompt, SamplingParams(max_tokens=4), frozenset(), 0, 1024, 2)
    assert manager.allocate(request, len(prompt))
    request.num_computed_tokens = len(prompt)
    manager.cache_computed_blocks(request)
    return manager, request


def probe(prompt: list[int]) -> Request:
    return Request("p", None, prompt, SamplingParams(max_tokens=4), frozenset(), 0, 1024, 2)


def test_prefix_hit_needs_every_full_block_and_the_window_of_the_windowed_group():
    prompt = list(range(24))
    manager, request = computed_manager(prompt)
    hit = manager.find_cached_prefix(probe(prompt + [99]))
    assert hit.num_tokens == 24
    assert hit.blocks[WINDOWED][:4] == [None] * 4  # keys >= 17 only: blocks 4 and 5
    # A windowed block outside the window of 24 does not matter.
    manager.uncache_blocks([request.block_tables[WINDOWED][1]])
    assert manager.find_cached_prefix(probe(prompt + [99])).num_tokens == 24
    # One inside it does: 20 needs keys >= 13 (blocks 3, 4), still cached.
    manager.uncache_blocks([request.block_tables[WINDOWED][5]])
    assert manager.find_cached_prefix(probe(prompt + [99])).num_tokens == 20
    # Then 16 (keys >= 9: blocks 2, 3).
    manager.uncache_blocks([request.block_tables[WINDOWED][4]])
    assert manager.find_cached_prefix(probe(prompt + [99])).num_tokens == 16
    # A full-attention miss at block 2 caps it at 8, which needs keys >= 1: blocks 0 and
    # 1, and 1 is gone; 4 needs block 0 only.
    manager.uncache_blocks([request.block_tables[FULL][2]])
    assert manager.find_cached_prefix(probe(prompt + [99])).num_tokens == 4


def windowed_request(num_computed: int, full: list[int], windowed: list[int]) -> Request:
    request = Request("r", None, list(range(num_computed)), SamplingParams(max_tokens=4),
                      frozenset(), 0, 1024, 2)
    request.block_tables[FULL][:] = full
    request.block_tables[WINDOWED][:] = windowed
    request.num_computed_tokens = num_computed
    request.status = RequestStatus.RUNNING
    return request


# 24 tokens computed (6 blocks). The load brought the windowed group's last window
# (keys >= 17: blocks 4, 5) and one more window (blocks 2, 3); blocks 0, 1 are null.
FULL_TABLE = [1, 2, 3, 4, 5, 6]
WINDOWED_TABLE = [NULL_BLOCK_ID, NULL_BLOCK_ID, 13, 14, 15, 16]


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_lost_block_no_window_reads_again_recomputes_nothing(policy):
    recovery = KVLoadRecovery(BLOCK, policy, 1, GROUPS)
    request = windowed_request(24, FULL_TABLE, WINDOWED_TABLE)
    (verdict,) = recovery.plan({13}, [request]).requests
    assert verdict.rollback_to == 24 and verdict.num_tokens_lost == 0
    assert not verdict.fail and not verdict.voids_step
    assert verdict.drop_block_ids == [13]


def test_a_lost_block_inside_the_last_window_rolls_back_to_its_own_start():
    recovery = KVLoadRecovery(BLOCK, "recompute", 1, GROUPS)
    request = windowed_request(24, FULL_TABLE, WINDOWED_TABLE)
    (verdict,) = recovery.plan({15}, [request]).requests
    # Resuming at 16 reads keys >= 9: blocks 2, 3, held thanks to the load's margin.
    assert (verdict.rollback_to, verdict.first_invalid_block) == (16, 4)
    assert verdict.num_tokens_lost == 8 and verdict.voids_step
    # Without the margin no earlier point has its window held: back to 0.
    bare = windowed_request(24, FULL_TABLE, [NULL_BLOCK_ID] * 4 + [15, 16])
    (verdict,) = recovery.plan({15}, [bare]).requests
    assert verdict.rollback_to == 0


def test_a_lost_full_attention_block_rolls_back_to_its_start():
    recovery = KVLoadRecovery(BLOCK, "recompute", 1, GROUPS)
    request = windowed_request(24, FULL_TABLE, WINDOWED_TABLE)
    (verdict,) = recovery.plan({5}, [request]).requests
    # Block 4 of the full group: 16, whose window (blocks 2, 3) is held.
    assert verdict.rollback_to == 16
    (verdict,) = recovery.plan({2}, [windowed_request(24, FULL_TABLE, WINDOWED_TABLE)]).requests
    # Full block 1 lost: 4 at most, which reads keys 0..3, never loaded (null): 0 is the answer.
    assert verdict.rollback_to == 0



def test_a_rollback_point_must_satisfy_every_group_at_once():
    recovery = KVLoadRecovery(BLOCK, "recompute", 1, GROUPS)
    # Full block 5 (tokens 16..19) and windowed block 3 (12..15) lost: 16 needs keys >= 9
    # (blocks 2, 3): not valid; 12 needs blocks 1, 2: block 1 is null; 8 needs 0, 1: null.
    request = windowed_request(24, FULL_TABLE, WINDOWED_TABLE)
    (verdict,) = recovery.plan({5, 14}, [request]).requests
    assert verdict.rollback_to == 0


def test_a_scheduled_rollback_inside_the_window_recomputes_from_the_blocks_start():
    scheduler = make_scheduler(num_blocks=64, budget=64, groups=GROUPS)
    request = add(scheduler, "a", list(range(30)), max_tokens=3)
    step(scheduler)  # the prompt in one step, then a decode of token 30:
    # its windowed block 7 (tokens 28..31) is reported lost. Resuming at 28 reads keys
    # >= 21 (blocks 5, 6), still held; blocks 0..4 were released before that step.
    output, _ = step(scheduler, invalid=lambda: {request.block_tables[WINDOWED][7]})
    assert request.block_tables[WINDOWED][:5] == [NULL_BLOCK_ID] * 5
    assert request.num_computed_tokens == 28
    assert scheduler.stats.kv_load_recomputed_tokens == 31 - 28
    output, _ = step(scheduler)
    assert output.scheduled[0].num_computed_tokens == 28
    assert output.scheduled[0].tables[WINDOWED][7] != NULL_BLOCK_ID
