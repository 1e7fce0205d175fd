"""The Triton `delta_gates` and `gated_rms_norm` (`ops/triton/delta_gates.py`): close to
the torch reference, and each row's bits independent of how many rows the call holds
(a decode row alone, in a batch, at any place of it). Marked `gpu`; with
`TRITON_INTERPRET=1` they run on the CPU."""

from __future__ import annotations

import pytest
import torch
from conftest import CUDA, TRITON_TESTS
from conftest import TRITON_DEVICE as DEVICE

from kvrecover.ops.reference import gated_delta as reference

pytestmark = TRITON_TESTS
DTYPES = ["float32", pytest.param("bfloat16", marks=pytest.mark.skipif(
    not CUDA, reason="bf16: only on a real GPU"))]


def kernels():
    from kvrecover.ops.triton import delta_gates

    return delta_gates


def gate_inputs(rows: int, heads: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(rows)
    a = torch.randn(rows, 2 * heads, generator=gen) * 8  # reaches the softplus threshold
    a[0, 0] = 30.0
    b = torch.randn(rows, heads, generator=gen) * 4
    a_log = torch.randn(heads, generator=gen)
    dt_bias = torch.randn(heads, generator=gen)
    # `a` as the strided view `_project` gives (a split of a wider projection).
    return [t.to(DEVICE, dtype) for t in (a, b, a_log, dt_bias)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_delta_gates_close_to_the_reference_and_row_invariant(dtype):
    dtype = getattr(torch, dtype)
    heads = 6
    wide, b, a_log, dt_bias = gate_inputs(37, heads, dtype)
    a = wide[:, heads:]
    decay, beta = kernels().delta_gates(a, b, a_log, dt_bias)
    ref_decay, ref_beta = reference.delta_gates(a, b, a_log, dt_bias)
    assert decay.dtype == torch.float32 and beta.dtype == dtype
    torch.testing.assert_close(decay, ref_decay, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(beta, ref_beta, rtol=1e-5 if dtype == torch.float32 else 2e-2,
                               atol=1e-6)
    for rows in (slice(0, 1), slice(5, 6), slice(3, 20), slice(36, 37)):
        part_decay, part_beta = kernels().delta_gates(a[rows], b[rows], a_log, dt_bias)
        assert torch.equal(part_decay, decay[rows]) and torch.equal(part_beta, beta[rows])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [8, 128])
def test_gated_rms_norm_close_to_the_reference_and_row_invariant(dtype, width):
    dtype = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(width)
    x = (torch.randn(29, width, generator=gen) * 3).to(DEVICE, dtype)
    gate = (torch.randn(29, width, generator=gen) * 3).to(DEVICE, dtype)
    weight = torch.randn(width, generator=gen).to(DEVICE, dtype)
    out = kernels().gated_rms_norm(x, gate, weight, 1e-6)
    expected = reference.gated_rms_norm(x, gate, weight, 1e-6)
    assert out.dtype == dtype and out.shape == x.shape
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, expected, rtol=tolerance, atol=tolerance)
    for rows in (slice(0, 1), slice(7, 8), slice(2, 19)):
        assert torch.equal(kernels().gated_rms_norm(x[rows], gate[rows], weight, 1e-6), out[rows])
