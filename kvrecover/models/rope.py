"""Rotary position embedding tables, with Llama 3's, linear and YaRN frequency scaling.

YaRN (gpt-oss) is computed as Hugging Face's `_compute_yarn_parameters`: inverse
frequencies blended between interpolated (`/ factor`) and extrapolated ones by a
linear ramp over the correction range of `beta_fast` / `beta_slow` rotations in
`original_max_position_embeddings` (floored/ceiled unless `truncate` is false), and
cos/sin multiplied by the attention factor (`attention_factor`, else from `mscale`
/ `mscale_all_dim`, else `0.1 ln(factor) + 1`).

The model owns the tables; the kernels that rotate by them live in `kvrecover.ops`
(`ops.reference.rotary`, `ops.triton.fused_ops.rotary_`), which see the
tables through `ops.interface.RotaryTables`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_type_of(scaling: dict[str, Any] | None) -> str:
    """The rope type a `rope_scaling` / `rope_parameters` dict names ("default" if none)."""
    scaling = scaling or {}
    return scaling.get("rope_type", scaling.get("type")) or "default"


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(scaling: dict[str, Any]) -> float:
    """The factor YaRN multiplies cos and sin by (Hugging Face's `attention_factor`)."""
    factor = scaling["factor"]
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
    return _yarn_mscale(factor)


def _yarn_inverse_frequencies(head_dim: int, theta: float,
                              scaling: dict[str, Any]) -> torch.Tensor:
    factor = scaling["factor"]
    original = scaling["original_max_position_embeddings"]
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as Hugging Face: no zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_factor = 1 - ramp
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).to(dtype=torch.float) / head_dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    return (interpolated * (1 - extrapolation_factor)
            + extrapolated * extrapolation_factor)


def check_rope_scaling(scaling: dict[str, Any] | None, source: str) -> None:
    """A ValueError naming `source` for a rope type kvrecover does not compute, or a
    scaling that lacks a field its type needs."""
    rope_type = rope_type_of(scaling)
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"{source}: unsupported rope_scaling type {rope_type!r} (supported: "
                         f"{', '.join(ROPE_TYPES[1:])})")
    needed = {"linear": ("factor",), "yarn": ("factor", "original_max_position_embeddings"),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                         "original_max_position_embeddings")}.get(rope_type, ())
    lacking = [name for name in needed if (scaling or {}).get(name) is None]
    if lacking:
        raise ValueError(f"{source}: {rope_type} rope scaling needs {', '.join(lacking)}")
    if rope_type != "default" and (scaling or {}).get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"{source}: partial_rotary_factor is not supported")


def _inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    scaling = scaling or {}
    rope_type = rope_type_of(scaling)
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "yarn":
        return _yarn_inverse_frequencies(head_dim, theta, scaling)
    if rope_type != "llama3":
        raise ValueError(f"unsupported rope_scaling type {rope_type!r} (supported: "
                         f"{', '.join(ROPE_TYPES[1:])})")
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """RoPE cos/sin tables by position (rotate-half layout, as in Hugging Face Llama), times
    YaRN's attention factor where `scaling` is YaRN."""

    cos_cache: torch.Tensor  # buffers, registered in __init__
    sin_cache: torch.Tensor
    cos_sin_cache: torch.Tensor

    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None
    ) -> None:
        super().__init__()
        inv_freq = _inverse_frequencies(head_dim, theta, scaling)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if rope_type_of(scaling) == "yarn" and scaling is not None:
            attention_factor = yarn_attention_factor(scaling)
            cos, sin = cos * attention_factor, sin * attention_factor
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)
        # [cos | sin with rotate_half's sign folded in]: one lookup per call (`apply_rotary`).
        half = head_dim // 2
        signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        self.register_buffer("cos_sin_cache", torch.cat((cos, signed_sin), dim=-1), persistent=False)
