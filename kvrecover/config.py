"""User-facing configuration records and their validation."""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import asdict, dataclass, fields
from typing import Any

from kvrecover.device_defaults import MAX_MODEL_LEN_CAP, default_help
from kvrecover.options import (
    REQUIRED,
    add_flags,
    from_namespace,
    option,
    option_names,
    path_or_none,
    reject_unknown,
    to_argv,
    validate,
)
from kvrecover.options import from_dict as record_from_dict

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")
KV_LOAD_RECOMPUTE_SCOPES = ("prefix", "blocks")
ATTENTION_BACKENDS = ("auto", "torch", "triton")


def _non_empty(text: str) -> str | None:
    return None if text else "a non-empty string"


def _string_keys(extra: dict) -> str | None:
    return None if all(isinstance(k, str) for k in extra) else "a dict with string keys"


# One state per 1024 blocks: 14-38 % of the KV bytes at the Qwen3-Next / Qwen3.5 shapes
# (see `KVTransferConfig`).
DEFAULT_STATE_INTERVAL_BLOCKS = 1024


@dataclass
class KVTransferConfig:
    """Which KV connector to use and how to react when a KV load fails.

    `kv_connector` is a registered name, or the name of a class inside the module
    `kv_connector_module_path` (a user's own connector). `kv_role` says whether
    this instance stores KV (`kv_producer`), loads it (`kv_consumer`) or both.
    `kv_connector_extra_config` holds the connector's own settings (each connector
    declares them as a settings record; see `KVConnectorBase.settings_class`).
    `kv_load_failure_policy` is `recompute` (roll back to the longest valid prefix
    and recompute) or `fail` (end the affected requests with an error).
    `kv_load_retry_limit` bounds how often a request asks the connector again for
    KV after a failed load before it recomputes its prompt locally.
    `kv_load_recompute` is what policy `recompute` recomputes: `prefix` (everything
    from the first invalid block on) or `blocks` (only the invalid blocks, and what a
    sync load's step computed after them; the valid loaded blocks after a hole are
    kept; a model with sliding-window layers falls back to `prefix`).
    `state_interval_blocks` K: a hybrid model's (linear-attention layers) producer
    stores the recurrent state at every K-th block boundary of a prompt besides its
    last loadable one, so that a consumer whose load fails at block b resumes from the
    stored state at the latest multiple of K blocks at or before b rather than from 0
    (rule 8). One state costs what ~200 blocks of 16 tokens of KV cost at the
    Qwen3-Next-80B shape (73.7 MiB vs 0.375 MiB), ~390 at Qwen3.5-397B, ~150 at
    Qwen3.5-27B: the default 1024 keeps the states at 14-38 % of the stored KV bytes
    there (at block size 16; the share halves as the block size doubles).
    """

    kv_connector: str = option(
        REQUIRED, "a registered connector name, or a class of kv_connector_module_path", str,
        check=_non_empty, describe="a non-empty connector name")
    kv_role: str = option(
        "kv_both", "kv_producer (stores KV), kv_consumer (loads it) or kv_both", str,
        choices=KV_ROLES, describe=f"one of {KV_ROLES}")
    kv_connector_extra_config: dict[str, Any] = option(
        {}, "the connector's own settings (its settings record)", dict, check=_string_keys,
        describe="a dict with string keys")
    kv_connector_module_path: str | None = option(
        None, "a module name or .py file holding a user's connector class", str,
        nullable=True, convert=path_or_none, check=_non_empty,
        describe="a module name or a .py file path (or None)")
    kv_load_failure_policy: str = option(
        "recompute", "recompute (roll back to the valid prefix) or fail (end the requests)",
        str, choices=KV_LOAD_FAILURE_POLICIES, describe=f"one of {KV_LOAD_FAILURE_POLICIES}")
    kv_load_retry_limit: int = option(
        1, "how often a request asks the connector again after a failed load", int, minimum=0)
    kv_load_recompute: str = option(
        "prefix", "prefix (recompute from the first invalid block on) or blocks (only the "
        "invalid blocks; keep the valid loaded ones after them)", str,
        choices=KV_LOAD_RECOMPUTE_SCOPES, describe=f"one of {KV_LOAD_RECOMPUTE_SCOPES}")
    state_interval_blocks: int = option(
        DEFAULT_STATE_INTERVAL_BLOCKS, "hybrid models: also store the recurrent state at every "
        "K-th block boundary of a prompt (a failed load resumes from the latest one before "
        "it); fewer stored bytes with a larger K", int, minimum=1, metavar="K")

    def __post_init__(self) -> None:
        validate(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> KVTransferConfig:
        """Build from a plain dict (vLLM's `--kv-transfer-config` JSON); unknown keys
        are a ValueError with a "did you mean"."""
        if not isinstance(values, dict):
            raise ValueError(f"kv_transfer_config must be a JSON object, got {values!r}")
        if "kv_connector" not in values:
            reject_unknown(values, option_names(cls), "kv_transfer_config key")
            raise ValueError("kv_transfer_config needs a 'kv_connector'")
        return record_from_dict(cls, values, "kv_transfer_config key")

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
    """Limits the scheduler works under (resolved from `EngineArgs` by `engine/resolve.py`;
    not a command-line record)."""

    max_num_batched_tokens: int = option(
        REQUIRED, "tokens computed per step", int, minimum=1, flag=False)
    max_num_seqs: int = option(REQUIRED, "requests decoded together", int, minimum=1, flag=False)
    max_model_len: int = option(REQUIRED, "longest sequence in tokens", int, minimum=1,
                                flag=False)
    block_size: int = option(REQUIRED, "KV cache block size in tokens", int, minimum=1,
                             flag=False)
    enable_prefix_caching: bool = option(
        True, "reuse the KV of prompt prefixes computed before", bool, flag=False)

    def __post_init__(self) -> None:
        validate(self)


DTYPES = ("auto", "float32", "bfloat16", "float16")
_DEVICE = re.compile(r"auto|cpu|cuda(:[0-9]+)?")
_MAX_SEED = 2**63 - 1
RANK_TIMEOUT_S = 30.0  # rank_timeout_s's default (worker/parallel_runner.py's RankSpec too)


def _device_problem(device: str) -> str | None:
    return None if _DEVICE.fullmatch(device) else "'auto', 'cpu' or 'cuda[:N]'"


@dataclass
class EngineArgs:
    """Every engine option, declared once: `LLM(model, **options)` takes these keywords
    and every `kvrecover` command that builds an engine takes them as `--flags`
    (`add_engine_flags`). Adding an option is one field here."""

    model: str | None = option(
        None, "local Hugging Face checkpoint folder, or a hub id already in the local cache "
        "(default: the built-in model)", str, nullable=True, check=_non_empty)
    dtype: str = option(
        "auto", f"weights and KV cache dtype {default_help('dtype', 'auto')}", str,
        choices=DTYPES)
    device: str = option(
        "auto", "auto (the GPU when there is one), cpu or cuda[:N]", str,
        check=_device_problem, metavar="DEVICE")
    block_size: int = option(16, "KV cache block size in tokens", int, minimum=1)
    max_num_batched_tokens: int | None = option(
        None, "tokens computed per step; longer prompts are prefilled in chunks "
        + default_help("max_num_batched_tokens"), int, nullable=True, minimum=1, metavar="N")
    max_num_seqs: int | None = option(
        None, "requests decoded together " + default_help("max_num_seqs"), int,
        nullable=True, minimum=1, metavar="N")
    max_model_len: int | None = option(
        None, "longest sequence (prompt + output) in tokens; at most the model's "
        f"max_position_embeddings (default: that, capped at {MAX_MODEL_LEN_CAP})", int,
        nullable=True,
        minimum=1, metavar="N")
    enforce_eager: bool = option(False, "never replay CUDA graphs", bool)
    enable_prefix_caching: bool = option(
        True, "reuse the KV of prompt prefixes computed before", bool)
    num_state_checkpoints: int = option(
        32, "recurrent-state checkpoints kept at block boundaries for prefix caching, for "
        "models with linear-attention layers (Qwen3-Next, Qwen3.5); 0: none, so no prefix "
        "of theirs is reused", int, minimum=0, metavar="N")
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
        None, "KV cache memory budget in GiB " + default_help("kv_cache_memory_gb"), float,
        nullable=True, above=0, metavar="GB")
    gpu_memory_utilization: float = option(
        0.85, "share of the GPU's memory the engine may use", float, above=0, maximum=1)
    batch_invariant: bool = option(
        False, "numerics independent of batch composition and chunking (exact recovery "
        "in bf16 on GPUs, at a cost in speed; always on for bf16/fp16 on the CPU)", bool)
    attention_backend: str = option(
        "auto", "which kernels run: auto, torch (the reference) or triton (off CUDA only "
        f"under TRITON_INTERPRET=1) {default_help('attention_backend', 'auto')}", str,
        choices=ATTENTION_BACKENDS)
    native_kernels: bool | None = option(
        None, "whether our C kernels (CPU attention, norms and rotary) may be compiled with "
        "the system C compiler and run; off, slower torch kernels with the same numerics "
        "promise run (default: on, unless the environment sets KVRECOVER_NATIVE_KERNELS=0)",
        bool, nullable=True)

    tensor_parallel_size: int = option(
        1, "ranks the model is sharded over, one process each (gloo on the CPU, NCCL on "
        "GPUs: one GPU per rank)", int, minimum=1, metavar="N")
    rank_timeout_s: float = option(
        RANK_TIMEOUT_S, "seconds a tensor-parallel rank may keep rank 0 waiting (in a "
        "step's collective, or for its step report) before the engine fails every request, "
        "naming the rank (a stopped or hung one); start-up (weights, kernel builds) has a "
        "deadline of its own", float, above=0, metavar="S")

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
