"""`worker/recurrent_states.py`: a slot per request, given back at finish and preemption,
zeroed at position 0, and never used at a position it does not hold."""

from __future__ import annotations

import pytest
import torch

from kvrecover.models.recurrent_state import StateSpec, delta_chunk_size
from kvrecover.sampling import SamplingParams
from kvrecover.step_messages import ScheduledRequest
from kvrecover.worker.recurrent_states import INITIAL_SLOTS, RecurrentStateError, RecurrentStates

SPECS = {0: [StateSpec("conv", (3, 2)), StateSpec("state", (2, 2), torch.float32)],
         2: [StateSpec("conv", (3, 2))]}


def item(request_id: str, position: int, count: int) -> ScheduledRequest:
    return ScheduledRequest(request_id, [5] * count, position, [1], True, SamplingParams(), 0)


def states() -> RecurrentStates:
    return RecurrentStates(SPECS, torch.bfloat16, torch.device("cpu"), chunk_size=4)


def test_slots_rows_and_positions_of_a_step():
    pool = states()
    steps = pool.step([item("a", 0, 3), item("b", 0, 2)])
    assert set(steps) == {0, 2}
    rows = [(r.start_row, r.end_row, r.position) for r in steps[0].requests]
    assert rows == [(0, 3, 0), (3, 5, 0)]
    assert steps[0].tensors["conv"].dtype == torch.bfloat16
    assert steps[0].tensors["state"].dtype == torch.float32
    assert pool.bytes_per_request == 3 * 2 * 2 + 2 * 2 * 4 + 3 * 2 * 2
    later = pool.step([item("b", 2, 1), item("a", 3, 1)])
    assert [r.slot for r in later[2].requests] == [steps[2].requests[1].slot,
                                                   steps[2].requests[0].slot]


def test_a_step_at_another_position_is_refused():
    pool = states()
    pool.step([item("a", 0, 3)])
    with pytest.raises(RecurrentStateError, match="position 2.*stands at 3"):
        pool.step([item("a", 2, 1)])


def test_position_zero_zeroes_the_slot_and_release_frees_it():
    pool = states()
    slot = pool.step([item("a", 0, 3)])[0].requests[0].slot
    pool.tensors[0]["state"][slot].fill_(7.0)
    pool.step([item("a", 0, 3)])  # recomputed from scratch (a preemption)
    assert not pool.tensors[0]["state"][slot].any()
    pool.release(["a", "unknown"])
    assert not pool.slots and len(pool.free) == INITIAL_SLOTS


def test_the_pool_grows_and_keeps_every_state():
    pool = states()
    pool.step([item(str(i), 0, 1) for i in range(INITIAL_SLOTS)])
    for i in range(INITIAL_SLOTS):
        pool.tensors[0]["state"][pool.slots[str(i)]].fill_(i + 1)
    pool.step([item("new", 0, 1)])
    assert pool.num_slots == 2 * INITIAL_SLOTS
    for i in range(INITIAL_SLOTS):
        assert pool.tensors[0]["state"][pool.slots[str(i)]].eq(i + 1).all()


@pytest.mark.parametrize(("block_size", "chunk"), [(4, 4), (16, 16), (128, 64), (48, 48),
                                                   (13, 13), (96, 48)])
def test_chunks_divide_the_block_size(block_size, chunk):
    assert delta_chunk_size(block_size) == chunk


def test_a_restore_starts_from_the_checkpoint_and_saves_are_passed_to_the_layers():
    pool = RecurrentStates(SPECS, torch.bfloat16, torch.device("cpu"), chunk_size=4,
                           num_checkpoints=2)
    assert pool.bytes_per_checkpoint == 3 * 2 * 2 + 2 * 2 * 4 + 3 * 2 * 2
    pool.checkpoints[0]["state"][1].fill_(3.0)
    pool.checkpoints[2]["conv"][1].fill_(2.0)
    restored = item("a", 8, 5)
    restored.restore_checkpoint = 1
    restored.save_checkpoints = [(12, 0)]
    steps = pool.step([restored])
    slot = pool.slots["a"]
    assert pool.tensors[0]["state"][slot].eq(3.0).all()
    assert pool.tensors[2]["conv"][slot].eq(2.0).all()
    assert not pool.tensors[0]["conv"][slot].any()
    assert steps[0].requests[0].checkpoints == ((12, 0),)
    assert steps[2].checkpoints["conv"] is pool.checkpoints[2]["conv"]
    pool.step([item("a", 13, 1)])  # continues where the restored state stands


def test_a_pool_can_start_with_every_slot_it_will_need():
    pool = RecurrentStates(SPECS, torch.bfloat16, torch.device("cpu"), chunk_size=4,
                           initial_slots=7)
    assert pool.num_slots == 7 and len(pool.free) == 7
    assert pool.tensors[0]["state"].shape[0] == 7
    assert pool.bytes_per_request == 3 * 2 * 2 + 2 * 2 * 4 + 3 * 2 * 2
    pool.step([item(str(i), 0, 1) for i in range(7)])
    assert pool.num_slots == 7
    with pytest.raises(ValueError, match="initial_slots"):
        RecurrentStates(SPECS, torch.bfloat16, torch.device("cpu"), chunk_size=4, initial_slots=0)


def payload_of(pool: RecurrentStates, value: float) -> bytes:
    """A `read_checkpoint`-form payload whose recurrent state is all `value`."""
    pool.tensors[0]["state"][pool.slots["donor"]].fill_(value)
    return b"".join(pool.tensors[layer][name][pool.slots["donor"]].contiguous()
                    .view(torch.uint8).numpy().tobytes() for layer, name in pool._checkpointed())


def test_a_resume_state_is_used_by_the_next_slice_that_starts_there_only():
    """A failed load kept the state at 8: a slice starting at 8 continues from it (the
    slot stood elsewhere); it is used up then, and a slice elsewhere is still refused."""
    pool = states()
    pool.step([item("donor", 0, 1), item("a", 0, 20)])
    pool.keep_resume_state("a", 8, payload_of(pool, 4.0))
    with pytest.raises(RecurrentStateError, match="position 12"):
        pool.step([item("a", 12, 1)])
    pool.step([item("a", 8, 2)])
    assert pool.tensors[0]["state"][pool.slots["a"]].eq(4.0).all()
    assert "a" not in pool.resume_states
    pool.keep_resume_state("a", 4, payload_of(pool, 5.0))
    pool.release(["a"])
    assert "a" not in pool.resume_states


def test_a_resume_state_of_another_size_is_refused():
    pool = states()
    with pytest.raises(ValueError, match="bytes"):
        pool.keep_resume_state("a", 8, b"\0" * 3)
