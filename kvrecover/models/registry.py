"""Model families by the `architectures` name of a checkpoint's config.json.

One line per family: the architecture name -> the module under `kvrecover.models`
and the `CausalLM` subclass in it (which names its `ModelConfig` subclass as
`config_class`). A family's module is imported only when a checkpoint asks for it.
Adding a family is one file (the model and its config, built from `layers.py`),
one line here, and one test file.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvrecover.models.config import ModelConfig, architecture_of, read_hf_config

if TYPE_CHECKING:
    from kvrecover.models.layers import CausalLM
    from kvrecover.models.parallel_layers import TensorParallelGroup
    from kvrecover.ops.backend import KernelBackend

MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),  # Llama 2/3, SmolLM
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "MistralForCausalLM": ("mistral", "MistralForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "Gemma2ForCausalLM": ("gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),  # text only (gemma3_text)
    "GptOssForCausalLM": ("gpt_oss", "GptOssForCausalLM"),
    "Qwen3NextForCausalLM": ("qwen3_next", "Qwen3NextForCausalLM"),  # linear-attention hybrid
    "Qwen3_5ForCausalLM": ("qwen3_next", "Qwen3_5ForCausalLM"),  # text only (qwen3_5_text)
    "Qwen3_5MoeForCausalLM": ("qwen3_next", "Qwen3_5MoeForCausalLM"),  # qwen3_5_moe_text
    # Qwen3.5's released (vision-language) checkpoints, run as text only
    "Qwen3_5ForConditionalGeneration": ("qwen3_next", "Qwen3_5ForConditionalGeneration"),
    "Qwen3_5MoeForConditionalGeneration": ("qwen3_next", "Qwen3_5MoeForConditionalGeneration"),
}


def supported_architectures() -> tuple[str, ...]:
    """The architecture names kvrecover can run."""
    return tuple(MODELS)


def model_class(architecture: str, source: str = "config.json") -> type[CausalLM[Any]]:
    """The model class registered for `architecture`; ValueError (naming `source` and
    every supported architecture) for an unknown one."""
    entry = MODELS.get(architecture)
    if entry is None:
        raise ValueError(
            f"unsupported architecture {architecture!r} in {source}; "
            f"kvrecover supports {', '.join(MODELS)}"
        )
    module_name, class_name = entry
    return getattr(importlib.import_module(f"kvrecover.models.{module_name}"), class_name)


def load_model_config(model_dir: Path) -> ModelConfig:
    """The family config of the checkpoint in `model_dir` (its config.json, and
    generation_config.json for EOS ids); ValueError for what kvrecover cannot run."""
    raw = read_hf_config(model_dir)
    cls = model_class(architecture_of(raw), str(Path(model_dir) / "config.json"))
    return cls.config_class.from_hf_config(raw, Path(model_dir))


def build_model(config: ModelConfig, backend: KernelBackend, max_positions: int,
                tp: TensorParallelGroup | None = None) -> CausalLM[Any]:
    """The (uninitialised) model of `config`'s family, its kernels from `backend`; with a
    `tp` group of more than one rank, this rank's shard of it."""
    cls = model_class(config.architecture)
    if not isinstance(config, cls.config_class):
        raise ValueError(f"{config.architecture} needs a {cls.config_class.__name__}, got a "
                         f"{type(config).__name__}; read it with load_model_config")
    if tp is None or tp.size == 1:
        return cls(config, backend, max_positions)
    check_tensor_parallel_family(cls, config, tp.size)
    return cls(config, backend, max_positions, tp)


def check_tensor_parallel_family(cls: type[CausalLM[Any]], config: ModelConfig,
                                 size: int) -> None:
    """A ValueError when `cls` cannot run on `size` ranks (its family does not shard,
    or `size` does not split its heads); size 1 always passes."""
    if size == 1:
        return
    if not cls.tensor_parallel:
        raise ValueError(f"model family {config.architecture} does not support tensor "
                         f"parallelism; use tensor_parallel_size 1 (got {size})")
    cls.check_tensor_parallel(config, size)
