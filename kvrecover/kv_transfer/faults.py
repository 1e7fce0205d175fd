"""FaultInjectionConnector: wraps a storage connector and makes chosen loads fail.

Configured in `kv_connector_extra_config` (other keys pass to the inner connector):

    {"inner_connector": "SharedStorageConnector", "seed": 0,
     "faults": [{"requests": "first", "blocks": "all", "kind": "missing"}]}

`requests`: "first", "all", an int k (the k-th request that loads external KV,
counting from 0) or a float p (each such request with probability p).
`blocks`: "all", "first", "last", "middle", a list of block positions within the
request's loaded blocks, or a float fraction (a seeded random subset).
`group`: the KV cache group whose loaded blocks `blocks` counts (default 0; a model
with sliding-window layers has several, `kv_groups.py`; a windowed group's loaded
blocks are its window and margin only).
`target`: "kv" (default) or "state": the recurrent state a hybrid model's load
carries (`state_entries`), every chunk of it.
`kind`: "missing" (not loaded), "error" (the read raises), "corrupt" (bytes are
altered after the read, before verification: only the checksum catches it),
"hang" (the read never returns; the load deadline ends it).
A selected request stays broken on every attempt, like a persistently bad entry: the
blocks its first load chose stay bad (by position in the request), so a retry from its
first bad block on fails at that block again.

Every block a load fails (each block the inner connector reports invalid, and each
one faulted around a connector without a read hook) is filled with NaN in every
layer before the forward pass can read it (sync loads) or before the load is
reported finished (async ones): a recovery that skipped a recompute reads NaN and
changes the output, so it can never pass a test by luck on whatever the cache held.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kvrecover.config import KVTransferConfig
from kvrecover.kv_layout import NULL_BLOCK_ID, KVCacheLayout
from kvrecover.kv_transfer.base import (
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRole,
)
from kvrecover.kv_transfer.stores.state_entries import STATE_READ_BLOCK_ID
from kvrecover.options import from_dict, option, option_names, validate

if TYPE_CHECKING:
    from kvrecover.kv_transfer.request_view import KVRequestView
    from kvrecover.kv_transfer.stores.state_entries import RecurrentStateAccess
    from kvrecover.step_messages import SchedulerOutput

FAULT_KINDS = ("missing", "error", "corrupt", "hang")
FAULT_TARGETS = ("kv", "state")
STATE_FAULT = (-1, -1)  # the (group, position) under which a load's state fault is kept
BLOCK_SELECTORS = ("all", "first", "last", "middle")
DEFAULT_FAULTS = [{"requests": "first", "blocks": "all", "kind": "missing"}]
FAULT_LABEL = "fault {name!r}"


class InjectedFault(OSError):
    """Raised by an injected `error` fault."""


def _requests_problem(value: Any) -> str | None:
    ok = value in ("first", "all") or _is_int(value) or _is_fraction(value)
    return None if ok else "bad"


def _blocks_problem(value: Any) -> str | None:
    ok = (value in BLOCK_SELECTORS or _is_fraction(value)
          or (isinstance(value, list) and all(_is_int(b) for b in value)))
    return None if ok else "bad"


@dataclass(frozen=True)
class FaultRule:
    """One entry of the `faults` list."""

    requests: Any = option(
        "first", "which loading requests break: 'first', 'all', the k-th (an int) or each "
        "with probability p (a float)", object, check=_requests_problem,
        describe="'first', 'all', an int or a float in [0, 1]")
    blocks: Any = option(
        "all", "which of their loaded blocks: 'all', 'first', 'last', 'middle', a list of "
        "positions or a fraction", object, check=_blocks_problem,
        describe=f"one of {BLOCK_SELECTORS}, a list of ints or a float in [0, 1]")
    kind: str = option("missing", "how they fail: " + ", ".join(FAULT_KINDS), str,
                       choices=FAULT_KINDS, describe=f"one of {FAULT_KINDS}")
    group: int = option(0, "the KV cache group whose loaded blocks `blocks` selects from",
                        int, minimum=0)
    target: str = option("kv", "what fails: 'kv' (the selected KV blocks) or 'state' (the "
                         "recurrent state a hybrid model's load carries; `blocks` unused)",
                         str, choices=FAULT_TARGETS, describe=f"one of {FAULT_TARGETS}")

    def __post_init__(self) -> None:
        validate(self, FAULT_LABEL)

    @classmethod
    def parse(cls, raw: dict[str, Any]) -> FaultRule:
        """A rule from one dict of the `faults` list."""
        if isinstance(raw, FaultRule):
            return raw
        if not isinstance(raw, dict):
            raise ValueError(f"each fault must be a dict, got {raw!r}")
        return from_dict(cls, raw, "fault key")

    def selects_request(self, load_index: int, rng: random.Random) -> bool:
        if self.requests == "first":
            return load_index == 0
        if self.requests == "all":
            return True
        if _is_int(self.requests):
            return load_index == self.requests
        return rng.random() < self.requests

    def select_positions(self, count: int, rng: random.Random) -> list[int]:
        if count == 0:
            return []
        if self.blocks == "all":
            return list(range(count))
        if self.blocks == "first":
            return [0]
        if self.blocks == "last":
            return [count - 1]
        if self.blocks == "middle":
            return [count // 2]
        if isinstance(self.blocks, list):
            return sorted({p for p in self.blocks if 0 <= p < count})
        return sorted(rng.sample(range(count), max(1, round(self.blocks * count))))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_fraction(value: Any) -> bool:
    return isinstance(value, float) and 0.0 <= value <= 1.0


def _fault_rules(faults: Any) -> tuple[FaultRule, ...]:
    if isinstance(faults, tuple):
        return faults
    if not isinstance(faults, list):
        raise ValueError(f"'faults' must be a list of fault dicts, got {faults!r}")
    return tuple(FaultRule.parse(f) for f in faults)


def _not_itself(name: str) -> str | None:
    return "another connector" if name == "FaultInjectionConnector" else None


@dataclass(frozen=True)
class FaultSettings:
    """FaultInjectionConnector's own settings; every other key of
    `kv_connector_extra_config` is the inner connector's."""

    inner_connector: str = option(
        "SharedStorageConnector", "the wrapped connector (a registered name)", str,
        check=_not_itself)
    faults: tuple[FaultRule, ...] = option(
        DEFAULT_FAULTS, "the fault rules: a list of {'requests', 'blocks', 'kind'} dicts", tuple,
        convert=_fault_rules)
    seed: int = option(0, "seed of the random choices (fractions, probabilities)", int,
                       minimum=0)

    def __post_init__(self) -> None:
        validate(self, FAULT_LABEL)


@dataclass
class FaultMetadata(KVConnectorMetadata):
    """The inner connector's metadata plus this step's faults: request -> {block id: kind}."""

    inner: KVConnectorMetadata
    faults: dict[str, dict[int, str]] = field(default_factory=dict)

    def loads_by_request(self) -> dict[str, tuple[list[int], bool]]:
        return self.inner.loads_by_request()

    def num_save_blocks(self) -> int:
        return self.inner.num_save_blocks()


def _inner_name(config: KVTransferConfig) -> Any:
    name = config.get_extra("inner_connector", "SharedStorageConnector")
    if name == "FaultInjectionConnector":
        raise ValueError("inner_connector cannot be FaultInjectionConnector itself")
    return name


class FaultInjectionConnector(KVConnectorBase):
    """Delegates to an inner connector and injects the configured load faults."""

    settings_class = FaultSettings

    @classmethod
    def kv_groups_supported(cls, config: KVTransferConfig) -> bool:
        """Per KV cache group exactly when the connector it wraps is."""
        from kvrecover.kv_transfer.registry import connector_class

        inner = connector_class(KVTransferConfig(_inner_name(config), config.kv_role))
        return inner.kv_groups_supported(config)

    @classmethod
    def recurrent_states_supported(cls, config: KVTransferConfig) -> bool:
        """Stores recurrent states exactly when the connector it wraps does."""
        from kvrecover.kv_transfer.registry import connector_class

        inner = connector_class(KVTransferConfig(_inner_name(config), config.kv_role))
        return inner.recurrent_states_supported(config)

    @classmethod
    def resume_states_kept(cls, config: KVTransferConfig) -> bool:
        """Keeps resume states exactly when the connector it wraps does."""
        from kvrecover.kv_transfer.registry import connector_class

        inner = connector_class(KVTransferConfig(_inner_name(config), config.kv_role))
        return inner.resume_states_kept(config)

    @classmethod
    def accepted_settings(cls, config: KVTransferConfig) -> list[str] | None:
        """Its own settings and those of the inner connector (None: it takes any)."""
        from kvrecover.kv_transfer.registry import connector_class

        inner_name = _inner_name(config)
        try:
            inner = connector_class(KVTransferConfig(inner_name, config.kv_role))
        except ValueError as error:
            raise ValueError(f"inner_connector {inner_name!r}: {error}") from error
        inner_keys = inner.accepted_settings(config)
        return None if inner_keys is None else option_names(FaultSettings) + inner_keys

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, layout: KVCacheLayout):
        super().__init__(config, role, layout)
        from kvrecover.kv_transfer.registry import create_connector

        settings: FaultSettings = self.settings
        self.rules = list(settings.faults)
        self.seed = settings.seed
        inner_name = settings.inner_connector
        own = option_names(FaultSettings)
        inner_config = KVTransferConfig(
            kv_connector=inner_name,
            kv_role=config.kv_role,
            kv_connector_extra_config={k: v for k, v in config.kv_connector_extra_config.items()
                                       if k not in own},
            kv_load_failure_policy=config.kv_load_failure_policy,
            kv_load_retry_limit=config.kv_load_retry_limit,
            kv_load_recompute=config.kv_load_recompute,
            state_interval_blocks=config.state_interval_blocks,
        )
        try:
            self.inner = create_connector(inner_config, role, layout)
        except ValueError as error:
            raise ValueError(f"inner_connector {inner_name!r}: {error}") from error
        # A "hang" lasts well past the inner connector's (validated) load deadline.
        self.load_timeout_s = self.inner.load_timeout_s
        # Scheduler role: which requests are broken, in order of their first load, and
        # their bad blocks (position in the request's block table -> kind), chosen then.
        self._load_order: dict[str, int] = {}
        self._bad_blocks: dict[str, dict[tuple[int, int], str]] = {}
        self._step_faults: dict[str, dict[int, str]] = {}
        # Worker role.
        self._active: dict[str, dict[int, str]] = {}
        self._missing_reported: set[int] = set()
        # Faults go into the inner connector's raw reads where it takes a filter,
        # else they are emulated around its loads (`_poison`).
        self._filters_reads = self.inner.set_read_filter(self._filter_read, self._faulted)

    # ----- scheduler role -------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: KVRequestView, num_computed_tokens: int) -> tuple[int, bool]:
        return self.inner.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: KVRequestView, block_ids: list[int], num_external_tokens: int) -> None:
        self.inner.update_state_after_alloc(request, block_ids, num_external_tokens)
        if num_external_tokens <= 0:
            return
        block_size = self.layout.block_size
        first = request.num_computed_tokens // block_size
        last = first + num_external_tokens // block_size
        tables = request.block_tables or (tuple(block_ids),)
        bad = self._bad_blocks.get(request.request_id)
        if bad is None:  # its first load: choose them, by (group, position), for every retry
            load_index = self._load_order.setdefault(request.request_id, len(self._load_order))
            groups = self.layout.kv_groups
            load_end = request.num_computed_tokens + num_external_tokens
            rng = random.Random(f"{self.seed}:{load_index}")
            bad = {}
            for rule in self.rules:
                if rule.target == "state":
                    if rule.selects_request(load_index, rng):
                        bad.setdefault(STATE_FAULT, rule.kind)
                    continue
                if rule.group >= len(tables):
                    continue
                start = max(first, groups[rule.group].first_loaded_block(load_end, block_size))
                loaded = [p for p in range(start, last) if tables[rule.group][p] != NULL_BLOCK_ID]
                if rule.selects_request(load_index, rng):
                    for position in rule.select_positions(len(loaded), rng):
                        bad.setdefault((rule.group, loaded[position]), rule.kind)
            self._bad_blocks[request.request_id] = bad
        faults = {tables[g][p]: kind for (g, p), kind in bad.items()
                  if first <= p < min(last, len(tables[g])) and tables[g][p] != NULL_BLOCK_ID}
        if STATE_FAULT in bad:  # every read of the load's state (`state_entries`) fails
            faults[STATE_READ_BLOCK_ID] = bad[STATE_FAULT]
        if faults:
            self._step_faults[request.request_id] = faults

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> FaultMetadata:
        metadata = FaultMetadata(self.inner.build_connector_meta(scheduler_output), self._step_faults)
        self._step_faults = {}
        return metadata

    def request_finished(self, request: KVRequestView, block_ids: list[int]) -> bool:
        return self.inner.request_finished(request, block_ids)

    # ----- worker role ----------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        self.kv_caches = kv_caches
        self.inner.register_kv_caches(kv_caches)

    def register_recurrent_states(self, states: RecurrentStateAccess) -> None:
        self.inner.register_recurrent_states(states)

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(metadata)
        bound = self._get_metadata_of(FaultMetadata)
        self._active.update(bound.faults)
        self.inner.bind_connector_metadata(bound.inner)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self.inner.clear_connector_metadata()

    def _faulted(self, request_id: str, block_id: int) -> bool:
        """Whether this step's read of the block is one `_filter_read` acts on."""
        return block_id in self._active.get(request_id, {})

    def _filter_read(self, request_id: str, block_id: int, key: bytes, raw: bytes,
                     cancelled: threading.Event) -> bytes:
        kind = self._active.get(request_id, {}).get(block_id)
        if kind is None:
            return raw
        if kind == "missing":
            raise FileNotFoundError(f"injected fault: block {key.hex()} is missing")
        if kind == "error":
            raise InjectedFault(f"injected fault: reading block {key.hex()} failed")
        if kind == "corrupt":
            corrupted = bytearray(raw)
            corrupted[len(corrupted) // 2] ^= 0x5A
            return bytes(corrupted)
        cancelled.wait(self.load_timeout_s * 10)  # "hang": until the deadline gives up
        raise TimeoutError("injected fault: the read hung")

    def start_load_kv(self, kv_caches: list[torch.Tensor]) -> None:
        self.inner.start_load_kv(kv_caches)
        if self._filters_reads:  # this step's failed sync loads, poisoned before the forward
            self._poison(self.inner.get_block_ids_with_load_errors() or ())
            return
        # An inner connector without a read hook: emulate the faults around it.
        metadata = self._get_metadata_of(FaultMetadata)
        loads = metadata.loads_by_request()
        for request_id, faults in metadata.faults.items():
            if request_id in loads and not loads[request_id][1]:
                if "error" in faults.values():
                    raise InjectedFault(f"injected fault: load of request {request_id} failed")
                self._poison(faults)

    def _poison(self, block_ids: Iterable[int]) -> None:
        """Fill failed blocks with NaN and report them invalid."""
        num_blocks = self.kv_caches[0].shape[1] if self.kv_caches else 0
        block_ids = list(block_ids)
        self._missing_reported.update(block_ids)  # (an invalid id: the engine rejects the report)
        valid = [b for b in block_ids if isinstance(b, int) and 0 < b < num_blocks]
        if valid:  # one fill per cache tensor: a block at a time was a launch per block
            index = torch.tensor(valid, device=self.kv_caches[0].device)
            for cache in self.kv_caches:
                cache.index_fill_(1, index, float("nan"))

    def wait_for_layer_load(self, layer_index: int) -> None:
        self.inner.wait_for_layer_load(layer_index)

    def save_kv_layer(self, layer_index: int, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        self.inner.save_kv_layer(layer_index, kv_layer, attn_metadata)

    def wait_for_save(self) -> None:
        if self._missing_reported:
            metadata = self._get_metadata_of(FaultMetadata)
            self.inner.discard_saves_for(set(metadata.faults))
        self.inner.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving = self.inner.get_finished(finished_req_ids)
        if self._filters_reads:  # the async loads that ended and failed
            self._poison(self.inner.get_block_ids_with_load_errors() or ())
        for request_id in recving or ():
            faults = self._active.pop(request_id, None)
            if faults and not self._filters_reads:
                self._poison(faults)
        for request_id in finished_req_ids:
            self._active.pop(request_id, None)
        return sending, recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        late = self.inner.get_block_ids_with_load_errors() or ()
        if self._filters_reads:
            self._poison(late)
        invalid = set(late) | self._missing_reported
        self._missing_reported = set()
        return invalid

    def get_save_failures(self) -> int:
        return self.inner.get_save_failures()

    def discard_saves_for(self, request_ids: set[str]) -> None:
        self.inner.discard_saves_for(request_ids)

    def shutdown(self) -> None:
        self._active = {}
        self.kv_caches = []
        self.inner.shutdown()
