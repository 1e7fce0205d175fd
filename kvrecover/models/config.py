"""The model hyper-parameters every family shares, read from a Hugging Face config.

A family (one file under `models/`, see `registry.py`) subclasses `ModelConfig`
with its own fields and extends `hf_fields` to read them.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvrecover.models.rope import check_rope_scaling, rope_type_of


@dataclass
class ModelConfig:
    """Shape and numerics of a decoder-only transformer, common to every family."""

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
    rope_scaling: dict[str, Any] | None = None
    checkpoint_dtype: torch.dtype = torch.float32
    eos_token_ids: list[int] = field(default_factory=list)

    def layer_windows(self) -> list[int | None]:
        """Each layer's sliding window in tokens (None: full attention); a family with
        windowed layers overrides this. Read by the model's layers and by whoever sizes
        the KV cache per layer."""
        return [None] * self.num_hidden_layers

    def recurrent_layers(self) -> list[int]:
        """The layers that keep a recurrent state instead of a KV cache (linear attention,
        `models/recurrent_state.py`); a hybrid family overrides this. They belong to no KV
        cache group."""
        return []

    @property
    def identity(self) -> str:
        """A short stable digest of everything that shapes the KV cache's contents
        (every field of the family's config, by name: stored KV keys depend on it)."""
        record = asdict(self)
        record["checkpoint_dtype"] = str(self.checkpoint_dtype)
        record.pop("eos_token_ids")
        blob = json.dumps(record, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    @classmethod
    def from_hf_config(cls, raw: dict[str, Any], model_dir: Path) -> ModelConfig:
        """This class's config from the parsed `config.json` of checkpoint `model_dir`."""
        return cls(**cls.hf_fields(raw, Path(model_dir)))

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], model_dir: Path) -> dict[str, Any]:
        """The constructor arguments read from `raw`; a family returns these plus its own
        (`{**super().hf_fields(raw, model_dir), "field": ...}`) and may refuse a setting."""
        refuse_quantization(raw, model_dir)  # every family: quantized weights would be misread
        num_heads = raw["num_attention_heads"]
        rope_parameters = raw.get("rope_parameters") or {}
        rope_theta = raw.get("rope_theta", rope_parameters.get("rope_theta", 10000.0))
        rope_scaling = raw.get("rope_scaling") or None
        if rope_scaling is None and rope_parameters.get("rope_type", "default") != "default":
            rope_scaling = rope_parameters
        rope_scaling = rope_defaults(rope_scaling, raw)
        check_rope_scaling(rope_scaling, str(Path(model_dir) / "config.json"))
        dtype_name = raw.get("torch_dtype") or raw.get("dtype") or "float32"
        return dict(
            architecture=architecture_of(raw),
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
            rope_scaling=rope_scaling,
            checkpoint_dtype=getattr(torch, dtype_name, torch.float32),
            eos_token_ids=_eos_token_ids(model_dir, raw),
        )


def rope_defaults(rope_scaling: dict[str, Any] | None,
                  raw: dict[str, Any]) -> dict[str, Any] | None:
    """`rope_scaling` with what Hugging Face fills in for YaRN and Llama 3: the
    pre-training length `original_max_position_embeddings` defaults to
    `max_position_embeddings`."""
    if rope_type_of(rope_scaling) not in ("yarn", "llama3") or rope_scaling is None:
        return rope_scaling
    filled = dict(rope_scaling)
    if filled.get("original_max_position_embeddings") is None:
        filled["original_max_position_embeddings"] = raw.get("max_position_embeddings")
    return filled


def read_hf_config(model_dir: Path) -> dict[str, Any]:
    """The parsed `config.json` of a checkpoint folder."""
    config_path = Path(model_dir) / "config.json"
    if not config_path.is_file():
        raise ValueError(f"model folder {model_dir} has no config.json")
    return json.loads(config_path.read_text())


def architecture_of(raw: dict[str, Any]) -> str:
    """The architecture name a parsed `config.json` declares (its first `architectures`)."""
    architectures = raw.get("architectures") or [raw.get("model_type", "unknown")]
    return architectures[0]


def refuse_sliding_window(raw: dict[str, Any], model_dir: Path) -> None:
    """For families that attend over the whole context: a config asking for a window
    is a ValueError (such a model would silently diverge)."""
    if raw.get("use_sliding_window") or "sliding_attention" in (raw.get("layer_types") or []):
        raise ValueError(
            f"{Path(model_dir) / 'config.json'} asks for sliding-window attention, which "
            "kvrecover does not support; set use_sliding_window to false if the model allows it"
        )


def sliding_window_field(raw: dict[str, Any], model_dir: Path, name: str = "sliding_window",
                         default: int | None = None) -> int | None:
    """`raw[name]` (`default` where absent) as a window in tokens: None, or a positive
    int; anything else is a ValueError naming the field."""
    value = raw.get(name, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{Path(model_dir) / 'config.json'}: {name} must be a positive "
                         f"integer (a window in tokens) or null, got {value!r}")
    return value


LAYER_TYPES = ("full_attention", "sliding_attention")  # the `layer_types` kvrecover runs


def layer_types_field(raw: dict[str, Any], model_dir: Path, default: list[str]) -> list[str]:
    """`raw["layer_types"]` (`default` where absent or null): one known type per layer,
    else a ValueError naming the field."""
    value = raw.get("layer_types") or default
    source = Path(model_dir) / "config.json"
    if not isinstance(value, list) or len(value) != raw["num_hidden_layers"]:
        raise ValueError(f"{source}: layer_types must list one type per layer "
                         f"(num_hidden_layers = {raw['num_hidden_layers']}), got {value!r}")
    unknown = sorted({str(kind) for kind in value if kind not in LAYER_TYPES})
    if unknown:
        raise ValueError(f"{source}: layer_types names {', '.join(unknown)}; kvrecover runs "
                         f"{', '.join(LAYER_TYPES)}")
    return list(value)


def positive_field(raw: dict[str, Any], model_dir: Path, name: str,
                   default: float | None) -> float | None:
    """`raw[name]` (`default` where absent) as a positive number or None (null), else a
    ValueError naming the field (soft-caps, scalars)."""
    value = raw.get(name, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{Path(model_dir) / 'config.json'}: {name} must be a positive "
                         f"number or null, got {value!r}")
    return float(value)


def refuse_quantization(raw: dict[str, Any], model_dir: Path) -> None:
    """A config with a `quantization_config` is a ValueError naming its method: kvrecover
    runs unquantized weights only, and would misread quantized ones."""
    quantization = raw.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method", "unknown") if isinstance(quantization, dict) \
            else "unknown"
        raise ValueError(
            f"{Path(model_dir) / 'config.json'} has a quantization_config ({method!r}); "
            "kvrecover runs unquantized (float32/bf16/fp16) checkpoints only: use the "
            "unquantized weights of this model"
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
