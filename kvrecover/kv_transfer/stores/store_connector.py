"""BlockStoreConnector: the KV connector logic over any block store.

Every full prompt block is stored as its own entry keyed by the prefix-chain hash
(format: `block_store`), so any later prompt sharing a block-aligned prefix loads
it. Loads cover the longest stored run of blocks after the locally cached ones,
never the prompt's last token. `kv_role` decides what happens: producers save,
consumers load, `kv_both` does both. A subclass says where the blocks live
(`_open_store`): RedisConnector a Redis server, TieredConnector several stores
tried in order. (The folder connector, SharedStorageConnector, has its own
zero-copy path: entries move by readv/writev straight between file and cache.)

Extra config and everything but the load and save path come from `store_base`
(shared with SharedStorageConnector); `shutdown` also calls `_close_store`, where a
subclass releases its store's connections.

The store is reached only through batched calls: `exists_many` per lookup,
`read_many` per step's synchronous loads (or per async load), `write_many` per
step's saves. Every load reads and verifies into host memory on a reader thread
(`reader_threads`) and the worker copies the result into the cache itself: a sync
load waits for its reader until `load_timeout_s` at most, an async one until the
worker reports it finished, so a read that missed its deadline can never write into
blocks that were given to someone else, and a store that trickles or hangs never
blocks the engine past the deadline.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Protocol

import torch

from kvrecover.kv_transfer.stores.block_store import (
    BlockLoadError,
    StoredBlock,
    payload_checksum,
)
from kvrecover.kv_transfer.stores.cache_copy import encode_blocks, gather_blocks, scatter_blocks
from kvrecover.kv_transfer.stores.store_base import (
    BlockTransfer,
    StorageConnectorMetadata,
    StoreConnectorBase,
)

__all__ = ["BatchedBlockStore", "BlockStoreConnector", "BlockTransfer", "StorageConnectorMetadata"]

logger = logging.getLogger(__name__)


class BatchedBlockStore(Protocol):
    """What `BlockStoreConnector` needs of a store: batched lookups, reads and writes,
    and the entry codec (`block_store.BlockCodec`); `BlockStore` (a folder) and
    `RedisBlockStore` are two."""

    def exists_many(self, keys: list[bytes]) -> list[bool]:
        """Whether an entry exists for each key (not yet verified)."""
        ...

    def read_many(self, keys: list[bytes]) -> list[bytes | BlockLoadError]:
        """Each key's raw entry, or the BlockLoadError that reading it gave."""
        ...

    def write_many(self, entries: list[tuple[bytes, memoryview]]) -> int:
        """Store each (key, encoded entry); how many writes failed (never raises)."""
        ...

    def parse(self, key: bytes, raw: bytes) -> StoredBlock:
        """Verify a raw entry; raise BlockLoadError if it is bad."""
        ...

    def new_entry(self) -> tuple[bytearray, torch.Tensor]:
        """A blank entry and a writable view of its payload as one block."""
        ...

    def seal(self, key: bytes, entry: bytearray) -> memoryview:
        """Write the header of a filled entry from `new_entry`."""
        ...

    def encode(self, key: bytes, block: torch.Tensor) -> memoryview:
        """The stored form of one block."""
        ...

    def recycle(self, entries: Sequence[tuple[bytes, memoryview | bytes]]) -> None:
        """Take back written entries for reuse by `new_entry`."""
        ...


class BlockStoreConnector(StoreConnectorBase):
    """Saves and loads KV blocks through the block store `_open_store` returns (see
    module docstring); subclasses supply the store."""

    def _open_store(self) -> BatchedBlockStore:
        """The block store this connector reads and writes (both roles call it once, at
        construction)."""
        raise NotImplementedError(f"{type(self).__name__} must say where its blocks live")

    # One batched read for every synchronous load of the step, under one deadline.
    batched_sync_reads = True

    # ----- worker role ----------------------------------------------------------------
    def _read_sync(self, transfers: list[BlockTransfer],
                   cancelled: threading.Event) -> list[list[StoredBlock | None]]:
        return self._read_blocks(transfers, cancelled)

    def _read_blocks(self, transfers: list[BlockTransfer],
                     cancelled: threading.Event) -> list[list[StoredBlock | None]]:
        """Read and verify the transfers' blocks with one batched store read (on a reader
        thread); per transfer a list with None for each block that failed. `cancelled`
        (set at the load's deadline) ends the work early (None from there on)."""
        raws = self.store.read_many([key for transfer in transfers for key in transfer.keys])
        results, start = [], 0
        for transfer in transfers:
            count = len(transfer.keys)
            results.append(self._verified_blocks(transfer, raws[start : start + count], cancelled))
            start += count
        return results

    def _verified_blocks(self, transfer: BlockTransfer, raws: list[bytes | BlockLoadError],
                         cancelled: threading.Event) -> list[StoredBlock | None]:
        """Parse a transfer's raw entries; None for each bad one. Every block is checked,
        so that only the blocks that failed are reported (a cluster node lost costs its
        own blocks, not every block after its first)."""
        blocks: list[StoredBlock | None] = []
        for block_id, key, raw in zip(transfer.block_ids, transfer.keys, raws):
            if cancelled.is_set():
                break
            blocks.append(self._verified_block(transfer.request_id, block_id, key, raw,
                                               cancelled))
        return blocks + [None] * (len(transfer.block_ids) - len(blocks))

    def _verified_block(self, request_id: str, block_id: int, key: bytes,
                        raw: bytes | BlockLoadError, cancelled: threading.Event,
                        ) -> StoredBlock | None:
        """One raw entry through the read filter and the checks; None if it is bad."""
        try:
            if isinstance(raw, BlockLoadError):
                raise raw
            if self._read_filter is not None:
                raw = self._read_filter(request_id, block_id, key, raw, cancelled)
            return self.store.parse(key, raw)
        except BlockLoadError as error:
            logger.warning("KV block %s failed to load: %s", key.hex(), error)
            self._suspect_keys.add(key)  # a later save of this block may replace it
        except Exception as error:  # a failing read is an invalid block, never a crash
            logger.warning("KV block %s failed to load: %r", key.hex(), error)
        return None

    def _install(self, transfer: BlockTransfer, blocks: list[StoredBlock | None]) -> None:
        """Copy the verified blocks into the cache; report every other block as invalid
        (the scheduler recomputes from the first invalid one)."""
        pairs = list(zip(transfer.block_ids, blocks))
        invalid = [block_id for block_id, block in pairs if block is None]
        block_ids = [block_id for block_id, block in pairs if block is not None]
        loaded = [block for _, block in pairs if block is not None]
        if loaded:
            scatter_blocks(self._kv_caches, block_ids, [block.tensor for block in loaded])
            if self.verify_after_load:
                invalid += self._mismatched(block_ids, loaded)
        if invalid:
            self._invalid_block_ids.update(invalid)
            self._failed_requests.add(transfer.request_id)

    def _mismatched(self, block_ids: list[int], blocks: list[StoredBlock]) -> list[int]:
        """The blocks that do not hold, in the engine's own cache, the stored bytes."""
        mismatched = []
        for block_id, block, cached in zip(block_ids, blocks,
                                           gather_blocks(self._kv_caches, block_ids)):
            if payload_checksum(cached) != block.checksum:
                logger.warning("KV block %d does not match its stored checksum after the load",
                               block_id)
                mismatched.append(block_id)
        return mismatched

    def _read_async(self, transfer: BlockTransfer,
                    cancelled: threading.Event) -> list[StoredBlock | None]:
        return self._read_blocks([transfer], cancelled)[0]

    def wait_for_save(self) -> None:
        metadata = self._get_metadata_of(StorageConnectorMetadata)
        # KV computed on top of a failed load is garbage: never store it.
        skipped = self._failed_requests | self._discarded_saves
        self._save_states(metadata, skipped)
        blocks = {key: block_id for transfer in metadata.saves
                  if transfer.request_id not in skipped
                  for block_id, key in zip(transfer.block_ids, transfer.keys)}
        if blocks:
            self._save_failures += self._save_blocks(blocks)

    def _save_blocks(self, blocks: dict[bytes, int]) -> int:
        """Save key -> cache block id where the store lacks it (one batched check, one
        batched write); returns how many saves failed."""
        todo = self._missing(self.store, blocks)
        if not todo:
            return 0  # already stored (by us or another producer)
        self._suspect_keys.difference_update(todo)
        entries = self._encoded(todo, blocks)
        failures = self.store.write_many(entries)
        self.store.recycle(entries)
        return failures

    def _missing(self, store: BatchedBlockStore, blocks: dict[bytes, int]) -> list[bytes]:
        """The keys `store` lacks, or holds an entry of that failed to load."""
        keys = list(blocks)
        present = store.exists_many(keys)
        return [key for key, found in zip(keys, present) if key in self._suspect_keys or not found]

    def _encoded(self, keys: list[bytes], blocks: dict[bytes, int]) -> list[tuple[bytes, memoryview]]:
        """The stored form of the cache blocks `blocks[key]` (one codec serves every store)."""
        return encode_blocks(self._kv_caches, self.store, blocks, keys)
