"""Qwen3-Next and Qwen3.5 (text): linear-attention hybrids (`Qwen3NextForCausalLM`,
`Qwen3_5ForCausalLM`, `Qwen3_5MoeForCausalLM`).

Layer i is a Gated DeltaNet layer (`gated_deltanet.py`: a recurrent state, no KV
cache) or a gated full-attention layer (`gated_attention.py`), as config.json's
`layer_types` says (else Hugging Face's rule: every `full_attention_interval`-th
layer, default 4, is full). Every norm is zero-centred (times `1 + w`). The
feed-forward: Qwen3-Next's sparse layers (Qwen3-MoE's rule: `decoder_sparse_step`,
`mlp_only_layers`, experts present) are a mixture of experts plus a shared expert
gated by `sigmoid(shared_expert_gate(x))`; Qwen3.5's dense model has a SwiGLU MLP
in every layer, its MoE model experts plus the shared expert in every layer
(always renormalised top-k). Qwen3.5's linear layers project q/k/v, z, b and a
separately; Qwen3-Next's fuse them grouped by key head.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from kvrecover.models.config import FieldReader, ModelConfig
from kvrecover.models.gated_attention import GatedAttention, row_sigmoid
from kvrecover.models.gated_deltanet import GatedDeltaNet
from kvrecover.models.layers import CausalLM, DecoderLayer, GatedMLP
from kvrecover.models.loader import CheckpointRename
from kvrecover.models.moe import (
    SparseMoeBlock,
    check_expert_split,
    expert_renames,
    routing_fields,
)
from kvrecover.models.parallel_layers import SINGLE_RANK, TensorParallelGroup
from kvrecover.models.recurrent_state import StateSpec
from kvrecover.models.rope import RotaryEmbedding
from kvrecover.ops.interface import BackendFeatures

if TYPE_CHECKING:
    from kvrecover.ops.interface import ModelOps

LINEAR_ATTENTION, FULL_ATTENTION = "linear_attention", "full_attention"
HYBRID_LAYER_TYPES = (LINEAR_ATTENTION, FULL_ATTENTION)
LINEAR_FIELDS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                 "linear_value_head_dim", "linear_conv_kernel_dim")


def hybrid_layer_types(fields: FieldReader) -> list[str]:
    """config.json's `layer_types` (or Hugging Face's default from
    `full_attention_interval`), checked: one known type per layer, one full layer at least."""
    count = fields.positive_int("num_hidden_layers")
    interval = fields.positive_int("full_attention_interval", 4)
    default = [LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION for i in range(count)]
    value = fields.kinds_list("layer_types", count, default, HYBRID_LAYER_TYPES)
    if FULL_ATTENTION not in value:
        raise ValueError(f"{fields.source}: layer_types has no full_attention layer; kvrecover "
                         "needs at least one (its KV cache holds the prefix)")
    return value


@dataclass
class Qwen3NextConfig(ModelConfig):
    """Qwen3-Next's config (and Qwen3.5's, which drops some of its MoE fields)."""

    layer_types: list[str] = field(default_factory=list)
    linear_num_key_heads: int = 1
    linear_num_value_heads: int = 1
    linear_key_head_dim: int = 1
    linear_value_head_dim: int = 1
    linear_conv_kernel_dim: int = 4
    partial_rotary_factor: float = 0.25
    attention_bias: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], model_dir: Path) -> dict[str, Any]:
        reader = FieldReader.of(raw, model_dir)
        fields = super().hf_fields(raw, model_dir)
        linear = {name: reader.positive_int(name) for name in LINEAR_FIELDS}
        if linear["linear_num_value_heads"] % linear["linear_num_key_heads"]:
            reader.fail("linear_num_value_heads", "a multiple of linear_num_key_heads "
                        f"({linear['linear_num_key_heads']})")
        fields = {**fields, **linear, "layer_types": hybrid_layer_types(reader),
                  "attention_bias": reader.flag("attention_bias", False)}
        rope = reader.nested("rope_parameters")
        if rope is not None and rope.raw.get("partial_rotary_factor") is not None:
            factor = rope.positive_number("partial_rotary_factor", at_most=1.0)
        else:
            factor = reader.positive_number("partial_rotary_factor", 0.25, at_most=1.0)
        fields["partial_rotary_factor"] = factor
        if int(fields["head_dim"] * factor) % 2:
            raise ValueError(f"{reader.source}: head_dim * partial_rotary_factor must be even")
        reader.choice("hidden_act", "silu", ("silu",))
        return {**fields, **cls.moe_fields(reader)}

    @classmethod
    def moe_fields(cls, fields: FieldReader) -> dict[str, Any]:
        """The experts' fields (Qwen3-Next: experts when `num_experts` > 0)."""
        if fields.raw.get("num_experts") in (0, None):
            return {}
        return {**expert_fields(fields),
                "norm_topk_prob": fields.flag("norm_topk_prob", True),
                "decoder_sparse_step": fields.positive_int("decoder_sparse_step", 1),
                "mlp_only_layers": fields.index_list("mlp_only_layers",
                                                     fields.raw["num_hidden_layers"])}

    def recurrent_layers(self) -> list[int]:
        return [i for i, kind in enumerate(self.layer_types) if kind == LINEAR_ATTENTION]

    def is_sparse(self, index: int) -> bool:
        """Whether layer `index` has experts (Hugging Face's rule)."""
        return (self.num_experts > 0 and index not in self.mlp_only_layers
                and (index + 1) % self.decoder_sparse_step == 0)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)


def expert_fields(fields: FieldReader) -> dict[str, Any]:
    """The routed and shared experts' counts and sizes, checked."""
    num_experts, top_k = routing_fields(fields, "num_experts")
    return {"num_experts": num_experts, "num_experts_per_tok": top_k,
            "moe_intermediate_size": fields.positive_int("moe_intermediate_size"),
            "shared_expert_intermediate_size": fields.positive_int(
                "shared_expert_intermediate_size")}


@dataclass
class Qwen3_5Config(Qwen3NextConfig):
    """Qwen3.5's dense text config: no experts."""

    @classmethod
    def moe_fields(cls, fields: FieldReader) -> dict[str, Any]:
        return {}


@dataclass
class Qwen3_5MoeConfig(Qwen3NextConfig):
    """Qwen3.5-MoE's text config: experts in every layer, top-k always renormalised."""

    @classmethod
    def moe_fields(cls, fields: FieldReader) -> dict[str, Any]:
        return {**expert_fields(fields), "norm_topk_prob": True}


def text_config_of(raw: dict[str, Any]) -> dict[str, Any]:
    """The text model's config of a Qwen3.5 vision-language config.json (`text_config`),
    with the top level's architecture and settings that apply to the whole model."""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"{raw.get('architectures')} config.json has no text_config")
    whole = {key: raw[key] for key in ("architectures", "tie_word_embeddings",
                                        "quantization_config", "torch_dtype", "dtype")
             if key in raw}
    return {**text, **whole}


@dataclass
class Qwen3_5VisionLanguageConfig(Qwen3_5Config):
    """`Qwen3_5ForConditionalGeneration`'s text model (its `text_config`)."""

    @classmethod
    def from_hf_config(cls, raw: dict[str, Any], model_dir: Path) -> ModelConfig:
        return super().from_hf_config(text_config_of(raw), model_dir)


@dataclass
class Qwen3_5MoeVisionLanguageConfig(Qwen3_5MoeConfig):
    """`Qwen3_5MoeForConditionalGeneration`'s text model (its `text_config`)."""

    @classmethod
    def from_hf_config(cls, raw: dict[str, Any], model_dir: Path) -> ModelConfig:
        return super().from_hf_config(text_config_of(raw), model_dir)


class SharedExpertMoeBlock(SparseMoeBlock):
    """Routed experts plus a shared expert weighted by `sigmoid(shared_expert_gate(x))`
    (Hugging Face's `Qwen2MoeSparseMoeBlock`)."""

    def __init__(self, config: Qwen3NextConfig, ops: ModelOps,
                 tp: TensorParallelGroup = SINGLE_RANK) -> None:
        super().__init__(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                         config.num_experts_per_tok, ops, renormalize=config.norm_topk_prob,
                         round_weights=True, tp=tp)
        self.shared_expert = GatedMLP(config.hidden_size, config.shared_expert_intermediate_size,
                                      ops, tp)
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def partial_sum(self, x: torch.Tensor) -> torch.Tensor:
        # The gate is per token, so it weights each rank's partial sum alike: one
        # all-reduce (in `forward`) for the routed and the shared experts together.
        gate = row_sigmoid(self.ops.linear(x, self.shared_expert_gate))
        return super().partial_sum(x) + gate * self.shared_expert.partial_sum(x)


class Qwen3NextForCausalLM(CausalLM[Qwen3NextConfig]):
    """The hybrid decoder (see the module docstring)."""

    config_class: type[Qwen3NextConfig] = Qwen3NextConfig
    norm_plus_one = True
    split_projections: ClassVar[bool] = False  # Qwen3.5 projects q/k/v, z, b, a apart
    partial_rotary: RotaryEmbedding
    # Every mixer is the decoder layer's `self_attn`; Hugging Face names the linear ones
    # `linear_attn`.
    checkpoint_renames = (*expert_renames("mlp", {"gate_proj": "gate", "up_proj": "up",
                                                  "down_proj": "down"}),
                          CheckpointRename(r"(layers\.\d+)\.linear_attn\.(.+)", r"\1.self_attn.\2"))
    packed_modules = {"gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up")}
    checkpoint_ignored: tuple[str, ...] = (r"mtp\..*",)  # the multi-token-prediction head (unused, as in HF)
    tensor_parallel = True

    @classmethod
    def check_tensor_parallel(cls, config: ModelConfig, size: int) -> None:
        """The attention heads and MLP split (`CausalLM`'s check), the linear layers' key
        heads (each rank holds whole key heads and the value heads that read them),
        no o_proj bias, the routed and shared experts' intermediate sizes."""
        super().check_tensor_parallel(config, size)
        if not isinstance(config, Qwen3NextConfig):
            return
        if config.linear_num_key_heads % size:
            raise ValueError(f"tensor_parallel_size {size} does not divide the model's "
                             f"linear_num_key_heads {config.linear_num_key_heads}; choose a "
                             f"divisor of {config.linear_num_key_heads}")
        if config.attention_bias:
            raise ValueError("attention_bias (an o_proj bias) runs on one rank only; use "
                             f"tensor_parallel_size 1 for this model (got {size})")
        if any(config.is_sparse(index) for index in range(config.num_hidden_layers)):
            check_expert_split(config, size, ("moe_intermediate_size",
                                              "shared_expert_intermediate_size"))

    @classmethod
    def required_features(cls, config: ModelConfig) -> BackendFeatures:
        moe = isinstance(config, Qwen3NextConfig) and config.num_experts > 0
        return replace(super().required_features(config), linear_attention=True, moe=moe)

    def add_rotary_tables(self, config: Qwen3NextConfig, max_positions: int) -> None:
        self.partial_rotary = RotaryEmbedding(config.rotary_dim, max_positions, config.rope_theta,
                                              config.rope_scaling)

    def rotary_tables(self) -> list[RotaryEmbedding]:
        return [self.rotary, self.partial_rotary]

    def make_layer(self, config: Qwen3NextConfig, index: int, attention: Any,
                   ops: ModelOps) -> nn.Module:
        mixer: nn.Module
        if config.layer_types[index] == LINEAR_ATTENTION:
            mixer = GatedDeltaNet(config, ops, split_projections=self.split_projections,
                                  tp=self.tp)
        else:
            mixer = GatedAttention(config, self.partial_rotary, config.rotary_dim, attention, ops,
                                   bias=config.attention_bias, tp=self.tp)
        mlp: nn.Module
        if config.is_sparse(index):
            mlp = SharedExpertMoeBlock(config, ops, self.tp)
        else:
            mlp = GatedMLP(config.hidden_size, config.intermediate_size, ops, self.tp)
        return DecoderLayer(config, mixer, mlp, ops, norm_plus_one=True)

    def recurrent_state_specs(self, chunk_size: int) -> dict[int, list[StateSpec]]:
        return {index: layer.self_attn.state_specs(chunk_size)
                for index, layer in enumerate(self.layers)
                if isinstance(layer.self_attn, GatedDeltaNet)}


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5 dense text model: separate linear-attention projections, SwiGLU MLPs."""

    config_class = Qwen3_5Config
    split_projections = True


class Qwen3_5MoeForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5-MoE text model: separate linear-attention projections, experts everywhere."""

    config_class = Qwen3_5MoeConfig
    split_projections = True


class Qwen3_5ForConditionalGeneration(Qwen3_5ForCausalLM):
    """A Qwen3.5 vision-language checkpoint run as text only: its language model (under
    `model.language_model.`); the vision tower and the MTP head are not loaded."""

    config_class = Qwen3_5VisionLanguageConfig
    checkpoint_prefix = "language_model."
    checkpoint_ignored = (r"model\.visual\..*", r"mtp\..*")


class Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeForCausalLM):
    """A Qwen3.5-MoE vision-language checkpoint run as text only (see
    `Qwen3_5ForConditionalGeneration`)."""

    config_class = Qwen3_5MoeVisionLanguageConfig
    checkpoint_prefix = "language_model."
    checkpoint_ignored = (r"model\.visual\..*", r"mtp\..*")
