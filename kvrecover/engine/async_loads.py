"""The engine's own bookkeeping of in-flight async KV loads: deadlines and orphans.

A connector may never report a load finished (a bug, a dead store, a lost
message). The engine therefore enforces a deadline on every async load itself
(DESIGN rule 5), counted from the step that started it, whatever the connector
does. Blocks that a load nobody waits for any more may still write (its request
was aborted, failed, or gave up on it at the deadline) are orphaned: held, never
reused, until the worker confirms that the load finished or was cancelled
(rule 7; the holding is `held_blocks.py`'s, shared with the sends of ended requests). Until its deadline (the load's, or, for a load that expired, `timeout_s`
after the cancel) an orphan keeps the engine stepping so the confirmation is
collected; after it, it no longer does, and if no confirmation ever comes its
blocks stay held.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvrecover.engine.held_blocks import BlockHolds, HeldBlocks


class AsyncLoadTracker:
    """Deadlines of in-flight async loads and the blocks of orphaned ones, by request id."""

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s = timeout_s
        self.clock = clock
        self._deadlines: dict[str, float] = {}
        self._orphans = BlockHolds(clock)  # held until the worker confirms the load

    @property
    def orphans(self) -> dict[str, HeldBlocks]:
        """The orphaned loads' held blocks, by request id."""
        return self._orphans.holds

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
        """Hold `block_ids` (their references pass to the tracker) until the load is confirmed.

        The hold is awaited until the load's own deadline, or, for a load that passed it
        (the worker is only now told to cancel it), for another `timeout_s`: with no time
        to confirm the cancel, a request that needs those blocks (the expired request
        itself, in a small cache) would end with an error the very step its load expired
        instead of recomputing once the cancelled load lets go of them."""
        now = self.clock()
        deadline = self._deadlines.pop(request_id, now)
        if deadline <= now:
            deadline = now + self.timeout_s
        # A second unconfirmed load of the same id keeps both sets of blocks.
        self._orphans.hold(request_id, block_ids, deadline)

    def confirm(self, request_id: str) -> list[int] | None:
        """The worker confirmed an orphaned load: its block ids (to release), else None."""
        return self._orphans.release(request_id)

    def is_orphaned(self, request_id: str) -> bool:
        """Whether an unconfirmed load of this request may still write blocks."""
        return self._orphans.is_held(request_id)

    def awaiting_confirmation(self) -> bool:
        """Whether an orphaned load is still within its deadline (worth stepping for)."""
        return self._orphans.awaiting_confirmation()
