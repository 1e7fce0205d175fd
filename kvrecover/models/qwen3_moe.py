"""Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3 attention (q/k norms) and sparse-MoE layers.

Layer `i` is sparse unless it is in `mlp_only_layers` or `(i + 1) % decoder_sparse_step`
is non-zero; a dense layer keeps the SwiGLU MLP of `intermediate_size`. A sparse
layer routes each token to `num_experts_per_tok` of `num_experts` experts of
`moe_intermediate_size`, renormalised when `norm_topk_prob`, the weights rounded to
the model dtype (as Hugging Face does). Checkpoints name the experts
`mlp.experts.E.gate_proj/up_proj/down_proj` or hold them fused under `mlp.experts`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from kvrecover.models.config import FieldReader, ModelConfig
from kvrecover.models.layers import Attention, CausalLM, DecoderLayer, GatedMLP
from kvrecover.models.moe import SparseMoeBlock, check_expert_split, expert_renames, routing_fields
from kvrecover.models.qwen3 import Qwen3Config
from kvrecover.ops.interface import BackendFeatures

if TYPE_CHECKING:
    from kvrecover.ops.interface import ModelOps


@dataclass
class Qwen3MoeConfig(Qwen3Config):
    """Qwen3-MoE's config: Qwen3's fields plus the experts and which layers have them."""

    num_experts: int = 1
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 1
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], model_dir: Path) -> dict[str, Any]:
        count_field = "num_experts" if "num_experts" in raw else "num_local_experts"
        common = super().hf_fields(raw, model_dir)
        fields = FieldReader.of(raw, model_dir)
        num_experts, top_k = routing_fields(fields, count_field)
        return {**common, "num_experts": num_experts, "num_experts_per_tok": top_k,
                "moe_intermediate_size": fields.positive_int("moe_intermediate_size"),
                "norm_topk_prob": fields.flag("norm_topk_prob", False),
                "decoder_sparse_step": fields.positive_int("decoder_sparse_step", 1),
                "mlp_only_layers": fields.index_list("mlp_only_layers",
                                                     common["num_hidden_layers"])}

    def is_sparse(self, layer_index: int) -> bool:
        """Whether layer `layer_index` has experts (Hugging Face's rule)."""
        return (layer_index not in self.mlp_only_layers
                and (layer_index + 1) % self.decoder_sparse_step == 0)


class Qwen3MoeForCausalLM(CausalLM[Qwen3MoeConfig]):
    """Qwen3-MoE decoder: Qwen3 attention, sparse-MoE or dense SwiGLU feed-forward."""

    config_class = Qwen3MoeConfig
    checkpoint_renames = expert_renames("mlp", {"gate_proj": "gate", "up_proj": "up",
                                                "down_proj": "down"})
    tensor_parallel = True

    @classmethod
    def check_tensor_parallel(cls, config: ModelConfig, size: int) -> None:
        super().check_tensor_parallel(config, size)
        if isinstance(config, Qwen3MoeConfig):
            check_expert_split(config, size, ("moe_intermediate_size",))

    @classmethod
    def required_features(cls, config: ModelConfig) -> BackendFeatures:
        return replace(super().required_features(config), moe=True)

    def make_layer(self, config: Qwen3MoeConfig, index: int, attention: Any,
                   ops: ModelOps) -> nn.Module:
        self_attn = Attention(config, self.rotary, attention, ops, bias=config.attention_bias,
                              qk_norm=True, tp=self.tp)
        mlp: nn.Module
        if config.is_sparse(index):
            mlp = SparseMoeBlock(config.hidden_size, config.moe_intermediate_size,
                                 config.num_experts, config.num_experts_per_tok, ops,
                                 renormalize=config.norm_topk_prob, round_weights=True,
                                 tp=self.tp)
        else:
            mlp = GatedMLP(config.hidden_size, config.intermediate_size, ops, self.tp)
        return DecoderLayer(config, self_attn, mlp, ops)
