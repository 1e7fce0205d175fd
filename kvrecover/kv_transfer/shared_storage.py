"""SharedStorageConnector: KV blocks in a folder that prefill and decode share.

Every full prompt block is stored as its own file keyed by the prefix-chain hash
(format: `block_store`), so any later prompt sharing a block-aligned prefix loads
it. Loads cover the longest stored run of blocks after the locally cached ones,
never the prompt's last token. `kv_role` decides what happens: producers save,
consumers load, `kv_both` does both.

Extra config (`kv_connector_extra_config`): `shared_storage_path`, the folder of the
store (required), plus `async_load`, `load_timeout_s` (30) and `verify_after_load`
as for every store connector (`store_base`, which also holds the scheduler role,
the async-load bookkeeping and shutdown; this module keeps only the folder's own
load and save path).

Async loads read and verify into host memory on a thread; the worker copies the
result into the cache only when it reports the load finished, so a load that
missed its deadline can never write into blocks that were given to someone else.
Sync loads on the CPU read each entry straight into its cache blocks (which the
request owns, and which nothing reads before this step's forward pass) and hash it
there, so the load's checksum is already the end-to-end check `verify_after_load`
asks for; saves on the CPU write from the cache itself (`paged_blocks`). On a GPU,
entries are read into pinned memory and uploaded in one copy per transfer.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvrecover.config import KVTransferConfig
from kvrecover.kv_layout import KVCacheLayout
from kvrecover.kv_transfer.base import KVConnectorRole
from kvrecover.kv_transfer.block_store import BlockLoadError, BlockStore
from kvrecover.kv_transfer.paged_blocks import PagedBlocks
from kvrecover.kv_transfer.store_base import (
    BlockTransfer,
    StorageConnectorMetadata,
    StoreConnectorBase,
)

if TYPE_CHECKING:
    from kvrecover.engine.request import Request

__all__ = ["BlockTransfer", "LoadedBlock", "SharedStorageConnector", "StorageConnectorMetadata"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedBlock:
    """A block that `_read_blocks` read and verified: its payload checksum and where
    its bytes are (row `position` of `staging`, or already in the cache if None)."""

    checksum: int
    staging: torch.Tensor | None
    position: int


class SharedStorageConnector(StoreConnectorBase):
    """Saves and loads KV blocks through a shared folder (see module docstring)."""

    extra_config_keys = ("shared_storage_path", *StoreConnectorBase.extra_config_keys)

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, layout: KVCacheLayout):
        super().__init__(config, role, layout)
        self._paged: PagedBlocks | None = None  # set by register_kv_caches

    def _open_store(self) -> BlockStore:
        path = self.config.get_extra("shared_storage_path")
        if not path:
            raise ValueError(
                f"{type(self).__name__} needs kv_connector_extra_config['shared_storage_path']"
            )
        if not isinstance(path, (str, os.PathLike)):
            raise ValueError(
                "kv_connector_extra_config['shared_storage_path'] must be a folder path "
                f"(a string), got {path!r}"
            )
        return BlockStore(path, self.layout)

    # ----- scheduler role -----------------------------------------------------------
    def _count_stored_prefix(self, request: Request, keys: list[bytes]) -> int:
        # One stat per block, stopping at the first miss: a folder has no batched lookup.
        return next((i for i, key in enumerate(keys) if not self.store.exists(key)), len(keys))

    # ----- worker role ----------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        self._paged = PagedBlocks(kv_caches)

    def start_load_kv(self, kv_caches: list[torch.Tensor]) -> None:
        metadata: StorageConnectorMetadata = self._get_connector_metadata()
        for transfer in metadata.loads:
            if transfer.is_async:
                self._start_async(transfer)
            else:
                cancelled = threading.Event()
                deadline = threading.Timer(self.load_timeout_s, cancelled.set)
                deadline.start()
                try:
                    blocks = self._read_blocks(transfer, cancelled)
                finally:
                    deadline.cancel()
                self._install(transfer, blocks)

    def _read_blocks(self, transfer: BlockTransfer, cancelled: threading.Event) -> list[LoadedBlock | None]:
        """Read and verify a request's blocks; None from the first failure on. Sync loads
        on the CPU land in the cache blocks themselves, the others in a staging buffer."""
        paged = self._paged
        staging = None if paged.direct and not transfer.is_async else paged.staging(
            len(transfer.block_ids))
        rows = None if staging is None else memoryview(staging.numpy()).cast("B")
        row_nbytes = paged.block_nbytes
        blocks: list[LoadedBlock | None] = []
        for position, (block_id, key) in enumerate(zip(transfer.block_ids, transfer.keys)):
            if cancelled.is_set():
                break
            parts = paged.parts(block_id) if rows is None else [
                rows[position * row_nbytes : (position + 1) * row_nbytes]]
            try:
                if self._read_filter is None:
                    checksum = self.store.read_into(key, parts)
                else:
                    raw = self._read_filter(transfer.request_id, block_id, key,
                                            self.store.read_raw(key), cancelled)
                    checksum = self.store.parse_into(key, raw, parts)
                blocks.append(LoadedBlock(checksum, staging, position))
            except BlockLoadError as error:
                logger.warning("KV block %s failed to load: %s", key.hex(), error)
                self._suspect_keys.add(key)  # a later save of this block may replace it
                break
            except Exception as error:  # a failing read is an invalid block, never a crash
                logger.warning("KV block %s failed to load: %r", key.hex(), error)
                break
        return blocks + [None] * (len(transfer.block_ids) - len(blocks))

    def _read_async(self, transfer: BlockTransfer, cancelled: threading.Event) -> list[LoadedBlock | None]:
        return self._read_blocks(transfer, cancelled)

    def _install(self, transfer: BlockTransfer, blocks: list[LoadedBlock | None]) -> None:
        """Copy the leading verified blocks into the cache unless they were read there;
        report every block from the first bad one on as invalid."""
        count = next((i for i, block in enumerate(blocks) if block is None), len(blocks))
        if count and blocks[0].staging is not None:
            block_ids = transfer.block_ids[:count]
            self._paged.scatter(block_ids, blocks[0].staging)
            self._paged.release(blocks[0].staging)
            if self.verify_after_load:
                count = self._verified_prefix(block_ids, blocks[:count])
        # Blocks read in place were hashed in the cache: that check was end to end already.
        if count < len(blocks):
            self._invalid_block_ids.update(transfer.block_ids[count:])
            self._failed_requests.add(transfer.request_id)

    def _verified_prefix(self, block_ids: list[int], blocks: list[LoadedBlock]) -> int:
        """How many leading blocks hold, in the engine's own cache, the stored bytes."""
        for position, checksum in enumerate(self._paged.checksums(block_ids)):
            if checksum != blocks[position].checksum:
                logger.warning("KV block %d does not match its stored checksum after the load",
                               block_ids[position])
                return position
        return len(blocks)

    def wait_for_save(self) -> None:
        metadata: StorageConnectorMetadata = self._get_connector_metadata()
        for transfer in metadata.saves:
            # KV computed on top of a failed load is garbage: never store it.
            if transfer.request_id in self._failed_requests | self._discarded_saves:
                continue
            todo = [(block_id, key) for block_id, key in zip(transfer.block_ids, transfer.keys)
                    if key in self._suspect_keys or not self.store.exists(key)]
            if not todo:
                continue  # already stored (by us or another producer)
            paged = self._paged
            gathered = None if paged.direct else paged.gather([block_id for block_id, _ in todo])
            for position, (block_id, key) in enumerate(todo):
                self._suspect_keys.discard(key)
                try:
                    if gathered is None:
                        self.store.write_parts(key, paged.parts(block_id))
                    else:
                        self.store.write(key, gathered[position])
                except Exception as error:
                    self._save_failures += 1
                    logger.debug("KV block %s not saved: %r", key.hex(), error)

    def extra(self) -> dict[str, Any]:
        """The extra config this connector understood (for logs and tests)."""
        return {"shared_storage_path": str(self.store.root), **super().extra()}
