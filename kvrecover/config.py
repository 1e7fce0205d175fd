"""User-facing configuration records and their validation."""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from kvrecover.options import (
    add_flags,
    from_namespace,
    option,
    path_or_none,
    reject_unknown,
    to_argv,
    validate,
)

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")
ATTENTION_BACKENDS = ("auto", "torch", "triton")


@dataclass
class KVTransferConfig:
    """Which KV connector to use and how to react when a KV load fails.

    `kv_connector` is a registered name, or the name of a class inside the module
    `kv_connector_module_path` (a user's own connector). `kv_role` says whether
    this instance stores KV (`kv_producer`), loads it (`kv_consumer`) or both.
    `kv_connector_extra_config` holds the connector's own settings (each connector
    declares the keys it accepts). `kv_load_failure_policy` is `recompute` (roll
    back to the longest valid prefix and recompute) or `fail` (end the affected
    requests with an error). `kv_load_retry_limit` bounds how often a request asks
    the connector again for KV after a failed load before it recomputes its prompt
    locally.
    """

    kv_connector: str
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    kv_connector_module_path: str | None = None
    kv_load_failure_policy: str = "recompute"
    kv_load_retry_limit: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.kv_connector, str) or not self.kv_connector:
            raise ValueError(
                f"kv_connector must be a non-empty connector name, got {self.kv_connector!r}"
            )
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_role must be one of {KV_ROLES}, got {self.kv_role!r}")
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(
                f"kv_load_failure_policy must be one of {KV_LOAD_FAILURE_POLICIES}, "
                f"got {self.kv_load_failure_policy!r}"
            )
        extra = self.kv_connector_extra_config
        if not isinstance(extra, dict) or not all(isinstance(k, str) for k in extra):
            raise ValueError(
                f"kv_connector_extra_config must be a dict with string keys, got {extra!r}"
            )
        self.kv_connector_module_path = path_or_none(self.kv_connector_module_path)
        module_path = self.kv_connector_module_path
        if module_path is not None and (not isinstance(module_path, str) or not module_path):
            raise ValueError(
                "kv_connector_module_path must be a module name or a .py file path (or None), "
                f"got {module_path!r}"
            )
        retry_limit = self.kv_load_retry_limit
        if isinstance(retry_limit, bool) or not isinstance(retry_limit, int) or retry_limit < 0:
            raise ValueError(
                f"kv_load_retry_limit must be an integer >= 0, got {retry_limit!r}"
            )

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> KVTransferConfig:
        """Build from a plain dict (vLLM's `--kv-transfer-config` JSON); unknown keys
        are a ValueError with a "did you mean"."""
        if not isinstance(values, dict):
            raise ValueError(f"kv_transfer_config must be a JSON object, got {values!r}")
        reject_unknown(values, [f.name for f in fields(cls)], "kv_transfer_config key")
        if "kv_connector" not in values:
            raise ValueError("kv_transfer_config needs a 'kv_connector'")
        return cls(**values)

    @classmethod
    def from_json(cls, text: str) -> KVTransferConfig:
        """Build from a JSON object (the `--kv-transfer-config` flag)."""
        try:
            values = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"kv_transfer_config is not valid JSON: {error}") from error
        return cls.from_dict(values)

    def to_json(self) -> str:
        """The JSON object that `from_json` reads back."""
        return json.dumps(asdict(self))

    @property
    def is_producer(self) -> bool:
        """True when this instance saves KV."""
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        """True when this instance loads KV."""
        return self.kv_role in ("kv_consumer", "kv_both")

    def get_extra(self, key: str, default: Any = None) -> Any:
        """One value of `kv_connector_extra_config`, or `default`."""
        return self.kv_connector_extra_config.get(key, default)


@dataclass
class SchedulerConfig:
    """Limits the scheduler works under."""

    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    block_size: int
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


DTYPES = ("auto", "float32", "bfloat16", "float16")
_DEVICE = re.compile(r"auto|cpu|cuda(:[0-9]+)?")
_MAX_SEED = 2**63 - 1


def _device_problem(device: str) -> str | None:
    return None if _DEVICE.fullmatch(device) else "'auto', 'cpu' or 'cuda[:N]'"


def _non_empty(text: str) -> str | None:
    return None if text else "a non-empty string"


@dataclass
class EngineArgs:
    """Every engine option, declared once: `LLM(model, **options)` takes these keywords
    and every `kvrecover` command that builds an engine takes them as `--flags`
    (`add_engine_flags`). Adding an option is one field here."""

    model: str | None = option(
        None, "local Hugging Face checkpoint folder, or a hub id already in the local cache "
        "(default: the built-in model)", str, nullable=True, check=_non_empty)
    dtype: str = option(
        "auto", "weights and KV cache dtype; auto = float32 on the CPU, bf16 on a GPU "
        "(fp16 for fp16 checkpoints)", str, choices=DTYPES)
    device: str = option(
        "auto", "auto (the GPU when there is one), cpu or cuda[:N]", str,
        check=_device_problem, metavar="DEVICE")
    block_size: int = option(16, "KV cache block size in tokens", int, minimum=1)
    max_num_batched_tokens: int | None = option(
        None, "tokens computed per step; longer prompts are prefilled in chunks "
        "(default: 8192 on a GPU, 2048 on the CPU)", int, nullable=True, minimum=1, metavar="N")
    max_num_seqs: int | None = option(
        None, "requests decoded together (default: 256 on a GPU, 64 on the CPU)", int,
        nullable=True, minimum=1, metavar="N")
    max_model_len: int | None = option(
        None, "longest sequence (prompt + output) in tokens; at most the model's "
        "max_position_embeddings (default: that, capped at 32768)", int, nullable=True,
        minimum=1, metavar="N")
    enforce_eager: bool = option(False, "never replay CUDA graphs", bool)
    enable_prefix_caching: bool = option(
        True, "reuse the KV of prompt prefixes computed before", bool)
    seed: int = option(
        0, "engine seed; requests without their own seed derive theirs from it", int,
        minimum=0, maximum=_MAX_SEED)
    kv_transfer_config: KVTransferConfig | None = option(
        None, "KV connector settings as JSON, e.g. '{\"kv_connector\": "
        "\"SharedStorageConnector\", \"kv_role\": \"kv_consumer\", "
        "\"kv_connector_extra_config\": {\"shared_storage_path\": \"/shared/kv\"}}'",
        KVTransferConfig, nullable=True, parse=KVTransferConfig.from_json,
        format=KVTransferConfig.to_json, metavar="JSON")
    num_kv_blocks: int | None = option(
        None, "fix the number of KV cache blocks (default: from the memory budget)", int,
        nullable=True, minimum=2, metavar="N")
    kv_cache_memory_gb: float | None = option(
        None, "KV cache memory budget in GiB (default: from gpu_memory_utilization on a "
        "GPU, 2 GiB or a quarter of the RAM on the CPU)", float, nullable=True, above=0, metavar="GB")
    gpu_memory_utilization: float = option(
        0.85, "share of the GPU's memory the engine may use", float, above=0, maximum=1)
    batch_invariant: bool = option(
        False, "numerics independent of batch composition and chunking (exact recovery "
        "in bf16 on GPUs, at a cost in speed; always on for bf16/fp16 on the CPU)", bool)
    attention_backend: str = option(
        "auto", "which kernels run: auto (Triton on CUDA, the torch reference elsewhere), "
        "torch or triton (off CUDA only under TRITON_INTERPRET=1)", str,
        choices=ATTENTION_BACKENDS)
    native_kernels: bool | None = option(
        None, "whether our C kernels (CPU attention, norms and rotary) may be compiled with "
        "the system C compiler and run; off, slower torch kernels with the same numerics "
        "promise run (default: on, unless the environment sets KVRECOVER_NATIVE_KERNELS=0)",
        bool, nullable=True)

    def __post_init__(self) -> None:
        self.model = path_or_none(self.model)
        validate(self)

    def to_argv(self) -> list[str]:
        """The `--flags` that rebuild these arguments in another process."""
        return to_argv(self)


ENGINE_OPTIONS = tuple(f.name for f in fields(EngineArgs))


def add_engine_flags(
    parser: argparse.ArgumentParser, skip: tuple[str, ...] = (), **defaults: Any
) -> None:
    """Add one `--flag` per engine option (minus `skip`) to a parser; `defaults`
    replace EngineArgs' defaults in the help (pass the same to
    `engine_args_from_namespace`)."""
    add_flags(parser, EngineArgs, skip=skip, defaults=defaults)


def engine_args_from_namespace(namespace: argparse.Namespace, **defaults: Any) -> EngineArgs:
    """EngineArgs from flags that `add_engine_flags` added; `defaults` fill the flags
    the user did not give. A bad value is a ValueError naming the option."""
    return from_namespace(EngineArgs, namespace, **defaults)
