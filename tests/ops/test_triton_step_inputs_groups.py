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


def test_cached_decode_packing_of_groups_matches_a_fresh_packing():
    """The graph path's cached rows hold every group's table as a fresh builder writes it,
    except windowed entries released below the window (never read: the kernels start
    at the window)."""
    import random

    rng = random.Random(0)
    fast = StepInputBuilder(BLOCK, 16, CPU, max_model_len=256, num_kv_groups=2)
    requests = {f"r{i}": [rng.randint(1, 50), [rng.randint(1, 99)], [rng.randint(1, 99)]]
                for i in range(8)}
    for step in range(120):
        scheduled = []
        for name in sorted(requests)[: rng.choice([8, 6])]:
            position, full, windowed = requests[name]
            while len(full) * BLOCK <= position:
                full.append(rng.randint(1, 99))
                windowed.append(rng.randint(1, 99))
            for index in range(max(0, (position - 8 + 1) // BLOCK)):
                windowed[index] = 0  # released below a window of 8
            scheduled.append(item(name, [rng.randint(0, 99)], position,
                                  [list(full), list(windowed)]))
            requests[name][0] += 1
        got = fast.pack(scheduled, pad_to=8)
        fresh = StepInputBuilder(BLOCK, 16, CPU, max_model_len=256, num_kv_groups=2)
        want = fresh.pack(scheduled, pad_to=8)
        assert got.offsets == want.offsets
        for name, offset in got.offsets.items():
            span = slice(offset, offset + got.lengths[name])
            if name != "table1":
                assert (fast._host_np[span] == fresh._host_np[span]).all(), (step, name)
                continue
            width = got.lengths[name] // 8
            rows_got = fast._host_np[span].reshape(8, width)
            rows_want = fresh._host_np[span].reshape(8, width)
            for row, s in enumerate(scheduled):
                first = max(0, (s.num_computed_tokens - 8 + 1) // BLOCK)
                assert (rows_got[row, first:] == rows_want[row, first:]).all(), (step, row)
