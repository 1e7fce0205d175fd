"""SharedStorageConnector: KV blocks in a folder that prefill and decode share.

Every full prompt block is stored as its own file keyed by the prefix-chain hash
(format: `block_store`), so any later prompt sharing a block-aligned prefix loads
it. Loads cover the longest stored run of blocks after the locally cached ones,
never the prompt's last token. `kv_role` decides what happens: producers save,
consumers load, `kv_both` does both.

Settings (`SharedStorageSettings`, keys of `kv_connector_extra_config`):
`shared_storage_path`, the folder of the store (required); `io_threads`, how many
threads read a staged load's entries or write a gathered save's (min(8, CPU
count)); plus `async_load`, `load_timeout_s` (30) and `verify_after_load` as for
every store connector (`store_base`, which also holds the scheduler role,
the async-load bookkeeping and shutdown; this module keeps only the folder's own
load and save path).

Every load runs on a reader thread (`reader_threads`) and never reads a file into
the cache itself: a sync load waits for its reader until `load_timeout_s` at most,
an async one until the worker reports it finished. A file read stuck in the kernel
(a hung NFS mount) therefore costs a load at most its deadline and can never write
into cache blocks later, when they may belong to someone else; its thread is
abandoned (bounded in number). A step's sync loads are one read (`batched_sync_reads`):
every request's entries as one batch of rows, each request a run of its own (a
failure cuts its own run only), one install for the step; at the deadline a
CPU load keeps the blocks it had finished (`_salvage`). A step's async loads are
another such batch (`batched_async_reads`; on a GPU in one leased staging buffer):
each request is ready as soon as its own run is read, the batch lands together
(`store_base`), and every load that landed by one `get_finished` is installed at once
(`PagedBlocks.install_groups`: on a GPU one check, one host sync). `io_threads` threads
read a load's entries (`staged_io`): its reader and helpers from a pool that every load
of the connector shares (`helper_pool`). A load into a CPU cache, sync or async, reads
each entry into a small bounce row and copies it into its block under the load's write
fence (an async load's own fence too, set when it is aborted or expires, before its
blocks are freed), checking it there, so its check is on the cache's own bytes
(`PagedBlocks.load_direct`); GPU loads verify into staging rows that the worker copies
into the cache. On a GPU the
rows are pinned and reused, each chunk going up on a side stream while the next
ones are read, one indexed copy per layer puts them in the cache, and
`verify_after_load` compares the cache's blocks with the verified rows
(`paged_blocks` says what that proves). Saves on the CPU write from the cache
itself (`paged_blocks`); GPU saves gather on the device, come down in one copy, and
are written by `io_threads` threads.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvrecover.config import KVTransferConfig
from kvrecover.kv_layout import KVCacheLayout
from kvrecover.kv_transfer.base import KVConnectorRole
from kvrecover.kv_transfer.stores.block_store import BlockLoadError, BlockStore, byte_view
from kvrecover.kv_transfer.stores.entry_read import EntryReader
from kvrecover.kv_transfer.stores.paged_blocks import PagedBlocks, RowGroup, StagedRows
from kvrecover.kv_transfer.stores.reader_threads import ReadCancel, ReadTimedOut
from kvrecover.kv_transfer.stores.staged_io import RowResult, write_rows
from kvrecover.kv_transfer.stores.store_base import (
    BlockTransfer,
    StorageConnectorMetadata,
    StoreConnectorBase,
    StoreSettings,
    prefix_before_none,
)
from kvrecover.options import option, path_or_none

if TYPE_CHECKING:
    from kvrecover.kv_transfer.request_view import KVRequestView

__all__ = ["BlockTransfer", "LoadedBlock", "SharedStorageConnector", "SharedStorageSettings",
           "StorageConnectorMetadata"]

logger = logging.getLogger(__name__)

MAX_IO_THREADS = 8  # default `io_threads`: beyond this the per-entry Python work (GIL) bounds it
# ... but a GPU cache's staged chunks are read off the GIL (`entry_read`): 16 threads reach
# 0.96x of the best plain read + upload of an 8B step on an H100 host, 8 only 0.67x.
MAX_STAGED_IO_THREADS = 16


@dataclass(frozen=True)
class LoadedBlock:
    """A block that `_read_batch` read and verified: its payload checksum and where
    its bytes are (row `position` of the staged rows, or None: in its cache block,
    checked there)."""

    checksum: int
    staging: StagedRows | None
    position: int


@dataclass(frozen=True)
class SharedStorageSettings(StoreSettings):
    """SharedStorageConnector's settings (keys of `kv_connector_extra_config`)."""

    shared_storage_path: str | None = option(
        None, "the folder of the store (required)", str, nullable=True, convert=path_or_none,
        describe="a folder path (a string)")
    io_threads: int | None = option(
        None, "threads that read a staged load's entries or write a gathered save's "
        f"(default: min({MAX_IO_THREADS}, CPU count); min({MAX_STAGED_IO_THREADS}, CPU count) for "
        "a GPU cache read through the C entry reader)", int, nullable=True, minimum=1,
        maximum=64, describe="a whole number from 1 to 64")


class SharedStorageConnector(StoreConnectorBase):
    """Saves and loads KV blocks through a shared folder (see module docstring)."""

    settings_class = SharedStorageSettings
    batched_sync_reads = True  # a step's sync loads read as one staged batch
    batched_async_reads = True  # and its async loads as another

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, layout: KVCacheLayout):
        super().__init__(config, role, layout)
        self._paged: PagedBlocks | None = None  # set by register_kv_caches
        io_threads = self.settings.io_threads
        self.io_threads = min(MAX_IO_THREADS, os.cpu_count() or 1) if io_threads is None else io_threads
        # Each block read and installed on its own (a bad one costs only itself) where
        # recovery keeps valid blocks after a hole: KV cache groups (rule 8), or the
        # engine's scope "blocks"; otherwise a request's blocks count up to its first bad one.
        self._each_block = self._grouped or config.kv_load_recompute == "blocks"

    def _open_store(self) -> BlockStore:
        path = self.settings.shared_storage_path
        if not path:
            raise ValueError(
                f"{type(self).__name__} needs kv_connector_extra_config['shared_storage_path']"
            )
        return BlockStore(path, self.layout)

    # ----- scheduler role -----------------------------------------------------------
    def _count_stored_prefix(self, request: KVRequestView, keys: Sequence[bytes]) -> int:
        # One stat per block, stopping at the first miss: a folder has no batched lookup.
        return next((i for i, key in enumerate(keys) if not self.store.exists(key)), len(keys))

    # ----- worker role ----------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        if self._paged is not None:
            self._paged.close()
        self._paged = PagedBlocks(kv_caches)
        # (Built, compiled at first use, here: not on a reader thread under a deadline.)
        native_reads = not self._paged.direct and EntryReader.shared() is not None
        if self.settings.io_threads is None and self._paged.on_gpu and native_reads:
            self.io_threads = min(MAX_STAGED_IO_THREADS, os.cpu_count() or 1)

    def shutdown(self) -> None:
        super().shutdown()
        if self._paged is not None:
            self._paged.close()
        self._paged = None  # its views of the cache and its pinned rows go with it

    def _paged_blocks(self) -> PagedBlocks:
        """The registered caches as whole blocks (worker role, after `register_kv_caches`)."""
        if self._paged is None:
            raise RuntimeError(f"{type(self).__name__}: register_kv_caches was not called")
        return self._paged

    def _read_sync(self, transfers: list[BlockTransfer],
                   cancelled: ReadCancel) -> list[list[LoadedBlock | None]]:
        # The step's sync loads as one batch (`batched_sync_reads`): every request's rows
        # in one staging buffer (or straight into a direct cache), read by one set of
        # `io_threads` threads, one install for them all.
        return self._read_batch(transfers, cancelled, into_cache=self._paged_blocks().direct)

    def _read_async(self, transfer: BlockTransfer, cancelled: ReadCancel) -> list[LoadedBlock | None]:
        # (Unbatched async loads; this connector batches them: `_read_async_batch`.)
        # Staged: without a fence of its own, a load must not write the cache.
        return self._read_batch([transfer], cancelled, into_cache=False)[0]

    def _read_async_batch(self, transfers: list[BlockTransfer], cancelled: ReadCancel,
                          ready: Callable[[int, Any], None],
                          writes: list[ReadCancel]) -> list[list[LoadedBlock | None]]:
        # One set of `io_threads` threads for the step's loads, each handed to `ready` as
        # soon as its own run of rows is read: straight into a direct (CPU) cache through
        # bounce rows, each load's copies behind its own fence (`writes`, set before an
        # aborted or expired load's blocks are freed); else staged in one buffer (a GPU
        # load must not write the cache before the worker confirms it).
        return self._read_batch(transfers, cancelled, into_cache=self._paged_blocks().direct,
                                ready=ready, writes=writes)

    def _drop_async_result(self, result: list[LoadedBlock | None]) -> None:
        staging = next((block.staging for block in result if block is not None), None)
        if staging is not None and staging.lease is not None:
            staging.lease.drop()

    def _read_batch(self, transfers: list[BlockTransfer], cancelled: ReadCancel,
                    into_cache: bool, ready: Callable[[int, Any], None] | None = None,
                    writes: Sequence[ReadCancel] | None = None,
                    ) -> list[list[LoadedBlock | None]]:
        """Read and verify the transfers' blocks (on a reader thread) as one batch of rows,
        each transfer a run of its own (a failure cuts its own run only), into staging
        rows or `into_cache` (a direct cache, `PagedBlocks.load_direct`, transfer i's
        copies also behind `writes[i]` when given); per transfer, its blocks (None from
        its first failure on, or each failed one with `_each_block`). With `ready`,
        `ready(i, blocks)` as soon as transfer i's run ends; a staged transfer with
        blocks then holds the staging buffer's lease until installed."""
        paged = self._paged_blocks()
        rows = [(transfer, position) for transfer in transfers
                for position in range(len(transfer.block_ids))]
        ends = list(itertools.accumulate(len(transfer.block_ids) for transfer in transfers))

        def read_row(index: int, row: memoryview) -> int:
            transfer, position = rows[index]
            return self._read_entry(transfer, position, [row], cancelled,
                                    check_payload=not into_cache)

        def read_chunk(start: int, end: int, address: int) -> Sequence[RowResult] | None:
            if self._read_filter is not None:  # a fault injector sees every read
                return None
            return self.store.read_entries_into(
                [transfer.keys[position] for transfer, position in rows[start:end]], address,
                paged.block_nbytes, every_row=self._each_block)

        staged: StagedRows | None = None
        starts = [0, *ends[:-1]]
        handed: set[int] = set()  # runs given to `ready` while the others were read

        def run_ended(run: int, part: StagedRows, results: list[RowResult]) -> None:
            blocks = self._loaded_blocks([transfers[run]], results[starts[run] : ends[run]],
                                         part, first_row=starts[run])[0]
            if any(blocks) and part.lease is not None:
                part.lease.hold()
            handed.add(run)
            if ready is not None:
                ready(run, blocks)

        if into_cache:
            results: list[RowResult] = [None] * len(rows)
            cancelled.progress = results  # kept by `_salvage` if the deadline gives up

            def direct_run_ended(run: int) -> None:
                handed.add(run)
                if ready is not None:
                    ready(run, self._loaded_blocks([transfers[run]],
                                                   results[starts[run] : ends[run]], None)[0])

            paged.load_direct([block_id for transfer in transfers for block_id in transfer.block_ids],
                              read_row, cancelled, self.io_threads, every_row=self._each_block,
                              segments=ends, results=results, fences=writes,
                              after_run=None if ready is None else direct_run_ended)
            if ready is not None:  # the runs not handed out yet (cut short by `cancelled`)
                return [[] if run in handed else self._loaded_blocks(
                    [transfer], results[starts[run] : ends[run]], None)[0]
                    for run, transfer in enumerate(transfers)]
        elif ready is not None:
            staged, results = paged.stage(len(rows), read_row, cancelled, self.io_threads,
                                          every_row=self._each_block, segments=ends,
                                          on_run=run_ended, read_chunk=read_chunk)
            loads: list[list[LoadedBlock | None]] = []
            for run, transfer in enumerate(transfers):
                # Rows of their own per transfer: each lets go of its share when installed.
                part = StagedRows(staged.host, staged.device, staged.uploaded, staged.lease)
                blocks = [] if run in handed else self._loaded_blocks(
                    [transfer], results[starts[run] : ends[run]], part,
                    first_row=starts[run])[0]
                if any(blocks) and staged.lease is not None:
                    staged.lease.hold()
                loads.append(blocks)
            if staged.lease is not None:
                staged.lease.finish_read(staged.uploaded)
            return loads
        else:
            staged, results = paged.stage(len(rows), read_row, cancelled, self.io_threads,
                                          every_row=self._each_block, segments=ends,
                                          read_chunk=read_chunk)
        loads = self._loaded_blocks(transfers, results, staged)
        if staged is not None and not any(any(blocks) for blocks in loads):
            paged.release(staged.host, staged.uploaded)
        return loads

    def _loaded_blocks(self, transfers: list[BlockTransfer], results: Sequence[RowResult],
                       staged: StagedRows | None, first_row: int = 0,
                       ) -> list[list[LoadedBlock | None]]:
        """Per transfer, its blocks from a batch's row results (failures logged); the
        results start at row `first_row` of the staging buffer."""
        loads: list[list[LoadedBlock | None]] = []
        offset = 0
        for transfer in transfers:
            blocks: list[LoadedBlock | None] = []
            for position in range(len(transfer.block_ids)):
                result = results[offset + position]
                if not isinstance(result, int):
                    self._log_failure(transfer.keys[position], result)
                    if not self._each_block:
                        break
                    blocks.append(None)  # each block stands on its own
                    continue
                blocks.append(LoadedBlock(result, staged, first_row + offset + position))
            loads.append(blocks + [None] * (len(transfer.block_ids) - len(blocks)))
            offset += len(transfer.block_ids)
        return loads

    def _salvage(self, transfers: list[BlockTransfer],
                 cancelled: ReadCancel) -> list[list[LoadedBlock | None] | None]:
        # A direct load's finished blocks are in the cache, checked there, and its fence
        # is closed; staged rows are not kept (a reader that comes unstuck may still be
        # queueing their uploads), so a staged batch at its deadline is all invalid.
        if cancelled.progress is None:
            return [None] * len(transfers)
        return list(self._loaded_blocks(transfers, list(cancelled.progress), None))

    def _read_entry(self, transfer: BlockTransfer, position: int, parts: list[memoryview],
                    cancelled: ReadCancel, check_payload: bool = True) -> int:
        """Read entry `position` of the transfer into `parts` and check it (its payload
        too unless not `check_payload`: the caller checks it where it ends up); its
        stored payload checksum."""
        key = transfer.keys[position]
        block_id = transfer.block_ids[position]
        # Reads the filter leaves alone take the zero-copy path (a fault injector that
        # fails a few blocks must not slow every other read of the load).
        if self._read_filter is None or (self._filtered_block is not None and not
                                         self._filtered_block(transfer.request_id, block_id)):
            if check_payload:
                return self.store.read_into(key, parts)
            return self.store.read_unchecked_into(key, parts)
        raw = self._read_filter(transfer.request_id, block_id, key, self.store.read_raw(key),
                                cancelled)
        return self.store.parse_into(key, raw, parts)

    def _log_failure(self, key: bytes, error: BaseException | None) -> None:
        if error is None or isinstance(error, ReadTimedOut):  # the load was given up
            return
        if isinstance(error, BlockLoadError):
            logger.warning("KV block %s failed to load: %s", key.hex(), error)
            self._suspect_keys.add(key)  # a later save of this block may replace it
        else:
            logger.warning("KV block %s failed to load: %r", key.hex(), error)

    def _install(self, transfer: BlockTransfer, blocks: list[LoadedBlock | None]) -> None:
        self._install_batch([transfer], [blocks])

    def _install_step(self, transfers: list[BlockTransfer],
                      results: list[list[LoadedBlock | None] | None]) -> None:
        self._install_batch(transfers, results)

    def _install_batch(self, transfers: list[BlockTransfer],
                       results: Sequence[list[LoadedBlock | None] | None]) -> None:
        """Copy the loads' verified blocks into the cache unless they were loaded there
        (one `PagedBlocks.install_groups` for them all, whatever staging buffers they
        came in: on a GPU one indexed copy per layer and buffer and one check with one
        host sync for the whole step); report, per transfer, every block from
        its first bad one on as invalid (with `_each_block`, every verified block is
        installed and only the bad ones are invalid). None: already reported."""
        chosen: list[tuple[int, int, LoadedBlock]] = []  # (transfer, position, block)
        for index, blocks in enumerate(results):
            if blocks is None:
                continue
            usable = blocks if self._each_block else prefix_before_none(blocks)
            chosen += [(index, position, block) for position, block in enumerate(usable)
                       if block is not None]
        passed = [True] * len(chosen)  # loaded into a direct cache: checked there
        by_staging: dict[int, tuple[StagedRows, list[int]]] = {}  # rows -> indices into `chosen`
        for number, (_, _, block) in enumerate(chosen):
            if block.staging is not None:
                by_staging.setdefault(id(block.staging), (block.staging, []))[1].append(number)
        if by_staging:
            groups = [RowGroup(
                [transfers[chosen[n][0]].block_ids[chosen[n][1]] for n in numbers],
                [chosen[n][2].position for n in numbers], staging,
                [chosen[n][2].checksum for n in numbers] if self.verify_after_load else None)
                for staging, numbers in by_staging.values()]
            for (_, numbers), group_passed in zip(by_staging.values(),
                                                  self._paged_blocks().install_groups(groups)):
                for n, ok in zip(numbers, group_passed):
                    passed[n] = ok
        good = {(index, position) for (index, position, _), ok in zip(chosen, passed) if ok}
        for (index, position, _), ok in zip(chosen, passed):
            if not ok:
                logger.warning("KV block %d does not match its stored checksum after the load",
                               transfers[index].block_ids[position])
        for index, (transfer, blocks) in enumerate(zip(transfers, results)):
            if blocks is None:
                continue
            held = [(index, position) in good for position in range(len(transfer.block_ids))]
            if not self._each_block:  # a request's blocks count up to its first bad one
                count = next((i for i, ok in enumerate(held) if not ok), len(held))
                held = [position < count for position in range(len(held))]
            invalid = [block_id for block_id, ok in zip(transfer.block_ids, held) if not ok]
            if invalid:
                self._invalid_block_ids.update(invalid)
                self._failed_requests.add(transfer.request_id)

    def wait_for_save(self) -> None:
        metadata = self._get_metadata_of(StorageConnectorMetadata)
        self._save_states(metadata, self._failed_requests | self._discarded_saves)
        todo: dict[bytes, int] = {}  # key -> cache block id, for the whole step
        for transfer in metadata.saves:
            # KV computed on top of a failed load is garbage: never store it.
            if transfer.request_id in self._failed_requests | self._discarded_saves:
                continue
            for block_id, key in zip(transfer.block_ids, transfer.keys):
                # (Unless already stored, by us or another producer.)
                if key not in todo and (key in self._suspect_keys or not self.store.exists(key)):
                    todo[key] = block_id
        if not todo:
            return
        self._suspect_keys.difference_update(todo)
        paged = self._paged_blocks()
        if paged.direct:
            for key, block_id in todo.items():
                self._save_failures += self._write(key, paged.parts(block_id))
            return
        keys = list(todo)
        rows, buffer = paged.gather([todo[key] for key in keys])
        views = byte_view(rows)
        nbytes = paged.block_nbytes

        def write_row(position: int) -> None:
            if self._write(keys[position], [views[position * nbytes : (position + 1) * nbytes]]):
                raise OSError("not saved")  # counted by write_rows

        self._save_failures += write_rows(len(keys), write_row, self.io_threads)
        if buffer is not None:
            paged.release(buffer)

    def _write(self, key: bytes, parts: list[memoryview]) -> int:
        """Store one entry from its parts; 1 if that failed (logged), else 0."""
        try:
            self.store.write_parts(key, parts)
        except Exception as error:
            logger.debug("KV block %s not saved: %r", key.hex(), error)
            return 1
        return 0

    def extra(self) -> dict[str, Any]:
        """The extra config this connector understood (for logs and tests)."""
        return {"shared_storage_path": str(self.store.root), **super().extra()}
