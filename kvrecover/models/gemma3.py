"""Gemma 3, text only (`Gemma3ForCausalLM`, `model_type` gemma3_text).

Gemma 2's layers (`gemma2.py`: (1 + w) norms, four per layer, GeGLU, scaled
embeddings, `query_pre_attn_scalar`, optional soft-caps, off by default here) plus
(1 + w) q/k norms, and two rotary tables: sliding layers rotate by the local base
(`rope_local_base_freq`, default 10 000, no scaling), full-attention layers by the
global one (`rope_theta`, default 1 000 000, with `rope_scaling`, e.g. linear).
Transformers 5 writes both as `rope_parameters: {"sliding_attention": {...},
"full_attention": {...}}`; both forms are read. Which layers slide: `layer_types`,
else as Hugging Face computes it from `sliding_window_pattern` (default 6: every
sixth layer is full).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from kvrecover.models.config import FieldReader, checked_rope_scaling
from kvrecover.models.gemma2 import Gemma2Config, Gemma2ForCausalLM, gemma_fields
from kvrecover.models.layers import Attention
from kvrecover.models.rope import RotaryEmbedding, rope_type_of

if TYPE_CHECKING:
    from kvrecover.ops.interface import ModelOps

GLOBAL_ROPE_THETA, LOCAL_ROPE_THETA = 1_000_000.0, 10_000.0  # HF Gemma3TextConfig defaults


def _rope_fields(fields: FieldReader) -> dict[str, Any]:
    """Global and local rope bases and scalings, from either config.json form, checked."""
    nested = fields.nested("rope_parameters")
    if nested is not None and ("full_attention" in nested.raw
                               or "sliding_attention" in nested.raw):
        full, local = (nested.nested(kind) or FieldReader({}, fields.source, f"{kind}.")
                       for kind in ("full_attention", "sliding_attention"))
        full_theta = full.positive_number("rope_theta", GLOBAL_ROPE_THETA)
        local_theta = local.positive_number("rope_theta", LOCAL_ROPE_THETA)
    else:
        scaling = fields.nested("rope_scaling")
        full = FieldReader({**(scaling.raw if scaling else {}),
                            "rope_theta": fields.raw.get("rope_theta")}, fields.source,
                           "rope_scaling.")
        local = FieldReader({}, fields.source)
        full_theta = fields.positive_number("rope_theta", GLOBAL_ROPE_THETA)
        local_theta = fields.positive_number("rope_local_base_freq", LOCAL_ROPE_THETA)
    max_positions = fields.positive_int("max_position_embeddings", 4096)

    def scaling_of(params: FieldReader) -> dict[str, Any] | None:
        if rope_type_of(params.raw) == "default":
            return None
        return checked_rope_scaling(params, max_positions)

    return {"rope_theta": full_theta, "rope_scaling": scaling_of(full),
            "local_rope_theta": local_theta, "local_rope_scaling": scaling_of(local)}


@dataclass
class Gemma3Config(Gemma2Config):
    """Gemma 3's config: Gemma 2's fields, soft-caps off by default, the local rope."""

    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    local_rope_theta: float = LOCAL_ROPE_THETA
    local_rope_scaling: dict[str, Any] | None = None

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], model_dir: Path) -> dict[str, Any]:
        fields = FieldReader.of(raw, model_dir)
        pattern = fields.positive_int("sliding_window_pattern", 6)
        return {**super(Gemma2Config, cls).hf_fields(raw, model_dir),
                **gemma_fields(raw, model_dir, pattern, soft_caps=(None, None)),
                **_rope_fields(fields)}


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 text decoder: Gemma 2's, with q/k norms and a local rotary table for the
    sliding layers (see the module docstring)."""

    config_class = Gemma3Config
    local_rotary: RotaryEmbedding

    def add_rotary_tables(self, config: Gemma3Config, max_positions: int) -> None:
        self.local_rotary = RotaryEmbedding(config.head_dim, max_positions,
                                            config.local_rope_theta, config.local_rope_scaling)

    def rotary_tables(self) -> list[RotaryEmbedding]:
        return [self.rotary, self.local_rotary]

    def make_layer(self, config: Gemma2Config, index: int, attention: Any,
                   ops: ModelOps) -> nn.Module:
        window = config.layer_windows()[index]
        sliding = config.layer_types[index] == "sliding_attention"
        self_attn = Attention(config, self.local_rotary if sliding else self.rotary, attention,
                              ops, qk_norm=True, norm_plus_one=True, window=window,
                              scale=config.query_pre_attn_scalar**-0.5,
                              softcap=config.attn_logit_softcapping)
        return self.gemma_layer(config, self_attn, ops)
