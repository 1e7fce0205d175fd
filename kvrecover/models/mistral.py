"""Mistral (`MistralForCausalLM`): the Llama model, every layer over a sliding window.

`sliding_window` in config.json is the window in tokens (a query at position q
sees keys q - window < k <= q), or null for full attention (Mistral v0.2 on);
where the key is absent, Hugging Face's default of 4096 applies.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvrecover.models.config import FieldReader
from kvrecover.models.llama import LlamaConfig, LlamaForCausalLM

HF_DEFAULT_SLIDING_WINDOW = 4096  # transformers' MistralConfig default


@dataclass
class MistralConfig(LlamaConfig):
    """Mistral's config: the Llama fields plus one window shared by every layer."""

    sliding_window: int | None = None

    @classmethod
    def window_fields(cls, raw: dict[str, Any], model_dir: Path) -> dict[str, Any]:
        # Mistral reads `sliding_window` alone (HF ignores `layer_types` here, with a warning).
        return {"sliding_window": FieldReader.of(raw, model_dir).positive_int(
            "sliding_window", HF_DEFAULT_SLIDING_WINDOW, nullable=True)}

    def layer_windows(self) -> list[int | None]:
        return [self.sliding_window] * self.num_hidden_layers


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral decoder (the Llama layers, each with `sliding_window`)."""

    config_class = MistralConfig
