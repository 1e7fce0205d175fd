"""Mixtral (`MixtralForCausalLM`): Mistral attention and a sparse mixture of SwiGLU experts.

Every layer's feed-forward is a `moe.SparseMoeBlock`: `num_local_experts` experts of
`intermediate_size`, `num_experts_per_tok` of them per token with renormalised
float32 weights. Every layer attends over `sliding_window` tokens where config.json
sets it (null, the usual value and Hugging Face's default: the whole context). Checkpoints name the experts `block_sparse_moe.experts.E.w1/w2/w3`
(gate, down, up) or, as `transformers` holds them, fused under `mlp.experts`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from kvrecover.models.config import FieldReader, ModelConfig
from kvrecover.models.layers import Attention, CausalLM, DecoderLayer
from kvrecover.models.llama import LlamaConfig
from kvrecover.models.moe import SparseMoeBlock, expert_renames, routing_fields
from kvrecover.ops.interface import BackendFeatures

if TYPE_CHECKING:
    from kvrecover.ops.interface import ModelOps


@dataclass
class MixtralConfig(LlamaConfig):
    """Mixtral's config: the Llama fields plus the expert count, top-k and one window
    shared by every layer."""

    num_experts: int = 1
    num_experts_per_tok: int = 1
    sliding_window: int | None = None

    @classmethod
    def window_fields(cls, raw: dict[str, Any], model_dir: Path) -> dict[str, Any]:
        # Mixtral's attention slides whenever `sliding_window` is set (no separate switch).
        return {"sliding_window": FieldReader.of(raw, model_dir).positive_int(
            "sliding_window", None, nullable=True)}

    def layer_windows(self) -> list[int | None]:
        return [self.sliding_window] * self.num_hidden_layers

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], model_dir: Path) -> dict[str, Any]:
        num_experts, top_k = routing_fields(FieldReader.of(raw, model_dir), "num_local_experts")
        return {**super().hf_fields(raw, model_dir), "num_experts": num_experts,
                "num_experts_per_tok": top_k}


class MixtralForCausalLM(CausalLM[MixtralConfig]):
    """Mixtral decoder: GQA attention (windowed or not) and a sparse-MoE feed-forward in
    every layer."""

    config_class = MixtralConfig
    checkpoint_renames = expert_renames("block_sparse_moe", {"w1": "gate", "w3": "up",
                                                             "w2": "down"})
    tensor_parallel = True  # the experts' intermediate_size splits (CausalLM's check)

    @classmethod
    def required_features(cls, config: ModelConfig) -> BackendFeatures:
        return replace(super().required_features(config), moe=True)

    def make_layer(self, config: MixtralConfig, index: int, attention: Any,
                   ops: ModelOps) -> nn.Module:
        self_attn = Attention(config, self.rotary, attention, ops, bias=config.attention_bias,
                              window=config.layer_windows()[index], tp=self.tp)
        mlp = SparseMoeBlock(config.hidden_size, config.intermediate_size, config.num_experts,
                             config.num_experts_per_tok, ops, renormalize=True,
                             round_weights=False, tp=self.tp)
        return DecoderLayer(config, self_attn, mlp, ops)
