"""Batch-invariant linears on the CPU: fixed-shape row tiles through oneDNN.

A oneDNN (or torch) matmul of a fixed shape (rows, in, out) on a fixed thread
count runs one kernel with one reduction order, so a row's result cannot depend
on the other rows. `TiledLinears.linear` therefore runs only fixed shapes:
tiles of exactly `tile_rows` rows; for long prefill chunks, tiles of
`large_tile_rows` rows; proven `MEDIUM_TILE_CANDIDATES` (multiples of `tile_rows`)
where they fit exactly; and, for a decode batch or a chunk's last rows, the
smallest proven tile of `SMALL_TILE_CANDIDATES` (below `tile_rows`), or one of
`2 * tile_rows` for a batch just above `tile_rows`, zero-padded.
`prepare_weights` proves, per weight shape and at start-up, that a row's bits in
every large, medium or small tile equal its bits in a `tile_rows` tile; a tile
size that fails for any shape is never used. The weight of one linear stays in cache
across its tiles. Accumulation is float32 inside oneDNN's bf16 kernels; the
result is rounded once to the model dtype. The rest of the CPU-invariant op set
is `ops.cpu.invariant_ops.InvariantCpuOps`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvrecover.ops.cpu.onednn import _trim_heap

# Measured on the 2-core AVX-512-bf16 EPYC (bench/NOTES.md, "bf16 on the CPU"):
# decode pays for every padded row of a small tile; a prefill chunk in small
# tiles pays a parallel region per tile, which a busy machine makes expensive.
TILE_ROWS = 16
LARGE_TILE_ROWS = 256
# Tiles below TILE_ROWS for decode and chunk tails: a weight-bound matmul costs
# about the same for 1-5 rows, so a batch of 1 in a 16-row tile paid ~2x per linear.
# Never 1 row: oneDNN runs a one-row product as a matrix-vector kernel that rounds
# differently from the tile kernels for a few percent of rows, data-dependently, so
# a sampled proof can pass it by chance (it did, in about a quarter of test runs).
SMALL_TILE_CANDIDATES = (2, 4, 8, 12)
# Tiles between TILE_ROWS and LARGE_TILE_ROWS: a decode batch of 17-32 requests ran two
# 16-row tiles, reading every weight twice (bf16, 30 layers of SmolLM2-135M streamed
# from memory at 32 rows: 28.2 ms in two tiles, 24.4 ms in one).
MEDIUM_TILE_CANDIDATES = (32, 64, 128)
PACKABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class TiledLinears:
    """Linears that run only fixed-shape row tiles (see the module doc)."""

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
        # The tile sizes in use, ascending, tile_rows last (smaller ones once proven).
        self.small_tiles: tuple[int, ...] = (tile_rows,)
        # Proven multiples of tile_rows below the large tile, ascending.
        self.medium_tiles: tuple[int, ...] = ()
        # _pad_to[n]: the tile that runs n < tile_rows leftover rows.
        self._pad_to = [tile_rows] * tile_rows

    def prepare_weights(self, model: nn.Module) -> None:
        """Called once after loading: pack the linear weights for oneDNN (a tied
        embedding keeps its dense copy for lookups), then enable the large tile
        and each small and medium tile that gives a row, for every weight shape,
        the same bits as a `tile_rows` tile."""
        linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
        dtypes = [layer.weight.dtype for layer in linears]  # before packing hides them
        if torch.backends.mkldnn.is_available():
            for layer in linears:
                _pack_linear(layer, self.tile_rows)
        large: int | None = self._wanted_large_tile_rows
        smalls = [t for t in SMALL_TILE_CANDIDATES if t < self.tile_rows]
        mediums = [t for t in MEDIUM_TILE_CANDIDATES
                   if t > self.tile_rows and t % self.tile_rows == 0 and t < self._wanted_large_tile_rows]
        sizes = smalls + mediums
        checked = set()
        for layer, dtype in zip(linears, dtypes):
            shape = (layer.in_features, layer.out_features, layer.bias is not None, dtype)
            if shape not in checked:
                checked.add(shape)
                large, sizes = self._proven_tiles(layer, dtype, large, sizes)
        self.large_tile_rows = large
        self.small_tiles = (*(t for t in sizes if t < self.tile_rows), self.tile_rows)
        self.medium_tiles = tuple(t for t in sizes if t > self.tile_rows)
        self._pad_to = [next(t for t in self.small_tiles if t >= n) for n in range(self.tile_rows)]

    def _proven_tiles(
        self, layer: nn.Linear, dtype: torch.dtype, large: int | None, sizes: list[int]
    ) -> tuple[int | None, list[int]]:
        """The large tile (or None) and those of the other tile `sizes` that give every
        row of a random input the same bits as `tile_rows` tiles do, for this weight."""
        tile, rows = self.tile_rows, self._wanted_large_tile_rows
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(rows, layer.in_features, generator=generator).to(dtype)
        reference = torch.cat([_matmul(x[s : s + tile], layer) for s in range(0, rows, tile)])
        if large is not None and not torch.equal(_matmul(x, layer), reference):
            large = None
        proven = []
        for size in sizes:
            starts = range(0, rows - size + 1, size)  # every row of the input
            if all(torch.equal(_matmul(x[s : s + size], layer), reference[s : s + size])
                   for s in starts):
                proven.append(size)
        return large, proven

    def linear(self, x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
        """`x @ layer.weight.T + layer.bias`, one fixed-shape call per row tile."""
        tile = self.tile_rows
        rows = x.shape[0]
        double = 2 * tile
        if rows <= tile or (rows <= double and double in self.medium_tiles):
            # A decode batch: one tile, the smallest that holds it. (Padding to a larger
            # medium tile would cost more than it saves: those rows are compute-bound.)
            size = double if rows > tile else tile if rows == tile else self._pad_to[rows]
            if size == rows:
                return _matmul(x, layer)
            padded = x.new_zeros(size, x.shape[1])
            padded[:rows] = x
            return _matmul(padded, layer)[:rows]
        x = x.contiguous()
        out = x.new_empty(rows, layer.out_features)
        done = 0
        large = self.large_tile_rows
        if large is not None:
            done = rows - rows % large
            for start in range(0, done, large):
                out[start : start + large] = _matmul(x[start : start + large], layer)
        full = rows - rows % tile
        for size in (*reversed(self.medium_tiles), tile):
            while full - done >= size:
                out[done : done + size] = _matmul(x[done : done + size], layer)
                done += size
        if full < rows:
            left = rows - full
            size = self._pad_to[left]
            if size == left:
                out[full:] = _matmul(x[full:], layer)
            else:
                padded = x.new_zeros(size, x.shape[1])
                padded[:left] = x[full:]
                out[full:] = _matmul(padded, layer)[:left]
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
