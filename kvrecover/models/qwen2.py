"""Qwen2 (`Qwen2ForCausalLM`): the Llama model with biased q/k/v projections."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvrecover.models.config import FieldReader
from kvrecover.models.llama import LlamaConfig, LlamaForCausalLM


@dataclass
class Qwen2Config(LlamaConfig):
    """Qwen2's config: q/k/v biases unless config.json says otherwise; no sliding window
    (refused, as for Llama)."""

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], model_dir: Path) -> dict[str, Any]:
        return {**super().hf_fields(raw, model_dir),
                "attention_bias": FieldReader.of(raw, model_dir).flag("attention_bias", True)}


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 decoder (the Llama layers with `attention_bias`)."""

    config_class = Qwen2Config
