"""`TorchOps` with the C row kernels (`ops.cpu.row_ops`) for float32 on the CPU.

RMSNorm (plain, after the residual add, and Gemma's `1 + weight`) and rotary
run as one C call each instead of four to eight torch ops. They are bit-equal
to `TorchOps`: rotary rounds step for step as torch does, the residual add is
one exact-rounded add, and the norm's sum of squares runs in the order of
torch's own CPU sum (`row_ops.c`, `torch_sum_squares`) with the vector width
torch was found to add with on this machine (`torch_sum_width`, probed once
against `TorchOps.rms_norm`). Where no width reproduces torch's bits, the
norms stay the torch versions; rotary runs the kernel anyway. The torch path
on the CPU (`ops.backend`) runs these ops for float32, and `InvariantCpuOps`
extends them to bf16/fp16 (close to, not bit-equal with, torch there).
"""

from __future__ import annotations

import torch

from kvrecover.ops.cpu.row_ops import MAX_HIDDEN, NativeRowOps, native_row_ops
from kvrecover.ops.interface import RotaryTables
from kvrecover.ops.reference.torch_ops import TorchOps

# Vector widths (floats) tried in turn; ATen's CPU sum is built for 8 (AVX2) or 16 lanes.
SUM_WIDTH_CANDIDATES = (8, 16, 4, 32, 64)
# Row sizes the probe compares: shorter than a vector, odd tails, cascaded levels.
PROBE_HIDDEN_SIZES = (3, 7, 24, 100, 576, 2056, 4100, MAX_HIDDEN)


def torch_sum_width(rows: NativeRowOps, reference: TorchOps) -> int | None:
    """The vector width with which the kernel's float32 norm equals `reference.rms_norm`
    bit for bit on every probe row (seeded random rows of `PROBE_HIDDEN_SIZES`), or None
    where no candidate does (another torch build or CPU: the norms then stay in torch)."""
    generator = torch.Generator().manual_seed(0)
    probes = [(torch.randn(5, hidden, generator=generator).mul_(3),
               torch.randn(hidden, generator=generator)) for hidden in PROBE_HIDDEN_SIZES]
    expected = [reference.rms_norm(x, weight, 1e-6) for x, weight in probes]
    for width in SUM_WIDTH_CANDIDATES:
        if all(torch.equal(rows.add_rms_norm(None, x, weight, 1e-6, sum_width=width)[0], want)
               for (x, weight), want in zip(probes, expected)):
            return width
    return None


class RowKernelOps(TorchOps):
    """`TorchOps` whose float32 CPU norms and rotary are the C row kernels, bit-equal.
    `native_kernels=False` (`EngineArgs.native_kernels`) keeps the torch versions."""

    # The dtypes whose norms and rotary run the kernels besides float32 (`InvariantCpuOps`).
    native_half_dtypes: tuple[torch.dtype, ...] = ()

    def __init__(self, *, native_kernels: bool = True) -> None:
        super().__init__()
        self.native_kernels = native_kernels  # whether the C row kernels may be built
        self._rows: NativeRowOps | None = None  # loaded at the first call that could use them
        self._rows_loaded = False
        self._float32_sum_width: int | None = None  # `torch_sum_width`, probed with the load

    def _kernels(self) -> NativeRowOps | None:
        if not self._rows_loaded:
            self._rows, self._rows_loaded = native_row_ops(self.native_kernels), True
            if self._rows is not None:
                self._float32_sum_width = torch_sum_width(self._rows, TorchOps())
        return self._rows

    def _kernels_for(self, dtype: torch.dtype) -> NativeRowOps | None:
        """The row kernels for rotary in `dtype` (float32 or a `native_half_dtypes`)."""
        if dtype != torch.float32 and dtype not in self.native_half_dtypes:
            return None
        return self._kernels()

    def _norm_kernels(self, plus_one: bool,
                      *tensors: torch.Tensor) -> tuple[NativeRowOps, int] | None:
        """(kernels, sum width) for a norm of `tensors` (one dtype, contiguous, on the CPU,
        rows of at most `MAX_HIDDEN`), or None where the torch version runs: Gemma's
        `plus_one` and float32 only where the kernel's sum is torch's (`torch_sum_width`)."""
        first = tensors[0]
        if first.device.type != "cpu" or first.shape[-1] > MAX_HIDDEN:
            return None
        if not all(t.dtype == first.dtype and t.is_contiguous() for t in tensors):
            return None
        if first.dtype != torch.float32:
            if plus_one or first.dtype not in self.native_half_dtypes:
                return None
            rows = self._kernels()
            return None if rows is None else (rows, 0)
        rows = self._kernels()
        if rows is None or self._float32_sum_width is None:
            return None
        return rows, self._float32_sum_width

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """`TorchOps.rms_norm`, one C call where `_norm_kernels` allows."""
        kernels = self._norm_kernels(False, x, weight)
        if kernels is None:
            return super().rms_norm(x, weight, eps)
        return kernels[0].add_rms_norm(None, x, weight, eps, sum_width=kernels[1])[0]

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`TorchOps.add_rms_norm`, one C call where `_norm_kernels` allows (the sum in
        place in `residual`, as `ModelOps.add_rms_norm` allows)."""
        kernels = self._norm_kernels(False, x, residual, weight)
        if kernels is None or x.shape != residual.shape:
            return super().add_rms_norm(x, residual, weight, eps)
        return kernels[0].add_rms_norm(x, residual, weight, eps, sum_width=kernels[1],
                                       in_place=True)

    def rms_norm_plus_one(self, x: torch.Tensor, weight: torch.Tensor,
                          eps: float) -> torch.Tensor:
        """`TorchOps.rms_norm_plus_one`, one C call for float32 where `_norm_kernels` allows."""
        kernels = self._norm_kernels(True, x, weight)
        if kernels is None:
            return super().rms_norm_plus_one(x, weight, eps)
        return kernels[0].add_rms_norm(None, x, weight, eps, sum_width=kernels[1],
                                       plus_one=True)[0]

    def add_rms_norm_plus_one(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`TorchOps.add_rms_norm_plus_one`, one C call for float32 where allowed."""
        kernels = self._norm_kernels(True, x, residual, weight)
        if kernels is None or x.shape != residual.shape:
            return super().add_rms_norm_plus_one(x, residual, weight, eps)
        return kernels[0].add_rms_norm(x, residual, weight, eps, sum_width=kernels[1],
                                       plus_one=True, in_place=True)

    def rotary(
        self, tables: RotaryTables, positions: torch.Tensor, query: torch.Tensor,
        key: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`TorchOps.rotary`, one C call (bit-equal) for float32 and `native_half_dtypes`."""
        return self._rotary(tables, positions, query, key, in_place=False)

    def rotary_in_place(
        self, tables: RotaryTables, positions: torch.Tensor, query: torch.Tensor,
        key: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`rotary` into `query` and `key` themselves where the kernel runs (a fresh
        tensor less per call): the attention's rotary, whose `attend` may overwrite them."""
        return self._rotary(tables, positions, query, key, in_place=True)

    def _rotary(
        self, tables: RotaryTables, positions: torch.Tensor, query: torch.Tensor,
        key: torch.Tensor, *, in_place: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cache = tables.cos_sin_cache
        if (query.device.type != "cpu" or cache.dtype != torch.float32
                or query.dtype != key.dtype or query.stride(-1) != 1 or key.stride(-1) != 1
                or positions.dtype != torch.int64):
            return super().rotary(tables, positions, query, key)
        rows = self._kernels_for(query.dtype)  # q and k are views of the qkv output
        if rows is None:
            return super().rotary(tables, positions, query, key)
        return rows.rotary(cache, positions, query, key, in_place=in_place)
