"""TieredConnector (alias MultiConnector): block stores tried in order, block by block.

Configured in vLLM's MultiConnector format:

    {"connectors": [
        {"kv_connector": "SharedStorageConnector",
         "kv_connector_extra_config": {"shared_storage_path": "/fast/kv"}},
        {"kv_connector": "RedisConnector",
         "kv_connector_extra_config": {"url": "redis://kv-host:6379/0"}, "save": true}],
     "async_load": false}

Each tier is a block-store connector (SharedStorageConnector, RedisConnector or any
`BlockStoreConnector`); its `kv_role` defaults to the outer one (a `kv_producer` tier only
saves, a `kv_consumer` tier only loads). `async_load`, `load_timeout_s` (default:
the tiers' deadlines summed; it bounds each load as a whole, every tier it tries
included) and `verify_after_load` are set once, outside.

- Lookup: every block of the prompt is looked for tier by tier (one batched call
  per tier, later tiers only asked for what earlier ones lack); the prefix offered
  is the longest run of blocks that some tier holds.
- Load: each block is read from the first tier that held it; a block that is
  missing or fails verification there is tried in each later tier before it is
  declared invalid, so only blocks every tier lost are recomputed. Each block is
  tried at most once per tier per load: retries are bounded by the tier count.
- Save: into every tier, or, when any tier has `"save"`, into those with
  `"save": true`; a block that fails in two tiers counts twice in
  `kv_save_failed_blocks`.

The first entry may be a NixlConnector instead (`p2p/pull_tier.py`): a request with a
P2P reference pulls first and each block the pull fails is read from the stores, then
recomputed; its counters are `kv_tier0_loaded_blocks` (verified from the pull) and
`kv_tier0_failed_blocks`, beside the connector's own `kv_nixl_pulled_blocks`.

Hybrid models (linear-attention layers, a recurrent state per request: Qwen3-Next,
Qwen3.5) take exactly one block-store tier, behind an optional NixlConnector (the
store's states are `store_states`' and only its store holds them; more store tiers
are refused at start-up, `recurrent_states_supported`). The rule:

- Claim: the larger of the two ends, each at a boundary its tier has the state of: the
  pull's at the reference's `kv_state_block`, the store's at its last stored state
  inside its stored prefix. The load's state is the one at the claim's end, E.
- State at E: the pull's, when the pull ended at E and its state verified; else the
  store's at E (read as a store load's, `_read_states`). If neither, E's state is
  zeros and the claim's last block invalid, and the store's resume rule applies
  (`keeps_resume_states`): the store's state at the latest multiple of
  `state_interval_blocks` inside the load at or before the first failed block, else a
  checkpoint the engine holds, or 0.
- Blocks go tier by tier as above; states are installed on the engine's thread only
  (sync: right after the load's reads; async: in `get_finished`), never by the reader
  thread that pulled them (`PullTier.pulled_state` only hands the payload over).

A producer keeps each prompt's last-boundary state for pulls (the NixlConnector) and
saves its states into the store (every K blocks and at the last boundary).

Per-tier counters appear in `LLM.stats` as `kv_tier<i>_<counter>_blocks`, `<i>`
being the tier's position in `connectors`: `hit` (blocks planned to load from
it), `loaded` (verified from it), `failed` (missing or bad there),
`fallen_through` (failed there and tried in a later tier), `saved`, `save_failed`;
a hybrid's also `kv_tier<i>_loaded_states` (the load's state came from that tier).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kvrecover.config import KVTransferConfig
from kvrecover.kv_layout import KVCacheLayout
from kvrecover.kv_transfer.base import KVConnectorMetadata, KVConnectorRole
from kvrecover.kv_transfer.p2p.nixl_connector import NixlConnector, NixlMetadata
from kvrecover.kv_transfer.p2p.pull_tier import IN_CACHE, PullTier
from kvrecover.kv_transfer.stores.block_store import StoredBlock
from kvrecover.kv_transfer.stores.reader_threads import ReadCancel
from kvrecover.kv_transfer.stores.shared_storage import SharedStorageConnector
from kvrecover.kv_transfer.stores.store_base import prefix_before_none
from kvrecover.kv_transfer.stores.store_connector import (
    BatchedBlockStore,
    BlockStoreConnector,
    BlockTransfer,
    StorageConnectorMetadata,
)
from kvrecover.kv_transfer.tiered.config import TieredSettings, tier_config

if TYPE_CHECKING:
    from kvrecover.kv_transfer.request_view import KVRequestView
    from kvrecover.kv_transfer.stores.state_entries import RecurrentStateAccess
    from kvrecover.step_messages import SchedulerOutput

COUNTERS = ("hit", "loaded", "failed", "fallen_through", "saved", "save_failed")


@dataclass
class Tier:
    """One configured store: its position in `connectors`, its connector and what it does."""

    index: int
    connector: BlockStoreConnector | SharedStorageConnector
    loads: bool
    saves: bool

    @property
    def store(self) -> BatchedBlockStore:
        return self.connector.store


@dataclass
class TieredMetadata(StorageConnectorMetadata):
    """The stores' loads and saves, and the P2P tier's pulls and kept prompts."""

    p2p: KVConnectorMetadata = field(default_factory=KVConnectorMetadata)


@dataclass
class TieredTransfer(BlockTransfer):
    """A load, with the tier (index into `connectors`) each block is read from first."""

    first_tiers: list[int] = field(default_factory=list)


class TieredConnector(BlockStoreConnector):
    """Loads each block from the first tier that has it, falling through on failure."""

    settings_class = TieredSettings
    # A hybrid's states: with one store tier (`recurrent_states_supported`), see above.
    supports_recurrent_states = True
    keeps_resume_states = True

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, layout: KVCacheLayout):
        self.tiers: list[Tier] = []
        self.front: PullTier | None = None  # a P2P connector before the stores
        self._lookups: dict[str, dict[bytes, int]] = {}
        super().__init__(config, role, layout)
        self._counts = {f"kv_tier{i}_{name}_blocks": 0
                        for i in range(len(self.settings.connectors)) for name in COUNTERS}
        if self._stateful:
            self._counts.update((f"kv_tier{i}_loaded_states", 0)
                                for i in range(len(self.settings.connectors)))

    @classmethod
    def recurrent_states_supported(cls, config: KVTransferConfig) -> bool:
        """True with one block-store tier (after an optional NixlConnector); a ValueError
        that says so otherwise: a hybrid's states live in one store (`store_states`)."""
        stores = _store_tiers(config)
        if len(stores) != 1:
            raise ValueError(
                "TieredConnector on a model with linear-attention layers (recurrent states) "
                "takes exactly one block-store tier, optionally behind a NixlConnector: its "
                f"states are stored in and loaded from that store; got {len(stores)} "
                f"({', '.join(stores) or 'none'})")
        return True

    def _open_store(self) -> BatchedBlockStore:
        from kvrecover.kv_transfer.registry import connector_class

        entries = self.settings.connectors
        marked = any(entry.save is not None for entry in entries)
        for index, entry in enumerate(entries):
            inner = tier_config(self.config, index, entry)
            try:
                cls = connector_class(inner)
                if index == 0 and issubclass(cls, NixlConnector):
                    self.front = PullTier(cls(inner, self.role, self.layout))
                    continue
                if (not issubclass(cls, (BlockStoreConnector, SharedStorageConnector))
                        or issubclass(cls, TieredConnector)):
                    raise ValueError(
                        f"{inner.kv_connector} is not a block-store connector; tiers must be "
                        "SharedStorageConnector, RedisConnector or another BlockStoreConnector "
                        "(the first may be a NixlConnector)")
                connector = cls(inner, self.role, self.layout)
            except ValueError as error:
                raise ValueError(f"connectors[{index}] ({inner.kv_connector}): {error}") from error
            saves = inner.is_producer and (bool(entry.save) if marked else True)
            self.tiers.append(Tier(index, connector, inner.is_consumer, saves))
        if not self.tiers:
            raise ValueError("TieredConnector needs a block-store tier after the NixlConnector "
                             "(for pulls alone, use the NixlConnector itself)")
        if self.layout.has_recurrent_layers:
            self.recurrent_states_supported(self.config)  # the resolver's check, if skipped
        return self.tiers[0].store  # the codec every tier shares (one engine layout)

    def _default_load_timeout_s(self) -> float:
        pulls = 0.0 if self.front is None else self.front.connector.load_timeout_s
        return pulls + sum(tier.connector.load_timeout_s for tier in self.tiers)

    def _count(self, tier: int, name: str, amount: int = 1) -> None:
        self._counts[f"kv_tier{tier}_{name}_blocks"] += amount

    # ----- scheduler role -------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: KVRequestView,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        tokens, is_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if self.front is None or not self.config.is_consumer:
            return tokens, is_async
        pulled = self.front.claim(request, num_computed_tokens)
        return max(tokens, pulled), self.async_load and max(tokens, pulled) > 0

    def update_state_after_alloc(self, request: KVRequestView, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        super().update_state_after_alloc(request, block_ids, num_external_tokens)
        if self.front is not None:
            self.front.plan(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> TieredMetadata:
        stores = super().build_connector_meta(scheduler_output)
        metadata = TieredMetadata(stores.loads, stores.saves, stores.state_saves)
        if self.front is not None:
            metadata.p2p = self.front.connector.build_connector_meta(scheduler_output)
        return metadata

    def kv_transfer_params(self, request: KVRequestView) -> dict[str, Any] | None:
        return None if self.front is None else self.front.connector.kv_transfer_params(request)

    def _count_stored_prefix(self, request: KVRequestView, keys: Sequence[bytes]) -> int:
        first_tiers: list[int | None] = [None] * len(keys)
        pending = list(range(len(keys)))
        for tier in self.tiers:
            if not pending:
                break
            if not tier.loads:
                continue
            present = tier.store.exists_many([keys[position] for position in pending])
            for position, found in zip(pending, present):
                if found:
                    first_tiers[position] = tier.index
            pending = [position for position in pending if first_tiers[position] is None]
        planned = prefix_before_none(first_tiers)
        self._lookups[request.request_id] = dict(zip(keys, planned))
        return len(planned)

    def _new_load(self, request: KVRequestView, block_ids: list[int],
                  keys: Sequence[bytes]) -> BlockTransfer:
        # By key: a load of several KV cache groups skips some of the keys looked up.
        planned = self._lookups.pop(request.request_id, {})
        default = self._first_load_tier()
        first_tiers = [planned.get(key, default) for key in keys]
        for tier in first_tiers:
            self._count(tier, "hit")
        return TieredTransfer(request.request_id, block_ids, keys, is_async=self.async_load,
                              first_tiers=first_tiers)

    def _first_load_tier(self) -> int:
        return next((tier.index for tier in self.tiers if tier.loads), 0)

    def request_finished(self, request: KVRequestView, block_ids: list[int]) -> bool:
        self._lookups.pop(request.request_id, None)
        kept = super().request_finished(request, block_ids)
        if self.front is not None:
            self.front.forget(request)
            kept = self.front.connector.request_finished(request, block_ids) or kept
        return kept

    # ----- worker role: the P2P tier ---------------------------------------------------
    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        if self.front is not None:
            self.front.connector.register_kv_caches(kv_caches)

    def register_recurrent_states(self, states: RecurrentStateAccess) -> None:
        super().register_recurrent_states(states)
        if self.front is not None:
            self.front.connector.register_recurrent_states(states)

    def wait_for_save(self) -> None:
        super().wait_for_save()
        if self.front is not None:  # a hybrid producer copies out the states it keeps
            self.front.connector.wait_for_save()

    def discard_saves_for(self, request_ids: set[str]) -> None:
        super().discard_saves_for(request_ids)
        if self.front is not None:
            self.front.connector.discard_saves_for(request_ids)

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(metadata)
        if self.front is not None and isinstance(metadata, TieredMetadata) \
                and isinstance(metadata.p2p, NixlMetadata):
            self.front.connector.bind_connector_metadata(metadata.p2p)  # the kept prompts
            self.front.take(metadata.p2p)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        if self.front is not None:
            self.front.connector.clear_connector_metadata()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, receiving = super().get_finished(finished_req_ids)
        if self.front is not None:
            self.front.forget_states(finished_req_ids)
            released, _ = self.front.connector.get_finished(finished_req_ids)
            sending = (sending or set()) | (released or set()) or None
        return sending, receiving

    def _install(self, transfer: BlockTransfer, blocks: list[StoredBlock | None]) -> None:
        """Install what the stores read; the blocks a pull verified are in place."""
        if self.front is not None:
            pairs = [(b, k, x) for b, k, x in zip(transfer.block_ids, transfer.keys, blocks)
                     if x is not IN_CACHE]
            transfer = BlockTransfer(transfer.request_id, [b for b, _, _ in pairs],
                                     [k for _, k, _ in pairs])
            blocks = [x for _, _, x in pairs]
        super()._install(transfer, blocks)

    # ----- worker role ----------------------------------------------------------------
    def _read_states(self, transfers: list[BlockTransfer], cancelled: ReadCancel,
                     ) -> list[bytes | None]:
        """Each load's state at its end: the one its pull verified there, else the
        store's (on the load's reader thread, after its blocks; installed by the caller
        on the engine's thread)."""
        pulled = [None if self.front is None else
                  self.front.pulled_state(t.request_id, t.state_position) for t in transfers]
        rest = [t for t, payload in zip(transfers, pulled) if payload is None]
        read = iter(super()._read_states(rest, cancelled) if rest else [])
        payloads = [payload if payload is not None else next(read) for payload in pulled]
        pulls = sum(payload is not None for payload in pulled)
        stored = sum(payload is not None for payload in payloads) - pulls
        self._counts["kv_tier0_loaded_states"] += pulls  # tier 0 is the pull when it pulls
        self._counts[f"kv_tier{self.tiers[0].index}_loaded_states"] += stored
        return payloads

    def _read_blocks(self, transfers: list[BlockTransfer],
                     cancelled: threading.Event) -> list[list[StoredBlock | None]]:
        """Read every block from its first tier, then each failed one from later tiers:
        one batched read per tier per call (on the load's reader thread, so the load's
        deadline bounds all the tiers together)."""
        results: list[list[StoredBlock | None]] = [[None] * len(t.keys) for t in transfers]
        pending = [(t, p) for t, transfer in enumerate(transfers) for p in range(len(transfer.keys))]
        if self.front is not None:
            fence = cancelled if isinstance(cancelled, ReadCancel) else None
            loaded, failed = self.front.pull([t.request_id for t in transfers],
                                             self.load_timeout_s, fence)
            for t, p in pending:
                if transfers[t].block_ids[p] in loaded:
                    results[t][p] = IN_CACHE
            pending = [(t, p) for t, p in pending if results[t][p] is None]
            self._count(0, "loaded", len(loaded))
            self._count(0, "failed", len(failed))
        for tier in self.tiers:
            if not pending or cancelled.is_set():
                break
            if not tier.loads:
                continue
            todo = [(t, p) for t, p in pending if _first_tier(transfers[t], p) <= tier.index]
            if not todo:
                continue
            raws = tier.store.read_many([transfers[t].keys[p] for t, p in todo])
            for (t, p), raw in zip(todo, raws):
                transfer = transfers[t]
                block = self._verified_block(transfer.request_id, transfer.block_ids[p],
                                             transfer.keys[p], raw, cancelled)
                results[t][p] = block
                self._count(tier.index, "failed" if block is None else "loaded")
            pending = [(t, p) for t, p in pending if results[t][p] is None]
            later = any(other.loads for other in self.tiers if other.index > tier.index)
            if later:
                failed_here = sum(results[t][p] is None for t, p in todo)
                self._count(tier.index, "fallen_through", failed_here)
        return results

    def _save_blocks(self, blocks: dict[bytes, int]) -> int:
        """Each saving tier gets the blocks it lacks; each block is encoded once."""
        saving = {tier.index: tier for tier in self.tiers if tier.saves}
        todo = {index: self._missing(tier.store, blocks) for index, tier in saving.items()}
        union = list(dict.fromkeys(key for keys in todo.values() for key in keys))
        if not union:
            return 0
        self._suspect_keys.difference_update(union)
        encoded = self._encoded(union, blocks)
        entries = dict(encoded)
        failures = 0
        for index, keys in todo.items():
            failed = saving[index].store.write_many([(key, entries[key]) for key in keys])
            self._count(index, "saved", len(keys) - failed)
            self._count(index, "save_failed", failed)
            failures += failed
        self.store.recycle(encoded)
        return failures

    def get_connector_stats(self) -> dict[str, int]:
        counts = self._counts
        self._counts = dict.fromkeys(counts, 0)
        if self.front is not None:
            counts = {**counts, **self.front.connector.get_connector_stats()}
        return counts

    def _close_store(self) -> None:
        # `shutdown` has cancelled this connector's own loads; each tier releases its store.
        for tier in self.tiers:
            tier.connector.shutdown()
        if self.front is not None:
            self.front.drop_pulls()
            self.front.connector.shutdown()

    def extra(self) -> dict[str, Any]:
        """The tiers' understood configs, in order."""
        return {"connectors": [tier.connector.extra() for tier in self.tiers],
                "async_load": self.async_load, "load_timeout_s": self.load_timeout_s}


def _store_tiers(config: KVTransferConfig) -> list[str]:
    """The block-store tiers `config` names (a leading NixlConnector is not one)."""
    from kvrecover.kv_transfer.registry import connector_class

    entries = TieredConnector.own_settings(config).connectors or ()
    return [entry.kv_connector for index, entry in enumerate(entries)
            if not (index == 0 and issubclass(connector_class(tier_config(config, index, entry)),
                                              NixlConnector))]


def _first_tier(transfer: BlockTransfer, position: int) -> int:
    return transfer.first_tiers[position] if isinstance(transfer, TieredTransfer) else 0
