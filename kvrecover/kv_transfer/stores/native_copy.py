"""Loaded rows into a contiguous CPU KV cache in one C call, off the GIL (`csrc/row_install.c`).

A row is one stored block's payload (layer 0 K, layer 0 V, layer 1 K, ...: its "parts",
`paged_blocks`). Copying it into the cache part by part from Python (`memoryview` slice
assignments) and hashing the parts there (a streaming xxh3, 32 KB an update) holds the
GIL: two reader threads then take turns for about a quarter of a load's time. Here one
ctypes call (which releases the GIL) copies rows into their blocks and compares each
part with its row right after its copy, while both are in the CPU's cache; the row
itself is hashed whole (one xxh3 call over a contiguous buffer, which releases the GIL
too). "The row passed its stored checksum and the cache holds the row's bytes" is the
check that hashing the cache's own bytes made.

The C file is compiled at first use like the CPU kernels (`ops.cpu.native_build`); where
no compiler is found, or `KVRECOVER_NATIVE_KERNELS=0`, `RowInstaller.for_caches`
returns None and `PagedBlocks` keeps its Python copies.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path

import torch

from kvrecover.ops.cpu.native_build import load_library, native_kernels_default

SOURCE_DIR = Path(__file__).parent / "csrc"
COPY, CHECK = 1, 2  # kvr_install_rows' flags

_Int64s = ctypes.POINTER(ctypes.c_int64)
_ZERO = ctypes.c_int64(0)  # row position 0 of a one-row call (read only)


def _library() -> ctypes.CDLL | None:
    """The compiled `row_install.c`, or None (see the module docstring)."""
    if not native_kernels_default():
        return None
    library = load_library("row_install", source_dir=SOURCE_DIR)
    if library is not None:  # (the same types each time: once per connector)
        function = library.kvr_install_rows
        function.argtypes = [ctypes.c_void_p, ctypes.c_int64, _Int64s, _Int64s, ctypes.c_int64,
                             ctypes.POINTER(ctypes.c_void_p), ctypes.c_int32, ctypes.c_int64,
                             ctypes.c_int64, ctypes.c_int64, ctypes.c_int32,
                             ctypes.POINTER(ctypes.c_uint8)]
        function.restype = ctypes.c_int
    return library


class RowInstaller:
    """Copies rows of `row_nbytes` bytes into the blocks of one worker's contiguous CPU
    caches (each [2, num_blocks, ...]) and checks them there. Any thread may call it;
    callers keep the tensors alive (the caches and the rows)."""

    def __init__(self, library: ctypes.CDLL, caches: Sequence[torch.Tensor]) -> None:
        one_part = caches[0][0, 0]
        self._install = library.kvr_install_rows
        self.part_nbytes = one_part.numel() * one_part.element_size()
        self.row_nbytes = 2 * len(caches) * self.part_nbytes
        self.num_blocks = caches[0].shape[1]
        self.v_offset = self.num_blocks * self.part_nbytes
        self._num_layers = len(caches)
        self._layers = (ctypes.c_void_p * len(caches))(*[cache.data_ptr() for cache in caches])

    @classmethod
    def for_caches(cls, caches: Sequence[torch.Tensor]) -> RowInstaller | None:
        """An installer for these caches (contiguous, on the CPU), or None where the C
        file cannot be used."""
        library = _library()
        return None if library is None else cls(library, caches)

    def install_one(self, row: torch.Tensor, block_id: int) -> bool:
        """`install(row, [0], [block_id], check=True)` for one contiguous uint8 row of
        `row_nbytes` bytes (a direct load's bounce row), with less Python per call."""
        if row.numel() != self.row_nbytes:
            raise ValueError(f"a row has {self.row_nbytes} bytes, not {row.numel()}")
        mismatched = ctypes.c_uint8(0)
        status = self._install(
            row.data_ptr(), self.row_nbytes, ctypes.byref(_ZERO), ctypes.byref(
                ctypes.c_int64(block_id)), 1, self._layers, self._num_layers, self.part_nbytes,
            self.v_offset, self.num_blocks, COPY | CHECK, ctypes.byref(mismatched))
        if status != 0:
            raise ValueError(f"block id {block_id} outside the cache's {self.num_blocks} blocks")
        return not mismatched.value

    def install(self, rows: torch.Tensor, positions: Sequence[int], block_ids: Sequence[int],
                check: bool, copy: bool = True) -> list[bool]:
        """Copy row `positions[i]` of `rows` (contiguous uint8 [n, row_nbytes] or one
        row) into cache block `block_ids[i]`; with `check`, whether each block then holds
        its row's bytes (all True without). `copy=False` only compares (tests). Raises
        ValueError, writing nothing, for a block id or position out of range."""
        count = len(block_ids)
        if rows.dtype != torch.uint8 or not rows.is_contiguous() or rows.device.type != "cpu":
            raise ValueError("rows must be a contiguous uint8 CPU tensor")
        if any(not 0 <= position < rows.numel() // self.row_nbytes for position in positions):
            raise ValueError(f"row positions {list(positions)} outside the {rows.numel()} "
                             f"bytes of rows")
        mismatched = (ctypes.c_uint8 * max(1, count))()
        status = self._install(
            rows.data_ptr(), self.row_nbytes, (ctypes.c_int64 * max(1, count))(*positions),
            (ctypes.c_int64 * max(1, count))(*block_ids), count, self._layers,
            self._num_layers, self.part_nbytes, self.v_offset, self.num_blocks,
            (COPY if copy else 0) | (CHECK if check else 0), mismatched)
        if status != 0:
            raise ValueError(f"block ids {list(block_ids)} outside the cache's "
                             f"{self.num_blocks} blocks")
        return [not mismatched[i] for i in range(count)] if check else [True] * count
