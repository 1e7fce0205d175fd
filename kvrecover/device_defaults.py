"""Defaults that depend on the device: one table, read by the resolver and by the help.

`engine/resolve.py` turns an option left unset (None, or "auto") into the value this
table gives for the device, and `EngineArgs`' help texts are generated from the same
entries (`default_help`), so what `--help` says and what the engine does cannot
drift apart. Nothing here imports torch: the CLI's parser is built from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GIB = 1 << 30


@dataclass(frozen=True)
class DeviceDefault:
    """What one option becomes when left unset: `gpu` on CUDA, `cpu` elsewhere;
    `note` states a rule the two values alone do not say (the code applies it
    beside the table, the help prints it)."""

    gpu: Any
    cpu: Any
    note: str = ""

    def on(self, device_type: str) -> Any:
        """The value for a torch device type ("cuda" or "cpu")."""
        return self.gpu if device_type == "cuda" else self.cpu


# `kvrecover serve`'s step budget on the CPU where `--max-num-batched-tokens` is not given:
# smaller than the engine's (vLLM also gives its server a smaller one than `LLM`). A CPU
# prefill is compute-bound, so a step of eight 256-token prompts makes all eight wait for
# all of it; one prompt a step (the decodes riding along) halves the median time to first
# token at 4-16 clients for the same CPU time, at a longer inter-token latency
# (bench/NOTES.md, 'Serving under guidellm'). The entrypoint applies it (`cli/serve.py`).
SERVE_CPU_MAX_NUM_BATCHED_TOKENS = 256

DEVICE_DEFAULTS: dict[str, DeviceDefault] = {
    "dtype": DeviceDefault("bfloat16", "float32", "float16 for a float16 checkpoint on a GPU"),
    "attention_backend": DeviceDefault("triton", "torch"),
    "max_num_batched_tokens": DeviceDefault(
        8192, 2048, f"{SERVE_CPU_MAX_NUM_BATCHED_TOKENS} under `kvrecover serve` on the CPU"),
    "max_num_seqs": DeviceDefault(256, 64),
    # GiB. On a GPU the budget is measured once the weights are loaded.
    "kv_cache_memory_gb": DeviceDefault(
        "gpu_memory_utilization of its memory, less what is in use once the weights are "
        "loaded", 2.0, "on the CPU at most a quarter of the RAM"),
}

# `max_model_len` left unset: the model's max_position_embeddings, capped at this.
MAX_MODEL_LEN_CAP = 32768


def default_help(option: str, unset: str = "default") -> str:
    """The help's statement of what `option` resolves to when `unset`, from the table:
    "(default on a GPU: 8192; on the CPU: 2048)"."""
    entry = DEVICE_DEFAULTS[option]
    unit = " GiB" if option == "kv_cache_memory_gb" else ""
    gpu = f"{entry.gpu}{unit}" if isinstance(entry.gpu, (int, float)) else entry.gpu
    text = f"({unset} on a GPU: {gpu}; on the CPU: {entry.cpu}{unit}"
    return text + (f"; {entry.note})" if entry.note else ")")
