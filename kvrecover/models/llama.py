"""The Llama family (Llama 2/3, SmolLM): `LlamaForCausalLM` in config.json.

Built from the shared layers (`layers.py`); Qwen2, Qwen3 and Mistral (`qwen2.py`,
`qwen3.py`, `mistral.py`) are this model with attention biases, per-head q/k
norms or a sliding window.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from kvrecover.models.config import FieldReader, ModelConfig, refuse_sliding_window
from kvrecover.models.layers import Attention, CausalLM, DecoderLayer, GatedMLP

if TYPE_CHECKING:
    from kvrecover.ops.interface import ModelOps


@dataclass
class LlamaConfig(ModelConfig):
    """A Llama-family config: the common fields plus q/k/v biases and q/k norms."""

    attention_bias: bool = False
    qk_norm: bool = False

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], model_dir: Path) -> dict[str, Any]:
        return {**super().hf_fields(raw, model_dir), **cls.window_fields(raw, model_dir),
                "attention_bias": FieldReader.of(raw, model_dir).flag("attention_bias", False)}

    @classmethod
    def window_fields(cls, raw: dict[str, Any], model_dir: Path) -> dict[str, Any]:
        """The sliding-window fields of a family that has them (see `layer_windows`);
        here none: these layers attend over the whole context, and a config asking
        for a window is refused."""
        refuse_sliding_window(raw, model_dir)
        return {}


class LlamaForCausalLM(CausalLM[LlamaConfig]):
    """Llama-family decoder over a paged KV cache: pre-norm layers of GQA attention
    (optionally biased, optionally with q/k norms, optionally windowed) and a SwiGLU MLP."""

    config_class = LlamaConfig
    tensor_parallel = True

    def make_layer(self, config: LlamaConfig, index: int, attention: Any,
                   ops: ModelOps) -> nn.Module:
        self_attn = Attention(config, self.rotary, attention, ops,
                              bias=config.attention_bias, qk_norm=config.qk_norm,
                              window=config.layer_windows()[index], tp=self.tp)
        mlp = GatedMLP(config.hidden_size, config.intermediate_size, ops, self.tp)
        return DecoderLayer(config, self_attn, mlp, ops)
