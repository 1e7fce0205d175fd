"""A store connector's recurrent-state I/O: a hybrid model's states as store entries.

`StoreConnectorBase` (`store_base.py`) keeps one `StoreStates` when the model has
linear-attention layers (layers in no KV cache group). Its scheduler role asks it
which boundary a claim may end at (`last_boundary`), which checkpointed states a
producer's step stores (`plan_saves`) and what a load carries (`plan_load`); its
worker role reads and verifies states (`read`), installs them in the request's state
slot (`install`), keeps a failed load's resume state (`keep_resume_state`) and stores
the step's checkpoints (`save`). The entry format is `state_entries`'.

Where a failed load resumes (rule 8). A producer stores the state at the prompt's last
loadable boundary and at every multiple of K = `state_interval_blocks` blocks before it.
A consumer's load carries, besides the state at its end, the stored-state boundaries
strictly inside it. When its KV from block b on (or its end state) failed, the worker
reads the state at the latest of them at or before b's start, B (a second, bounded,
checksummed read, on a failure only) and keeps it as the request's resume state; if
that read fails, it reports the block ending at B invalid too, so the first invalid
block moves before B, and tries the next earlier one (at most `MAX_RESUME_READS`
reads; after the last, the block ending at the earliest is reported invalid). So the
first invalid block f the scheduler sees always names the state the worker keeps:
the latest multiple of K blocks inside the load at or before f, if any: both sides
pick it with `kv_layout.resume_points` and `latest_resume_point`
(`engine/state_checkpoints.StateCheckpoints.loaded_resume_point` on the scheduler's).
Reading every boundary's state with each load instead would cost up to the states'
share of the stored bytes on every load, failed or not; one at a time on a failure
costs nothing on the way that matters.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvrecover.kv_layout import latest_resume_point, resume_points, stores_state_at
from kvrecover.kv_transfer.base import ReadFilter
from kvrecover.kv_transfer.stores.reader_threads import ReadCancel
from kvrecover.kv_transfer.stores.state_entries import (
    STATE_READ_BLOCK_ID,
    RecurrentStateAccess,
    decode_state,
    encode_state,
    state_key,
    state_keys,
)
from kvrecover.kv_transfer.stores.transfers import BlockTransfer, StateSave

if TYPE_CHECKING:
    from kvrecover.kv_transfer.request_view import KVRequestView

logger = logging.getLogger(__name__)

# Reads of earlier states after a failed load, at most (each bounded by the load deadline).
MAX_RESUME_READS = 2


class StoreStates:
    """The recurrent states of one connector's store (`store`: `exists_many`,
    `read_many`, `write_many` and the entry codec, as `store_connector.BatchedBlockStore`)."""

    def __init__(self, store: Any, block_size: int, interval: int) -> None:
        self.store = store
        self.block_size = block_size
        self.interval = interval  # K: a state every K blocks (`state_interval_blocks`)
        self.states: RecurrentStateAccess | None = None  # worker role (`register`)

    # ----- scheduler role -----------------------------------------------------------
    def last_boundary(self, keys: Sequence[bytes], first: int, end: int) -> int:
        """The last block boundary in (first, end] whose recurrent state is stored, else
        `first` (a hybrid's claim must end where its state can be supplied)."""
        if end <= first:
            return first
        candidates = list(range(end, first, -1))
        present = self.store.exists_many([state_key(keys[b - 1]) for b in candidates])
        return next((b for b, found in zip(candidates, present) if found), first)

    def plan_saves(self, request: KVRequestView, checkpoints: list[tuple[int, int]],
                   saves: list[StateSave]) -> None:
        """Store the states this step checkpoints at the prompt's last loadable boundary
        (where a consumer's claim ends) and at every K-th block boundary before it."""
        for position, slot in checkpoints:
            boundary, partial = divmod(position, self.block_size)
            if not partial and stores_state_at(
                    boundary, request.num_prompt_tokens, self.block_size, self.interval):
                saves.append(StateSave(request.request_id, slot,
                                       request.block_hashes[boundary - 1]))

    def plan_load(self, load: BlockTransfer, request: KVRequestView, first: int,
                  last: int) -> None:
        """Give a load of blocks [first, last) its state at the end, its blocks'
        positions and the stored-state boundaries strictly inside it (resume points)."""
        hashes = request.block_hashes
        load.state_hash = hashes[last - 1]
        load.state_position = last * self.block_size
        tables = request.block_tables or ((),)
        position_of = {table[p]: p for table in tables for p in range(first, min(last, len(table)))}
        load.block_positions = [position_of.get(block_id, first) for block_id in load.block_ids]
        load.resume_points = [(b * self.block_size, hashes[b - 1])
                              for b in resume_points(first, last, self.interval)]

    # ----- worker role ----------------------------------------------------------------
    def register(self, states: RecurrentStateAccess) -> None:
        self.states = states

    def _keys(self, states: RecurrentStateAccess, block_hash: bytes) -> list[bytes]:
        """The chunk keys of the state at the end of the block of this chain hash."""
        return state_keys(block_hash, states.bytes_per_checkpoint, self.store.payload_nbytes)

    def read(self, transfers: list[BlockTransfer], cancelled: ReadCancel,
             read_filter: ReadFilter | None, suspect_keys: set[bytes]) -> list[bytes | None]:
        """Read and verify the transfers' recurrent states (one batched store read, on a
        reader thread); None for each that failed (its chunks join `suspect_keys`)."""
        states = self.states
        if states is None or any(t.state_hash is None for t in transfers):
            return [None] * len(transfers)
        keys = [self._keys(states, t.state_hash) for t in transfers if t.state_hash]
        raws = self.store.read_many([key for chunk_keys in keys for key in chunk_keys])
        payloads: list[bytes | None] = []
        start = 0
        for transfer, chunk_keys in zip(transfers, keys):
            chunk_raws = raws[start : start + len(chunk_keys)]
            start += len(chunk_keys)
            try:
                filtered = []
                for key, raw in zip(chunk_keys, chunk_raws):
                    if isinstance(raw, Exception):
                        raise raw
                    if read_filter is not None:
                        raw = read_filter(transfer.request_id, STATE_READ_BLOCK_ID, key,
                                          raw, cancelled)
                    filtered.append(raw)
                payloads.append(decode_state(self.store, chunk_keys, states.state_signature,
                                             states.bytes_per_checkpoint, filtered))
            except Exception as error:  # a failing read is a failed load, never a crash
                logger.warning("recurrent state at %s failed to load: %r",
                               chunk_keys[0].hex(), error)
                suspect_keys.update(chunk_keys)
                payloads.append(None)
        return payloads

    def install(self, transfer: BlockTransfer, payload: bytes | None) -> None:
        """Give the request its loaded state at the load's end (None: zeros there; the
        connector then fails the load)."""
        if self.states is not None:
            self.states.install(transfer.request_id, transfer.state_position, payload)

    def keep_resume_state(self, transfer: BlockTransfer, invalid: set[int],
                          read: Callable[[BlockTransfer], bytes | None]) -> set[int]:
        """After a load's installs (`invalid`: the blocks reported invalid so far): if some
        of its blocks failed, read (`read`: a bounded, verified read of one transfer's
        state) the state at its latest resume point at or before the first failed one
        and keep it as the request's resume state. Returns the blocks to report invalid
        as well (those ending at a resume point whose state failed: see the module)."""
        states = self.states
        failed = [p for block_id, p in zip(transfer.block_ids, transfer.block_positions)
                  if block_id in invalid]
        if states is None or not failed or not transfer.resume_points:
            return set()
        first_failed = min(failed)
        hash_at = dict(transfer.resume_points)
        boundaries = [position // self.block_size for position, _ in transfer.resume_points]
        marked: set[int] = set()
        for _ in range(MAX_RESUME_READS):
            boundary = latest_resume_point(boundaries, first_failed)
            if boundary is None:
                return marked
            position = boundary * self.block_size
            block_hash = hash_at[position]
            payload = read(dataclasses.replace(transfer, state_hash=block_hash,
                                               state_position=position))
            if payload is not None:
                states.keep_resume_state(transfer.request_id, position, payload)
                return marked
            first_failed = boundary - 1
            marked |= self._blocks_at(transfer, first_failed)
        earliest = boundaries[0] - 1
        if earliest < first_failed:  # out of reads: no resume point of this load
            marked |= self._blocks_at(transfer, earliest)
        return marked

    @staticmethod
    def _blocks_at(transfer: BlockTransfer, position: int) -> set[int]:
        """The load's blocks at block index `position` (one per KV cache group)."""
        return {block_id for block_id, p in zip(transfer.block_ids, transfer.block_positions)
                if p == position}

    def save(self, saves: list[StateSave], skipped: set[str], suspect_keys: set[bytes]) -> int:
        """Store the checkpointed states of `saves`, except those of `skipped` requests or
        that the store holds already (and not suspect); returns the failed writes."""
        states = self.states
        if states is None or not saves:
            return 0
        todo = [save for save in saves if save.request_id not in skipped]
        present = self.store.exists_many([state_key(save.block_hash) for save in todo])
        entries = []
        for save, found in zip(todo, present):
            keys = self._keys(states, save.block_hash)
            if found and not suspect_keys.intersection(keys):
                continue
            suspect_keys.difference_update(keys)
            entries += encode_state(self.store, keys, states.state_signature,
                                    states.read_checkpoint(save.slot))
        return self.store.write_many(entries) if entries else 0
