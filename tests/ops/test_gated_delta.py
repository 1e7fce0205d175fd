"""The gated delta rule (`ops/reference/gated_delta.py`): Hugging Face's numbers, and
states whose bits do not depend on how the sequence was split (issue 23, point 2)."""

from __future__ import annotations

import pytest
import torch

from kvrecover.ops.interface import DeltaRuleState
from kvrecover.ops.reference.gated_delta import causal_conv1d, gated_delta_rule

HK, HV, DK, DV, CHUNK, LENGTH = 2, 4, 16, 8, 16, 100


def fresh_state(dtype: torch.dtype = torch.float32) -> DeltaRuleState:
    f32 = torch.float32
    return DeltaRuleState(torch.zeros(HV, DK, DV, dtype=f32), torch.zeros(CHUNK, HV, DK, dtype=f32),
                          torch.zeros(CHUNK, HV, DK, dtype=f32), torch.zeros(CHUNK, HV, DV, dtype=f32),
                          torch.zeros(CHUNK, HV, dtype=f32), torch.zeros(CHUNK, HV, dtype=f32))


def inputs(dtype: torch.dtype, length: int = LENGTH, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(length, HK, DK, generator=generator).to(dtype)
    key = torch.randn(length, HK, DK, generator=generator).to(dtype)
    value = torch.randn(length, HV, DV, generator=generator).to(dtype)
    decay = -torch.rand(length, HV, generator=generator) * 0.5
    beta = torch.rand(length, HV, generator=generator).to(dtype)
    return query, key, value, decay, beta


def run_split(tensors, split: int, length: int = LENGTH) -> tuple[torch.Tensor, DeltaRuleState]:
    """The outputs and final state when the sequence arrives `split` tokens at a time."""
    state = fresh_state()
    outputs = []
    for start in range(0, length, split):
        part = [x[start : start + split] for x in tensors]
        outputs.append(gated_delta_rule(*part, state, start, CHUNK))
    return torch.cat(outputs), state


def state_bits(state: DeltaRuleState, length: int) -> list[torch.Tensor]:
    rows = length % CHUNK
    return [state.state, state.query_tail[:rows], state.key_tail[:rows], state.value_tail[:rows],
            state.decay_tail[:rows], state.beta_tail[:rows]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("length", [LENGTH, 96])  # mid-chunk and at a chunk boundary
def test_state_and_outputs_have_the_same_bits_for_every_split(dtype, length):
    tensors = inputs(dtype, length)
    whole_out, whole_state = run_split(tensors, length, length)
    for split in (1, 7, 16, 64):  # 1: decode steps
        out, state = run_split(tensors, split, length)
        assert torch.equal(out.view(torch.int32), whole_out.view(torch.int32)), split
        for ours, reference in zip(state_bits(state, length), state_bits(whole_state, length)):
            assert torch.equal(ours.view(torch.int32), reference.view(torch.int32)), split


def test_matches_hugging_face_chunked_and_recurrent_rules():
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        torch_chunk_gated_delta_rule,
        torch_recurrent_gated_delta_rule,
    )

    query, key, value, decay, beta = inputs(torch.float32)
    out, state = run_split((query, key, value, decay, beta), LENGTH)
    args = [x.unsqueeze(0) for x in (query, key, value, decay, beta)]
    for rule in (torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule):
        hf_out, _ = rule(*args, output_final_state=True, use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(out, hf_out[0], rtol=1e-4, atol=1e-5)
    # The state at the last boundary (96) against Hugging Face's state after 96 tokens.
    _, hf_state = torch_recurrent_gated_delta_rule(*[x[:, :96] for x in args],
                                                   output_final_state=True,
                                                   use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(state.state, hf_state[0], rtol=1e-4, atol=1e-5)


def test_causal_conv_continues_across_splits_and_matches_torch():
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(30, 12, generator=generator)
    weight = torch.randn(12, 4, generator=generator)
    whole_state = torch.zeros(12, 3)
    whole = causal_conv1d(x, whole_state, weight)
    state = torch.zeros(12, 3)
    pieces = torch.cat([causal_conv1d(x[i : i + 7], state, weight) for i in range(0, 30, 7)])
    assert torch.equal(pieces, whole) and torch.equal(state, whole_state)
    reference = torch.nn.functional.silu(torch.nn.functional.conv1d(
        x.T.unsqueeze(0), weight.unsqueeze(1), padding=3, groups=12)[0, :, :30].T)
    torch.testing.assert_close(whole, reference)
    assert torch.equal(whole_state, x[-3:].T)


def test_snapshots_at_boundaries_equal_the_state_of_a_prompt_ending_there():
    tensors = inputs(torch.float32)
    state = fresh_state()
    snapshots = {32: torch.empty(HV, DK, DV), 48: torch.empty(HV, DK, DV)}
    for start in range(0, LENGTH, 7):
        wanted = [(p, t) for p, t in snapshots.items() if start < p <= start + 7]
        gated_delta_rule(*[x[start : start + 7] for x in tensors], state, start, CHUNK, wanted)
    for position, snapshot in snapshots.items():
        _, prefix_state = run_split([x[:position] for x in tensors], position, position)
        assert torch.equal(snapshot, prefix_state.state), position


def test_batched_calls_equal_the_per_request_calls_bit_for_bit():
    """`gated_delta_rule_batch` / `causal_conv1d_batch` of the reference: each request's
    rows and slot exactly as its own per-request call (the CPU path is unchanged)."""
    from kvrecover.models.recurrent_state import RequestRows
    from kvrecover.ops.reference.gated_delta import causal_conv1d_batch, gated_delta_rule_batch

    lengths, starts = [3, 40, 17], [5, 0, 16]
    seqs = [inputs(torch.float32, start + length, seed=i)
            for i, (start, length) in enumerate(zip(starts, lengths))]
    singles = [fresh_state() for _ in lengths]
    pools = DeltaRuleState(*(torch.stack([getattr(s, f) for s in singles])
                             for f in ("state", "query_tail", "key_tail", "value_tail",
                                       "decay_tail", "beta_tail")))
    for tensors, state, start in zip(seqs, singles, starts):  # bring each to its start
        if start:
            gated_delta_rule(*[x[:start] for x in tensors], state, 0, CHUNK)
    for index, single in enumerate(singles):
        for name in ("state", "query_tail", "key_tail", "value_tail", "decay_tail", "beta_tail"):
            getattr(pools, name)[index].copy_(getattr(single, name))
    checkpoints = torch.zeros(2, HV, DK, DV)
    requests, row = [], 0
    for index, (start, length) in enumerate(zip(starts, lengths)):
        marks = ((32, 1),) if index == 1 else ()
        requests.append(RequestRows(row, row + length, start, index, marks))
        row += length
    step = [torch.cat([x[start:] for x, start in zip(parts, starts)]) for parts in zip(*seqs)]
    batched = gated_delta_rule_batch(*step, pools, requests, CHUNK, checkpoints)
    snapshot = torch.empty(HV, DK, DV)
    for index, (tensors, state, start) in enumerate(zip(seqs, singles, starts)):
        wanted = [(32, snapshot)] if index == 1 else []
        alone = gated_delta_rule(*[x[start:] for x in tensors], state, start, CHUNK, wanted)
        rows = slice(requests[index].start_row, requests[index].end_row)
        assert torch.equal(batched[rows], alone)
        for name in ("state", "query_tail", "key_tail", "value_tail", "decay_tail", "beta_tail"):
            assert torch.equal(getattr(pools, name)[index], getattr(state, name)), name
    assert torch.equal(checkpoints[1], snapshot)

    generator = torch.Generator().manual_seed(4)
    x = torch.randn(row, 12, generator=generator)
    weight = torch.randn(12, 4, generator=generator)
    conv_pool = torch.randn(3, 12, 3, generator=generator)
    conv_singles = [conv_pool[i].clone() for i in range(3)]
    conv = causal_conv1d_batch(x, conv_pool, weight, requests)
    for request, conv_state in zip(requests, conv_singles):
        rows = slice(request.start_row, request.end_row)
        assert torch.equal(conv[rows], causal_conv1d(x[rows], conv_state, weight))
        assert torch.equal(conv_pool[request.slot], conv_state)
