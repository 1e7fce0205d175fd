"""A store connector's recurrent-state I/O: a hybrid model's states as store entries.

`StoreConnectorBase` (`store_base.py`) keeps one `StoreStates` when the model has
linear-attention layers (layers in no KV cache group). Its scheduler role asks it
which boundary a claim may end at (`last_boundary`) and which checkpointed states a
producer's step stores (`plan_saves`); its worker role reads and verifies states
(`read`), installs them in the request's state slot (`install`) and stores the step's
checkpoints (`save`). The entry format is `state_entries`'.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvrecover.kv_transfer.base import ReadFilter
from kvrecover.kv_transfer.reader_threads import ReadCancel
from kvrecover.kv_transfer.state_entries import (
    STATE_READ_BLOCK_ID,
    RecurrentStateAccess,
    decode_state,
    encode_state,
    state_key,
    state_keys,
)
from kvrecover.kv_transfer.transfers import BlockTransfer, StateSave

if TYPE_CHECKING:
    from kvrecover.kv_transfer.request_view import KVRequestView

logger = logging.getLogger(__name__)


class StoreStates:
    """The recurrent states of one connector's store (`store`: `exists_many`,
    `read_many`, `write_many` and the entry codec, as `store_connector.BatchedBlockStore`)."""

    def __init__(self, store: Any, block_size: int) -> None:
        self.store = store
        self.block_size = block_size
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
        """Store the state at the prompt's last loadable boundary (where a consumer's claim
        ends) if this step checkpoints it."""
        boundary = (request.num_prompt_tokens - 1) // self.block_size
        for position, slot in checkpoints:
            if boundary > 0 and position == boundary * self.block_size:
                saves.append(StateSave(request.request_id, slot,
                                       request.block_hashes[boundary - 1]))

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
