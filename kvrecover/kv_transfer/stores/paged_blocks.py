"""The paged KV cache seen as whole stored blocks: what storage connectors load into and save from.

Each layer's cache is [2 (K, V), num_blocks, block_size, kv_heads, head_dim]; a stored
block is [layers, 2, block_size, kv_heads, head_dim]. On the CPU one block's bytes are
2 x layers contiguous slices of the caches, its "parts" in file order (`block_store`),
so an entry is written from the cache itself with no copy in between ("direct").
No load reads straight into the cache: a read abandoned at its deadline may still
write later, and must only write memory of its own. A load into a contiguous CPU
cache, sync or async (`load_direct`), reads each entry into a one-block bounce row
of the reading thread's own, still in the CPU's cache when it is copied into the
block's slices and checked there, copy and check fenced by the load's `ReadCancel`
(`reader_threads`; an async load's own fence too, set when it is aborted), so the
load costs about what reading into the cache did. The copy and check are one C call
off the GIL where it can be built (`native_copy`: the row hashed whole first, then
each part compared with the row right after its copy), else Python copies and a
hash of the block's slices. GPU loads stage whole entries in rows of a pooled host
buffer (`stage`, read by several threads: `staged_io`) and `install` copies them
into the cache later (`install` also serves strided CPU caches, and copies into a
contiguous one block by block, checked after its copy for `verify_after_load`);
saves elsewhere `gather` the other way.

On a GPU the host rows are pinned and reused (pinning fresh memory costs more than
the read), each chunk of rows goes up on a side stream as soon as it is read, and
the compute stream waits for an event, not the host. Until it is installed, a load
holds a device copy of its rows (as large as the blocks it loads), so that an async
load never writes into the cache before the worker confirms it. The check after a GPU load
(`install(verify=True)`) reads the blocks back from the cache on the device and
compares them bit for bit with the uploaded rows, whose host copy is what passed
the xxh3 check: it proves that every loaded block, in every layer, holds exactly
the verified bytes at the right block id (a wrong index, layer or garbled scatter
is caught), without copying the blocks back to the host. It trusts the
host-to-device DMA itself to deliver the bytes it was given.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvrecover.kv_transfer.stores.block_store import (
    BlockLoadError,
    byte_view,
    parts_checksum,
    payload_checksum,
)
from kvrecover.kv_transfer.stores.helper_pool import HelperPool
from kvrecover.kv_transfer.stores.native_copy import RowInstaller
from kvrecover.kv_transfer.stores.reader_threads import ReadCancel
from kvrecover.kv_transfer.stores.staged_io import RowResult, chunk_rows, read_rows

# Staging buffers kept for reuse: enough for every async load in flight at once and a
# batched step's sync loads (16 x 1024 tokens of Llama-3.1-8B KV: 2.1 GB each way), since
# pinning fresh memory costs more than reading into it; the smallest go first.
MAX_FREE_STAGING = 32
MAX_FREE_STAGING_BYTES = 8 << 30
MAX_FREE_BOUNCE_ROWS = 16  # one-block rows kept for direct loads (one per reading thread)
# Rows a thread of a direct load claims at a time: a helper thread costs about one
# block's read to start, so a load of a few blocks stays on one thread.
DIRECT_CHUNK_BYTES = 4 << 20
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # same-size integer views


class StagingLease:
    """A staging buffer whose runs of rows (one per request of a batch of async loads)
    are installed at different times: it goes back to the pool once its read has ended
    (`finish_read`, with the event after its last upload) and every holder of rows in
    it let go (`hold`, `drop`). Any thread may call it."""

    def __init__(self, paged: PagedBlocks, host: torch.Tensor) -> None:
        self._paged, self._host = paged, host
        self._holders = 1  # the read itself
        self._ready: Any = None
        self._lock = threading.Lock()

    def hold(self) -> None:
        with self._lock:
            self._holders += 1

    def drop(self) -> None:
        with self._lock:
            self._holders -= 1
            last = self._holders == 0
        if last:
            self._paged.release(self._host, self._ready)

    def finish_read(self, ready: Any) -> None:
        with self._lock:
            self._ready = ready
        self.drop()


@dataclass
class StagedRows:
    """A staged load's rows: on the host, and on a GPU also uploaded (`device`, ready
    for the compute stream once `uploaded` has fired); `lease` where the buffer is
    shared by runs installed at different times."""

    host: torch.Tensor
    device: torch.Tensor | None = None
    uploaded: Any = None  # a torch.cuda.Event
    lease: StagingLease | None = None

    def device_rows(self) -> torch.Tensor:
        """The uploaded copy of the rows (staged for a GPU cache only)."""
        if self.device is None:
            raise RuntimeError("these rows were staged for a CPU cache: nothing was uploaded")
        return self.device


@dataclass
class RowGroup:
    """Rows of one staging buffer to install: row `positions[i]` into cache block
    `block_ids[i]`, checked against `checksums[i]` (None: no check; a None entry: a row
    that failed to read)."""

    block_ids: list[int]
    positions: Sequence[int]
    staged: StagedRows
    checksums: Sequence[int | None] | None


class PagedBlocks:
    """Block-granular access to one worker's per-layer KV cache tensors."""

    def __init__(self, kv_caches: list[torch.Tensor]) -> None:
        one_block = kv_caches[0][:, 0]
        self.caches = kv_caches
        self.device = kv_caches[0].device
        self.dtype = one_block.dtype
        self.block_shape = (len(kv_caches), *one_block.shape)
        self.block_nbytes = one_block.numel() * one_block.element_size() * len(kv_caches)
        self.direct = self.device.type == "cpu" and all(
            isinstance(cache, torch.Tensor) and cache.is_contiguous() for cache in kv_caches)
        self.on_gpu = self.device.type == "cuda"
        # Flat byte views of the caches (no copy): one block's parts are slices of them.
        self._layer_bytes = [byte_view(cache) for cache in kv_caches] if self.direct else []
        self._part_nbytes = one_block[0].numel() * one_block.element_size()
        # In a layer's bytes, V blocks follow all K blocks.
        self._v_offset = kv_caches[0].shape[1] * self._part_nbytes if self.direct else 0
        self._free_staging: list[tuple[torch.Tensor, Any]] = []  # (buffer, event or None)
        self._free_bounce_rows: list[tuple[torch.Tensor, memoryview]] = []  # (row, its bytes)
        # Copies rows into a direct cache off the GIL (None: Python copies; `native_copy`).
        self._installer = RowInstaller.for_caches(kv_caches) if self.direct else None
        self._staging_lock = threading.Lock()
        self._upload_stream = torch.cuda.Stream(self.device) if self.on_gpu else None
        self._helpers = HelperPool()  # every load's reader helpers (`helper_pool`)

    def close(self) -> None:
        """Let the reader helper threads end (the connector shuts down)."""
        self._helpers.close()

    def parts(self, block_id: int) -> list[memoryview]:
        """The block's bytes in file order: layer 0 K, layer 0 V, layer 1 K, ... (direct only)."""
        k, size = block_id * self._part_nbytes, self._part_nbytes
        v = k + self._v_offset
        return [piece for layer in self._layer_bytes for piece in (layer[k : k + size], layer[v : v + size])]

    # ----- staging buffers ---------------------------------------------------------
    def staging(self, count: int) -> torch.Tensor:
        """An uninitialised host buffer of at least `count` block rows (uint8), pinned for
        a GPU cache: the smallest free one that fits, else a fresh one. Any thread may
        call this."""
        with self._staging_lock:  # (indices, not list.remove: tensors compare elementwise)
            fits = [i for i, (buffer, _) in enumerate(self._free_staging) if buffer.shape[0] >= count]
            if fits:
                buffer, ready = self._free_staging.pop(
                    min(fits, key=lambda i: self._free_staging[i][0].shape[0]))
                if ready is not None:
                    ready.synchronize()  # the copies that last read it are done (long since)
                return buffer
        # Fresh memory costs a page fault per 4 KiB on first touch (about as much as the
        # read itself), and pinning it costs more still: hence the pool.
        return torch.empty((count, self.block_nbytes), dtype=torch.uint8, pin_memory=self.on_gpu)

    def release(self, staging: torch.Tensor, ready: Any = None) -> None:
        """Give a staging buffer back for reuse once nothing will write it again; device
        copies still reading it must be done when the event `ready` fires."""
        with self._staging_lock:
            self._free_staging.append((staging, ready))
            self._free_staging.sort(key=lambda entry: entry[0].shape[0])
            while len(self._free_staging) > MAX_FREE_STAGING or sum(
                    buffer.numel() for buffer, _ in self._free_staging) > MAX_FREE_STAGING_BYTES:
                del self._free_staging[0]

    def let_go(self, staged: StagedRows) -> None:
        """Nothing more is installed from `staged`: its buffer goes back to the pool
        (through its lease, if shared)."""
        if staged.lease is not None:
            staged.lease.drop()
        else:
            self.release(staged.host, staged.uploaded)

    def _bounce_row(self) -> tuple[torch.Tensor, memoryview]:
        """A one-block row (uint8) for a direct load to read into, and its bytes
        (`_give_back` it once read and copied: only the thread that read into it may, so
        no late read ever lands in a row that another load uses)."""
        with self._staging_lock:
            if self._free_bounce_rows:
                return self._free_bounce_rows.pop()
        row = torch.empty(self.block_nbytes, dtype=torch.uint8)
        return row, byte_view(row)

    def _give_back(self, row: tuple[torch.Tensor, memoryview]) -> None:
        with self._staging_lock:
            if len(self._free_bounce_rows) < MAX_FREE_BOUNCE_ROWS:
                self._free_bounce_rows.append(row)

    # ----- loads -------------------------------------------------------------------
    def load_direct(self, block_ids: list[int], read_row: Callable[[int, memoryview], int],
                    cancelled: ReadCancel, threads: int, every_row: bool = False,
                    segments: Sequence[int] | None = None,
                    results: list[RowResult] | None = None,
                    fences: Sequence[ReadCancel] | None = None,
                    after_run: Callable[[int], None] | None = None) -> list[RowResult]:
        """Load entries 0..len(block_ids)-1 into the given cache blocks (direct caches
        only) on up to `threads` threads: `read_row(position, row)` reads an entry into a
        bounce row and returns its stored payload checksum (header checked); the row is
        then copied into the block and the block hashed there, both under `cancelled`'s
        fence (and the row's run's own fence, `fences[run]`, when given: one per
        segment), so nothing is written once `set()` has returned on either. A block
        whose hash differs fails (BlockLoadError); failed blocks hold garbage. The hash
        is of the cache's own bytes: the check `verify_after_load` asks for. Results (and
        `segments`, `results`, `after_run`) as `staged_io.read_rows`."""

        installer = self._installer
        ends = list(segments) if segments is not None else [len(block_ids)]
        if fences is not None and len(fences) != len(ends):
            raise ValueError(f"{len(fences)} fences for {len(ends)} runs of rows")

        def load_one(position: int) -> int:
            bounce = self._bounce_row()
            row, view = bounce
            try:
                checksum = read_row(position, view)
                block_id = block_ids[position]
                if installer is None:
                    parts = self.parts(block_id)

                    def copy_and_check() -> int:
                        self._copy_row(view, parts)
                        if parts_checksum(parts) != checksum:
                            raise BlockLoadError("payload checksum mismatch")
                        return checksum
                else:
                    # The row is hashed whole (GIL-free) before the cache is touched; the
                    # copy then compares each part with the row (`native_copy`).
                    if parts_checksum([view]) != checksum:
                        raise BlockLoadError("payload checksum mismatch")

                    def copy_and_check() -> int:
                        if not installer.install_one(row, block_id):
                            raise BlockLoadError("the cache block differs from its verified "
                                                 "row after the copy")
                        return checksum

                if fences is None:
                    return cancelled.write_unless_set(copy_and_check)
                fence = fences[bisect.bisect_right(ends, position)]
                return cancelled.write_unless_set(lambda: fence.write_unless_set(copy_and_check))
            finally:
                self._give_back(bounce)

        return read_rows(len(block_ids), load_one, cancelled, threads,
                         max(1, DIRECT_CHUNK_BYTES // self.block_nbytes), every_row=every_row,
                         segments=segments, results=results, pool=self._helpers,
                         after_run=after_run)

    @staticmethod
    def _copy_row(row: memoryview, parts: list[memoryview]) -> None:
        """Copy a block's bytes from `row` into its parts."""
        offset = 0
        for part in parts:
            end = offset + part.nbytes
            part[:] = row[offset:end]
            offset = end

    def stage(self, count: int, read_row: Callable[[int, memoryview], int],
              cancelled: threading.Event, threads: int, every_row: bool = False,
              segments: Sequence[int] | None = None,
              on_run: Callable[[int, StagedRows, list[RowResult]], None] | None = None,
              read_chunk: Callable[[int, int, int], Sequence[RowResult] | None] | None = None,
              ) -> tuple[StagedRows, list[RowResult]]:
        """Read `count` entries into staging rows, `read_row(position, row)` each (it
        returns the entry's checksum or raises), on up to `threads` threads; on a GPU
        each chunk goes up as soon as it is read. Results as `staged_io.read_rows`
        (`every_row` and `segments` too). With `on_run`, `on_run(run, rows, results)`
        is called as each run (segment) ends, with rows ready to install that run's
        (their own upload event) while the others are read; the buffer is then leased:
        the caller holds the lease for each run it will install and calls
        `lease.finish_read(staged.uploaded)` once it has handed out what it returns.
        `read_chunk(start, end, address)`, when given, may read rows start..end-1 at once
        into the rows from host address `address` on (`staged_io.read_rows`)."""
        host = self.staging(count)
        rows = byte_view(host)
        nbytes = self.block_nbytes
        staged = StagedRows(host, lease=None if on_run is None else StagingLease(self, host))
        after_chunk = None
        if self.on_gpu:
            with torch.cuda.stream(self._upload_stream):  # allocated for that stream
                device_rows = torch.empty((count, nbytes), dtype=torch.uint8, device=self.device)
            staged.device = device_rows
            # Inference mode is per thread: the reader threads must share the caller's, or
            # their copies into an inference tensor (the engine's step) would be refused.
            inference = torch.is_inference_mode_enabled()

            def after_chunk(start: int, end: int) -> None:
                with torch.inference_mode(inference), torch.cuda.stream(self._upload_stream):
                    device_rows[start:end].copy_(host[start:end], non_blocking=True)

        results: list[RowResult] = [None] * count
        after_run = None
        if on_run is not None:
            def after_run(run: int) -> None:
                part = StagedRows(host, staged.device, lease=staged.lease)
                if self.on_gpu:  # after every chunk of the run was queued
                    part.uploaded = torch.cuda.Event()
                    part.uploaded.record(self._upload_stream)
                on_run(run, part, results)

        read_rows(
            count, lambda position: read_row(position, rows[position * nbytes : (position + 1) * nbytes]),
            cancelled, threads, chunk_rows(nbytes), after_chunk, every_row, segments,
            results=results, pool=self._helpers, after_run=after_run,
            read_chunk=None if read_chunk is None else (
                lambda start, end: read_chunk(start, end, host.data_ptr() + start * nbytes)))
        if self.on_gpu:  # every chunk's copy was queued before read_rows returned
            staged.uploaded = torch.cuda.Event()
            staged.uploaded.record(self._upload_stream)
        return staged, results

    def install_rows(self, block_ids: list[int], positions: Sequence[int], staged: StagedRows,
                     checksums: Sequence[int | None] | None) -> list[bool]:
        """Copy staged row `positions[i]` into cache block `block_ids[i]`, for every i, and
        let go of the staging buffer (`install_groups` of one group)."""
        return self.install_groups([RowGroup(block_ids, positions, staged, checksums)])[0]

    def install_groups(self, groups: Sequence[RowGroup]) -> list[list[bool]]:
        """Install every group's rows (`RowGroup`) and let go of their staging buffers:
        on a GPU one indexed copy per layer for all the groups of one buffer (a batched
        step's every request at once) and one check with ONE host sync for all of them
        (see the module docstring). Returns, per group and block, whether it holds its
        stored bytes (all True without a check)."""
        if self.direct:
            return [self._install_direct(group) for group in groups]
        # Groups of one buffer (runs of one batch landing together) scatter as one.
        merged: dict[int, list[int]] = {}
        for index, group in enumerate(groups):
            merged.setdefault(id(group.staged.host), []).append(index)
        passed: list[list[bool]] = [[True] * len(group.block_ids) for group in groups]
        checks: list[tuple[list[tuple[int, int]], list[int | None], torch.Tensor]] = []
        for members in merged.values():
            block_ids = [b for i in members for b in groups[i].block_ids]
            positions = [p for i in members for p in groups[i].positions]
            rows = self._scatter(block_ids, positions, [groups[i].staged for i in members])
            for i in members:
                self.let_go(groups[i].staged)
            checked = [i for i in members if groups[i].checksums is not None]
            if not checked or not block_ids:
                continue
            where = [(i, k) for i in members for k in range(len(groups[i].block_ids))]
            sums = [None if (sums_i := groups[i].checksums) is None else sums_i[k]
                    for i, k in where]
            if not self.on_gpu:
                actual = self.checksums(block_ids)
                for (i, k), a, c in zip(where, actual, sums):
                    if groups[i].checksums is not None:
                        passed[i][k] = c is not None and a == c
                continue
            checks.append((where, sums, self._mismatched(block_ids, rows)))
        if checks:
            bad = torch.cat([mismatched for _, _, mismatched in checks]).tolist()  # the one host sync
            offset = 0
            for where, sums, _ in checks:
                for (i, k), c, b in zip(where, sums, bad[offset : offset + len(where)]):
                    if groups[i].checksums is not None:
                        passed[i][k] = c is not None and not b
                offset += len(where)
        return passed

    def _install_direct(self, group: RowGroup) -> list[bool]:
        """A group's rows copied block by block into a direct (CPU) cache, each block
        hashed right after its copy when checked (or, through `native_copy`, compared
        with its row right after the copy, and the row hashed)."""
        host_rows, nbytes = byte_view(group.staged.host), self.block_nbytes
        checksums = group.checksums
        if self._installer is not None:
            held = self._installer.install(group.staged.host, group.positions, group.block_ids,
                                           check=checksums is not None)
            if checksums is not None:
                held = [ok and checksum is not None and parts_checksum(
                    [host_rows[position * nbytes : (position + 1) * nbytes]]) == checksum
                    for ok, position, checksum in zip(held, group.positions, checksums)]
            self.let_go(group.staged)
            return held
        passed = []
        for position, block_id, checksum in zip(group.positions, group.block_ids,
                                                checksums or [None] * len(group.block_ids)):
            parts = self.parts(block_id)
            self._copy_row(host_rows[position * nbytes : (position + 1) * nbytes], parts)
            passed.append(checksums is None or (
                checksum is not None and parts_checksum(parts) == checksum))
        self.let_go(group.staged)
        return passed

    def _mismatched(self, block_ids: list[int], rows: torch.Tensor) -> torch.Tensor:
        """Per block (on the device), whether the cache differs from its uploaded row."""
        count = len(block_ids)
        index = torch.tensor(block_ids, device=self.device)
        mismatched = torch.zeros(count, dtype=torch.bool, device=self.device)
        bits = _BITS[rows.element_size()]  # bit patterns: a NaN must equal itself
        for layer, cache in enumerate(self.caches):
            back = cache.index_select(1, index).transpose(0, 1).view(bits)
            mismatched |= (back != rows[:, layer].view(bits)).reshape(count, -1).any(dim=1)
        return mismatched

    def install_each(self, block_ids: list[int], staged: StagedRows,
                     checksums: list[int | None]) -> list[bool]:
        """`install` of every row, judged block by block: row i goes into `block_ids[i]`
        whatever the others hold (a row that failed to read fills its block with
        garbage, and that block is reported invalid); returns, per block, whether it
        holds its stored bytes (`checksums[i]`, None: a row that failed to read). For
        loads whose blocks do not depend on each other (KV cache groups, rule 8)."""
        return self.install_rows(block_ids, range(len(block_ids)), staged, checksums)

    def install(self, block_ids: list[int], staged: StagedRows,
                checksums: list[int] | None) -> int:
        """Copy staged rows 0..len(block_ids)-1 into the given cache blocks and give the
        staging buffer back. With `checksums` (the stored ones), check the blocks in the
        cache afterwards (see the module docstring); returns how many leading blocks
        passed (all of them without a check)."""
        passed = self.install_rows(block_ids, range(len(block_ids)), staged, checksums)
        return next((i for i, ok in enumerate(passed) if not ok), len(block_ids))

    def _device_blocks(self, staged: StagedRows, count: int) -> torch.Tensor:
        """The uploaded rows as blocks [count, *block_shape] in the cache's dtype."""
        return staged.device_rows()[:count].view(self.dtype).view(count, *self.block_shape)

    def _scatter(self, block_ids: list[int], positions: Sequence[int],
                 parts: Sequence[StagedRows]) -> torch.Tensor:
        """Copy staged row `positions[i]` into cache block `block_ids[i]` (rows of one
        buffer, staged as `parts`: one per run, each with its own upload event); returns
        the rows copied, as blocks (on the cache's device)."""
        staged = parts[0]
        count = len(block_ids)
        in_order = list(positions) == list(range(count))
        if not self.on_gpu:
            host = staged.host if in_order else staged.host[torch.tensor(list(positions))]
            self._scatter_host(block_ids, host)
            return host[:count].view(self.dtype).view(count, *self.block_shape)
        stream = torch.cuda.current_stream(self.device)
        for part in parts:
            stream.wait_event(part.uploaded)  # the compute stream waits, not the host
        staged.device_rows().record_stream(stream)
        rows = self._device_blocks(staged, max(positions, default=-1) + 1)
        if not in_order:
            rows = rows.index_select(0, torch.tensor(list(positions), device=self.device))
        index = torch.tensor(block_ids, device=self.device)
        for layer, cache in enumerate(self.caches):
            cache.index_copy_(1, index, rows[:, layer].transpose(0, 1))
        return rows

    def _scatter_host(self, block_ids: list[int], staging: torch.Tensor) -> None:
        """Copy host rows into the cache blocks of a CPU cache."""
        count = len(block_ids)
        blocks = staging[:count].view(self.dtype).view(count, *self.block_shape)
        # Strided slice copies over runs of consecutive block ids beat an indexed copy;
        # freshly allocated blocks mostly come in such runs.
        start = 0
        while start < count:
            end = start + 1
            while end < count and block_ids[end] == block_ids[end - 1] + 1:
                end += 1
            first = block_ids[start]
            for layer, cache in enumerate(self.caches):
                cache[:, first : first + end - start].copy_(blocks[start:end, layer].transpose(0, 1))
            start = end

    # ----- saves -------------------------------------------------------------------
    def gather(self, block_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The given blocks as host rows [len(block_ids), block_nbytes] (uint8): one indexed
        copy per layer, then one device-to-host copy, into a pinned staging buffer for a
        GPU cache. Returns the rows and that buffer (None on the CPU): `release` it once
        the rows are written."""
        count = len(block_ids)
        index = torch.tensor(block_ids, device=self.device)
        gathered = torch.empty((count, *self.block_shape), dtype=self.dtype, device=self.device)
        for layer, cache in enumerate(self.caches):
            gathered[:, layer].copy_(cache.index_select(1, index).transpose(0, 1))
        flat = gathered.view(torch.uint8).view(count, self.block_nbytes)
        if not self.on_gpu:
            return flat, None
        buffer = self.staging(count)
        buffer[:count].copy_(flat, non_blocking=True)
        torch.cuda.current_stream(self.device).synchronize()
        return buffer[:count], buffer

    def checksums(self, block_ids: list[int]) -> list[int]:
        """xxh3-64 of each block's bytes as the cache holds them (the stored checksum)."""
        if self.direct:
            return [parts_checksum(self.parts(block_id)) for block_id in block_ids]
        rows, buffer = self.gather(block_ids)
        sums = [payload_checksum(row) for row in rows]
        if buffer is not None:
            self.release(buffer)
        return sums
