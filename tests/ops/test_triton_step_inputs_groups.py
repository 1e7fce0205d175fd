"""The Triton path's packed step inputs with several KV cache groups (host side, on the
CPU): one block table and one cache-slot segment per group, and padded (graph) steps
whose offsets depend on the batch size alone."""

from __future__ import annotations

import torch

from kvrecover.ops.triton.step_inputs import StepInputBuilder
from kvrecover.sampling import SamplingParams
from kvrecover.step_messages import ScheduledRequest

CPU = torch.device("cpu")
BLOCK = 4


def item(request_id: str, tokens: list[int], start: int, tables: list[list[int]]):
    return ScheduledRequest(request_id, tokens, start, tables[0], True, SamplingParams(), 0,
                            tables if len(tables) > 1 else [])


def slots_of(table: list[int], start: int, count: int) -> list[int]:
    return [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, start + count)]


def test_each_group_gets_its_own_table_and_slots():
    builder = StepInputBuilder(BLOCK, 16, CPU, max_model_len=64, num_kv_groups=2)
    a = item("a", [5, 6, 7], 5, [[1, 2], [0, 3]])
    b = item("b", [9], 2, [[4], [5]])
    inputs = builder.build([a, b])
    full, windowed = inputs.group_attn
    assert full is inputs.attn
    assert full.slot_mapping.tolist() == slots_of([1, 2], 5, 3) + slots_of([4], 2, 1)
    assert windowed.slot_mapping.tolist() == slots_of([0, 3], 5, 3) + slots_of([5], 2, 1)
    width = int(full.block_table_stride[0])
    assert full.block_tables.view(2, width).tolist() == [[1, 2], [4, 0]]
    assert windowed.block_tables.view(2, width).tolist() == [[0, 3], [5, 0]]
    assert full.seq_lens is windowed.seq_lens


def test_padded_steps_of_several_groups_keep_offsets_whatever_the_table_width():
    builder = StepInputBuilder(BLOCK, 16, CPU, max_model_len=64, num_kv_groups=2)
    short = builder.pack([item("a", [1], 4, [[1, 2], [3, 4]])], pad_to=4)
    offsets = dict(short.offsets)
    long = builder.pack([item("a", [1], 40, [list(range(1, 12)), [0] * 9 + [20, 21]])],
                        pad_to=4)
    assert long.offsets == offsets
    windowed = builder.views(long, builder.upload(long)).group_attn[1]
    assert windowed.slot_mapping.tolist()[:1] == slots_of([0] * 9 + [20, 21], 40, 1)


def test_one_group_packs_exactly_as_before():
    builder = StepInputBuilder(BLOCK, 16, CPU, max_model_len=64)
    inputs = builder.build([item("a", [5, 6], 0, [[1]])])
    assert inputs.group_attn == []
    assert inputs.attn.slot_mapping.tolist() == [4, 5]
