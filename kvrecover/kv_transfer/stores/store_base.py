"""What every connector over a block store shares: its options, the scheduler role,
sync loads, states, and shutdown; the bookkeeping of async loads is mixed in from
`store_async_loads`.

Every load reads on a reader thread and waits for it only until its deadline
(`reader_threads`), so a store that trickles or hangs costs a load at most
`load_timeout_s`, and a sync load never blocks the engine longer. A connector may read
a step's sync loads as one batch on one thread (`batched_sync_reads`), and its async
loads as another (`batched_async_reads`: each load ready as soon as its blocks are
read, the batch landing together unless one of it is slow); every async load that
finished by a `get_finished` is installed by one `_install_step` call.

Both the folder connector (`shared_storage`, one file per block, one system call
each way) and the batched connector over any store (`store_connector`: Redis, tiers) build on
`StoreConnectorBase`, which also starts each step's loads (`start_load_kv`: async
ones on their threads, sync ones read at once); each keeps its own read, install and
save path (`_read_sync`, `_read_async`, `_install`, `wait_for_save`), the only part
where they differ.

Settings shared by all of them (`StoreSettings`, keys of `kv_connector_extra_config`):
  async_load           load in a background thread while the request waits (False)
  load_timeout_s       bound on each load as a whole, sync or async (30, or the
                       subclass's `_default_load_timeout_s`): the blocks of a load
                       unfinished after this long are invalid and recomputed
  verify_after_load    re-check the engine's cache blocks after a load (True; each
                       connector says how)
Each connector's own settings record extends `StoreSettings`.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from kvrecover.config import KVTransferConfig
from kvrecover.kv_groups import single_group
from kvrecover.kv_layout import NULL_BLOCK_ID, KVCacheLayout, group_block_key
from kvrecover.kv_transfer.base import (
    SETTING_LABEL,
    FilteredBlock,
    KVConnectorBase,
    KVConnectorRole,
    ReadFilter,
)
from kvrecover.kv_transfer.stores.reader_threads import (
    ReadCancel,
    ReaderThreads,
    ReadTimedOut,
    StoreRead,
    StoreStuck,
)
from kvrecover.kv_transfer.stores.store_async_loads import AsyncLoad, AsyncStoreLoads
from kvrecover.kv_transfer.stores.store_states import StoreStates
from kvrecover.kv_transfer.stores.transfers import BlockTransfer, StorageConnectorMetadata
from kvrecover.options import option, validate

if TYPE_CHECKING:
    from kvrecover.kv_transfer.request_view import KVRequestView
    from kvrecover.kv_transfer.stores.state_entries import RecurrentStateAccess
    from kvrecover.step_messages import SchedulerOutput

logger = logging.getLogger(__name__)

SHUTDOWN_JOIN_S = 5.0  # how long `shutdown` waits for loader threads, in all
# A sync load's read of some transfers: (transfers, cancelled) -> one result per transfer.
SyncRead = Callable[[list["BlockTransfer"], ReadCancel], list[Any]]


ItemT = TypeVar("ItemT")


def prefix_before_none(items: Sequence[ItemT | None]) -> list[ItemT]:
    """The items before the first None (e.g. a load's verified blocks)."""
    prefix: list[ItemT] = []
    for item in items:
        if item is None:
            break
        prefix.append(item)
    return prefix


# Bounds of a duration setting in seconds (an upper bound keeps timers sane).
MAX_SECONDS = 1e9


def seconds(default: float | None, help: str, nullable: bool = False) -> Any:
    """A duration setting in seconds, > 0."""
    return option(default, help, float, nullable=nullable, above=0, maximum=MAX_SECONDS,
                  describe="a number of seconds > 0")


@dataclass(frozen=True)
class StoreSettings:
    """The settings every block-store connector shares (`kv_connector_extra_config`)."""

    async_load: bool = option(
        False, "load in a background thread while the request waits", bool)
    load_timeout_s: float | None = seconds(
        None, "bound on each load as a whole, sync or async: the blocks of a load unfinished "
        "after this long are invalid and recomputed (default: the connector's; 30 for a folder)", nullable=True)
    verify_after_load: bool = option(
        True, "re-check the engine's cache blocks after a load (each connector says how)",
        bool)

    def __post_init__(self) -> None:
        validate(self, SETTING_LABEL)


class StoreConnectorBase(AsyncStoreLoads, KVConnectorBase):
    """A connector whose KV blocks live in a block store, one entry per block keyed by
    the prefix-chain hash. Subclasses say where (`_open_store`) and how blocks move
    (`_read_sync`, `_read_async`, `_install`, `wait_for_save`)."""

    settings_class = StoreSettings
    # A step's sync loads are read as one group (one batched store read) rather than
    # each on its own reader thread.
    batched_sync_reads = False
    # A step's async loads are read as one group too, on one reader thread
    # (`_read_async_batch`), each ready as soon as its own blocks are read; a batch
    # lands together (`_landable`).
    batched_async_reads = False
    # Per KV cache group: a block id spans the layers of one group (the registered
    # tensors), so only the scheduler role's choice of blocks and keys knows groups.
    supports_kv_groups = True
    # A hybrid model's recurrent states travel as entries of the same store
    # (`state_entries`): at the last loadable boundary of each saved prompt and every
    # `state_interval_blocks`-th one before it (`store_states`).
    supports_recurrent_states = True
    # A failed load keeps the stored state it can resume from (`store_states`).
    keeps_resume_states = True

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, layout: KVCacheLayout):
        super().__init__(config, role, layout)
        settings: StoreSettings = self.settings
        self.store = self._open_store()
        self.async_load = settings.async_load
        self.load_timeout_s = (self._default_load_timeout_s() if settings.load_timeout_s is None
                               else settings.load_timeout_s)
        self.verify_after_load = settings.verify_after_load
        self.block_size = layout.block_size
        self.kv_groups = layout.kv_groups
        # Several groups or a window: blocks and keys per group (`_group_blocks`).
        self._grouped = layout.kv_groups != single_group(layout.num_layers)
        self._stateful = layout.has_recurrent_layers  # claims need states
        # A hybrid's states (`store_states`), stored beside its KV.
        self._states = (StoreStates(self.store, layout.block_size, config.state_interval_blocks)
                        if self._stateful else None)
        self._read_filter: ReadFilter | None = None  # see `set_read_filter`
        self._filtered_block: FilteredBlock | None = None
        # Scheduler role state.
        self._requests: dict[str, KVRequestView] = {}
        self._pending_loads: list[BlockTransfer] = []
        # Worker role state.
        self._kv_caches: list[torch.Tensor] = []
        self._invalid_block_ids: set[int] = set()
        self._failed_requests: set[str] = set()
        self._discarded_saves: set[str] = set()
        self._async_loads: dict[str, AsyncLoad] = {}
        self._readers = ReaderThreads()
        self._save_failures = 0
        self._suspect_keys: set[bytes] = set()

    def _open_store(self) -> Any:
        """The block store this connector reads and writes (called once, at construction)."""
        raise NotImplementedError(f"{type(self).__name__} must say where its blocks live")

    def _default_load_timeout_s(self) -> float:
        """`load_timeout_s` when the config does not set it."""
        return 30.0

    # ----- scheduler role -----------------------------------------------------------
    def get_num_new_matched_tokens(self, request: KVRequestView, num_computed_tokens: int) -> tuple[int, bool]:
        if not self.config.is_consumer:
            return 0, False
        keys = request.block_hashes  # the engine hashed every full prompt block
        last_loadable = (request.num_prompt_tokens - 1) // self.block_size
        first = num_computed_tokens // self.block_size
        wanted = keys[first : min(last_loadable, len(keys))]
        if self._grouped:  # a position counts when every group's entry is stored
            num_groups = len(self.kv_groups)
            group_keys = [group_block_key(key, g) for key in wanted for g in range(num_groups)]
            end = first + self._count_stored_prefix(request, group_keys) // num_groups
        else:
            end = first + self._count_stored_prefix(request, wanted)
        if self._states is not None:
            end = self._states.last_boundary(keys, first, end)
        num_tokens = max(0, end * self.block_size - num_computed_tokens)
        return num_tokens, self.async_load and num_tokens > 0

    def _count_stored_prefix(self, request: KVRequestView, keys: Sequence[bytes]) -> int:
        """How many leading `keys` the store holds (one batched call)."""
        if not keys:
            return 0
        present = self.store.exists_many(keys)
        return next((i for i, found in enumerate(present) if not found), len(keys))

    def _new_load(self, request: KVRequestView, block_ids: list[int],
                  keys: Sequence[bytes]) -> BlockTransfer:
        """The transfer that loads `keys` into `block_ids` for `request`."""
        return BlockTransfer(request.request_id, block_ids, keys, is_async=self.async_load)

    def update_state_after_alloc(self, request: KVRequestView, block_ids: list[int], num_external_tokens: int) -> None:
        self._requests[request.request_id] = request
        if num_external_tokens <= 0:
            return
        first = request.num_computed_tokens // self.block_size
        count = num_external_tokens // self.block_size
        keys = request.block_hashes
        if self._grouped:
            end = request.num_computed_tokens + num_external_tokens
            ids, group_keys = self._group_blocks(request, request.block_tables, first,
                                                 first + count, load_end=end)
            load = self._new_load(request, ids, group_keys)
        else:
            load = self._new_load(request, block_ids[first : first + count],
                                  keys[first : first + count])
        if self._states is not None:
            self._states.plan_load(load, request, first, first + count)
        self._pending_loads.append(load)

    def _group_blocks(self, request: KVRequestView, tables: Sequence[Sequence[int]],
                      first: int, last: int, load_end: int | None = None,
                      ) -> tuple[list[int], list[bytes]]:
        """(block ids, store keys) of positions [first, last) in every group, position
        by position (a failure cuts the fewest valid blocks after it), skipping a
        windowed group's null blocks and, for a load ending at `load_end`, the blocks
        before its window and margin (`KVCacheGroup.first_loaded_block`)."""
        starts = [first if load_end is None else max(first, g.first_loaded_block(
            load_end, self.block_size)) for g in self.kv_groups]
        ids: list[int] = []
        keys: list[bytes] = []
        hashes = request.block_hashes
        for position in range(first, last):
            for g, table in enumerate(tables):
                if position < starts[g] or table[position] == NULL_BLOCK_ID:
                    continue
                ids.append(table[position])
                keys.append(group_block_key(hashes[position], g))
        return ids, keys

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> StorageConnectorMetadata:
        metadata = StorageConnectorMetadata(loads=self._pending_loads)
        self._pending_loads = []
        if not self.config.is_producer:
            return metadata
        for item in scheduler_output.scheduled:
            request = self._requests.get(item.request_id)
            if request is None:
                continue
            end = min(item.num_computed_tokens + len(item.token_ids), request.num_prompt_tokens)
            first, last = item.num_computed_tokens // self.block_size, end // self.block_size
            if self._states is not None:
                self._states.plan_saves(request, item.save_checkpoints + item.held_checkpoints,
                                        metadata.state_saves)
            if last <= first:
                continue
            keys = request.block_hashes
            if self._grouped:
                ids, group_keys = self._group_blocks(request, item.tables, first, last)
                metadata.saves.append(BlockTransfer(item.request_id, ids, group_keys))
                continue
            metadata.saves.append(BlockTransfer(
                item.request_id, item.block_ids[first:last], keys[first:last],
            ))
        return metadata

    def request_finished(self, request: KVRequestView, block_ids: list[int]) -> bool:
        self._requests.pop(request.request_id, None)
        return False

    # ----- worker role ----------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        self._kv_caches = kv_caches

    def register_recurrent_states(self, states: RecurrentStateAccess) -> None:
        if self._states is not None:
            self._states.register(states)

    def start_load_kv(self, kv_caches: list[torch.Tensor]) -> None:
        """Start the step's async loads on their threads; read its sync loads now
        (`_read_now`, under one deadline) and install what they read (and their states)."""
        metadata = self._get_metadata_of(StorageConnectorMetadata)
        asynchronous = [transfer for transfer in metadata.loads if transfer.is_async]
        if asynchronous and self.batched_async_reads:
            self._start_async_batch(asynchronous)
        else:
            for transfer in asynchronous:
                self._start_async(transfer)
        synchronous = [transfer for transfer in metadata.loads if not transfer.is_async]
        if not synchronous:
            return
        results = self._read_now(synchronous, self._read_sync, batched=self.batched_sync_reads)
        self._install_step(synchronous, results)
        stateful = [transfer for transfer in synchronous if transfer.state_hash is not None]
        if stateful:
            payloads = self._read_now(stateful, self._read_states, batched=True)
            for transfer, payload in zip(stateful, payloads):
                self._install_state(transfer, payload)
            self._keep_resume_states(stateful)

    def _read_states(self, transfers: list[BlockTransfer], cancelled: ReadCancel,
                     ) -> list[bytes | None]:
        """Read and verify the transfers' recurrent states (`StoreStates.read`)."""
        if self._states is None:
            return [None] * len(transfers)
        return self._states.read(transfers, cancelled, self._read_filter, self._suspect_keys)

    def _install_state(self, transfer: BlockTransfer, payload: bytes | None) -> None:
        """Give the request its loaded state at the load's end; without one (a failed
        read) zeros there, and the load fails: its last block is reported invalid, so
        recovery rolls the request back to a boundary whose state it holds."""
        if self._states is None or self._states.states is None:
            return
        self._states.install(transfer, payload)
        if payload is None and transfer.block_ids:
            self._invalid_block_ids.add(transfer.block_ids[-1])
            self._failed_requests.add(transfer.request_id)

    def _keep_resume_states(self, transfers: list[BlockTransfer]) -> None:
        """After the transfers' installs: where one failed, keep the stored state it can
        resume from (`StoreStates.keep_resume_state`, each read bounded like a sync load)."""
        if self._states is None:
            return
        for transfer in transfers:
            self._invalid_block_ids |= self._states.keep_resume_state(
                transfer, self._invalid_block_ids,
                lambda t: self._read_now([t], self._read_states, batched=True)[0])

    def _save_states(self, metadata: StorageConnectorMetadata, skipped: set[str]) -> None:
        """Store the step's checkpointed states (`wait_for_save` calls it), unless their
        request's load failed or the store holds them already."""
        if self._states is not None:
            self._save_failures += self._states.save(metadata.state_saves, skipped,
                                                     self._suspect_keys)

    def _install_step(self, transfers: list[BlockTransfer], results: list[Any]) -> None:
        """Install a step's sync loads (`_read_now`'s results: None where every block was
        already reported invalid), or the async loads that one `get_finished` lands; one
        `_install` each unless the subclass installs a batch at once."""
        for transfer, blocks in zip(transfers, results):
            if blocks is not None:
                self._install(transfer, blocks)

    def _read_sync(self, transfers: list[BlockTransfer], cancelled: ReadCancel) -> list[Any]:
        """Read and verify a group of sync loads on a reader thread, off the cache (one
        transfer, or all of the step's where `batched_sync_reads`); one result per
        transfer, for `_install`."""
        raise NotImplementedError(f"{type(self).__name__} does not load synchronously")

    def _install(self, transfer: BlockTransfer, blocks: Any) -> None:
        """Put a load's verified blocks into the cache; report the rest as invalid."""
        raise NotImplementedError(f"{type(self).__name__} does not install loads")

    def _read_now(self, transfers: list[BlockTransfer], read: SyncRead,
                  batched: bool) -> list[Any]:
        """A step's sync loads: `read(group, cancelled)` returns one result per transfer of
        `group`; all transfers are one group (`batched`: one store read) or each its own,
        every group on its own reader thread, all at once, waited for until
        `load_timeout_s` from now at most. Returns one result per transfer, None where
        its read did not end in time, was refused or crashed: every block of those is
        reported invalid here; pass the others to `_install`."""
        deadline = time.monotonic() + self.load_timeout_s
        groups = [transfers] if batched else [[transfer] for transfer in transfers]
        tasks: list[StoreRead | Exception] = []
        for group in groups:
            try:
                tasks.append(self._readers.start(
                    f"kv-load-{group[0].request_id}",
                    functools.partial(read, group)))
            except StoreStuck as error:
                tasks.append(error)
        results: list[Any] = []
        for group, task in zip(groups, tasks):
            salvaged: list[Any] = [None] * len(group)
            try:
                if isinstance(task, Exception):
                    raise task
                results += self._readers.wait(task, deadline - time.monotonic())
                continue
            except ReadTimedOut:
                logger.warning("KV load of request %s exceeded load_timeout_s=%.1fs; its "
                               "unfinished blocks are invalid", group[0].request_id,
                               self.load_timeout_s)
                if not isinstance(task, Exception):
                    salvaged = self._salvage(group, task.cancelled)
            except StoreStuck as error:
                logger.warning("KV load of request %s refused (%s); its blocks are invalid",
                               group[0].request_id, error)
            except Exception as error:  # reads catch their own errors; be safe
                logger.warning("KV load of request %s crashed (%r); its blocks are invalid",
                               group[0].request_id, error)
            results += salvaged
            for transfer, result in zip(group, salvaged):
                if result is None:
                    self._invalid_block_ids.update(transfer.block_ids)
                    self._failed_requests.add(transfer.request_id)
        return results

    def _salvage(self, transfers: list[BlockTransfer], cancelled: ReadCancel) -> list[Any]:
        """What a sync read given up at its deadline still delivered, once `cancelled`
        is set (nothing it does reaches the cache any more): one `_install` result per
        transfer, or None (every block invalid). By default nothing is kept."""
        return [None] * len(transfers)

    def set_read_filter(self, read_filter: ReadFilter | None,
                        filtered_block: FilteredBlock | None = None) -> bool:
        """Every raw entry read goes through `read_filter` before it is parsed (a
        subclass with a fast path may skip the reads `filtered_block` says no to)."""
        self._read_filter = read_filter
        self._filtered_block = filtered_block
        return True

    def discard_saves_for(self, request_ids: set[str]) -> None:
        """Skip this step's saves of these requests (a wrapper found their loads bad)."""
        self._discarded_saves |= request_ids

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self._invalid_block_ids = self._invalid_block_ids, set()
        return invalid

    def get_save_failures(self) -> int:
        failures, self._save_failures = self._save_failures, 0
        return failures

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self._failed_requests = set()
        self._discarded_saves = set()

    # ----- both roles -----------------------------------------------------------
    def shutdown(self) -> None:
        """Cancel every in-flight async load and join its thread, and the threads of
        abandoned reads (a read stuck in the kernel is given up after SHUTDOWN_JOIN_S in
        all, its daemon thread left behind), then release the store (`_close_store`).
        Idempotent."""
        loads, self._async_loads = list(self._async_loads.values()), {}
        for load in loads:
            self._abandon(load)
        self._readers.join_abandoned(time.monotonic() + SHUTDOWN_JOIN_S)
        self._kv_caches = []
        self._close_store()

    def _close_store(self) -> None:
        """Release what the store holds (connections); called by `shutdown`, perhaps
        more than once. The default holds nothing."""

    def extra(self) -> dict[str, Any]:
        """The extra config this connector understood (for logs and tests)."""
        return {
            "async_load": self.async_load,
            "load_timeout_s": self.load_timeout_s,
            "verify_after_load": self.verify_after_load,
        }
