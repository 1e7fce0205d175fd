"""The model runner's graphed-step recurrent rows (`ModelRunner._recurrent_rows`): the
step's slots assigned, starting requests' states zeroed before the replay, rows one per
request, and a state pool that grew (new tensors) drops the captured graphs, which read
the old ones. CPU, a tiny Qwen3-Next, a stand-in for the graphs."""

from __future__ import annotations

import torch
from test_qwen3_next_vs_hf import FAMILIES, build_hybrid

from kvrecover import LLM, SamplingParams
from kvrecover.step_messages import ScheduledRequest


class _Graphs:
    def __init__(self) -> None:
        self.graphs = {1: object()}

    def clear(self) -> None:
        self.graphs.clear()


def decode(request_id: str, position: int, saves=()) -> ScheduledRequest:
    return ScheduledRequest(request_id, [5], position, [1], True, SamplingParams(), 0,
                            save_checkpoints=list(saves))


def test_rows_slots_resets_and_a_grown_pool_drops_the_graphs(tmp_path):
    folder = build_hybrid(tmp_path / "qwen3_next", **FAMILIES["qwen3_next"])
    runner = LLM(str(folder), device="cpu", block_size=16).engine.model_runner
    states = runner.recurrent_states
    runner.graphs = graphs = _Graphs()
    layer = next(iter(states.tensors))
    states.tensors[layer]["state"].fill_(3.0)  # a starting request's slot must be zeroed
    rows = runner._recurrent_rows([decode("a", 0), decode("b", 0, [(1, 0)])])
    assert [(r.start_row, r.end_row, r.position, r.checkpoints) for r in rows] == [
        (0, 1, 0, ()), (1, 2, 0, ((1, 0),))]
    slot_a, slot_b = rows[0].slot, rows[1].slot
    assert slot_a != slot_b
    assert not states.tensors[layer]["state"][[slot_a, slot_b]].any()
    assert graphs.graphs  # same pool: the graphs stay
    slots = states.num_slots
    more = [decode(f"n{i}", 0) for i in range(slots)]  # more requests than slots: it grows
    runner._recurrent_rows(more)
    assert states.num_slots > slots and not graphs.graphs
    graphs.graphs[1] = object()
    runner._recurrent_rows([decode("a", 1)])  # continues; the pool did not grow again
    assert graphs.graphs
    assert torch.equal(states.tensors[layer]["state"][slot_a],
                       torch.zeros_like(states.tensors[layer]["state"][slot_a]))
