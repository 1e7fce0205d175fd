"""The CPU-invariant op set: fixed-tile linears plus row-local norms and rotary.

Linears run `ops.cpu.tiled_linear.TiledLinears` (bf16/fp16 by default, float32
on request), and so does each expert of a mixture-of-experts layer: its rows,
gathered by expert, run the expert's own packed `nn.Linear` pair in the same
proven tiles, and a token's outputs are combined in its top-k order, so its bits
do not depend on which other tokens share its experts. Norms, rotary, SwiGLU and sampling are row-local already (the
inherited `TorchOps` versions; `tests/ops/test_cpu_invariant.py` proves it bit for
bit). RMSNorm (with its residual add) and rotary run as one C call each
(`ops.cpu.row_ops`, row-local by construction) where the library builds: in
float32 bit-equal to torch (`ops.cpu.row_kernel_ops.RowKernelOps`), in bf16/fp16
close to it.
"""

from __future__ import annotations

import torch
from torch import nn

from kvrecover.ops.cpu.row_kernel_ops import RowKernelOps
from kvrecover.ops.cpu.tiled_linear import LARGE_TILE_ROWS, TILE_ROWS, TiledLinears
from kvrecover.ops.interface import ExpertWeights

HALF_DTYPES = (torch.bfloat16, torch.float16)


class InvariantCpuOps(RowKernelOps):
    """`TorchOps` whose linears run only fixed-shape row tiles (`linears`) and whose
    norms and rotary are the C row kernels (bf16/fp16 too, `RowKernelOps`)."""

    native_half_dtypes = HALF_DTYPES

    def __init__(
        self, tile_rows: int = TILE_ROWS, large_tile_rows: int = LARGE_TILE_ROWS, *,
        native_kernels: bool = True,
    ) -> None:
        super().__init__(native_kernels=native_kernels)
        self.linears = TiledLinears(tile_rows, large_tile_rows)

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
