"""The KV connector contract (modelled on vLLM's v1 connector).

A connector class is instantiated twice: once with role SCHEDULER inside the
scheduler and once with role WORKER beside the model runner. The two instances
talk only through the metadata object that the scheduler-role instance builds in
`build_connector_meta` each step and the worker-role instance receives in
`bind_connector_metadata`, and through the worker's step output (finished loads,
invalid block ids). Either side can therefore move to another process.

Step order on the worker: `bind_connector_metadata` -> `start_load_kv` ->
per layer (`wait_for_layer_load` before attention reads the cache,
`save_kv_layer` after it wrote it) -> `wait_for_save` ->
`get_finished` -> `get_block_ids_with_load_errors` -> `clear_connector_metadata`.

The scheduler-role methods see a request as a read-only `KVRequestView`
(`request_view.py`: id, prompt tokens, block hashes, computed tokens, sampling
parameters), never the engine's own `Request`. What every method may assume:
`request.block_hashes` already holds the chain hash (`kv_layout.hash_block_tokens`)
of every full block of the prompt; the engine computes them. Those hashes are the
keys of stored KV.

Seams for wrappers (a connector that delegates to inner connectors, such as
`FaultInjectionConnector`): `load_timeout_s`, `set_read_filter` and
`discard_saves_for` are declared here with safe defaults, so a wrapper calls
them on any inner connector and forwards them to its own inner ones; nobody
probes a connector with `hasattr`.

The engine does not trust a connector: an exception from any method, or an
answer outside the contract below, is contained and becomes a KV load failure
of the requests it touches (`kvrecover/engine/scheduler_connector.py` on the
scheduler side, `kvrecover/worker/kv_connector.py` on the worker side), logged once
per kind.
The engine also enforces the deadline `load_timeout_s` on every async load.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import torch

from kvrecover.config import KVTransferConfig
from kvrecover.kv_layout import KVCacheLayout
from kvrecover.options import from_dict, option_names, reject_unknown

if TYPE_CHECKING:
    from kvrecover.kv_transfer.request_view import KVRequestView
    from kvrecover.kv_transfer.stores.state_entries import RecurrentStateAccess
    from kvrecover.step_messages import SchedulerOutput

DEFAULT_LOAD_TIMEOUT_S = 30.0

# (request id, block id, store key, raw stored bytes, cancelled) -> the bytes to parse.
# May raise (the block then failed to load) or wait on `cancelled` (a hang that
# the load deadline ends).
ReadFilter = Callable[[str, int, bytes, bytes, threading.Event], bytes]
# (request id, block id) -> whether the filter may act on that block's read; the others
# may be read without it (a folder reads them straight into place, never as raw bytes).
FilteredBlock = Callable[[str, int], bool]


class KVConnectorRole(enum.Enum):
    """Which half of a connector an instance is."""

    SCHEDULER = "scheduler"
    WORKER = "worker"


@dataclass
class KVConnectorMetadata:
    """Base class of the per-step message from scheduler role to worker role.

    The two methods let the engine contain a connector that raises: every load
    of the step is then reported invalid, every save counted as failed.
    """

    def loads_by_request(self) -> dict[str, tuple[list[int], bool]]:
        """Request id -> (block ids this step loads into, whether asynchronously)."""
        return {}

    def num_save_blocks(self) -> int:
        """How many blocks this step saves."""
        return 0


MetadataT = TypeVar("MetadataT", bound=KVConnectorMetadata)

# How messages name a connector setting: a key of `kv_connector_extra_config`.
SETTING_LABEL = "kv_connector_extra_config[{name!r}]"


class KVConnectorBase:
    """Base class of every KV connector; subclasses override what they support.

    `settings_class` declares the `kv_connector_extra_config` keys a connector reads:
    a frozen dataclass of `options.option` fields whose `__post_init__` calls
    `validate(self, SETTING_LABEL)`. The base class builds it at construction
    (`self.settings`); any other key is a ValueError with a "did you mean", so a typo
    never passes silently. Adding a setting is one field. None (the default, for a
    user's connector that reads its extra config itself) accepts every key.
    """

    settings_class: ClassVar[type | None] = None

    # Seconds a load may run before all its blocks count as failed. Connectors that
    # load set it from their config (extra key `load_timeout_s`) and bound their sync
    # loads by it (store connectors: `reader_threads`); the engine reads it from the
    # scheduler-role instance and enforces it itself on every async load, whether or
    # not the connector ever reports the load. Wrappers read it (an
    # emulated hang must outlast it) and report their inner connector's.
    load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S

    # Whether the connector works per KV cache group (`kv_groups.py`): it reads every
    # group's table (`KVRequestView.block_tables`, `ScheduledRequest.tables`), skips
    # the null block of a windowed table and keys each group's entries apart
    # (`kv_layout.group_block_key`). A model with sliding-window layers refuses, at
    # start-up, a connector that does not declare it.
    supports_kv_groups: ClassVar[bool] = False

    # Whether the connector stores and loads a hybrid model's recurrent states with the
    # KV (`stores/state_entries.py`; point to point, `p2p/states.py`): its claims end at a
    # boundary whose state it can supply, and its worker role installs that state
    # (`register_recurrent_states`). A model with linear-attention layers refuses, at
    # start-up, a connector that does not declare it.
    supports_recurrent_states: ClassVar[bool] = False
    # Whether, besides, a failed load of such a model leaves the request the stored state
    # at the latest multiple of `state_interval_blocks` blocks strictly inside the load at
    # or before its first failed block (`RecurrentStateAccess.keep_resume_state`), else
    # reports the block ending there invalid (rule 8, `store_states.py`): recovery resumes
    # a failed load there only from a connector that declares it, else from a checkpoint
    # the engine holds or 0.
    keeps_resume_states: ClassVar[bool] = False

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, layout: KVCacheLayout):
        self.config = config
        self.role = role
        self.layout = layout
        self.settings: Any = self.check_settings(config)
        self._metadata: KVConnectorMetadata | None = None

    @classmethod
    def check_settings(cls, config: KVTransferConfig) -> Any:
        """`own_settings(config)` after refusing every key nobody accepts (with a "did you
        mean"); the resolver calls it before the engine is built, `__init__` again."""
        accepted = cls.accepted_settings(config)
        if accepted is not None:
            reject_unknown(config.kv_connector_extra_config, accepted,
                           f"kv_connector_extra_config key of {cls.__name__}")
        return cls.own_settings(config)

    @classmethod
    def kv_groups_supported(cls, config: KVTransferConfig) -> bool:
        """Whether this class, configured so, works per KV cache group (default:
        `supports_kv_groups`; a wrapper asks the connector it wraps too)."""
        return cls.supports_kv_groups

    @classmethod
    def recurrent_states_supported(cls, config: KVTransferConfig) -> bool:
        """Whether this class, configured so, stores recurrent states (default:
        `supports_recurrent_states`; a wrapper asks the connector it wraps too)."""
        return cls.supports_recurrent_states

    @classmethod
    def resume_states_kept(cls, config: KVTransferConfig) -> bool:
        """Whether this class, configured so, keeps a failed load's resume state (default:
        `keeps_resume_states`; a wrapper asks the connector it wraps too)."""
        return cls.keeps_resume_states

    @classmethod
    def accepted_settings(cls, config: KVTransferConfig) -> list[str] | None:
        """The extra-config keys `config` may hold for this class (default: those of
        `settings_class`); a wrapper adds those of the connector it wraps."""
        return None if cls.settings_class is None else option_names(cls.settings_class)

    @classmethod
    def own_settings(cls, config: KVTransferConfig) -> Any:
        """This class's `settings_class` record built from `config`'s extra config (keys
        that are not its own, a wrapped connector's, are left to that one); None when
        the class declares none."""
        if cls.settings_class is None:
            return None
        names = option_names(cls.settings_class)
        own = {k: v for k, v in config.kv_connector_extra_config.items() if k in names}
        return from_dict(cls.settings_class, own,
                         f"kv_connector_extra_config key of {cls.__name__}")

    # ----- scheduler role -----------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: KVRequestView, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Scheduler calls this when it first schedules a request (and again, a
        bounded number of times, after a failed load). `num_computed_tokens` are
        already covered locally (block-aligned). Returns how many tokens after
        those the connector can supply (an int), and whether it loads them
        asynchronously (a bool). Must not offer the prompt's last token. The
        engine cuts a larger or non-block-aligned claim to whole blocks below
        the last prompt token and treats a negative or non-int one as 0; what
        was claimed but not loaded is computed locally."""
        return 0, False

    def update_state_after_alloc(
        self, request: KVRequestView, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """Scheduler calls this after allocating blocks for the request:
        `block_ids` is its whole block table and the external tokens start at
        `request.num_computed_tokens` (before they are counted)."""

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Scheduler calls this once per step, after scheduling; the result is
        handed to the worker role for that step. Resets per-step state."""
        return KVConnectorMetadata()

    def request_finished(self, request: KVRequestView, block_ids: list[int]) -> bool:
        """Scheduler calls this when a request ends. Return True to keep its blocks
        until the worker reports the request in `finished_sending`."""
        return False

    def kv_transfer_params(self, request: KVRequestView) -> dict[str, Any] | None:
        """Scheduler calls this right after `request_finished` returned True: the
        reference a consumer pulls the kept blocks with (a JSON-able dict, handed out as
        `RequestOutput.kv_transfer_params`), or None."""
        return None

    # ----- worker role --------------------------------------------------------
    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """Worker calls this once with the per-layer cache tensors
        ([2, num_blocks, block_size, kv_heads, head_dim] each)."""

    def register_recurrent_states(self, states: RecurrentStateAccess) -> None:
        """Worker calls this once, after `register_kv_caches`, for a hybrid model (only
        on a connector whose `recurrent_states_supported`): the states it saves at
        checkpoint slots and installs for the requests it loads."""

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        """Worker calls this at the start of each step with that step's metadata."""
        self._metadata = metadata

    def clear_connector_metadata(self) -> None:
        """Worker calls this at the end of each step."""
        self._metadata = None

    def _get_connector_metadata(self) -> KVConnectorMetadata:
        if self._metadata is None:
            raise RuntimeError("no connector metadata is bound for this step")
        return self._metadata

    def _get_metadata_of(self, expected: type[MetadataT]) -> MetadataT:
        """This step's metadata, which must be the class this connector's scheduler role
        builds (the engine binds a bare `KVConnectorMetadata` when building failed)."""
        metadata = self._get_connector_metadata()
        if not isinstance(metadata, expected):
            raise TypeError(f"this step's connector metadata is a {type(metadata).__name__}, "
                            f"not the {expected.__name__} this connector builds")
        return metadata

    def start_load_kv(self, kv_caches: list[torch.Tensor]) -> None:
        """Worker calls this before the forward pass: begin (or, for synchronous
        connectors, perform) the loads the metadata asks for."""

    def wait_for_layer_load(self, layer_index: int) -> None:
        """Worker calls this before layer `layer_index` reads the KV cache."""

    def save_kv_layer(self, layer_index: int, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        """Worker calls this after layer `layer_index` wrote this step's KV."""

    def wait_for_save(self) -> None:
        """Worker calls this after the forward pass; saves must be durable on return."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Worker calls this every step. Returns (requests whose async saves
        finished, requests whose async loads finished or were cancelled).
        `finished_req_ids` are requests the scheduler ended, or whose async load
        the engine gave up on at its deadline, since the last step: cancel their
        loads and report them here once nothing can write their blocks any more
        (until then the engine keeps those blocks reserved)."""
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Worker calls this after each step: block ids whose load failed in this
        step (sync) or whose async load was reported finished in this step. An
        answer that is not a set of valid block ids fails every load that ended."""
        return set()

    def get_save_failures(self) -> int:
        """Worker calls this after each step: blocks whose save failed since the last call."""
        return 0

    # ----- seams for wrapping connectors (both roles) -----------------------------
    def set_read_filter(self, read_filter: ReadFilter | None,
                        filtered_block: FilteredBlock | None = None) -> bool:
        """A wrapping connector calls this once, right after creating this one, to
        see (and alter, fail or delay) every raw stored entry this connector reads
        before it is parsed and verified; None removes the filter. With
        `filtered_block`, only the reads it says yes to need the filter (the rest may
        take the connector's fast path). Returns whether this connector applies
        filters: False (the default: it has no raw reads) tells the wrapper to emulate
        its faults around `start_load_kv` instead."""
        return False

    def discard_saves_for(self, request_ids: set[str]) -> None:
        """A wrapping worker-role connector calls this during a step, before
        `wait_for_save`, when it knows the KV loaded for these requests is bad:
        this step's saves of their blocks must not be stored. Connectors that save
        override it; the default (for connectors that never save) does nothing."""
    def get_connector_stats(self) -> dict[str, int]:
        """Both roles: the engine calls this after each step (the worker's instance
        through the step output, the scheduler's directly). Returns this
        connector's own counters' increments since the last call, by name (str ->
        int); they are summed into `LLM.stats` under those names. Prefix them (e.g.
        `kv_tier0_loaded_blocks`): an engine counter of the same name hides them."""
        return {}

    # ----- both roles -----------------------------------------------------------
    def shutdown(self) -> None:
        """The engine calls this once when it closes (`LLM.close()`, garbage collection,
        interpreter exit): cancel in-flight loads and join every thread the connector
        started, bounded in time, then drop every reference to the registered KV caches
        (views and staging buffers included): the engine frees the cache next. No other
        method is called afterwards."""
