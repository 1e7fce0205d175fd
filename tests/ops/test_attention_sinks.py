"""Attention sinks (gpt-oss) in every CPU kernel: one learned logit per query head joins
the softmax denominator and adds no value.

Against the dense reference of `test_sliding_window_attention` (with and without a
window, keys before it planted with NaN); a sink of -inf is no sink at all, a sink
of zero still changes the output, a dominant sink drives it to zero, and the
invariant kernels give the same bits for a query in a prefill, a chunk or a decode.
The Triton kernel's sinks run in `tests/ops/test_gpu_sliding_window.py` on a GPU.
"""

from __future__ import annotations

import pytest
import torch
from test_sliding_window_attention import CASES, CPU, KERNELS, _setup, dense_reference

from kvrecover.ops.reference.attention_metadata import AttentionMetadata

HEADS = 6  # the query heads of `_setup`'s steps


def sink_logits(seed: int = 0, spread: float = 2.0) -> torch.Tensor:
    return torch.randn(HEADS, generator=torch.Generator().manual_seed(seed)) * spread


def attend(kernel: str, requests, *, window=None, sinks=None, head_dim=32, block_size=5,
           dtype=torch.float32):
    """(the kernel's output, the step's whole keys and values, the new query) of one step."""
    query, key, value, cache, meta, keys, values = _setup(requests, block_size, window or 10_000,
                                                          dtype, head_dim=head_dim)
    scale = head_dim**-0.5
    out = KERNELS[kernel].forward(query.clone(), key, value, cache, meta, scale, window, None,
                                  sinks)
    return out, keys, values, query


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("head_dim", [32, 24])  # 24: the C kernel's scalar path
def test_sinks_match_the_dense_reference(kernel, case, window, head_dim):
    requests, sinks = CASES[case], sink_logits()
    out, keys, values, query = attend(kernel, requests, window=window, sinks=sinks,
                                      head_dim=head_dim)
    band = window or 10_000
    expected = dense_reference(query, keys, values, requests, band, head_dim**-0.5,
                               sinks=sinks)
    plain = dense_reference(query, keys, values, requests, band, head_dim**-0.5)
    assert (expected - plain).abs().max() > 0.05  # the sinks matter here
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_a_minus_infinity_sink_is_no_sink_and_a_zero_sink_is_one(kernel):
    requests = CASES["mixed"]
    plain, *_ = attend(kernel, requests, window=24)
    never, *_ = attend(kernel, requests, window=24, sinks=torch.full((HEADS,), float("-inf")))
    zero, *_ = attend(kernel, requests, window=24, sinks=torch.zeros(HEADS))
    if kernel == "torch":  # no sinks run SDPA, sinks the explicit ops: close, not equal
        torch.testing.assert_close(never, plain, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(never, plain)
    assert (zero - plain).abs().max() > 1e-3


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_a_dominant_sink_takes_all_the_weight(kernel):
    out, *_ = attend(kernel, CASES["mixed"], sinks=torch.full((HEADS,), 1e4))
    assert torch.isfinite(out).all() and out.abs().max() < 1e-30


@pytest.mark.parametrize("kernel", ["torch_tiles", "native"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [32, 24])
def test_invariant_sink_bits_equal_in_prefill_chunks_and_decode(kernel, dtype, head_dim):
    if kernel not in KERNELS:
        pytest.skip("the C kernel did not build here")
    attention, window, block_size, length = KERNELS[kernel], 21, 5, 50
    generator = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(length, h, head_dim, generator=generator).to(dtype)
               for h in (HEADS, 2, 2))
    sinks = sink_logits(1).to(dtype)
    table = list(range(1, 1 + -(-length // block_size)))

    def run(splits: list[int]) -> torch.Tensor:
        cache = torch.zeros(2, len(table) + 1, block_size, 2, head_dim, dtype=dtype)
        outs, start = [], 0
        for end in splits:
            meta = AttentionMetadata.build([start], [end - start], [table], block_size, CPU)
            outs.append(attention.forward(q[start:end], k[start:end], v[start:end], cache, meta,
                                          head_dim**-0.5, window, None, sinks))
            start = end
        return torch.cat(outs)

    whole = run([length])
    assert torch.equal(run([13, 30, 31, length]), whole)
    assert torch.equal(run(list(range(1, length + 1))), whole)
