"""The resolved configuration: every engine decision taken before anything is built.

`resolve_config(args)` turns `EngineArgs` into a `ResolvedConfig`: the model folder
and its config, the torch device and dtype, the kernel family, the scheduler's
limits, the KV layout, the inputs of the KV cache's size and the connector plan.
Every device-dependent default is taken here, from the table the help texts are
generated from (`kvrecover/device_defaults.py`). `Engine` only assembles parts from
the result; the one step left for assembly is measuring a GPU's free memory for
the KV cache, which needs the weights loaded first (`KVCacheSizing.num_blocks`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from kvrecover.config import EngineArgs, KVTransferConfig, SchedulerConfig
from kvrecover.device_defaults import DEVICE_DEFAULTS, GIB, MAX_MODEL_LEN_CAP
from kvrecover.kv_groups import KVCacheGroup, build_kv_groups
from kvrecover.kv_layout import KVCacheLayout, blocks_needed
from kvrecover.kv_transfer.base import KVConnectorBase, KVConnectorRole
from kvrecover.model_source import resolve_model_dir
from kvrecover.models.config import ModelConfig
from kvrecover.models.fingerprint import checkpoint_fingerprint
from kvrecover.models.parallel_layers import shard_heads
from kvrecover.models.registry import (
    check_tensor_parallel_family,
    load_model_config,
    model_class,
)
from kvrecover.worker.kv_cache import available_kv_cache_bytes

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class KVCacheSizing:
    """What decides the KV cache's block count: `num_kv_blocks` when given, else a
    byte budget (`kv_cache_memory_gb`, the CPU's default, or, when `budget_bytes` is
    None, the GPU's free memory measured once the weights are loaded), cut to what
    every sequence slot at full length can use."""

    block_nbytes: int
    max_useful_blocks: int
    fixed_num_blocks: int | None
    budget_bytes: int | None
    gpu_memory_utilization: float

    def num_blocks(self, device: torch.device) -> int:
        """The block count; the engine calls this after loading the weights."""
        if self.fixed_num_blocks is not None:
            return self.fixed_num_blocks
        budget = self.budget_bytes
        if budget is None:
            budget = available_kv_cache_bytes(device, self.gpu_memory_utilization)
        num_blocks = min(budget // self.block_nbytes, self.max_useful_blocks)
        if num_blocks < 2:
            raise ValueError(
                f"the KV cache budget ({budget} bytes) holds fewer than 2 blocks of "
                f"{self.block_nbytes} bytes; raise kv_cache_memory_gb or num_kv_blocks"
            )
        return num_blocks


@dataclass(frozen=True)
class ConnectorPlan:
    """The KV connector: its class (found once) and the roles the engine creates, the
    scheduler's inside the scheduler and the worker's inside the model runner."""

    transfer: KVTransferConfig
    connector_class: type[KVConnectorBase]
    roles: tuple[KVConnectorRole, ...] = (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER)

    def create(self, role: KVConnectorRole, layout: KVCacheLayout) -> KVConnectorBase:
        """One role's instance."""
        return self.connector_class(self.transfer, role, layout)


@dataclass(frozen=True)
class ResolvedConfig:
    """`EngineArgs` with every default taken and every input checked (see the module
    docstring); `args` keeps what the user gave."""

    args: EngineArgs
    model_dir: Path
    model_config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    attention_backend: str
    scheduler_config: SchedulerConfig
    layout: KVCacheLayout  # rank 0's under tensor parallelism (`rank_layout`)
    kv_sizing: KVCacheSizing
    connector: ConnectorPlan | None
    tensor_parallel_size: int = 1

    def rank_layout(self, rank: int) -> KVCacheLayout:
        """Rank `rank`'s KV layout: its own KV heads, its rank in the fingerprint."""
        return replace(self.layout, tensor_parallel_rank=rank)

    @property
    def max_model_len(self) -> int:
        """The longest sequence (prompt + output) in tokens."""
        return self.scheduler_config.max_model_len


def resolve_config(args: EngineArgs) -> ResolvedConfig:
    """Take every decision `args` leaves open; a ValueError says what to change."""
    model_dir = resolve_model_dir(args.model)
    model_config = load_model_config(model_dir)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device, model_config)
    scheduler_config = SchedulerConfig(
        max_num_batched_tokens=_device_default(args, "max_num_batched_tokens", device),
        max_num_seqs=_device_default(args, "max_num_seqs", device),
        max_model_len=resolve_max_model_len(args.max_model_len, model_config),
        block_size=args.block_size,
        enable_prefix_caching=args.enable_prefix_caching,
    )
    tp_size = resolve_tensor_parallel(args.tensor_parallel_size, model_config, device)
    layout = KVCacheLayout(
        model_identity=f"{model_config.identity}-{checkpoint_fingerprint(model_dir)}",
        dtype=dtype,
        block_size=args.block_size,
        num_layers=model_config.num_hidden_layers,
        num_kv_heads=shard_heads(model_config.num_attention_heads,
                                 model_config.num_key_value_heads, tp_size, 0).num_kv_heads,
        head_dim=model_config.head_dim,
        tensor_parallel_size=tp_size,
        groups=resolve_kv_groups(model_config),
    )
    connector = resolve_connector(args.kv_transfer_config)
    if connector is not None and model_config.recurrent_layers():
        check_connector_states(connector, model_config.architecture, args.num_state_checkpoints)
    if connector is not None and layout.groups:
        check_connector_groups(connector, layout)
    return ResolvedConfig(
        args=args, model_dir=model_dir, model_config=model_config, device=device, dtype=dtype,
        attention_backend=resolve_attention_backend(args.attention_backend, device),
        scheduler_config=scheduler_config, layout=layout,
        kv_sizing=resolve_kv_sizing(args, device, layout, scheduler_config),
        connector=connector,
        tensor_parallel_size=tp_size,
    )


def resolve_tensor_parallel(size: int, model_config: ModelConfig, device: torch.device) -> int:
    """The rank count, checked: the family shards, `size` splits its heads, and on CUDA
    there is a GPU per rank (from the device's index on); a ValueError names both numbers."""
    check_tensor_parallel_family(model_class(model_config.architecture), model_config, size)
    if device.type == "cuda" and size > 1:
        available = torch.cuda.device_count() - (device.index or 0)
        if size > available:
            raise ValueError(f"tensor_parallel_size {size} exceeds the {available} CUDA "
                             f"device(s) from {device} on; lower it or choose another device")
    return size


def _device_default(args: EngineArgs, name: str, device: torch.device):
    value = getattr(args, name)
    return DEVICE_DEFAULTS[name].on(device.type) if value is None else value


def resolve_device(device: str) -> torch.device:
    """The torch device of the `device` option ("auto" picks CUDA when there is one)."""
    if device == "auto":
        return resolve_device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}") from error
    if resolved.type not in ("cpu", "cuda"):  # torch knows more types than we run on
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}")
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device='cuda' was asked for but CUDA is not available")
        if resolved.index is None:  # torch.cuda.set_device needs an index
            resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


def resolve_dtype(dtype: str, device: torch.device, config: ModelConfig) -> torch.dtype:
    """The torch dtype of the `dtype` option ("auto": the table's, and float16 for a
    float16 checkpoint on a GPU, as the table's note says)."""
    if dtype != "auto":
        return DTYPES[dtype]
    if device.type == "cuda" and config.checkpoint_dtype == torch.float16:
        return torch.float16
    return DTYPES[DEVICE_DEFAULTS["dtype"].on(device.type)]


def resolve_attention_backend(attention_backend: str, device: torch.device) -> str:
    """"torch" or "triton": "auto" becomes the table's choice for the device."""
    if attention_backend == "auto":
        return DEVICE_DEFAULTS["attention_backend"].on(device.type)
    return attention_backend


def resolve_max_model_len(max_model_len: int | None, config: ModelConfig) -> int:
    """The option, checked against the model, or the model's limit capped."""
    model_limit = config.max_position_embeddings
    if max_model_len is not None and max_model_len > model_limit:
        raise ValueError(
            f"max_model_len must be <= {model_limit} (the model's "
            f"max_position_embeddings), got {max_model_len}"
        )
    return max_model_len or min(model_limit, MAX_MODEL_LEN_CAP)


def resolve_kv_groups(model_config: ModelConfig) -> tuple[KVCacheGroup, ...]:
    """The KV cache groups of the model's layer windows; () (one full-attention group of
    every layer, the layout of a model without windows) when no layer has one."""
    windows, recurrent = model_config.layer_windows(), model_config.recurrent_layers()
    if not recurrent and all(window is None for window in windows):
        return ()
    return build_kv_groups(windows, recurrent)


def resolve_kv_sizing(args: EngineArgs, device: torch.device, layout: KVCacheLayout,
                      scheduler_config: SchedulerConfig) -> KVCacheSizing:
    """The KV cache's sizing inputs; only a GPU's budget is left to measure."""
    if args.kv_cache_memory_gb is not None:
        budget: int | None = int(args.kv_cache_memory_gb * GIB)
    elif device.type == "cuda":
        budget = None  # the free memory once the weights are in
    else:
        budget = available_kv_cache_bytes(device, args.gpu_memory_utilization)
    # No point in more blocks than every sequence slot at full length needs (+ the null block).
    cap = scheduler_config.max_num_seqs * len(layout.kv_groups) * blocks_needed(
        scheduler_config.max_model_len, scheduler_config.block_size)
    return KVCacheSizing(
        block_nbytes=layout.block_nbytes, max_useful_blocks=cap + 1,
        fixed_num_blocks=args.num_kv_blocks, budget_bytes=budget,
        gpu_memory_utilization=args.gpu_memory_utilization,
    )


def check_connector_states(plan: ConnectorPlan, architecture: str,
                           num_checkpoints: int) -> None:
    """A ValueError, before any weight loads, when a model with linear-attention layers
    meets a connector that cannot carry their recurrent states (`state_entries`), or a
    setup in which it cannot save them. Any tensor-parallel size: each rank stores its
    own heads' states under its own layout fingerprint, as its KV."""
    name = f"KV connector {plan.transfer.kv_connector!r} ({plan.connector_class.__name__})"
    if not plan.connector_class.recurrent_states_supported(plan.transfer):
        raise ValueError(
            f"{architecture} has linear-attention layers (a recurrent state per request), and "
            f"{name} does not store their states with the KV (supports_recurrent_states): use "
            "SharedStorageConnector, RedisConnector or NixlConnector, or run without "
            "kv_transfer_config")
    if plan.transfer.is_producer and num_checkpoints < 1:
        raise ValueError(f"{architecture} with {name} as a producer saves each prompt's state "
                         "from a checkpoint slot: set num_state_checkpoints to at least 1")


def check_connector_groups(plan: ConnectorPlan, layout: KVCacheLayout) -> None:
    """A ValueError, before any weight loads, when the model has sliding-window layers
    (KV cache groups) and the connector does not work per group."""
    if plan.connector_class.kv_groups_supported(plan.transfer):
        return
    windows = sorted({g.window for g in layout.kv_groups if g.window is not None})
    raise ValueError(
        f"KV connector {plan.transfer.kv_connector!r} ({plan.connector_class.__name__}) does "
        f"not support KV cache groups, and this model has sliding-window layers (windows "
        f"{windows}, {len(layout.kv_groups)} group(s)): its block tables hold the null block "
        "where a window keeps none. Use a connector that declares supports_kv_groups = True "
        "(SharedStorageConnector, RedisConnector, TieredConnector, ...), or make yours load "
        "and save every group's blocks (KVRequestView.block_tables, kv_layout.group_block_key)"
        " and declare it."
    )


def resolve_connector(transfer: KVTransferConfig | None) -> ConnectorPlan | None:
    """The connector plan of `kv_transfer_config`: its class found and its settings
    checked (a ValueError otherwise) before any weight is loaded."""
    if transfer is None:
        return None
    from kvrecover.kv_transfer.registry import connector_class

    cls = connector_class(transfer)
    cls.check_settings(transfer)
    return ConnectorPlan(transfer, cls)
