"""The C row kernels (`ops/cpu/row_ops.py`, `ops/cpu/csrc/row_ops.c`) in bf16/fp16 (float32:
tests/ops/test_row_kernel_ops.py):
a row's bits never depend on its batch or the thread count, results match torch's
within half rounding (residual sums and rotary exactly), bad input is refused."""

from __future__ import annotations

import pytest
import torch

from kvrecover.models.rope import RotaryEmbedding
from kvrecover.ops.cpu import native_build
from kvrecover.ops.cpu.invariant_ops import InvariantCpuOps
from kvrecover.ops.cpu.row_ops import NativeRowOps, native_row_ops
from kvrecover.ops.reference.rotary import apply_rotary
from kvrecover.ops.reference.torch_ops import TorchOps

HALF = (torch.bfloat16, torch.float16)
HIDDEN_SIZES = (24, 576, 2048 + 8)
BATCHES = (1, 2, 3, 7, 8, 16, 33, 64)
TOLERANCE = {torch.bfloat16: 2**-7, torch.float16: 2**-10}  # one rounding step, relative


@pytest.fixture(scope="module")
def rows() -> NativeRowOps:
    kernels = native_row_ops()
    assert kernels is not None, "csrc/row_ops.c must build on the test machine"
    return kernels


def _data(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).mul_(3).to(dtype)


def _assert_rows_invariant(run, batch: torch.Tensor) -> None:
    """Every row's result alone == inside each batch prefix == on 1, 2 or 4 threads."""
    alone = torch.cat([run(batch[r : r + 1], 1) for r in range(batch.shape[0])])
    for size in BATCHES:
        for threads in (1, 2, 4):
            assert torch.equal(run(batch[:size], threads), alone[:size]), (size, threads)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("hidden", HIDDEN_SIZES)
def test_add_rms_norm_rows_are_invariant_and_close_to_torch(rows, dtype, hidden):
    x, residual, weight = _data((64, hidden), dtype, 1), _data((64, hidden), dtype, 2), _data(
        (hidden,), dtype, 3)
    both = torch.stack((x, residual), dim=1)  # [rows, 2, hidden]: slice both together

    def run(part, threads):
        out, summed = rows.add_rms_norm(part[:, 0].contiguous(), part[:, 1].contiguous(), weight,
                                        1e-5, threads=threads)
        return torch.stack((out, summed), dim=1)

    _assert_rows_invariant(run, both)
    out, summed = rows.add_rms_norm(x, residual, weight, 1e-5)
    reference_out, reference_sum = TorchOps().add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(summed, reference_sum)  # one exact-rounded add either way
    assert torch.equal(summed, residual + x)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), reference_out.float(), rtol=2 * tol,
                               atol=2 * tol * weight.float().abs().max().item())


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("hidden", HIDDEN_SIZES)
def test_rms_norm_rows_are_invariant_and_close_to_torch(rows, dtype, hidden):
    x, weight = _data((64, hidden), dtype, 4), _data((hidden,), dtype, 5)
    _assert_rows_invariant(lambda part, t: rows.add_rms_norm(None, part, weight, 1e-6, t)[0], x)
    out, same = rows.add_rms_norm(None, x, weight, 1e-6)
    assert same is x
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), TorchOps().rms_norm(x, weight, 1e-6).float(),
                               rtol=2 * tol, atol=2 * tol * weight.float().abs().max().item())


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("head_dim", (8, 64, 128))
def test_rotary_equals_torch_bit_for_bit_and_is_row_invariant(rows, dtype, head_dim):
    rotary = RotaryEmbedding(head_dim, 512, 10000.0, None)
    heads, kv_heads = 6, 2
    qkv = _data((64, (heads + 2 * kv_heads) * head_dim), dtype, 7)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(-1, heads, head_dim), k.view(-1, kv_heads, head_dim)  # strided views
    positions = torch.randint(0, 512, (64,), generator=torch.Generator().manual_seed(8))
    out_q, out_k = rows.rotary(rotary.cos_sin_cache, positions, q, k)
    ref_q, ref_k = apply_rotary(rotary.cos_sin_cache, positions, q, k)
    assert torch.equal(out_q, ref_q) and torch.equal(out_k, ref_k)
    strided = qkv.clone()  # in place, into the strided views
    in_q, in_k, _ = strided.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim],
                                  dim=-1)
    rows.rotary(rotary.cos_sin_cache, positions, in_q.view(-1, heads, head_dim),
                in_k.view(-1, kv_heads, head_dim), in_place=True)
    assert torch.equal(in_q.reshape(-1, heads, head_dim), ref_q)
    assert torch.equal(in_k.reshape(-1, kv_heads, head_dim), ref_k)

    def run(index, threads):
        lo, hi = int(index[0]), int(index[-1]) + 1
        out = rows.rotary(rotary.cos_sin_cache, positions[lo:hi], q[lo:hi], k[lo:hi], threads)
        return torch.cat((out[0].flatten(1), out[1].flatten(1)), dim=1)

    _assert_rows_invariant(run, torch.arange(64))


def test_bad_inputs_are_refused(rows):
    x = _data((4, 24), torch.bfloat16)
    weight = _data((24,), torch.bfloat16)
    with pytest.raises(ValueError, match="x dtype torch.float32"):
        rows.add_rms_norm(x.float(), x, weight, 1e-5)
    with pytest.raises(ValueError, match="residual dtype torch.float64"):
        rows.add_rms_norm(None, x.double(), weight.double(), 1e-5)
    with pytest.raises(ValueError, match="contiguous"):
        rows.add_rms_norm(None, x.t(), weight, 1e-5)
    with pytest.raises(ValueError, match="weight shape"):
        rows.add_rms_norm(x, x, weight[:12], 1e-5)
    with pytest.raises(ValueError, match="x shape"):
        rows.add_rms_norm(x[:2], x, weight, 1e-5)
    with pytest.raises(ValueError, match="hidden size"):
        rows.add_rms_norm(None, _data((1, 8200), torch.bfloat16), _data((8200,), torch.bfloat16),
                          1e-5)
    rotary = RotaryEmbedding(8, 16, 10000.0, None)
    q, k = x.view(4, 3, 8), x[:, :16].contiguous().view(4, 2, 8)
    with pytest.raises(ValueError, match="positions must be in 0..15"):
        rows.rotary(rotary.cos_sin_cache, torch.tensor([0, 1, 16, 2]), q, k)
    with pytest.raises(ValueError, match="positions must be int64"):
        rows.rotary(rotary.cos_sin_cache, torch.arange(4, dtype=torch.int32), q, k)
    with pytest.raises(ValueError, match="query and key dtypes"):
        rows.rotary(rotary.cos_sin_cache, torch.arange(4), q.half(), k)


def test_invariant_ops_use_the_kernels_for_half_and_float32(monkeypatch):
    x, residual, weight = (_data((5, 24), torch.float32, s) for s in (1, 2, 3))
    weight = weight[0]
    ops, torch_ops = InvariantCpuOps(), TorchOps()
    for got, want in zip(ops.add_rms_norm(x, residual.clone(), weight, 1e-5),
                         torch_ops.add_rms_norm(x, residual, weight, 1e-5)):
        assert torch.equal(got, want)  # float32 stays bit-identical to the HF-checked path
    assert ops._rows is not None  # through the C kernel (tests/ops/test_row_kernel_ops.py)
    half = x.bfloat16(), residual.bfloat16(), weight.bfloat16()
    calls = []
    original = NativeRowOps.add_rms_norm
    monkeypatch.setattr(NativeRowOps, "add_rms_norm",
                        lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    ops.add_rms_norm(half[0], half[1].clone(), half[2], 1e-5)
    assert calls == [1]
    # Without the library the torch versions run.
    monkeypatch.setattr(native_build, "_loaded", {"row_ops": None})
    fallback = InvariantCpuOps()
    out, summed = fallback.add_rms_norm(*half, 1e-5)
    assert calls == [1] and fallback._rows is None
    reference = torch_ops.add_rms_norm(*half, 1e-5)
    assert torch.equal(out, reference[0]) and torch.equal(summed, reference[1])
