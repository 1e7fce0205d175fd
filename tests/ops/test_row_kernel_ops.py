"""ops.cpu.row_kernel_ops: the float32 CPU norms and rotary run the C row kernels, bit for
bit as `TorchOps` (torch's own sum order, probed once), a row's bits never depend on its
batch or the thread count, and the torch path on the CPU runs them (not off the CPU, not
with `native_kernels=False`); a float32 generate gives the torch version's logprobs bit
for bit."""

from __future__ import annotations

import pytest
import torch

from kvrecover import LLM, SamplingParams
from kvrecover.models.rope import RotaryEmbedding
from kvrecover.ops.backend import select_backend
from kvrecover.ops.cpu.invariant_ops import InvariantCpuOps
from kvrecover.ops.cpu.row_kernel_ops import RowKernelOps, torch_sum_width
from kvrecover.ops.cpu.row_ops import NativeRowOps, native_row_ops
from kvrecover.ops.reference.torch_ops import TorchOps

CPU = torch.device("cpu")
HIDDEN_SIZES = (7, 64, 576, 2048, 2056)
ROW_COUNTS = (1, 3, 7, 33)


@pytest.fixture(scope="module")
def ops() -> RowKernelOps:
    ops = RowKernelOps()
    assert ops._kernels() is not None, "csrc/row_ops.c must build on the test machine"
    assert ops._float32_sum_width is not None, "the kernel must reproduce torch's sum order"
    return ops


def _data(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).mul_(3)


def _norms(ops: TorchOps, plus_one: bool, x: torch.Tensor, residual: torch.Tensor | None,
           weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    if residual is None:
        norm = ops.rms_norm_plus_one if plus_one else ops.rms_norm
        return (norm(x, weight, 1e-6),)
    add_norm = ops.add_rms_norm_plus_one if plus_one else ops.add_rms_norm
    return add_norm(x, residual, weight, 1e-6)


@pytest.mark.parametrize("hidden", HIDDEN_SIZES)
@pytest.mark.parametrize("with_residual", (False, True))
@pytest.mark.parametrize("plus_one", (False, True))
def test_float32_norms_equal_torch_bit_for_bit(ops, hidden, with_residual, plus_one,
                                               monkeypatch):
    calls = []
    original = ops._rows.add_rms_norm
    monkeypatch.setattr(ops._rows, "add_rms_norm",
                        lambda *a, **k: calls.append(1) or original(*a, **k))
    for rows in ROW_COUNTS:
        x, weight = _data((rows, hidden), hidden + rows), _data((hidden,), 1)
        residual = _data((rows, hidden), 2) if with_residual else None
        want = _norms(TorchOps(), plus_one, x, residual, weight)
        got = _norms(ops, plus_one, x, residual, weight)  # may update `residual` in place
        assert calls == [1], "the float32 norm must be the C kernel"
        calls.clear()
        if residual is not None:  # the sum lands in place, as `ModelOps` allows
            assert got[1].data_ptr() == residual.data_ptr()
        for got_part, want_part in zip(got, want, strict=True):
            assert torch.equal(got_part, want_part), (rows, hidden)


@pytest.mark.parametrize("hidden", HIDDEN_SIZES)
def test_float32_norm_rows_do_not_depend_on_batch_or_threads(ops, hidden):
    x, residual, weight = _data((65, hidden), 3), _data((65, hidden), 4), _data((hidden,), 5)
    width = ops._float32_sum_width

    def run(lo: int, hi: int, threads: int) -> torch.Tensor:
        out, summed = ops._rows.add_rms_norm(x[lo:hi].contiguous(), residual[lo:hi].contiguous(),
                                             weight, 1e-5, threads, sum_width=width)
        return torch.cat((out, summed), dim=1)

    alone = torch.cat([run(r, r + 1, 1) for r in range(65)])
    for size in (2, 3, 8, 17, 33, 64, 65):
        for threads in (1, 2, 4):
            start = (size * 7) % (66 - size)
            assert torch.equal(run(start, start + size, threads), alone[start:start + size]), (
                size, threads)


@pytest.mark.parametrize("head_dim, rotary_dim", [(8, 8), (64, 64), (128, 128), (64, 32)])
def test_float32_rotary_equals_torch_bit_for_bit_and_rows_are_invariant(
    ops, head_dim, rotary_dim
):
    """Partial rotary as `models.gated_attention` calls it: the first `rotary_dim` of each
    head, sliced contiguous."""
    rotary = RotaryEmbedding(rotary_dim, 512, 10000.0, None)
    heads, kv_heads = 6, 2
    qkv = _data((41, (heads + 2 * kv_heads) * head_dim), 6)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(-1, heads, head_dim), k.view(-1, kv_heads, head_dim)  # strided views
    if rotary_dim != head_dim:
        q, k = q[..., :rotary_dim].contiguous(), k[..., :rotary_dim].contiguous()
    positions = torch.randint(0, 512, (41,), generator=torch.Generator().manual_seed(7))
    got = ops.rotary(rotary, positions, q, k)
    want = TorchOps().rotary(rotary, positions, q, k)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # In place (the attention's rotary): the same bits, written into q and k.
    in_q, in_k = q.clone(), k.clone()
    rotated = ops.rotary_in_place(rotary, positions, in_q, in_k)
    assert rotated[0] is in_q and rotated[1] is in_k
    assert torch.equal(in_q, want[0]) and torch.equal(in_k, want[1])
    strided = qkv.clone()  # and into strided views of the qkv output, its v untouched
    sq, sk, sv = strided.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    if rotary_dim == head_dim:
        ops.rotary_in_place(rotary, positions, sq.view(-1, heads, head_dim),
                            sk.view(-1, kv_heads, head_dim))
        assert torch.equal(sq.view(-1, heads, head_dim), want[0])
        assert torch.equal(sk.view(-1, kv_heads, head_dim), want[1])
        assert torch.equal(sv, qkv.split([heads * head_dim, 2 * kv_heads * head_dim], -1)[1][
            :, kv_heads * head_dim:])
    for size in (1, 2, 5, 16, 41):
        for threads in (1, 2, 4):
            part = ops._rows.rotary(rotary.cos_sin_cache, positions[:size], q[:size], k[:size],
                                    threads)
            assert torch.equal(part[0], got[0][:size]) and torch.equal(part[1], got[1][:size])


def test_the_probe_finds_torchs_width_and_refuses_a_wrong_one(ops):
    rows = ops._rows
    width = torch_sum_width(rows, TorchOps())
    assert width == ops._float32_sum_width
    x, weight = _data((5, 2056), 8), _data((2056,), 9)
    want = TorchOps().rms_norm(x, weight, 1e-6)
    other = 16 if width != 16 else 8
    assert torch.equal(rows.add_rms_norm(None, x, weight, 1e-6, sum_width=width)[0], want)
    assert not torch.equal(rows.add_rms_norm(None, x, weight, 1e-6, sum_width=other)[0], want)

    class ShiftedNorm(TorchOps):  # a torch whose order no width reproduces
        def rms_norm(self, x, weight, eps):
            return super().rms_norm(x, weight, eps).nextafter(torch.tensor(float("inf")))

    assert torch_sum_width(rows, ShiftedNorm()) is None
    with pytest.raises(ValueError, match="sum_width must be in 0..64, got 65"):
        rows.add_rms_norm(None, x, weight, 1e-6, sum_width=65)


def test_the_torch_path_on_the_cpu_runs_the_row_kernels(monkeypatch):
    backend = select_backend("auto", CPU)
    assert type(backend.ops) is RowKernelOps and backend.name == "torch"
    half_ops, invariant_ops = RowKernelOps(), InvariantCpuOps()
    for loaded in (backend.ops, half_ops, invariant_ops):
        assert loaded._kernels() is not None  # loaded and probed before counting calls
    calls: list[str] = []
    for name in ("add_rms_norm", "rotary"):
        original = getattr(NativeRowOps, name)
        monkeypatch.setattr(NativeRowOps, name, lambda self, *a, _n=name, _o=original, **k: (
            calls.append(_n) or _o(self, *a, **k)))
    x, weight = _data((3, 64), 10), _data((64,), 11)
    rotary = RotaryEmbedding(16, 64, 10000.0, None)
    q, k = _data((3, 4, 16), 12), _data((3, 2, 16), 13)
    backend.ops.add_rms_norm(x, x.clone(), weight, 1e-5)
    backend.attention.rotate(rotary, torch.arange(3), q, k)  # the attention's rotary is ops'
    assert calls == ["add_rms_norm", "rotary"]
    # bf16 on the torch path (not the default) keeps torch's versions: bit-equal only in float32.
    half_ops.rms_norm(x.bfloat16(), weight.bfloat16(), 1e-5)
    assert calls == ["add_rms_norm", "rotary"]
    # The invariant ops run the same float32 kernels.
    invariant_ops.rms_norm(x, weight, 1e-5)
    assert calls == ["add_rms_norm", "rotary", "add_rms_norm"]
    with pytest.warns(RuntimeWarning, match="the C kernel 'row_ops' is off"):
        RowKernelOps(native_kernels=False).rms_norm(x, weight, 1e-5)
    assert calls == ["add_rms_norm", "rotary", "add_rms_norm"]


def test_a_float32_generate_gives_the_torch_versions_logprobs_bit_for_bit(tiny_llama,
                                                                        monkeypatch):
    from conftest import random_prompts

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    prompts = random_prompts(5, [3, 17, 40], 256, seed=4)

    def generate() -> list[tuple[list[int], list]]:
        llm = LLM(str(tiny_llama), device="cpu", dtype="float32", num_kv_blocks=64)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        llm.close()
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]

    assert native_row_ops() is not None
    with_kernels = generate()
    monkeypatch.setattr(RowKernelOps, "_kernels", lambda self: None)
    assert with_kernels == generate()
