"""The recurrent plan of a CUDA-graphed decode step (`ops/triton/step_plan.py`), packed
by the Triton step-input builder into the graph's static buffer: each real request on
its own row with its position, slot and checkpoint, padding requests of 0 rows, the
layout fixed per graph size, stale rows cleared, and the real columns equal to the
eager step's `build_plan`. Needs no Triton and no GPU."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from kvrecover.models.recurrent_state import RequestRows
from kvrecover.ops.triton.step_inputs import StepInputBuilder
from kvrecover.ops.triton.step_plan import (
    PlannedRequests,
    build_plan,
    decode_plan_lengths,
    pack_decode_plan,
)

BLOCK = 4


@dataclass
class Decode:
    """A one-token slice of a request (the `ScheduledTokens` the builder reads)."""

    request_id: str
    num_computed_tokens: int
    block_ids: list[int]
    token_ids: list[int] = field(default_factory=lambda: [7])
    sample: bool = True

    @property
    def tables(self) -> list[list[int]]:
        return [self.block_ids]


def builder(recurrent: bool = True) -> StepInputBuilder:
    return StepInputBuilder(BLOCK, 16, torch.device("cpu"), max_model_len=64,
                            recurrent=recurrent)


def packed(build: StepInputBuilder, steps, rows, pad_to):
    layout = build.pack(steps, pad_to=pad_to, recurrent=rows)
    buffer = build.upload(layout, torch.zeros(layout.size + 64, dtype=torch.int32))
    return layout, build.views(layout, buffer)


def step(positions_slots, checkpoints=None):
    checkpoints = checkpoints or {}
    steps = [Decode(f"r{i}", p, list(range(1, p // BLOCK + 2))) for i, (p, _) in
             enumerate(positions_slots)]
    rows = [RequestRows(i, i + 1, p, s, checkpoints.get(i, ())) for i, (p, s) in
            enumerate(positions_slots)]
    return steps, rows


def test_a_padded_step_packs_rows_slots_and_checkpoints_with_empty_padding():
    steps, rows = step([(5, 3), (11, 0), (2, 5)], {1: ((12, 2),)})
    _, inputs = packed(builder(), steps, rows, pad_to=8)
    planned = inputs.recurrent
    assert isinstance(planned, PlannedRequests) and len(planned) == 8
    plan = planned.plan
    assert plan.num_requests == 8 and plan.max_rows == 1
    assert plan.meta.tolist() == [
        [0, 1, 2, 3, 4, 5, 6, 7],  # request i on row i (padding "starts" at its own row)
        [1, 1, 1, 0, 0, 0, 0, 0],  # padding brings 0 rows: the kernels write nothing for it
        [5, 11, 2, 0, 0, 0, 0, 0],
        [3, 0, 5, 0, 0, 0, 0, 0],
    ]
    assert plan.snapshot_begin.tolist() == [0, 0, 1, 1, 1, 1, 1, 1, 1]
    assert plan.snapshot_position.tolist()[:1] == [12]
    assert plan.snapshot_slot.tolist()[:1] == [2]
    assert plan.snapshot_position.tolist()[1:] == [-1] * 7
    # The real columns are what an eager step of the same requests builds.
    eager = build_plan(rows, torch.device("cpu"))
    assert torch.equal(plan.meta[:, :3], eager.meta)
    assert torch.equal(plan.snapshot_begin[:4], eager.snapshot_begin)
    assert torch.equal(plan.snapshot_position[:1], eager.snapshot_position)
    assert torch.equal(plan.snapshot_slot[:1], eager.snapshot_slot)


def test_the_plan_lies_at_offsets_that_depend_on_the_graph_size_alone():
    build = builder()
    first, _ = packed(build, *step([(3, 1)]), pad_to=4)
    # More requests, longer block tables: the graph's views must still find everything.
    second, _ = packed(build, *step([(30, 2), (17, 0), (9, 3)]), pad_to=4)
    names = list(decode_plan_lengths(0)) + ["ids", "positions", "slots", "seq_lens"]
    assert {n: first.offsets[n] for n in names} == {n: second.offsets[n] for n in names}
    assert max(first.offsets[n] for n in decode_plan_lengths(0)) < first.offsets["table"]


def test_a_row_that_held_a_request_last_step_is_padding_again():
    build = builder()
    packed(build, *step([(5, 3), (11, 2), (2, 1)], {2: ((4, 0),)}), pad_to=4)
    _, inputs = packed(build, *step([(6, 3)]), pad_to=4)
    plan = inputs.recurrent.plan
    assert plan.meta.tolist() == [[0, 1, 2, 3], [1, 0, 0, 0], [6, 0, 0, 0], [3, 0, 0, 0]]
    assert plan.snapshot_begin.tolist() == [0, 0, 0, 0, 0]
    assert plan.snapshot_position.tolist() == [-1] * 4


def test_the_capture_packs_padding_only():
    _, inputs = packed(builder(), [], None, pad_to=2)
    plan = inputs.recurrent.plan
    assert plan.meta.tolist() == [[0, 1], [0, 0], [0, 0], [0, 0]]
    assert plan.snapshot_begin.tolist() == [0, 0, 0]


def test_builders_of_models_without_recurrent_layers_carry_no_plan():
    build = builder(recurrent=False)
    layout, inputs = packed(build, *step([(5, 0)])[:1], None, pad_to=2)
    assert inputs.recurrent is None
    assert all(layout.lengths[name] == 0 for name in decode_plan_lengths(0))
    with pytest.raises(ValueError, match="without `recurrent`"):
        build.pack(*step([(5, 0)])[:1], pad_to=2, recurrent=step([(5, 0)])[1])
    eager = build.build(step([(5, 0)])[0])  # eager steps never carry one
    assert eager.recurrent is None


def segments(num_reqs):
    return {name: torch.zeros(n, dtype=torch.int32).numpy()
            for name, n in decode_plan_lengths(num_reqs).items()}


def test_only_one_token_rows_with_at_most_one_checkpoint_pack():
    with pytest.raises(ValueError, match="row 0 alone"):
        pack_decode_plan(segments(2), [RequestRows(0, 2, 5, 0)], 2)
    with pytest.raises(ValueError, match="row 1 alone"):
        pack_decode_plan(segments(2), [RequestRows(0, 1, 5, 0), RequestRows(2, 3, 5, 1)], 2)
    with pytest.raises(ValueError, match="one block boundary"):
        pack_decode_plan(segments(2), [RequestRows(0, 1, 3, 0, ((4, 0), (8, 1)))], 2)
