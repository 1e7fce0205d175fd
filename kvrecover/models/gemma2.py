"""Gemma 2 (`Gemma2ForCausalLM`): alternating sliding-window and full-attention layers.

Built from the shared layers with Gemma's options: every norm is `(1 + w)` RMSNorm
in float32, each layer norms its attention and MLP outputs as well (four norms),
the MLP is GeGLU (`hidden_activation`), attention scores are scaled by
`query_pre_attn_scalar ** -0.5` and soft-capped at `attn_logit_softcapping`, the
embeddings are multiplied by sqrt(hidden_size) (rounded to the model's dtype) and
the final logits soft-capped at `final_logit_softcapping`. `layer_types` says which
layers are windowed; without it, as in Hugging Face, the even layers (0, 2, ...)
are. Defaults for absent fields are Hugging Face's `Gemma2Config`'s.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from kvrecover.models.config import LAYER_TYPES, FieldReader, ModelConfig
from kvrecover.models.layers import GATED_ACTIVATIONS, Attention, CausalLM, DecoderLayer, GatedMLP
from kvrecover.ops.interface import BackendFeatures

if TYPE_CHECKING:
    from kvrecover.ops.backend import KernelBackend
    from kvrecover.ops.interface import ModelOps


def refuse_unsupported_gemma_fields(raw: dict[str, Any], model_dir: Path) -> None:
    """Settings of the Gemma configs these layers do not implement: a ValueError each."""
    fields = FieldReader.of(raw, model_dir)
    if fields.flag("attention_bias", False):
        raise ValueError(f"{fields.source}: attention_bias is not supported for Gemma models")
    if fields.flag("use_bidirectional_attention", False):
        raise ValueError(f"{fields.source}: use_bidirectional_attention is not supported")


def gemma_fields(raw: dict[str, Any], model_dir: Path, pattern: int,
                 soft_caps: tuple[float | None, float | None]) -> dict[str, Any]:
    """The fields Gemma 2 and Gemma 3 share (with Hugging Face's defaults): layer types
    default to every `pattern`-th layer full, the others sliding; `soft_caps` are the
    default attention and final soft-caps."""
    refuse_unsupported_gemma_fields(raw, model_dir)
    fields = FieldReader.of(raw, model_dir)
    layers = fields.positive_int("num_hidden_layers")
    pattern_types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                     for i in range(layers)]
    return {
        "hidden_activation": fields.choice("hidden_activation", "gelu_pytorch_tanh",
                                           GATED_ACTIVATIONS),
        "query_pre_attn_scalar": fields.positive_number("query_pre_attn_scalar", 256.0),
        "sliding_window": fields.positive_int("sliding_window", 4096, nullable=True),
        "layer_types": fields.kinds_list("layer_types", layers, pattern_types, LAYER_TYPES),
        "attn_logit_softcapping": fields.positive_number("attn_logit_softcapping",
                                                         soft_caps[0], nullable=True),
        "final_logit_softcapping": fields.positive_number("final_logit_softcapping",
                                                          soft_caps[1], nullable=True),
    }


@dataclass
class Gemma2Config(ModelConfig):
    """Gemma 2's config: the common fields plus the Gemma scalings and layer types."""

    hidden_activation: str = "gelu_pytorch_tanh"
    query_pre_attn_scalar: float = 256.0
    sliding_window: int | None = 4096
    layer_types: list[str] = field(default_factory=list)
    attn_logit_softcapping: float | None = 50.0
    final_logit_softcapping: float | None = 30.0
    default_head_dim: ClassVar[int | None] = 256
    default_tied_embeddings: ClassVar[bool] = True

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], model_dir: Path) -> dict[str, Any]:
        return {**super().hf_fields(raw, model_dir),
                **gemma_fields(raw, model_dir, 2, soft_caps=(50.0, 30.0))}

    def layer_windows(self) -> list[int | None]:
        return [self.sliding_window if kind == "sliding_attention" else None
                for kind in self.layer_types]


class GemmaCausalLM(CausalLM[Any]):
    """What Gemma 2 and 3 share: (1 + w) norms, the sqrt(hidden_size) embedding scale."""

    norm_plus_one = True
    embed_scale: torch.Tensor  # a buffer: cast with the model, as HF casts it

    def __init__(self, config: Any, backend: KernelBackend, max_positions: int) -> None:
        super().__init__(config, backend, max_positions)
        self.register_buffer("embed_scale", torch.tensor(config.hidden_size**0.5),
                             persistent=False)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed(input_ids) * self.embed_scale

    def gemma_layer(self, config: Any, self_attn: Attention, ops: ModelOps) -> nn.Module:
        """A Gemma decoder layer around `self_attn`: GeGLU MLP, four (1 + w) norms."""
        mlp = GatedMLP(config.hidden_size, config.intermediate_size, ops,
                       activation=config.hidden_activation)
        return DecoderLayer(config, self_attn, mlp, ops, sandwich_norms=True,
                            norm_plus_one=True)


class Gemma2ForCausalLM(GemmaCausalLM):
    """Gemma 2 decoder over a paged KV cache (see the module docstring)."""

    config_class = Gemma2Config

    @classmethod
    def required_features(cls, config: ModelConfig) -> BackendFeatures:
        needed = super().required_features(config)
        capped = isinstance(config, Gemma2Config) and config.attn_logit_softcapping is not None
        return dataclasses.replace(needed, logit_softcap=capped)

    def make_layer(self, config: Gemma2Config, index: int, attention: Any,
                   ops: ModelOps) -> nn.Module:
        self_attn = Attention(config, self.rotary, attention, ops,
                              window=config.layer_windows()[index],
                              scale=config.query_pre_attn_scalar**-0.5,
                              softcap=config.attn_logit_softcapping)
        return self.gemma_layer(config, self_attn, ops)

    @property
    def final_logit_softcap(self) -> float | None:
        return self.config.final_logit_softcapping
