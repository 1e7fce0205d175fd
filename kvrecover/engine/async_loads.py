"""The engine's own bookkeeping of in-flight async KV loads: deadlines and orphans.

A connector may never report a load finished (a bug, a dead store, a lost
message). The engine therefore enforces a deadline on every async load itself
(DESIGN rule 5), counted from the step that started it, whatever the connector
does. Blocks that a load nobody waits for any more may still write (its request
was aborted, failed, or gave up on it at the deadline) are orphaned: held, never
reused, until the worker confirms that the load finished or was cancelled
(rule 7). Until its deadline an orphan keeps the engine stepping so the
confirmation is collected; after it, it no longer does, and if no confirmation
ever comes its blocks stay held.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class OrphanedLoad:
    """Blocks held on behalf of a load whose request no longer waits for it."""

    block_ids: list[int]
    deadline: float


class AsyncLoadTracker:
    """Deadlines of in-flight async loads and the blocks of orphaned ones, by request id."""

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s = timeout_s
        self.clock = clock
        self._deadlines: dict[str, float] = {}
        self.orphans: dict[str, OrphanedLoad] = {}

    def start(self, request_id: str) -> None:
        """The scheduler parked the request in WAITING_FOR_REMOTE_KVS: its load starts now."""
        self._deadlines[request_id] = self.clock() + self.timeout_s

    def finish(self, request_id: str) -> None:
        """The worker reported the request's load finished."""
        self._deadlines.pop(request_id, None)

    def expired(self) -> list[str]:
        """Requests whose load is still in flight past its deadline."""
        if not self._deadlines:
            return []
        now = self.clock()
        return [request_id for request_id, deadline in self._deadlines.items() if deadline <= now]

    def orphan(self, request_id: str, block_ids: list[int]) -> None:
        """Hold `block_ids` (their references pass to the tracker) until the load is confirmed."""
        deadline = self._deadlines.pop(request_id, self.clock())
        previous = self.orphans.get(request_id)
        if previous is not None:  # a second unconfirmed load of the same id: keep both
            block_ids = previous.block_ids + block_ids
        self.orphans[request_id] = OrphanedLoad(block_ids, deadline)

    def confirm(self, request_id: str) -> list[int] | None:
        """The worker confirmed an orphaned load: its block ids (to release), else None."""
        orphan = self.orphans.pop(request_id, None)
        return None if orphan is None else orphan.block_ids

    def is_orphaned(self, request_id: str) -> bool:
        """Whether an unconfirmed load of this request may still write blocks."""
        return request_id in self.orphans

    def awaiting_confirmation(self) -> bool:
        """Whether an orphaned load is still within its deadline (worth stepping for)."""
        if not self.orphans:
            return False
        now = self.clock()
        return any(orphan.deadline > now for orphan in self.orphans.values())
