"""BlockStoreConnector: the KV connector logic over any block store.

Every full prompt block is stored as its own entry keyed by the prefix-chain hash
(format: `block_store`), so any later prompt sharing a block-aligned prefix loads
it. Loads cover the longest stored run of blocks after the locally cached ones,
never the prompt's last token. `kv_role` decides what happens: producers save,
consumers load, `kv_both` does both. A subclass says where the blocks live
(`_open_store`): RedisConnector a Redis server, TieredConnector several stores
tried in order. (The folder connector, SharedStorageConnector, has its own
zero-copy path: entries move by readv/writev straight between file and cache.)

Extra config shared by all of them (`kv_connector_extra_config`):
  async_load           load in a background thread while the request waits (False)
  load_timeout_s       an async load unfinished after this long fails (30, or the
                       subclass's `_default_load_timeout_s`)
  verify_after_load    re-checksum the engine's cache blocks after a load (True)

The store is reached only through batched calls: `exists_many` per lookup,
`read_many` per step's synchronous loads (or per async load), `write_many` per
step's saves. Async loads read and verify into host memory on a thread; the
worker copies the result into the cache only when it reports the load finished,
so a load that missed its deadline can never write into blocks that were given
to someone else.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kvrecover.config import KVTransferConfig
from kvrecover.kv_layout import KVCacheLayout
from kvrecover.kv_transfer.base import (
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRole,
    ReadFilter,
)
from kvrecover.kv_transfer.block_store import (
    BlockLoadError,
    BlockStore,
    StoredBlock,
    payload_checksum,
)
from kvrecover.kv_transfer.cache_copy import encode_blocks, gather_blocks, scatter_blocks

if TYPE_CHECKING:
    from kvrecover.engine.request import Request
    from kvrecover.engine.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)


def _extra_flag(config: KVTransferConfig, key: str, default: bool) -> bool:
    value = config.get_extra(key, default)
    if not isinstance(value, bool):  # bool("false") is True: never guess
        raise ValueError(f"kv_connector_extra_config[{key!r}] must be True or False, got {value!r}")
    return value


def _extra_seconds(config: KVTransferConfig, key: str, default: float) -> float:
    value = config.get_extra(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e9:
        raise ValueError(
            f"kv_connector_extra_config[{key!r}] must be a number of seconds > 0, got {value!r}"
        )
    return float(value)


@contextlib.contextmanager
def deadline_event(cancelled: threading.Event | None, timeout_s: float) -> Iterator[threading.Event]:
    """`cancelled` itself, or, when it is None, a new event set after `timeout_s`."""
    if cancelled is not None:
        yield cancelled
        return
    event = threading.Event()
    timer = threading.Timer(timeout_s, event.set)
    timer.start()
    try:
        yield event
    finally:
        timer.cancel()


@dataclass
class BlockTransfer:
    """Blocks of one request to load or save: cache block ids and their store keys."""

    request_id: str
    block_ids: list[int]
    keys: list[bytes]
    is_async: bool = False


@dataclass
class StorageConnectorMetadata(KVConnectorMetadata):
    """One step's loads and saves."""

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)

    def loads_by_request(self) -> dict[str, tuple[list[int], bool]]:
        return {t.request_id: (t.block_ids, t.is_async) for t in self.loads}

    def num_save_blocks(self) -> int:
        return sum(len(t.block_ids) for t in self.saves)


@dataclass
class _AsyncLoad:
    transfer: BlockTransfer
    future: concurrent.futures.Future
    deadline: float
    cancelled: threading.Event


class BlockStoreConnector(KVConnectorBase):
    """Saves and loads KV blocks through the block store `_open_store` returns (see
    module docstring); subclasses supply the store."""

    extra_config_keys = ("async_load", "load_timeout_s", "verify_after_load")

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, layout: KVCacheLayout):
        super().__init__(config, role, layout)
        self.store = self._open_store()
        self.async_load = _extra_flag(config, "async_load", False)
        self.load_timeout_s = _extra_seconds(config, "load_timeout_s",
                                            self._default_load_timeout_s())
        self.verify_after_load = _extra_flag(config, "verify_after_load", True)
        self.block_size = layout.block_size
        self._read_filter: ReadFilter | None = None  # see `set_read_filter`
        # Scheduler role state.
        self._requests: dict[str, Request] = {}
        self._pending_loads: list[BlockTransfer] = []
        # Worker role state.
        self._kv_caches: list[torch.Tensor] = []
        self._invalid_block_ids: set[int] = set()
        self._failed_requests: set[str] = set()
        self._discarded_saves: set[str] = set()
        self._async_loads: dict[str, _AsyncLoad] = {}
        self._save_failures = 0
        self._suspect_keys: set[bytes] = set()

    def _open_store(self) -> BlockStore:
        """The block store this connector reads and writes (both roles call it once, at
        construction): an object with `exists_many`, `read_many`, `write_many`,
        `parse`, `encode`, `new_entry`, `seal` and `recycle` (see `block_store`)."""
        raise NotImplementedError(f"{type(self).__name__} must say where its blocks live")

    def _default_load_timeout_s(self) -> float:
        """`load_timeout_s` when the config does not set it."""
        return 30.0

    # ----- scheduler role -----------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        if not self.config.is_consumer:
            return 0, False
        keys = request.block_hashes  # the engine hashed every full prompt block
        last_loadable = (request.num_prompt_tokens - 1) // self.block_size
        first = num_computed_tokens // self.block_size
        end = first + self._count_stored_prefix(request, keys[first : min(last_loadable, len(keys))])
        num_tokens = max(0, end * self.block_size - num_computed_tokens)
        return num_tokens, self.async_load and num_tokens > 0

    def _count_stored_prefix(self, request: Request, keys: list[bytes]) -> int:
        """How many leading `keys` the store holds (one batched call)."""
        if not keys:
            return 0
        present = self.store.exists_many(keys)
        return next((i for i, found in enumerate(present) if not found), len(keys))

    def _new_load(self, request: Request, block_ids: list[int], keys: list[bytes]) -> BlockTransfer:
        """The transfer that loads `keys` into `block_ids` for `request`."""
        return BlockTransfer(request.request_id, block_ids, keys, is_async=self.async_load)

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        self._requests[request.request_id] = request
        if num_external_tokens <= 0:
            return
        first = request.num_computed_tokens // self.block_size
        count = num_external_tokens // self.block_size
        keys = request.block_hashes
        self._pending_loads.append(self._new_load(
            request, block_ids[first : first + count], keys[first : first + count]))

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
            if last <= first:
                continue
            keys = request.block_hashes
            metadata.saves.append(BlockTransfer(
                item.request_id, item.block_ids[first:last], keys[first:last],
            ))
        return metadata

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        self._requests.pop(request.request_id, None)
        return False

    # ----- worker role ----------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        self._kv_caches = kv_caches

    def start_load_kv(self, kv_caches: list[torch.Tensor]) -> None:
        metadata: StorageConnectorMetadata = self._get_connector_metadata()
        synchronous = []
        for transfer in metadata.loads:
            if transfer.is_async:
                self._start_async(transfer)
            else:
                synchronous.append(transfer)
        if not synchronous:
            return
        # One batched read for every synchronous load of the step; each load has its own deadline.
        results = self._read_blocks(synchronous, None)
        for transfer, blocks in zip(synchronous, results):
            self._install(transfer, blocks)

    def _read_blocks(self, transfers: list[BlockTransfer],
                     cancelled: threading.Event | None) -> list[list[StoredBlock | None]]:
        """Read and verify the transfers' blocks with one batched store read; per
        transfer a list with None from its first failure on. `cancelled` ends the
        work early; None gives each transfer a deadline of `load_timeout_s`."""
        raws = self.store.read_many([key for transfer in transfers for key in transfer.keys])
        results, start = [], 0
        for transfer in transfers:
            count = len(transfer.keys)
            results.append(self._verified_blocks(transfer, raws[start : start + count], cancelled))
            start += count
        return results

    def _verified_blocks(self, transfer: BlockTransfer, raws: list[bytes | BlockLoadError],
                         cancelled: threading.Event | None) -> list[StoredBlock | None]:
        """Parse a transfer's raw entries; None from the first failure on."""
        blocks: list[StoredBlock | None] = []
        with deadline_event(cancelled, self.load_timeout_s) as cancelled:
            for block_id, key, raw in zip(transfer.block_ids, transfer.keys, raws):
                if cancelled.is_set():
                    break
                block = self._verified_block(transfer.request_id, block_id, key, raw, cancelled)
                if block is None:
                    break
                blocks.append(block)
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
        """Copy the leading verified blocks into the cache; report every block from the
        first bad one on as invalid."""
        count = next((i for i, block in enumerate(blocks) if block is None), len(blocks))
        if count:
            block_ids = transfer.block_ids[:count]
            scatter_blocks(self._kv_caches, block_ids, [block.tensor for block in blocks[:count]])
            if self.verify_after_load:
                count = self._verified_prefix(block_ids, blocks[:count])
        if count < len(blocks):
            self._invalid_block_ids.update(transfer.block_ids[count:])
            self._failed_requests.add(transfer.request_id)

    def _verified_prefix(self, block_ids: list[int], blocks: list[StoredBlock]) -> int:
        """How many leading blocks hold, in the engine's own cache, the stored bytes."""
        for position, cached in enumerate(gather_blocks(self._kv_caches, block_ids)):
            if payload_checksum(cached) != blocks[position].checksum:
                logger.warning("KV block %d does not match its stored checksum after the load",
                               block_ids[position])
                return position
        return len(blocks)

    def _start_async(self, transfer: BlockTransfer) -> None:
        cancelled = threading.Event()
        future: concurrent.futures.Future = concurrent.futures.Future()

        def load() -> None:
            try:
                future.set_result(self._read_blocks([transfer], cancelled)[0])
            except BaseException as error:  # _read_blocks catches read errors; be safe
                future.set_exception(error)

        # A daemon thread: a read stuck in the kernel past its deadline must not
        # keep the process alive at exit.
        threading.Thread(target=load, name=f"kv-load-{transfer.request_id}", daemon=True).start()
        self._async_loads[transfer.request_id] = _AsyncLoad(
            transfer, future, time.monotonic() + self.load_timeout_s, cancelled
        )

    def wait_for_save(self) -> None:
        metadata: StorageConnectorMetadata = self._get_connector_metadata()
        # KV computed on top of a failed load is garbage: never store it.
        skipped = self._failed_requests | self._discarded_saves
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

    def _missing(self, store: BlockStore, blocks: dict[bytes, int]) -> list[bytes]:
        """The keys `store` lacks, or holds an entry of that failed to load."""
        keys = list(blocks)
        present = store.exists_many(keys)
        return [key for key, found in zip(keys, present) if key in self._suspect_keys or not found]

    def _encoded(self, keys: list[bytes], blocks: dict[bytes, int]) -> list[tuple[bytes, memoryview]]:
        """The stored form of the cache blocks `blocks[key]` (one codec serves every store)."""
        return encode_blocks(self._kv_caches, self.store, blocks, keys)

    def set_read_filter(self, read_filter: ReadFilter | None) -> bool:
        """Every raw entry read goes through `read_filter` before it is parsed."""
        self._read_filter = read_filter
        return True

    def discard_saves_for(self, request_ids: set[str]) -> None:
        """Skip this step's saves of these requests (a wrapper found their loads bad)."""
        self._discarded_saves |= request_ids

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done: set[str] = set()
        now = time.monotonic()
        for request_id, load in list(self._async_loads.items()):
            if request_id in finished_req_ids:  # aborted: nothing will read these blocks
                load.cancelled.set()
                done.add(request_id)
            elif load.future.done():
                if load.future.exception() is None:
                    self._install(load.transfer, load.future.result())
                else:
                    self._invalid_block_ids.update(load.transfer.block_ids)
                done.add(request_id)
            elif now >= load.deadline:
                logger.warning("request %s: KV load exceeded %.1fs; its blocks are invalid",
                               request_id, self.load_timeout_s)
                load.cancelled.set()  # a late result is dropped with the future
                self._invalid_block_ids.update(load.transfer.block_ids)
                done.add(request_id)
            else:
                continue
            del self._async_loads[request_id]
        return None, done or None

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

    def extra(self) -> dict[str, Any]:
        """The extra config this connector understood (for logs and tests)."""
        return {
            "async_load": self.async_load,
            "load_timeout_s": self.load_timeout_s,
            "verify_after_load": self.verify_after_load,
        }
