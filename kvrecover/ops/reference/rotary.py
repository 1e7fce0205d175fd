"""Rotary position embedding applied in plain torch (the reference kernel).

The tables come from the model (any `ops.interface.RotaryTables`); this module
only rotates. The fused GPU version is `ops.triton.fused_ops.rotary_`.
`RotateThenAttend` gives an attention kernel that does not fuse rotary its
`attend` entry point: the backend's rotary op, then the kernel's `forward`
(which receives the layer's sliding window, soft-cap and sinks).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from kvrecover.ops.interface import RotaryKernel, RotaryTables


def apply_rotary(
    cos_sin_cache: torch.Tensor, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate `query` [T, Hq, D] and `key` [T, Hkv, D] by their token positions [T].

    `cos_sin_cache` is [max_positions, 2 * D]: cos, then sin with rotate_half's
    sign folded in, so each call does one table lookup.
    """
    cos, signed_sin = cos_sin_cache[positions].to(query.dtype).unsqueeze(1).chunk(2, dim=-1)
    return _rotate(query, cos, signed_sin), _rotate(key, cos, signed_sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """`x * cos + rotate_half(x) * sin`, bit for bit: rotate_half(x) = [-x2, x1] is
    the roll [x2, x1] times the sign folded into `signed_sin`."""
    rotated = x.roll(x.shape[-1] // 2, dims=-1).mul_(signed_sin)
    return (x * cos).add_(rotated)


def reference_rotary(
    tables: RotaryTables, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`apply_rotary` with the tables' folded cache (an `ops.interface.RotaryKernel`)."""
    return apply_rotary(tables.cos_sin_cache, positions, query, key)


class RotateThenAttend(ABC):
    """`PagedAttention.attend` for a kernel whose `forward(q, k, v, kv_cache, meta,
    scale)` attends to keys already rotated: `rotate` (the backend's rotary op, the
    reference by default) runs first."""

    def __init__(self, rotate: RotaryKernel = reference_rotary) -> None:
        self.rotate = rotate

    def attend(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        rotary: RotaryTables | None, positions: torch.Tensor, kv_cache: torch.Tensor,
        meta: Any, scale: float, *, window: int | None = None, softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Rotate q and k with `self.rotate` (unless `rotary` is None), then `forward`."""
        if rotary is not None:
            query, key = self.rotate(rotary, positions, query, key)
        return self.forward(query, key, value, kv_cache, meta, scale, window, softcap, sinks)

    @abstractmethod
    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        kv_cache: torch.Tensor, meta: Any, scale: float, window: int | None = None,
        softcap: float | None = None, sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write this step's K/V into the cache, then attend (over the last `window`
        positions only, unless None; scores soft-capped at `softcap`, unless None; each
        head's softmax with its `sinks` logit, unless None: `PagedAttention.attend`);
        returns [T, Hq, D]."""
