"""The Triton delta rule and convolution on a CUDA graph's static plan: decode steps
padded to a graph size (`ops/triton/step_plan.py`, packed by the step-input builder)
give the eager steps' bits (outputs, states, tails, checkpoints), padding requests
write nothing, and the convolution copies the conv state at each checkpoint exactly
as the reference does (what lets a graphed step save checkpoints).

Marked `gpu`; with `TRITON_INTERPRET=1` they run on the CPU (tiny shapes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from conftest import TRITON_DEVICE as DEVICE
from conftest import TRITON_TESTS

from kvrecover.models.recurrent_state import RequestRows
from kvrecover.ops.interface import DeltaRuleState

pytestmark = TRITON_TESTS
CHUNK = 4
HK, HV, DK, DV = 1, 2, 16, 16
CHANNELS, WIDTH = 24, 4
SLOTS = 5


def triton_ops():
    from kvrecover.ops.triton.fused_ops import TritonOps

    return TritonOps()


@dataclass
class Decode:
    request_id: str
    num_computed_tokens: int
    token_ids: tuple[int, ...] = (3,)

    @property
    def tables(self) -> list[list[int]]:
        return [[1] * (self.num_computed_tokens // 4 + 1)]

    @property
    def block_ids(self) -> list[int]:
        return self.tables[0]


def static_requests(rows: list[RequestRows], pad_to: int):
    """The layers' request list of a graphed step of `rows`: packed, uploaded, viewed."""
    from kvrecover.ops.triton.step_inputs import StepInputBuilder

    build = StepInputBuilder(4, 16, torch.device(DEVICE), max_model_len=64, recurrent=True)
    steps = [Decode(f"r{i}", r.position) for i, r in enumerate(rows)]
    layout = build.pack(steps, pad_to=pad_to, recurrent=rows)
    buffer = build.upload(layout, torch.zeros(layout.size + 64, dtype=torch.int32,
                                              device=DEVICE))
    return build.views(layout, buffer).recurrent


def pools():
    gen = torch.Generator().manual_seed(1)
    rand = lambda *s: torch.randn(*s, generator=gen).to(DEVICE)  # noqa: E731
    return (DeltaRuleState(rand(SLOTS, HV, DK, DV), rand(SLOTS, CHUNK, HV, DK),
                           rand(SLOTS, CHUNK, HV, DK), rand(SLOTS, CHUNK, HV, DV),
                           -rand(SLOTS, CHUNK, HV).abs(), rand(SLOTS, CHUNK, HV).sigmoid()),
            rand(SLOTS, CHANNELS, WIDTH - 1))


def step_inputs(rows: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [t.to(DEVICE) for t in (
        torch.randn(rows, CHANNELS, generator=gen), torch.randn(rows, HK, DK, generator=gen),
        torch.randn(rows, HK, DK, generator=gen), torch.randn(rows, HV, DV, generator=gen),
        -torch.rand(rows, HV, generator=gen) * 0.5, torch.rand(rows, HV, generator=gen))]


def run(ops, requests, inputs, states, conv_states, checkpoints):
    x, query, key, value, decay, beta = inputs
    weight = torch.randn(CHANNELS, WIDTH, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    conv = ops.causal_conv1d_batch(x, conv_states, weight, requests, checkpoints[0])
    out = ops.gated_delta_rule_batch(query, key, value, decay, beta, states, requests, CHUNK,
                                     checkpoints[1])
    return conv, out


def snapshot(states, conv_states, checkpoints):
    return [t.clone() for t in (*states.__dict__.values(), conv_states, *checkpoints)]


def test_padded_static_decode_steps_give_the_eager_bits_and_padding_writes_nothing():
    ops = triton_ops()
    eager_pools, graph_pools = pools(), pools()
    make_checkpoints = lambda: (torch.zeros(3, CHANNELS, WIDTH - 1, device=DEVICE),  # noqa: E731
                                torch.zeros(3, HV, DK, DV, device=DEVICE))
    eager_ck, graph_ck = make_checkpoints(), make_checkpoints()
    # Slot 0 holds a real request in some steps and is the padding requests' slot;
    # slot 4's request is not in the steps: nothing may touch it.
    positions = {0: 6, 2: 3, 3: 9}
    for number in range(6):
        slots = [3, 0, 2] if number % 2 == 0 else [2, 3]
        rows = []
        for index, slot in enumerate(slots):
            position = positions[slot]
            # One checkpoint slot per request of the step: two programs writing one
            # slot would race on a GPU (the interpreter runs them one after the other).
            marks = (((position + 1, (number + index) % 3),) if (position + 1) % CHUNK == 0
                     else ())
            rows.append(RequestRows(index, index + 1, position, slot, marks))
            positions[slot] += 1
        inputs = step_inputs(8, seed=number)
        eager = run(ops, rows, [t[: len(rows)] for t in inputs], *eager_pools, eager_ck)
        graph = run(ops, static_requests(rows, pad_to=8), inputs, *graph_pools, graph_ck)
        for ours, theirs in zip(graph, eager):
            assert torch.equal(ours[: len(rows)], theirs), number
        for ours, theirs in zip(snapshot(*graph_pools, graph_ck),
                                snapshot(*eager_pools, eager_ck)):
            assert torch.equal(ours, theirs), number
    assert eager_ck[1].abs().sum() > 0 and eager_ck[0].abs().sum() > 0  # checkpoints written


def test_the_conv_copies_each_checkpoint_as_the_reference():
    from kvrecover.ops.reference.torch_ops import TorchOps

    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(CHANNELS, WIDTH, generator=gen).to(DEVICE)
    x = torch.randn(19, CHANNELS, generator=gen).to(DEVICE)
    start = torch.randn(SLOTS, CHANNELS, WIDTH - 1, generator=gen).to(DEVICE)
    # Two requests: one prefill crossing two boundaries (one right at its first row + 1),
    # one decode row ending at a boundary.
    requests = [RequestRows(0, 18, 3, 1, ((4, 0), (8, 2), (20, 1))),
                RequestRows(18, 19, 7, 4, ((8, 3),))]
    results = []
    for ops in (TorchOps(), triton_ops()):
        states = start.clone()
        checkpoints = torch.full((4, CHANNELS, WIDTH - 1), float("nan"), device=DEVICE)
        out = ops.causal_conv1d_batch(x, states, weight, requests, checkpoints)
        results.append((out, states, checkpoints))
    (_, ref_states, ref_ck), (_, tri_states, tri_ck) = results
    assert torch.equal(tri_ck, ref_ck)  # copies of inputs and states: exact
    assert torch.equal(tri_states, ref_states)
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-5)
    # Without a pool the same step writes no checkpoint and the same outputs.
    states = start.clone()
    alone = triton_ops().causal_conv1d_batch(x, states, weight, requests)
    assert torch.equal(alone, results[1][0]) and torch.equal(states, tri_states)
