"""Registered staging rows for a consumer's NIXL READs: pulled bytes never land in the
KV cache straight from the wire.

A READ that outlives its deadline is given up (its blocks are recomputed, or freed and
reused), yet it may still complete later, and NIXL offers no cancel that is proven to
wait for the write. So every READ targets a staging buffer of this pool, never the
cache: the caller verifies the staged rows and copies only verified ones into the cache
itself (`PullReader.install`, `pull_reads.py`). A buffer whose READ was given up is
quarantined with its transfer handle, never released while in flight: it goes back into
use only once NIXL reports that transfer DONE or ERR (a terminal state: nothing more of
it is written). While `MAX_QUARANTINED_READS` buffers wait so, `acquire` refuses
(`StagingExhausted`: the pull fails at once and its blocks are recomputed) instead of
growing memory for a transport that hangs for good. Buffers are registered once and
reused: at most `MAX_FREE_BUFFERS` idle ones are kept, each sized to a power of two of
rows.

Layout. A READ of n producer blocks (each pulled one once, and the gaps it joins) fills
the buffer's first n rows (a row: a block's K and V in every cache tensor), in ascending
producer id (`StagingLayout`), side-major: (side, cache tensor, block), each piece
`half` bytes, so that a run of consecutive producer block ids is one descriptor per
(side, cache tensor) (`block_descriptors`) instead of one per (side, cache tensor,
block): 60 descriptors a block of 12 KB each were most of a CPU pull's READ time.
Ascending, because a producer that has served a while hands a prompt its blocks in the
order they were freed, and a request's blocks are freed tail first: descending runs, one
descriptor a block in the prompts' order (each ~3 µs in UCX on a CPU, ~5 µs on a GPU). A
gap between two runs is read too where its blocks cost less than the descriptors joining
saves (`max_gap_blocks`; those rows are neither checked nor installed). A block's
checksum still covers its bytes block-major (K of each cache tensor, then V), hashed
piece by piece (`checksums.py`), so producer and consumer hash the same bytes with no
permuted copy on either side. A hybrid's state rows follow the n block rows
(`states.py`).

Memory. Buffers live where the consumer's cache does: CPU memory (NIXL's "DRAM") for a
CPU engine, the cache's GPU ("VRAM") for a GPU one, so a GPU pull is a device-to-device
READ and its checks run on the device. Every descriptor names its memory's device
(`memory_of`); a producer's handshake names its own.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

# A READ's state is polled every eighth of the time it has taken so far, within
# [FIRST_POLL_S, POLL_INTERVAL_S]: a GPU's READ of GBs ends in about a millisecond, a
# CPU's in tens, and either is seen done at most about an eighth late (doubling waits
# saw a 1.6 ms READ done at 2.55 ms).
FIRST_POLL_S = 0.00005
POLL_INTERVAL_S = 0.001
MAX_QUARANTINED_READS = 4  # given-up READs still in flight before pulls are refused
MAX_FREE_BUFFERS = 2  # idle registered buffers kept for reuse
MIN_ROWS = 8
# A buffer's rows are rounded up to one of 8 steps per power of two (under 1/8 more
# than asked): a GPU pull's rows are MBs each.
ROUNDING_STEPS = 8

# Buffers whose READ may still be in flight when their pool closed: kept alive for the
# process's lifetime (at most MAX_QUARANTINED_READS per closed pool), never freed under
# a transfer that could still write them.
_RETIRED: list[torch.Tensor] = []


class StagingExhausted(Exception):
    """Too many given-up READs are still in flight: no staging buffer is handed out."""


@dataclass(eq=False)  # told apart by identity: field equality would compare tensors
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
                 max_quarantined: int = MAX_QUARANTINED_READS,
                 device: torch.device | str = "cpu") -> None:
        self.agent = agent
        self.row_nbytes = row_nbytes
        self.device = torch.device(device)
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
        rows = torch.zeros(rounded_rows(num_rows), self.row_nbytes, dtype=torch.uint8,
                           device=self.device)
        if rows.is_cuda:
            # UCX writes the READ on a stream of its own: the zeroing (and any kernel
            # still using this memory's previous tensor) must not land after it.
            torch.cuda.current_stream(rows.device).synchronize()
        return StagingBuffer(rows, self.agent.register_memory([rows]))

    def read(self, buffer: StagingBuffer, local: list[tuple[int, int, int]],
             remote: list[tuple[int, int, int]], remote_memory: str, peer_agent: str,
             deadline: float) -> bool:
        """One NIXL READ from `peer_agent`'s `remote` descriptors (of `remote_memory`) into
        `local` ones within `buffer`, waited for until `deadline`. True if it completed
        (the buffer stays the caller's, to give back); else the buffer is given back, or
        quarantined while the READ may still write it."""
        handle = None
        state = "ERR"
        try:
            local_descs = self.agent.get_xfer_descs(local, memory_of(buffer.rows)[0])
            remote_descs = self.agent.get_xfer_descs(remote, remote_memory)
            handle = self.agent.initialize_xfer("READ", local_descs, remote_descs,
                                                peer_agent, b"")
            state = self.agent.transfer(handle)
            posted = time.monotonic()
            while state not in ("DONE", "ERR") and time.monotonic() < deadline:
                waited = time.monotonic() - posted
                time.sleep(min(max(FIRST_POLL_S, waited / 8), POLL_INTERVAL_S))
                state = xfer_state(self.agent, handle)
            if state != "DONE":
                logger.warning("NIXL read of %d descriptors from %s: %s", len(local),
                               peer_agent, "failed" if state == "ERR" else "past its deadline")
        except Exception as error:  # a transfer that cannot be posted is a failed pull
            logger.warning("NIXL read from %s could not run: %r", peer_agent, error)
            state = "ERR" if handle is None else "PROC"  # posted: it may still write
        if handle is not None and state not in ("DONE", "ERR"):
            self.quarantine(buffer, handle)  # never released in flight
            return False
        if handle is not None:
            try:
                self.agent.release_xfer_handle(handle)
            except Exception:  # noqa: BLE001 - ended: nothing more is written
                pass
        if state != "DONE":
            self.give_back(buffer)
        return state == "DONE"

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
                state = xfer_state(self.agent, handle)
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


def xfer_state(agent: Any, handle: Any) -> str:
    """NIXL's state of transfer `handle`: "DONE", "PROC" or "ERR". NIXL's bindings report
    an error status (e.g. a dead peer's NIXL_ERR_REMOTE_DISCONNECT) by raising one of
    their `nixl...Error`s, never as "ERR": that is "ERR"; other exceptions propagate."""
    try:
        return agent.check_xfer_state(handle)
    except Exception as error:
        if type(error).__name__.startswith("nixl"):
            return "ERR"
        raise


def rounded_rows(num_rows: int) -> int:
    """A new buffer's capacity for `num_rows`: at least MIN_ROWS, rounded up to one of
    ROUNDING_STEPS steps between two powers of two."""
    if num_rows <= MIN_ROWS:
        return MIN_ROWS
    step = max(1, (1 << (num_rows.bit_length() - 1)) // ROUNDING_STEPS)
    return -(-num_rows // step) * step


def memory_of(tensor: torch.Tensor) -> tuple[str, int]:
    """NIXL's memory type of `tensor` and the device id its descriptors carry."""
    if tensor.is_cuda:
        return "VRAM", tensor.device.index or 0
    return "DRAM", 0


# What one more READ descriptor costs, as the bytes a READ moves meanwhile: ~5 µs a
# descriptor at ~1.5 TB/s on a GPU (cuda_ipc), ~3 µs at ~4 GB/s on a CPU (UCX on
# loopback) (bench/NOTES.md, "NIXL pulls from a used producer").
DESCRIPTOR_COST_BYTES = {"cuda": 4 << 20, "cpu": 16 << 10}


def max_gap_blocks(half: int, device_type: str) -> int:
    """The longest gap of unpulled producer blocks worth reading to join two runs: a gap
    block costs its `half` bytes per (side, cache tensor), joining saves a descriptor per
    (side, cache tensor)."""
    return DESCRIPTOR_COST_BYTES.get(device_type, DESCRIPTOR_COST_BYTES["cpu"]) // half


@dataclass(frozen=True)
class StagingLayout:
    """Where a READ puts a step's pulled blocks (module docstring): row r holds producer
    block `remote_ids[r]` (distinct, ascending); `rows[i]` is the row of the i-th pulled
    block (a block two prompts share on the producer is read once). Rows no pull uses
    fill short gaps between runs (each prompt's last, partial block is not pulled: the
    next prompt's run starts a block later)."""

    remote_ids: list[int]
    rows: list[int]

    @classmethod
    def of(cls, pulled_remote_ids: Sequence[int], max_gap: int = 0) -> StagingLayout:
        """The layout of the pulled producer blocks `pulled_remote_ids` (in pull order),
        gaps of up to `max_gap` blocks read too (in all, no more rows than are pulled)."""
        distinct = sorted(set(pulled_remote_ids))
        spare = len(distinct)  # gap rows at most double the buffer
        remote_ids: list[int] = []
        for block_id in distinct:
            gap = block_id - remote_ids[-1] - 1 if remote_ids else 0
            if 0 < gap <= min(max_gap, spare):
                remote_ids.extend(range(remote_ids[-1] + 1, block_id))
                spare -= gap
            remote_ids.append(block_id)
        row_of = {block_id: row for row, block_id in enumerate(remote_ids)}
        return cls(remote_ids, [row_of[block_id] for block_id in pulled_remote_ids])


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
                      half: int, local_base: int, first_row: int, num_blocks: int,
                      local_device: int = 0, remote_device: int = 0
                      ) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """The (local, remote) READ descriptors of the producer's blocks `remote_ids` (each
    cache tensor's (K base, V base) in `regions` on `remote_device`, `half` bytes a
    block's side) into block rows `first_row`.. of a staging buffer at `local_base` (on
    `local_device`) whose READ holds `num_blocks` blocks, laid out (side, cache tensor,
    block): one descriptor per (side, cache tensor, run of consecutive ids)."""
    count = len(regions)
    local: list[tuple[int, int, int]] = []
    remote: list[tuple[int, int, int]] = []
    for index, first_id, length in block_runs(remote_ids):
        for side in range(2):
            for c, bases in enumerate(regions):
                offset = ((side * count + c) * num_blocks + first_row + index) * half
                local.append((local_base + offset, length * half, local_device))
                remote.append((bases[side] + first_id * half, length * half, remote_device))
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
