"""The Triton gated delta rule and causal convolution (`ops/triton/gated_delta.py`,
`ops/triton/causal_conv.py`), batched over a step's requests: close to the torch
reference in float32, and bit for bit invariant themselves across chunkings (1, 7, 16,
64, whole), batch compositions and decode vs prefill, states at chunk boundaries and
checkpoints included (issue 23, point 2 on the GPU).

Marked `gpu`; with `TRITON_INTERPRET=1` they run on the CPU (tiny shapes), larger
shapes only on a real GPU.
"""

from __future__ import annotations

import pytest
import torch
from conftest import CUDA, TRITON_TESTS
from conftest import TRITON_DEVICE as DEVICE

from kvrecover.models.recurrent_state import RequestRows
from kvrecover.ops.interface import DeltaRuleState

pytestmark = TRITON_TESTS
needs_cuda = pytest.mark.skipif(not CUDA, reason="large shapes: only on a real GPU")

CHUNK = 16
SLOTS = 6
# (key heads, value heads, key dim, value dim)
# (1, 2, 16, 64): two value blocks per head (`MAX_VALUE_BLOCK`), which share the head's
# query / key / gate tails: one program's tail writes must not reach another's reads.
SHAPES = [(2, 2, 16, 16), (1, 4, 16, 8), (2, 4, 32, 16), (1, 2, 16, 64),
          pytest.param((2, 8, 128, 128), marks=needs_cuda),
          pytest.param((16, 32, 128, 128), marks=needs_cuda)]
SPLITS = [1, 7, 16, 64, None]  # None: the whole sequence in one step; 1: decode steps


def triton_ops():
    from kvrecover.ops.triton.fused_ops import TritonOps

    return TritonOps()


def reference_ops():
    from kvrecover.ops.reference.torch_ops import TorchOps

    return TorchOps()


def pools(shape, chunk: int = CHUNK, slots: int = SLOTS) -> DeltaRuleState:
    _, hv, dk, dv = shape
    zeros = lambda *s: torch.zeros(*s, device=DEVICE)  # noqa: E731
    return DeltaRuleState(zeros(slots, hv, dk, dv), zeros(slots, chunk, hv, dk),
                          zeros(slots, chunk, hv, dk), zeros(slots, chunk, hv, dv),
                          zeros(slots, chunk, hv), zeros(slots, chunk, hv))


def sequence(shape, length: int, seed: int) -> list[torch.Tensor]:
    hk, hv, dk, dv = shape
    gen = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(length, hk, dk, generator=gen), torch.randn(length, hk, dk, generator=gen),
               torch.randn(length, hv, dv, generator=gen),
               -torch.rand(length, hv, generator=gen) * 0.5, torch.rand(length, hv, generator=gen)]
    return [t.to(DEVICE) for t in tensors]


def run_steps(ops, states, requests, chunk=CHUNK, checkpoints=None):
    """Run requests [(slot, tensors, split)] together, step by step, until each is done;
    each step takes the next `split` rows of every unfinished request (None: all).
    Returns each request's outputs (concatenated over steps)."""
    done = [0] * len(requests)
    outputs: list[list[torch.Tensor]] = [[] for _ in requests]
    while any(d < t[1][0].shape[0] for d, t in zip(done, requests)):
        rows, parts, row = [], [], 0
        for index, (slot, tensors, split, *wanted) in enumerate(requests):
            length = tensors[0].shape[0]
            if done[index] >= length:
                continue
            end = length if split is None else min(length, done[index] + split)
            marks = tuple((p, c) for p, c in (wanted[0] if wanted else ())
                          if done[index] < p <= end)
            rows.append((index, RequestRows(row, row + end - done[index], done[index], slot,
                                            marks)))
            parts.append([t[done[index] : end] for t in tensors])
            row += end - done[index]
            done[index] = end
        step = [torch.cat([p[i] for p in parts]) for i in range(5)]
        out = ops.gated_delta_rule_batch(*step, states, [r for _, r in rows], chunk, checkpoints)
        for index, request in rows:
            outputs[index].append(out[request.start_row : request.end_row])
    return [torch.cat(o) for o in outputs]


def state_of(states: DeltaRuleState, slot: int, length: int, chunk=CHUNK) -> list[torch.Tensor]:
    rows = length % chunk
    return [states.state[slot], states.query_tail[slot, :rows], states.key_tail[slot, :rows],
            states.value_tail[slot, :rows], states.decay_tail[slot, :rows],
            states.beta_tail[slot, :rows]]


# ----- (a) close to the torch reference --------------------------------------------------
@pytest.mark.parametrize("shape", SHAPES)
def test_batch_outputs_and_states_close_to_the_reference(shape):
    lengths = [1, CHUNK + 5, 2 * CHUNK + 7]
    requests = [(slot, sequence(shape, length, seed=slot), split)
                for slot, (length, split) in enumerate(zip(lengths, [None, 5, 9]), start=1)]
    ref_states, tri_states = pools(shape), pools(shape)
    expected = run_steps(reference_ops(), ref_states, requests)
    got = run_steps(triton_ops(), tri_states, requests)
    tol = dict(rtol=2e-4, atol=2e-4)
    for (slot, tensors, _), ours, theirs in zip(requests, got, expected):
        torch.testing.assert_close(ours, theirs, **tol)
        length = tensors[0].shape[0]
        for a, b in zip(state_of(tri_states, slot, length), state_of(ref_states, slot, length)):
            torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("chunk", [4, pytest.param(64, marks=needs_cuda)])
def test_other_chunk_sizes_close_to_the_reference(chunk):
    shape = (1, 2, 16, 16)
    requests = [(0, sequence(shape, 2 * chunk + 3, seed=7), 3)]
    ref_states, tri_states = pools(shape, chunk), pools(shape, chunk)
    expected = run_steps(reference_ops(), ref_states, requests, chunk)[0]
    got = run_steps(triton_ops(), tri_states, requests, chunk)[0]
    torch.testing.assert_close(got, expected, rtol=2e-4, atol=2e-4)
    torch.testing.assert_close(tri_states.state, ref_states.state, rtol=2e-4, atol=2e-4)


# ----- (b) the Triton path's own bits -----------------------------------------------------
@pytest.mark.parametrize("shape", SHAPES[:2] + SHAPES[3:5])
def test_triton_bits_do_not_depend_on_chunking_decode_or_batch(shape):
    length = 2 * CHUNK + 9
    tensors = sequence(shape, length, seed=3)
    baseline = None
    for split in SPLITS:
        states = pools(shape)
        checkpoints = torch.full((4, *states.state.shape[1:]), float("nan"), device=DEVICE)
        out = run_steps(triton_ops(), states, [(2, tensors, split, [(CHUNK, 0), (2 * CHUNK, 3)])],
                        checkpoints=checkpoints)[0]
        bits = [out, checkpoints[0], checkpoints[3], *state_of(states, 2, length)]
        if baseline is None:
            baseline = bits
            continue
        for ours, theirs in zip(bits, baseline):
            assert torch.equal(ours, theirs), split
    # With two other requests of other lengths in the same steps, in another slot.
    others = [(0, sequence(shape, 5, seed=11), 2), (4, sequence(shape, 3 * CHUNK, seed=12), 13)]
    states = pools(shape)
    checkpoints = torch.zeros((4, *states.state.shape[1:]), device=DEVICE)
    out = run_steps(triton_ops(), states,
                    [others[0], (5, tensors, 7, [(CHUNK, 1), (2 * CHUNK, 2)]), others[1]],
                    checkpoints=checkpoints)[1]
    for ours, theirs in zip([out, checkpoints[1], checkpoints[2], *state_of(states, 5, length)],
                            baseline):
        assert torch.equal(ours, theirs)


def test_checkpoints_equal_the_state_of_a_prompt_ending_there():
    shape = SHAPES[1]
    tensors = sequence(shape, 3 * CHUNK, seed=5)
    states = pools(shape)
    checkpoints = torch.zeros((2, *states.state.shape[1:]), device=DEVICE)
    run_steps(triton_ops(), states, [(1, tensors, 11, [(2 * CHUNK, 1)])], checkpoints=checkpoints)
    prefix = pools(shape)
    run_steps(triton_ops(), prefix, [(0, [t[: 2 * CHUNK] for t in tensors], None)])
    assert torch.equal(checkpoints[1], prefix.state[0])
    assert not torch.equal(checkpoints[1], states.state[1])  # the state moved on past it


# ----- the convolution ----------------------------------------------------------------
def run_conv(ops, x, conv_states, weight, splits):
    """Requests [(slot, rows slice of x)] stepped `splits` rows at a time (all together)."""
    outputs = {slot: [] for slot, _ in splits}
    done = {slot: 0 for slot, _ in splits}
    while any(done[slot] < rows.shape[0] for slot, rows in splits):
        parts, requests, row = [], [], 0
        for slot, rows in splits:
            split = 1 + slot  # each request its own chunking
            if done[slot] >= rows.shape[0]:
                continue
            end = min(rows.shape[0], done[slot] + split)
            parts.append(rows[done[slot] : end])
            requests.append(RequestRows(row, row + end - done[slot], done[slot], slot))
            row += end - done[slot]
            done[slot] = end
        out = ops.causal_conv1d_batch(torch.cat(parts), conv_states, weight, requests)
        for request in requests:
            outputs[request.slot].append(out[request.start_row : request.end_row])
    return {slot: torch.cat(o) for slot, o in outputs.items()}


def test_conv_batch_close_to_the_reference_and_invariant():
    gen = torch.Generator().manual_seed(2)
    channels, width = 160, 4
    weight = torch.randn(channels, width, generator=gen).to(DEVICE)
    seqs = {slot: torch.randn(length, channels, generator=gen).to(DEVICE)
            for slot, length in ((0, 2), (1, 23), (3, 40))}
    results = {}
    for name, ops in (("reference", reference_ops()), ("triton", triton_ops())):
        states = torch.zeros(4, channels, width - 1, device=DEVICE)
        results[name] = (run_conv(ops, None, states, weight, list(seqs.items())), states)
    (ref_out, ref_states), (tri_out, tri_states) = results["reference"], results["triton"]
    for slot in seqs:
        torch.testing.assert_close(tri_out[slot], ref_out[slot], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tri_states, ref_states)
    # Alone, in one step: the same bits.
    ops = triton_ops()
    for slot, x in seqs.items():
        states = torch.zeros(4, channels, width - 1, device=DEVICE)
        whole = ops.causal_conv1d_batch(x, states, weight, [RequestRows(0, x.shape[0], 0, slot)])
        assert torch.equal(whole, tri_out[slot]) and torch.equal(states[slot], tri_states[slot])
