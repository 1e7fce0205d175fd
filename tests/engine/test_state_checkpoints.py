"""`engine/state_checkpoints.py`: which block boundaries keep a recurrent-state checkpoint,
in which slot, and how far a prefix-cache hit may go with them (issue 23, rule 8)."""

from __future__ import annotations

from kvrecover.engine.kv_cache_manager import PrefixHit
from kvrecover.engine.request import Request
from kvrecover.engine.state_checkpoints import StateCheckpoints
from kvrecover.kv_layout import update_block_hashes
from kvrecover.sampling import SamplingParams
from kvrecover.step_messages import ScheduledRequest

BLOCK = 4


def request(request_id: str, prompt: list[int]) -> Request:
    return Request(request_id, None, prompt, SamplingParams(max_tokens=4), frozenset(), 0, 256)


def slice_of(req: Request, start: int, count: int) -> ScheduledRequest:
    return ScheduledRequest(req.request_id, req.token_ids[start : start + count], start, [],
                            True, req.sampling_params, 0)


def hit(num_blocks: int) -> PrefixHit:
    return PrefixHit(num_blocks * BLOCK, [[None] * num_blocks])  # blocks are not read here


def test_every_boundary_a_slice_reaches_gets_a_slot_once():
    checkpoints = StateCheckpoints(8, BLOCK)
    first = request("a", list(range(20)))
    item = slice_of(first, 0, 6)  # reaches boundary 4
    checkpoints.plan(first, item)
    assert [position for position, _ in item.save_checkpoints] == [4]
    item = slice_of(first, 6, 10)  # reaches 8, 12 and 16
    checkpoints.plan(first, item)
    assert [position for position, _ in item.save_checkpoints] == [8, 12, 16]
    again = request("b", list(range(20)))  # the same prefix: its boundaries are kept already
    item = slice_of(again, 0, 16)
    checkpoints.plan(again, item)
    assert item.save_checkpoints == [] and len(checkpoints) == 4
    assert [position for position, _ in item.held_checkpoints] == [4, 8, 12, 16]


def test_a_hit_is_cut_to_its_last_checkpointed_boundary_and_restored_there():
    checkpoints = StateCheckpoints(8, BLOCK)
    first = request("a", list(range(20)))
    checkpoints.plan(first, slice_of(first, 0, 9))  # checkpoints at 4 and 8
    checkpoints.begin_step()
    second = request("b", list(range(20)) + [99])
    update_block_hashes(second.block_hashes, second.token_ids, BLOCK)
    usable = checkpoints.usable_prefix(second, hit(4))  # the KV is cached up to 16
    assert usable.num_tokens == 8 and len(usable) == 2
    item = slice_of(second, 8, 5)
    checkpoints.plan(second, item)
    assert item.restore_checkpoint is not None
    assert item.save_checkpoints and item.save_checkpoints[0][0] == 12
    other = request("c", [7] * 20)
    update_block_hashes(other.block_hashes, other.token_ids, BLOCK)
    assert checkpoints.usable_prefix(other, hit(4)).num_tokens == 0


def test_the_least_recently_used_checkpoint_gives_way_never_one_in_use():
    checkpoints = StateCheckpoints(2, BLOCK)
    first = request("a", list(range(12)))
    checkpoints.plan(first, slice_of(first, 0, 8))  # boundaries 4, 8: both slots
    checkpoints.begin_step()
    second = request("b", list(range(12)) + [50])
    update_block_hashes(second.block_hashes, second.token_ids, BLOCK)
    assert checkpoints.usable_prefix(second, hit(2)).num_tokens == 8  # 8 is now the newest
    item = slice_of(second, 8, 4)  # reaches 12: takes 4's slot, not 8's (being restored)
    checkpoints.plan(second, item)
    assert item.restore_checkpoint is not None
    assert item.save_checkpoints[0][1] != item.restore_checkpoint
    checkpoints.begin_step()
    third = request("c", list(range(12)))
    update_block_hashes(third.block_hashes, third.token_ids, BLOCK)
    assert checkpoints.usable_prefix(third, hit(2)).num_tokens == 8
    assert checkpoints.usable_prefix(third, hit(1)).num_tokens == 0  # 4 gave way


def test_no_slots_no_checkpoints():
    checkpoints = StateCheckpoints(0, BLOCK)
    first = request("a", list(range(12)))
    item = slice_of(first, 0, 12)
    checkpoints.plan(first, item)
    assert item.save_checkpoints == [] and len(checkpoints) == 0


def test_the_checkpoints_of_a_failed_step_are_forgotten():
    checkpoints = StateCheckpoints(4, BLOCK)
    first = request("a", list(range(12)))
    checkpoints.plan(first, slice_of(first, 0, 4))
    item = slice_of(first, 4, 8)
    checkpoints.plan(first, item)
    checkpoints.discard(item.save_checkpoints)  # the step that was to write 8 and 12 failed
    checkpoints.begin_step()
    again = request("b", list(range(12)) + [5])
    update_block_hashes(again.block_hashes, again.token_ids, BLOCK)
    assert checkpoints.usable_prefix(again, hit(3)).num_tokens == 4
    assert len(checkpoints) == 1


def test_two_requests_of_one_step_never_write_one_slot():
    """The second request of a step (the same prefix, further back) may not take the
    slots the first one writes in that step: both would write them in one forward."""
    checkpoints = StateCheckpoints(4, BLOCK)
    first, second = request("a", list(range(32))), request("b", list(range(32)))
    one, two = slice_of(first, 0, 32), slice_of(second, 0, 32)
    checkpoints.plan(first, one)  # boundaries 32, 28, 24, 20 take the four slots
    checkpoints.plan(second, two)  # 16 .. 4 find every slot written by `one`
    assert [position for position, _ in one.save_checkpoints] == [20, 24, 28, 32]
    assert two.save_checkpoints == []
    assert two.held_checkpoints == one.save_checkpoints
    checkpoints.begin_step()  # next step: the least recently used give way again
    third = request("c", list(range(100, 108)))
    item = slice_of(third, 0, 8)
    checkpoints.plan(third, item)
    assert len(item.save_checkpoints) == 2


def test_a_checkpoint_written_in_this_step_is_no_restore_point_before_it_ran():
    checkpoints = StateCheckpoints(8, BLOCK)
    first = request("a", list(range(20)))
    checkpoints.plan(first, slice_of(first, 0, 9))  # writes the checkpoints at 4 and 8
    second = request("b", list(range(20)) + [99])
    update_block_hashes(second.block_hashes, second.token_ids, BLOCK)
    assert checkpoints.usable_prefix(second, hit(4)).num_tokens == 0  # not written yet
    checkpoints.begin_step()
    assert checkpoints.usable_prefix(second, hit(4)).num_tokens == 8
