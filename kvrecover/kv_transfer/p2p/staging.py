"""Registered staging rows for a consumer's NIXL READs: pulled bytes never land in the
KV cache straight from the wire.

A READ that outlives its deadline is given up (its blocks are recomputed, or freed and
reused), yet it may still complete later, and NIXL offers no cancel that is proven to
wait for the write. So every READ targets a staging buffer of this pool, never the
cache: the caller verifies the staged rows and copies only verified ones into the cache
itself (`NixlConsumer._pull`, `consumer.py`). A buffer whose READ was given up is quarantined with its
transfer handle, never released while in flight: it goes back into use only once NIXL
reports that transfer DONE or ERR (a terminal state: nothing more of it is written).
While `MAX_QUARANTINED_READS` buffers wait so, `acquire` refuses (`StagingExhausted`:
the pull fails at once and its blocks are recomputed) instead of growing memory for a
transport that hangs for good. Buffers are registered once and reused: at most
`MAX_FREE_BUFFERS` idle ones are kept, each sized to a power of two of rows.

Layout. A READ of n blocks fills the buffer's first n rows (a row: a block's K and V in
every cache tensor) side-major: (side, cache tensor, block), each piece `half` bytes, so
that a run of consecutive producer block ids is one descriptor per (side, cache tensor)
(`block_descriptors`) instead of one per (side, cache tensor, block): 60 descriptors a
block of 12 KB each were most of a CPU pull's READ time. A block's checksum stays the
xxh3 of its bytes block-major (K of each cache tensor, then V), computed by streaming the
pieces (`block_checksums`), so producer and consumer hash the same bytes with no
permuted copy on either side. A hybrid's state rows follow the n block rows (`states.py`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash

logger = logging.getLogger(__name__)

MAX_QUARANTINED_READS = 4  # given-up READs still in flight before pulls are refused
MAX_FREE_BUFFERS = 2  # idle registered buffers kept for reuse
MIN_ROWS = 8

# Buffers whose READ may still be in flight when their pool closed: kept alive for the
# process's lifetime (at most MAX_QUARANTINED_READS per closed pool), never freed under
# a transfer that could still write them.
_RETIRED: list[torch.Tensor] = []


class StagingExhausted(Exception):
    """Too many given-up READs are still in flight: no staging buffer is handed out."""


@dataclass
class StagingBuffer:
    """A registered uint8 tensor of `capacity` rows of the pool's row size."""

    rows: torch.Tensor
    registration: Any

    @property
    def capacity(self) -> int:
        return self.rows.shape[0]


class StagingPool:
    """The consumer's staging buffers (see module docstring). Any thread may call it
    (async pulls run on their own threads); the agent is in NIXL's STRICT sync mode."""

    def __init__(self, agent: Any, row_nbytes: int,
                 max_quarantined: int = MAX_QUARANTINED_READS) -> None:
        self.agent = agent
        self.row_nbytes = row_nbytes
        self.max_quarantined = max_quarantined
        self._free: list[StagingBuffer] = []
        self._quarantined: list[tuple[StagingBuffer, Any]] = []
        self._lock = threading.Lock()

    def acquire(self, num_rows: int) -> StagingBuffer:
        """A registered buffer of at least `num_rows` rows, for one READ. Raises
        StagingExhausted while `max_quarantined` given-up READs are in flight."""
        with self._lock:
            self._reclaim()
            if len(self._quarantined) >= self.max_quarantined:
                raise StagingExhausted(f"{len(self._quarantined)} given-up NIXL reads are "
                                       "still in flight")
            fits = [b for b in self._free if b.capacity >= num_rows]
            if fits:
                buffer = min(fits, key=lambda b: b.capacity)
                self._free.remove(buffer)
                return buffer
        capacity = max(MIN_ROWS, 1 << (num_rows - 1).bit_length())
        rows = torch.zeros(capacity, self.row_nbytes, dtype=torch.uint8)
        return StagingBuffer(rows, self.agent.register_memory([rows]))

    def give_back(self, buffer: StagingBuffer) -> None:
        """`buffer`'s READ completed or was never posted: it may serve another."""
        with self._lock:
            self._free.append(buffer)
            if len(self._free) > MAX_FREE_BUFFERS:
                smallest = min(self._free, key=lambda b: b.capacity)
                self._free.remove(smallest)
                self._deregister(smallest)

    def quarantine(self, buffer: StagingBuffer, handle: Any) -> None:
        """`buffer`'s READ (`handle`, not released) was given up while in flight."""
        with self._lock:
            self._quarantined.append((buffer, handle))

    def num_quarantined(self) -> int:
        """Given-up READs still in flight (those that ended are reclaimed first)."""
        with self._lock:
            self._reclaim()
            return len(self._quarantined)

    def _reclaim(self) -> None:
        still: list[tuple[StagingBuffer, Any]] = []
        for buffer, handle in self._quarantined:
            try:
                state = self.agent.check_xfer_state(handle)
            except Exception:  # noqa: BLE001 - an unknown state: never reused
                state = "PROC"
            if state not in ("DONE", "ERR"):
                still.append((buffer, handle))
                continue
            try:
                self.agent.release_xfer_handle(handle)
            except Exception:  # noqa: BLE001 - ended: the buffer is safe either way
                pass
            self._free.append(buffer)
        self._quarantined = still

    def _deregister(self, buffer: StagingBuffer) -> None:
        try:
            self.agent.deregister_memory(buffer.registration)
        except Exception as error:  # noqa: BLE001 - a closing agent
            logger.debug("staging buffer deregistration failed: %r", error)

    def close(self) -> None:
        """Deregister the idle buffers; quarantined ones stay alive for good (`_RETIRED`)."""
        with self._lock:
            self._reclaim()
            for buffer in self._free:
                self._deregister(buffer)
            self._free = []
            _RETIRED.extend(buffer.rows for buffer, _ in self._quarantined)
            self._quarantined = []
            self.agent = None


def block_runs(remote_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """The runs of consecutive ids in `remote_ids`: (index of its first, first id,
    length) each, in order."""
    runs: list[tuple[int, int, int]] = []
    for index, block_id in enumerate(remote_ids):
        if runs and runs[-1][1] + runs[-1][2] == block_id:
            first, first_id, length = runs[-1]
            runs[-1] = (first, first_id, length + 1)
        else:
            runs.append((index, block_id, 1))
    return runs


def block_descriptors(remote_ids: Sequence[int], regions: Sequence[tuple[int, int]],
                      half: int, local_base: int, first_row: int, num_blocks: int
                      ) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """The (local, remote) READ descriptors of the producer's blocks `remote_ids` (each
    cache tensor's (K base, V base) in `regions`, `half` bytes a block's side) into block
    rows `first_row`.. of a staging buffer at `local_base` whose READ holds `num_blocks`
    blocks, laid out (side, cache tensor, block): one descriptor per (side, cache
    tensor, run of consecutive ids)."""
    count = len(regions)
    local: list[tuple[int, int, int]] = []
    remote: list[tuple[int, int, int]] = []
    for index, first_id, length in block_runs(remote_ids):
        for side in range(2):
            for c, bases in enumerate(regions):
                offset = ((side * count + c) * num_blocks + first_row + index) * half
                local.append((local_base + offset, length * half, 0))
                remote.append((bases[side] + first_id * half, length * half, 0))
    return local, remote


def half_nbytes(caches: Sequence[torch.Tensor]) -> int:
    """The bytes of one block's K (or V) in a cache tensor [2, blocks, ...]: every cache
    tensor's the same (a handshake compares the producer's)."""
    cache = caches[0]
    return cache[0, 0].numel() * cache.element_size()


def staged_blocks(rows: torch.Tensor, num_blocks: int, num_caches: int) -> torch.Tensor:
    """The first `num_blocks` rows of a staging buffer as `block_descriptors` filled
    them: a (2, num_caches, num_blocks, half) uint8 view."""
    return rows[:num_blocks].reshape(-1).view(2, num_caches, num_blocks, -1)


def block_checksums(sides: Sequence[np.ndarray], block_ids: Sequence[int]) -> list[int]:
    """xxh3 of each block's bytes block-major (K of every cache tensor in order, then V),
    streamed piece by piece: `sides[c]` is cache tensor c's uint8 (2, blocks, half) array
    (the producer's cache, or a staged view's `[:, c]`). Producer and consumer both hash
    so: a checksum covers exactly the bytes the consumer installs."""
    checksums = []
    for block_id in block_ids:
        digest = xxhash.xxh3_64()
        for side in range(2):
            for array in sides:
                digest.update(array[side, block_id])
        checksums.append(digest.intdigest())
    return checksums
