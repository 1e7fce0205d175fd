"""Batch-invariant linears on the CPU (bf16/fp16 by default, float32 on request).

A oneDNN (or torch) matmul of a fixed shape (rows, in, out) on a fixed thread
count runs one kernel with one reduction order, so a row's result cannot depend
on the other rows. `InvariantCpuOps.linear` therefore runs only fixed shapes:
tiles of exactly `tile_rows` rows (the last one zero-padded), and, for long
prefill chunks, tiles of `large_tile_rows` rows where `prepare_weights` has
proven, per weight shape and at start-up, that a row's bits in a large tile
equal its bits in a small one (else large tiles are off). Decode pads to one
small tile; a prefill chunk runs large tiles, then small ones. The weight of
one linear stays in cache across its tiles. Accumulation is float32 inside
oneDNN's bf16 kernels; the result is rounded once to the model dtype.

Norms, rotary, SwiGLU and sampling are row-local already (the inherited
`TorchOps` versions; `tests/test_cpu_invariant.py` proves it bit for bit).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvrecover.ops.onednn import _trim_heap
from kvrecover.ops.torch_ops import TorchOps

# Measured on the 2-core AVX-512-bf16 EPYC (bench/NOTES.md, "bf16 on the CPU"):
# decode pays for every padded row of a small tile; a prefill chunk in small
# tiles pays a parallel region per tile, which a busy machine makes expensive.
TILE_ROWS = 16
LARGE_TILE_ROWS = 256
HALF_DTYPES = (torch.bfloat16, torch.float16)
PACKABLE_DTYPES = (torch.float32, *HALF_DTYPES)


class InvariantCpuOps(TorchOps):
    """`TorchOps` whose linears run only fixed-shape row tiles (see the module doc)."""

    def __init__(self, tile_rows: int = TILE_ROWS, large_tile_rows: int = LARGE_TILE_ROWS) -> None:
        for field, value in (("tile_rows", tile_rows), ("large_tile_rows", large_tile_rows)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{field} must be an integer >= 1, got {value!r}")
        if large_tile_rows % tile_rows:
            raise ValueError(f"large_tile_rows must be a multiple of tile_rows ({tile_rows}), "
                             f"got {large_tile_rows!r}")
        self.tile_rows = tile_rows
        # None until prepare_weights proves large tiles agree with small ones.
        self.large_tile_rows: int | None = None
        self._wanted_large_tile_rows = large_tile_rows

    def prepare_weights(self, model: nn.Module) -> None:
        """Called once after loading: pack the linear weights for oneDNN (a tied
        embedding keeps its dense copy for lookups), then enable large tiles if
        every weight shape gives a row the same bits in a large and a small tile."""
        linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
        dtypes = [layer.weight.dtype for layer in linears]  # before packing hides them
        if torch.backends.mkldnn.is_available():
            for layer in linears:
                _pack_linear(layer, self.tile_rows)
        self.large_tile_rows = self._wanted_large_tile_rows
        checked = set()
        for layer, dtype in zip(linears, dtypes):
            shape = (layer.in_features, layer.out_features, layer.bias is not None, dtype)
            if shape not in checked:
                checked.add(shape)
                if not self._large_tiles_agree(layer, dtype):
                    self.large_tile_rows = None
                    return

    def _large_tiles_agree(self, layer: nn.Linear, dtype: torch.dtype) -> bool:
        large, tile = self._wanted_large_tile_rows, self.tile_rows
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(large, layer.in_features, generator=generator).to(dtype)
        small = torch.cat([_matmul(x[s : s + tile], layer) for s in range(0, large, tile)])
        return torch.equal(_matmul(x, layer), small)

    def linear(self, x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
        """`x @ layer.weight.T + layer.bias`, one fixed-shape call per row tile."""
        tile = self.tile_rows
        rows = x.shape[0]
        if rows == tile:
            return _matmul(x, layer)
        x = x.contiguous()
        out = x.new_empty(rows, layer.out_features)
        done = 0
        large = self.large_tile_rows
        if large is not None:
            done = rows - rows % large
            for start in range(0, done, large):
                out[start : start + large] = _matmul(x[start : start + large], layer)
        full = rows - rows % tile
        for start in range(done, full, tile):
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
