"""The model hyper-parameters kvrecover needs, read from a Hugging Face config."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


@dataclass
class ModelConfig:
    """Shape and numerics of a Llama-family decoder."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    qk_norm: bool = False
    rope_scaling: dict[str, Any] | None = None
    checkpoint_dtype: torch.dtype = torch.float32
    eos_token_ids: list[int] = field(default_factory=list)

    @property
    def identity(self) -> str:
        """A short stable digest of everything that shapes the KV cache's contents."""
        record = asdict(self)
        record["checkpoint_dtype"] = str(self.checkpoint_dtype)
        record.pop("eos_token_ids")
        blob = json.dumps(record, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    @classmethod
    def from_pretrained(cls, model_dir: Path) -> ModelConfig:
        """Read `config.json` (and `generation_config.json`) of a checkpoint folder."""
        config_path = Path(model_dir) / "config.json"
        if not config_path.is_file():
            raise ValueError(f"model folder {model_dir} has no config.json")
        raw = json.loads(config_path.read_text())
        architectures = raw.get("architectures") or [raw.get("model_type", "unknown")]
        architecture = architectures[0]
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {architecture!r} in {config_path}; "
                f"kvrecover supports {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if raw.get("use_sliding_window") or "sliding_attention" in (raw.get("layer_types") or []):
            # We attend over the whole context; a windowed model would silently diverge.
            raise ValueError(
                f"{config_path} asks for sliding-window attention, which kvrecover does not "
                "support; set use_sliding_window to false if the model allows it"
            )
        num_heads = raw["num_attention_heads"]
        rope_parameters = raw.get("rope_parameters") or {}
        rope_theta = raw.get("rope_theta", rope_parameters.get("rope_theta", 10000.0))
        rope_scaling = raw.get("rope_scaling") or None
        if rope_scaling is None and rope_parameters.get("rope_type", "default") != "default":
            rope_scaling = rope_parameters
        dtype_name = raw.get("torch_dtype") or raw.get("dtype") or "float32"
        return cls(
            architecture=architecture,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(
                raw.get("attention_bias", architecture == "Qwen2ForCausalLM")
            ),
            qk_norm=architecture == "Qwen3ForCausalLM",
            rope_scaling=rope_scaling,
            checkpoint_dtype=getattr(torch, dtype_name, torch.float32),
            eos_token_ids=_eos_token_ids(Path(model_dir), raw),
        )


def _eos_token_ids(model_dir: Path, raw_config: dict[str, Any]) -> list[int]:
    """EOS ids from generation_config.json, falling back to config.json."""
    ids: list[int] = []
    for source in (model_dir / "generation_config.json", None):
        value = raw_config.get("eos_token_id") if source is None else None
        if source is not None and source.is_file():
            value = json.loads(source.read_text()).get("eos_token_id")
        if isinstance(value, int):
            value = [value]
        for token_id in value or []:
            if token_id not in ids:
                ids.append(int(token_id))
    return ids
