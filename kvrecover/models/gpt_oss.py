"""gpt-oss (`GptOssForCausalLM`): biased GQA attention with sinks, alternating windows, MoE.

Attention: q/k/v/o projections with biases (`attention_bias`, default on), one
learned sink logit per head in the softmax, YaRN rotary (`rope_scaling` /
`rope_parameters`, Hugging Face's default: factor 32 over 4096 positions, theta
150 000), and `layer_types` saying which layers slide over `sliding_window`
tokens (default: the even layers, 128 tokens). Feed-forward in every layer: a
router with a bias picks the `num_experts_per_tok` largest logits and softmaxes
over those (`moe.route_topk_logits`); each expert is a biased SwiGLU clamped at
`swiglu_limit` with gain `swiglu_alpha` (`ops.interface.ClampedSwiGLU`).

Checkpoints hold the experts as `transformers` does: `mlp.experts.gate_up_proj`
[E, H, 2I] with gate and up interleaved (gate = columns 0, 2, ..., up = 1, 3, ...),
`gate_up_proj_bias` [E, 2I] likewise, `down_proj` [E, I, H], `down_proj_bias`;
the loader transposes and de-interleaves them into the stacked `[gate | up]` rows
the kernels read. MXFP4 checkpoints (`quant_method` "mxfp4", `*_blocks` /
`*_scales` tensors) are refused: use the bf16 weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from kvrecover.models.config import LAYER_TYPES, FieldReader, ModelConfig
from kvrecover.models.layers import Attention, CausalLM, DecoderLayer
from kvrecover.models.loader import CheckpointRename, attach_shard_loader
from kvrecover.models.moe import ExpertWeights, route_topk_logits, routing_fields
from kvrecover.ops.interface import BackendFeatures, ClampedSwiGLU

if TYPE_CHECKING:
    from kvrecover.ops.interface import ModelOps

# Hugging Face's GptOssConfig defaults.
ROPE_THETA, SLIDING_WINDOW, SWIGLU_ALPHA, SWIGLU_LIMIT = 150_000.0, 128, 1.702, 7.0
DEFAULT_ROPE_SCALING = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                        "beta_slow": 1.0, "truncate": False,
                        "original_max_position_embeddings": 4096}


def refuse_mxfp4(raw: dict[str, Any], model_dir: Path) -> None:
    """MXFP4 weights (the format gpt-oss ships in): a ValueError that says what to use."""
    quantization = raw.get("quantization_config")
    if isinstance(quantization, dict) and quantization.get("quant_method") == "mxfp4":
        raise ValueError(
            f"{Path(model_dir) / 'config.json'} is an MXFP4 checkpoint (quant_method "
            "'mxfp4', *_blocks/*_scales expert tensors), which kvrecover does not run: use "
            "a bf16 checkpoint of the model, e.g. one transformers saved after loading it "
            "with Mxfp4Config(dequantize=True)"
        )


@dataclass
class GptOssConfig(ModelConfig):
    """gpt-oss's config: the common fields plus biases, experts, windows and the clamp."""

    attention_bias: bool = True
    num_experts: int = 1
    num_experts_per_tok: int = 1
    sliding_window: int | None = SLIDING_WINDOW
    layer_types: list[str] = field(default_factory=list)
    swiglu_alpha: float = SWIGLU_ALPHA
    swiglu_limit: float = SWIGLU_LIMIT

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], model_dir: Path) -> dict[str, Any]:
        refuse_mxfp4(raw, model_dir)
        reader = FieldReader.of(raw, model_dir)
        num_experts, top_k = routing_fields(reader, "num_local_experts")
        fields = super().hf_fields(raw, model_dir)
        alternating = ["sliding_attention" if (i + 1) % 2 else "full_attention"
                       for i in range(fields["num_hidden_layers"])]
        rope_parameters = raw.get("rope_parameters") or {}
        if "rope_theta" not in raw and "rope_theta" not in rope_parameters:
            fields["rope_theta"] = ROPE_THETA
        if not raw.get("rope_scaling") and not rope_parameters.get("rope_type"):
            fields["rope_scaling"] = dict(DEFAULT_ROPE_SCALING)
        return {
            **fields,
            "attention_bias": reader.flag("attention_bias", True),
            "num_experts": num_experts,
            "num_experts_per_tok": top_k,
            "sliding_window": reader.positive_int("sliding_window", SLIDING_WINDOW,
                                                  nullable=True),
            "layer_types": reader.kinds_list("layer_types", fields["num_hidden_layers"],
                                             alternating, LAYER_TYPES),
            "swiglu_alpha": reader.positive_number("swiglu_alpha", SWIGLU_ALPHA),
            "swiglu_limit": reader.positive_number("swiglu_limit", SWIGLU_LIMIT),
        }

    def layer_windows(self) -> list[int | None]:
        return [self.sliding_window if kind == "sliding_attention" else None
                for kind in self.layer_types]


class GptOssExperts(ExpertWeights):
    """Stacked expert weights with biases and the clamped SwiGLU, loaded from the
    checkpoint's transposed, interleaved tensors (shard "hf": the whole tensor)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 activation: ClampedSwiGLU) -> None:
        super().__init__(num_experts, hidden_size, intermediate_size)
        self.gate_up_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size))
        self.down_bias = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.clamped_swiglu = activation
        attach_shard_loader(self.gate_up_proj, self._load_gate_up, ["hf"])
        attach_shard_loader(self.gate_up_bias, self._load_gate_up_bias, ["hf"])
        attach_shard_loader(self.down_proj, self._load_down_transposed, ["hf"])

    def _check_shape(self, loaded: torch.Tensor, expected: tuple[int, ...], layout: str) -> None:
        if tuple(loaded.shape) != expected:
            raise ValueError(
                f"shape {tuple(loaded.shape)} does not fit {layout} = {expected} "
                f"(E = num_local_experts, H = hidden_size, I = intermediate_size of "
                "config.json); does config.json match the weights?")

    def _load_gate_up(self, param: nn.Parameter, loaded: torch.Tensor, shard: str) -> None:
        experts, hidden, size = self.num_experts, self.hidden_size, self.intermediate_size
        self._check_shape(loaded, (experts, hidden, 2 * size), "[E, H, 2I]")
        param.data.copy_(_deinterleave(loaded).transpose(1, 2))

    def _load_gate_up_bias(self, param: nn.Parameter, loaded: torch.Tensor, shard: str) -> None:
        self._check_shape(loaded, (self.num_experts, 2 * self.intermediate_size), "[E, 2I]")
        param.data.copy_(_deinterleave(loaded))

    def _load_down_transposed(self, param: nn.Parameter, loaded: torch.Tensor,
                              shard: str) -> None:
        expected = (self.num_experts, self.intermediate_size, self.hidden_size)
        self._check_shape(loaded, expected, "[E, I, H]")
        param.data.copy_(loaded.transpose(1, 2))


def _deinterleave(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2I] with gate and up alternating -> [..., 2I] as [gate | up]."""
    return torch.cat((gate_up[..., ::2], gate_up[..., 1::2]), dim=-1)


class GptOssMoeBlock(nn.Module):
    """Router (`router`: a linear with a bias) and the experts (`GptOssExperts`)."""

    def __init__(self, config: GptOssConfig, ops: ModelOps) -> None:
        super().__init__()
        self.ops = ops
        self.top_k = config.num_experts_per_tok
        self.router = nn.Linear(config.hidden_size, config.num_experts, bias=True)
        activation = ClampedSwiGLU(alpha=config.swiglu_alpha, limit=config.swiglu_limit)
        self.experts = GptOssExperts(config.num_experts, config.hidden_size,
                                     config.intermediate_size, activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route_topk_logits(self.ops.linear(x, self.router), self.top_k)
        return self.ops.moe(x, weights, ids, self.experts)


_EXPERTS = r"(layers\.\d+)\.mlp\.experts\."


class GptOssForCausalLM(CausalLM[GptOssConfig]):
    """gpt-oss decoder: biased attention with sinks (windowed on the sliding layers) and
    a routed mixture of clamped-SwiGLU experts in every layer."""

    config_class = GptOssConfig
    checkpoint_renames = (
        CheckpointRename(_EXPERTS + "gate_up_proj", r"\1.mlp.experts.gate_up_proj", "hf"),
        CheckpointRename(_EXPERTS + "gate_up_proj_bias", r"\1.mlp.experts.gate_up_bias", "hf"),
        CheckpointRename(_EXPERTS + "down_proj", r"\1.mlp.experts.down_proj", "hf"),
        CheckpointRename(_EXPERTS + "down_proj_bias", r"\1.mlp.experts.down_bias"),
    )

    @classmethod
    def required_features(cls, config: ModelConfig) -> BackendFeatures:
        return replace(super().required_features(config), moe=True, attention_sinks=True)

    def make_layer(self, config: GptOssConfig, index: int, attention: Any,
                   ops: ModelOps) -> nn.Module:
        self_attn = Attention(config, self.rotary, attention, ops, bias=config.attention_bias,
                              o_bias=config.attention_bias, sinks=True,
                              window=config.layer_windows()[index])
        return DecoderLayer(config, self_attn, GptOssMoeBlock(config, ops), ops)
