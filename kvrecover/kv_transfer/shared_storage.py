"""SharedStorageConnector: KV blocks in a folder that prefill and decode share.

Every full prompt block is stored as its own file keyed by the prefix-chain hash
(format: `block_store`), so any later prompt sharing a block-aligned prefix loads
it. Loads cover the longest stored run of blocks after the locally cached ones,
never the prompt's last token. `kv_role` decides what happens: producers save,
consumers load, `kv_both` does both.

Extra config (`kv_connector_extra_config`):
  shared_storage_path  folder of the store (required)
  async_load           load in a background thread while the request waits (False)
  load_timeout_s       an async load unfinished after this long fails (30)
  verify_after_load    re-checksum the engine's cache blocks after a load (True)

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

import concurrent.futures
import logging
import os
import threading
import time
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
from kvrecover.kv_transfer.block_store import BlockLoadError, BlockStore
from kvrecover.kv_transfer.paged_blocks import PagedBlocks

if TYPE_CHECKING:
    from kvrecover.engine.request import Request
    from kvrecover.engine.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)

SHUTDOWN_JOIN_S = 5.0  # how long `shutdown` waits for loader threads, in all


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


@dataclass(frozen=True)
class LoadedBlock:
    """A block that `_read_blocks` read and verified: its payload checksum and where
    its bytes are (row `position` of `staging`, or already in the cache if None)."""

    checksum: int
    staging: torch.Tensor | None
    position: int


@dataclass
class _AsyncLoad:
    transfer: BlockTransfer
    future: concurrent.futures.Future
    deadline: float
    cancelled: threading.Event
    thread: threading.Thread


class SharedStorageConnector(KVConnectorBase):
    """Saves and loads KV blocks through a shared folder (see module docstring)."""

    extra_config_keys = ("shared_storage_path", "async_load", "load_timeout_s",
                         "verify_after_load")

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, layout: KVCacheLayout):
        super().__init__(config, role, layout)
        path = config.get_extra("shared_storage_path")
        if not path:
            raise ValueError(
                f"{type(self).__name__} needs kv_connector_extra_config['shared_storage_path']"
            )
        if not isinstance(path, (str, os.PathLike)):
            raise ValueError(
                "kv_connector_extra_config['shared_storage_path'] must be a folder path "
                f"(a string), got {path!r}"
            )
        self.store = BlockStore(path, layout)
        self.async_load = _extra_flag(config, "async_load", False)
        self.load_timeout_s = _extra_seconds(config, "load_timeout_s", 30.0)
        self.verify_after_load = _extra_flag(config, "verify_after_load", True)
        self.block_size = layout.block_size
        self._read_filter: ReadFilter | None = None  # see `set_read_filter`
        # Scheduler role state.
        self._requests: dict[str, Request] = {}
        self._pending_loads: list[BlockTransfer] = []
        # Worker role state.
        self._kv_caches: list[torch.Tensor] = []
        self._paged: PagedBlocks | None = None  # both set by register_kv_caches
        self._invalid_block_ids: set[int] = set()
        self._failed_requests: set[str] = set()
        self._discarded_saves: set[str] = set()
        self._async_loads: dict[str, _AsyncLoad] = {}
        self._save_failures = 0
        self._suspect_keys: set[bytes] = set()

    # ----- scheduler role -----------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        if not self.config.is_consumer:
            return 0, False
        keys = request.block_hashes  # the engine hashed every full prompt block
        last_loadable = (request.num_prompt_tokens - 1) // self.block_size
        first = num_computed_tokens // self.block_size
        end = first
        while end < min(last_loadable, len(keys)) and self.store.exists(keys[end]):
            end += 1
        num_tokens = max(0, end * self.block_size - num_computed_tokens)
        return num_tokens, self.async_load and num_tokens > 0

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        self._requests[request.request_id] = request
        if num_external_tokens <= 0:
            return
        first = request.num_computed_tokens // self.block_size
        count = num_external_tokens // self.block_size
        keys = request.block_hashes
        self._pending_loads.append(BlockTransfer(
            request.request_id, block_ids[first : first + count], keys[first : first + count],
            is_async=self.async_load,
        ))

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

    def _start_async(self, transfer: BlockTransfer) -> None:
        cancelled = threading.Event()
        future: concurrent.futures.Future = concurrent.futures.Future()

        def load() -> None:
            try:
                future.set_result(self._read_blocks(transfer, cancelled))
            except BaseException as error:  # _read_blocks catches read errors; be safe
                future.set_exception(error)

        # A daemon thread: a read stuck in the kernel past its deadline must not
        # keep the process alive at exit (`shutdown` cancels and joins the others).
        thread = threading.Thread(target=load, name=f"kv-load-{transfer.request_id}", daemon=True)
        thread.start()
        self._async_loads[transfer.request_id] = _AsyncLoad(
            transfer, future, time.monotonic() + self.load_timeout_s, cancelled, thread
        )

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
                    logger.warning("request %s: KV load crashed (%r); its blocks are invalid",
                                   request_id, load.future.exception())
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

    def shutdown(self) -> None:
        """Cancel every in-flight async load and join its thread (a read stuck in the
        kernel is given up after SHUTDOWN_JOIN_S, its daemon thread left behind)."""
        loads, self._async_loads = list(self._async_loads.values()), {}
        for load in loads:
            load.cancelled.set()
        give_up = time.monotonic() + SHUTDOWN_JOIN_S
        for load in loads:
            load.thread.join(max(0.0, give_up - time.monotonic()))

    def extra(self) -> dict[str, Any]:
        """The extra config this connector understood (for logs and tests)."""
        return {
            "shared_storage_path": str(self.store.root),
            "async_load": self.async_load,
            "load_timeout_s": self.load_timeout_s,
            "verify_after_load": self.verify_after_load,
        }
