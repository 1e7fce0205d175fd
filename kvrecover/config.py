"""User-facing configuration records and their validation."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")
ATTENTION_BACKENDS = ("auto", "torch", "triton")


@dataclass
class KVTransferConfig:
    """Which KV connector to use and how to react when a KV load fails.

    `kv_connector` is a registered name, or the name of a class inside the module
    `kv_connector_module_path` (a user's own connector). `kv_role` says whether
    this instance stores KV (`kv_producer`), loads it (`kv_consumer`) or both.
    `kv_load_failure_policy` is `recompute` (roll back to the longest valid prefix
    and recompute) or `fail` (end the affected requests with an error).
    `kv_load_retry_limit` bounds how often a request asks the connector again for
    KV after a failed load before it recomputes its prompt locally.
    """

    kv_connector: str
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    kv_connector_module_path: str | None = None
    kv_load_failure_policy: str = "recompute"
    kv_load_retry_limit: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.kv_connector, str) or not self.kv_connector:
            raise ValueError("kv_connector must be a non-empty connector name")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_role must be one of {KV_ROLES}, got {self.kv_role!r}")
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(
                f"kv_load_failure_policy must be one of {KV_LOAD_FAILURE_POLICIES}, "
                f"got {self.kv_load_failure_policy!r}"
            )
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError("kv_connector_extra_config must be a dict")
        if not isinstance(self.kv_load_retry_limit, int) or self.kv_load_retry_limit < 0:
            raise ValueError(
                f"kv_load_retry_limit must be an integer >= 0, got {self.kv_load_retry_limit!r}"
            )

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


@dataclass
class EngineArgs:
    """Everything `LLM(...)` accepts; see `kvrecover.LLM` for the meaning of each."""

    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    enforce_eager: bool = False
    enable_prefix_caching: bool = True
    seed: int = 0
    kv_transfer_config: KVTransferConfig | None = None
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float | None = None
    gpu_memory_utilization: float = 0.85
    batch_invariant: bool = False
    attention_backend: str = "auto"

    def __post_init__(self) -> None:
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                f"got {self.attention_backend!r}"
            )
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(
                f"dtype must be one of 'auto', 'float32', 'bfloat16', 'float16', got {self.dtype!r}"
            )
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {self.block_size!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2, got {self.num_kv_blocks!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}"
            )
        if self.kv_transfer_config is not None and not isinstance(
            self.kv_transfer_config, KVTransferConfig
        ):
            raise ValueError("kv_transfer_config must be a kvrecover.KVTransferConfig")
