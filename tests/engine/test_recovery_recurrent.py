"""Rule 8 for hybrid models on its own (no scheduler, no model): a rollback point P of a
request with recurrent layers needs their state at exactly P (`recurrent_state_at`, the
scheduler's state checkpoints); without one the request rolls back to 0."""

from __future__ import annotations

import pytest
from test_recovery_unit import BLOCK, make_request

from kvrecover.engine.kv_cache_manager import PrefixHit
from kvrecover.engine.recovery import KVLoadRecovery
from kvrecover.engine.request import Request
from kvrecover.engine.state_checkpoints import StateCheckpoints
from kvrecover.kv_layout import update_block_hashes
from kvrecover.step_messages import ScheduledRequest


def states_at(*positions: int):
    return lambda request, position, first_invalid: position in positions


def rollback(held: tuple[int, ...], invalid: set[int], policy: str = "recompute") -> int:
    recovery = KVLoadRecovery(BLOCK, policy, recurrent_state_at=states_at(*held))
    request = make_request("a", 24, [1, 2, 3, 4, 5, 6], 24)
    return recovery.plan(invalid, [request]).requests[0].rollback_to


def test_the_rollback_point_is_the_last_held_state_at_or_before_the_first_bad_block():
    assert rollback(held=(8, 12), invalid={5}) == 12  # block 4 (tokens 16-19) failed
    assert rollback(held=(8,), invalid={5}) == 8      # not 0: a later checkpoint is valid
    assert rollback(held=(8, 20), invalid={5}) == 8   # a state past the bad block is no use


def test_without_a_held_state_the_rollback_point_is_0():
    assert rollback(held=(), invalid={5}) == 0
    assert rollback(held=(24,), invalid={3}) == 0  # only the state at the end: lost too


def test_full_attention_alone_cuts_at_the_first_bad_block():
    recovery = KVLoadRecovery(BLOCK)
    request = make_request("a", 24, [1, 2, 3, 4, 5, 6], 24)
    assert recovery.plan({5}, [request]).requests[0].rollback_to == 16


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_nothing_lost_needs_no_state(policy):
    """A failed block past the computed tokens costs a hybrid nothing either."""
    recovery = KVLoadRecovery(BLOCK, policy, recurrent_state_at=states_at())
    request = make_request("a", 24, [1, 2, 3, 4, 5, 6], 12)
    assert recovery.plan({5}, [request]).requests == []


def hashed_request(num_tokens: int) -> Request:
    request = make_request("a", num_tokens, list(range(1, num_tokens // BLOCK + 1)), 0)
    update_block_hashes(request.block_hashes, request.token_ids, BLOCK)
    return request


def slice_of(request: Request, start: int, count: int) -> ScheduledRequest:
    return ScheduledRequest(request.request_id, request.token_ids[start : start + count], start,
                            request.block_ids, False, request.sampling_params, 0)


def test_a_rolled_back_request_resumes_from_the_checkpoint_there():
    checkpoints = StateCheckpoints(num_slots=3, block_size=BLOCK)
    request = hashed_request(24)
    item = slice_of(request, 0, 24)
    checkpoints.plan(request, item)
    # Three slots for six boundaries: the latest three are kept.
    assert [position for position, _ in item.save_checkpoints] == [16, 20, 24]
    assert checkpoints.holds(request, 16) and not checkpoints.holds(request, 12)
    checkpoints.restore_at(request, 16)
    resumed = slice_of(request, 16, 8)
    checkpoints.plan(request, resumed)
    assert resumed.restore_checkpoint == dict((p, s) for p, s in item.save_checkpoints)[16]


def test_a_restore_is_used_only_by_a_slice_that_starts_there():
    """A load carried the request past its prefix-cache hit: the hit's checkpoint is not
    its state any more (the connector installed the one at the load's end)."""
    checkpoints = StateCheckpoints(num_slots=4, block_size=BLOCK)
    request = hashed_request(24)
    checkpoints.plan(request, slice_of(request, 0, 8))
    checkpoints.begin_step()
    hit = checkpoints.usable_prefix(request, PrefixHit(8, [[1, 2]]))
    assert hit.num_tokens == 8
    after_load = slice_of(request, 16, 8)
    checkpoints.plan(request, after_load)
    assert after_load.restore_checkpoint is None


def test_a_pending_restore_keeps_its_slot():
    checkpoints = StateCheckpoints(num_slots=2, block_size=BLOCK)
    request = hashed_request(24)
    checkpoints.plan(request, slice_of(request, 0, 8))  # boundaries 4 and 8
    checkpoints.restore_at(request, 4)
    other = hashed_request(24)
    other.request_id = "b"
    other.token_ids[:] = [t + 100 for t in other.token_ids]
    other.block_hashes.clear()
    update_block_hashes(other.block_hashes, other.token_ids, BLOCK)
    checkpoints.plan(other, slice_of(other, 0, 24))
    assert checkpoints.holds(request, 4)


def loading_request(start: int, end: int) -> Request:
    request = hashed_request(44)
    request.pending_external = (start, end)
    return request


def test_a_failed_load_resumes_at_the_latest_multiple_of_k_blocks_inside_it():
    """K = 2 blocks of 4: stored states at 8, 16, 24, 32 of a load of [0, 40)."""
    checkpoints = StateCheckpoints(num_slots=4, block_size=BLOCK, load_interval=2)
    request = loading_request(0, 40)
    assert checkpoints.loaded_resume_point(request, 28) == 24  # block 7 failed
    assert checkpoints.loaded_resume_point(request, 24) == 24  # block 6: its start
    assert checkpoints.loaded_resume_point(request, 36) == 32  # the last block
    assert checkpoints.loaded_resume_point(request, 4) is None  # before the first one
    assert checkpoints.loaded_resume_point(loading_request(0, 32), 40) == 24  # end excluded
    assert checkpoints.loaded_resume_point(loading_request(16, 40), 20) is None  # start excluded
    assert StateCheckpoints(4, BLOCK).loaded_resume_point(request, 28) is None  # no connector


def test_recovery_rolls_a_failed_load_back_to_its_resume_point_and_remembers_it():
    checkpoints = StateCheckpoints(num_slots=4, block_size=BLOCK, load_interval=2)
    recovery = KVLoadRecovery(BLOCK, recurrent_state_at=checkpoints.can_resume)
    request = make_request("a", 41, list(range(1, 12)), 41)
    update_block_hashes(request.block_hashes, request.token_ids, BLOCK)
    request.pending_external = (0, 40)
    assert recovery.plan({8}, [request]).requests[0].rollback_to == 24  # block 7 failed
    checkpoints.restore_at(request, 24)
    request.pending_external = None  # the load ended; a second one may fail before 24
    assert checkpoints.can_resume(request, 24, 28)
    resumed = slice_of(request, 24, 8)
    checkpoints.plan(request, resumed)
    assert resumed.restore_checkpoint is None  # the worker's resume state, used up now
    assert not checkpoints.can_resume(request, 24, 28)


def test_a_producer_gives_the_stored_boundaries_slots_first():
    """Two slots for a 24-token prompt (last loadable boundary 20) with K = 2: 20 and 16
    get them, not 24."""
    checkpoints = StateCheckpoints(num_slots=2, block_size=BLOCK, store_interval=2)
    request = hashed_request(24)
    item = slice_of(request, 0, 24)
    checkpoints.plan(request, item)
    assert [position for position, _ in item.save_checkpoints] == [16, 20]
