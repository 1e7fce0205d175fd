"""The CPU-invariant op set: fixed-tile linears plus row-local norms and rotary.

Linears run `ops.cpu.tiled_linear.TiledLinears` (bf16/fp16 by default, float32
on request), and so does each expert of a mixture-of-experts layer: its rows,
gathered by expert, run the expert's own packed `nn.Linear` pair in the same
proven tiles, and a token's outputs are combined in its top-k order, so its bits
do not depend on which other tokens share its experts. Norms, rotary, SwiGLU and sampling are row-local already (the
inherited `TorchOps` versions; `tests/ops/test_cpu_invariant.py` proves it bit for
bit). For bf16/fp16, RMSNorm (with its residual add) and rotary run as one C
call each (`ops.cpu.row_ops`, row-local by construction) where the library
builds; float32 keeps the torch versions.
"""

from __future__ import annotations

import torch
from torch import nn

from kvrecover.ops.cpu.row_ops import DTYPE_CODES as ROW_DTYPES
from kvrecover.ops.cpu.row_ops import MAX_HIDDEN, NativeRowOps, native_row_ops
from kvrecover.ops.cpu.tiled_linear import LARGE_TILE_ROWS, TILE_ROWS, TiledLinears
from kvrecover.ops.interface import ExpertWeights, RotaryTables
from kvrecover.ops.reference.torch_ops import TorchOps

HALF_DTYPES = (torch.bfloat16, torch.float16)


class InvariantCpuOps(TorchOps):
    """`TorchOps` whose linears run only fixed-shape row tiles (`linears`) and whose
    bf16/fp16 norms and rotary are the C row kernels."""

    def __init__(
        self, tile_rows: int = TILE_ROWS, large_tile_rows: int = LARGE_TILE_ROWS, *,
        native_kernels: bool = True,
    ) -> None:
        super().__init__()
        self.linears = TiledLinears(tile_rows, large_tile_rows)
        self.native_kernels = native_kernels  # whether the C row kernels may be built
        self._rows: NativeRowOps | None = None  # the C row kernels, loaded at first half call
        self._rows_loaded = False

    def prepare_weights(self, model: nn.Module) -> None:
        """Called once after loading: split each experts module into per-expert linears,
        pack every weight and prove the tiles (`TiledLinears.prepare_weights`)."""
        expert_linears: list[nn.Linear] = []
        for module in model.modules():
            if isinstance(module, ExpertWeights):
                experts: ExpertWeights = module
                gate_up, down = experts.as_linears()
                self._expert_linears[id(experts)] = (experts, gate_up, down)
                expert_linears += gate_up + down
        self.linears.prepare_weights(nn.ModuleList([model, *expert_linears]))
        for prepared, _, _ in self._expert_linears.values():
            # The packed copies replace the stacked weights (their views keep what the
            # linears still read when nothing could be packed).
            for param in (prepared.gate_up_proj, prepared.down_proj):
                param.data = param.data.new_empty(0)

    def _stacked_moe(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
        experts: ExpertWeights,
    ) -> torch.Tensor:
        """Never: every expert must run the fixed-tile linears `prepare_weights` proved
        (`moe` runs each expert's rows through them, via `linear`)."""
        raise ValueError("the experts' weights were not prepared: the model runner calls "
                         "KernelBackend.prepare_weights once after loading")

    def linear(self, x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
        """`x @ layer.weight.T + layer.bias`, one fixed-shape call per row tile."""
        return self.linears.linear(x, layer)

    def _row_kernels(self, *tensors: torch.Tensor) -> NativeRowOps | None:
        """The C row kernels when they apply to `tensors` (one half dtype, contiguous)."""
        first = tensors[0]
        if first.shape[-1] > MAX_HIDDEN:
            return None
        if not all(t.dtype == first.dtype and t.is_contiguous() for t in tensors):
            return None
        return self._kernels_for(first.dtype)

    def _kernels_for(self, dtype: torch.dtype) -> NativeRowOps | None:
        """The C row kernels for a half dtype (None for float32: the torch versions)."""
        if dtype not in ROW_DTYPES:
            return None
        if not self._rows_loaded:
            self._rows, self._rows_loaded = native_row_ops(self.native_kernels), True
        return self._rows

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """`TorchOps.rms_norm`, one C call for bf16/fp16."""
        rows = self._row_kernels(x, weight)
        if rows is None or x.device.type != "cpu":
            return super().rms_norm(x, weight, eps)
        return rows.add_rms_norm(None, x, weight, eps)[0]

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`TorchOps.add_rms_norm`, one C call for bf16/fp16."""
        rows = self._row_kernels(x, residual, weight)
        if rows is None or x.device.type != "cpu" or x.shape != residual.shape:
            return super().add_rms_norm(x, residual, weight, eps)
        return rows.add_rms_norm(x, residual, weight, eps)

    def rotary(
        self, tables: RotaryTables, positions: torch.Tensor, query: torch.Tensor,
        key: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`TorchOps.rotary`, one C call for bf16/fp16 (bit-equal)."""
        cache = tables.cos_sin_cache
        rows = self._kernels_for(query.dtype)  # q and k are views of the qkv output
        if (rows is None or query.device.type != "cpu" or cache.dtype != torch.float32
                or query.dtype != key.dtype or query.stride(-1) != 1 or key.stride(-1) != 1
                or positions.dtype != torch.int64):
            return super().rotary(tables, positions, query, key)
        return rows.rotary(cache, positions, query, key)
