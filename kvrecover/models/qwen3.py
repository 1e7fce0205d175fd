"""Qwen3 (`Qwen3ForCausalLM`): the Llama model with a per-head RMSNorm on q and k."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvrecover.models.llama import LlamaConfig, LlamaForCausalLM


@dataclass
class Qwen3Config(LlamaConfig):
    """Qwen3's config: always q/k norms (head_dim is explicit in its config.json)."""

    @classmethod
    def hf_fields(cls, raw: dict[str, Any], model_dir: Path) -> dict[str, Any]:
        return {**super().hf_fields(raw, model_dir), "qk_norm": True}


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 decoder (the Llama layers with `qk_norm`)."""

    config_class = Qwen3Config
