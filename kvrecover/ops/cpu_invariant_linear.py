"""Batch-invariant linears on the CPU (bf16/fp16 by default, float32 on request): every matmul has one fixed shape.

A oneDNN (or torch) matmul of a fixed shape (rows, in, out) on a fixed thread
count runs one kernel with one reduction order, so a row's result cannot depend
on the other rows. `InvariantCpuOps.linear` therefore cuts its input into tiles
of exactly `TILE_ROWS` rows (the last tile zero-padded) and runs one call per
tile; the weight of one linear stays in cache across its tiles. Decode pads to
one tile, a prefill chunk loops tiles. Accumulation is float32 inside oneDNN's
bf16 kernels; the result is rounded once to the model dtype.

Norms, rotary, SwiGLU and sampling are row-local already (the inherited
`TorchOps` versions; `tests/test_cpu_invariant.py` proves it bit for bit).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvrecover.ops.onednn import _trim_heap
from kvrecover.ops.torch_ops import TorchOps

# Measured on the 2-core AVX-512-bf16 EPYC (bench/NOTES.md, "bf16 on the CPU"): 16
# rows costs decode least; larger tiles only help prefill chunks, which are few.
TILE_ROWS = 16
HALF_DTYPES = (torch.bfloat16, torch.float16)
PACKABLE_DTYPES = (torch.float32, *HALF_DTYPES)


class InvariantCpuOps(TorchOps):
    """`TorchOps` whose linears run in fixed `tile_rows`-row tiles (see the module doc)."""

    def __init__(self, tile_rows: int = TILE_ROWS) -> None:
        if not isinstance(tile_rows, int) or tile_rows < 1:
            raise ValueError(f"tile_rows must be an integer >= 1, got {tile_rows!r}")
        self.tile_rows = tile_rows

    def prepare_weights(self, model: nn.Module) -> None:
        """Called once after loading: pack the linear weights for oneDNN at the tile's
        row count (a tied embedding keeps its dense copy for lookups)."""
        if not torch.backends.mkldnn.is_available():
            return
        for module in model.modules():
            if isinstance(module, nn.Linear):
                _pack_linear(module, self.tile_rows)

    def linear(self, x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
        """`x @ layer.weight.T + layer.bias`, one fixed-shape call per row tile."""
        tile = self.tile_rows
        rows = x.shape[0]
        if rows == tile:
            return _matmul(x, layer)
        x = x.contiguous()
        out = x.new_empty(rows, layer.out_features)
        full = rows - rows % tile
        for start in range(0, full, tile):
            out[start : start + tile] = _matmul(x[start : start + tile], layer)
        if full < rows:
            padded = x.new_zeros(tile, x.shape[1])
            padded[: rows - full] = x[full:]
            out[full:] = _matmul(padded, layer)[: rows - full]
        return out


def _matmul(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    weight = layer.weight
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, layer.bias, "none", [], "")
    return F.linear(x, weight, layer.bias)


def _pack_linear(layer: nn.Linear, tile_rows: int) -> bool:
    """Pack one CPU weight in place for oneDNN; False (untouched) where it cannot."""
    weight = layer.weight
    if weight.is_mkldnn:
        return True
    if weight.device.type != "cpu" or weight.dtype not in PACKABLE_DTYPES:
        return False
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), tile_rows)
        # A build may pack but not run this dtype (fp16 without AVX-512-FP16): probe once.
        torch.ops.mkldnn._linear_pointwise(
            weight.new_zeros(1, weight.shape[1]), packed, None, "none", [], ""
        )
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    layer.weight = nn.Parameter(packed, requires_grad=False)
    _trim_heap()
    return True
