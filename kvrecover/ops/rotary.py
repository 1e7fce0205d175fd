"""Rotary position embedding applied in plain torch (the reference kernel).

The tables come from the model (`models.rope.RotaryEmbedding`); this module only
rotates. The fused GPU version is `triton_ops.rotary_`.
"""

from __future__ import annotations

import torch


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
