"""Registered staging rows for a consumer's NIXL READs: pulled bytes never land in the
KV cache straight from the wire.

A READ that outlives its deadline is given up (its blocks are recomputed, or freed and
reused), yet it may still complete later, and NIXL offers no cancel that is proven to
wait for the write. So every READ targets a staging buffer of this pool, never the
cache: the caller verifies the staged rows and copies only verified ones into the cache
itself (`NixlConnector._pull`). A buffer whose READ was given up is quarantined with its
transfer handle, never released while in flight: it goes back into use only once NIXL
reports that transfer DONE or ERR (a terminal state: nothing more of it is written).
While `MAX_QUARANTINED_READS` buffers wait so, `acquire` refuses (`StagingExhausted`:
the pull fails at once and its blocks are recomputed) instead of growing memory for a
transport that hangs for good. Buffers are registered once and reused: at most
`MAX_FREE_BUFFERS` idle ones are kept, each sized to a power of two of rows.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

import torch

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
