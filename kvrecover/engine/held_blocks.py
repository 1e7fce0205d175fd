"""Blocks held for a request id until the worker confirms that nothing touches them.

After the engine lets go of a request, work it started may still touch the request's
blocks: an async load nobody waits for any more (an orphan, `async_loads.py`) may still
write them, a connector's send of an ended request (`pending_sends.py`) may still read
them. Both hold the blocks here: never freed, never given to another request, until the
worker's confirmation. Until a hold's deadline the engine keeps stepping so that the
confirmation is collected; after it, it no longer does, and if no confirmation ever
comes the blocks stay held (reusing them could store or attend to wrong KV).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class HeldBlocks:
    """Blocks held for one request id until the worker confirms it."""

    block_ids: list[int]
    deadline: float  # until then the engine keeps stepping for the confirmation


class BlockHolds:
    """The held blocks of unconfirmed work, by request id."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.holds: dict[str, HeldBlocks] = {}

    def hold(self, request_id: str, block_ids: list[int], deadline: float) -> None:
        """Hold `block_ids` (their references pass here) until `request_id` is confirmed;
        a second hold of the same id keeps both sets of blocks."""
        previous = self.holds.get(request_id)
        if previous is not None:
            block_ids = previous.block_ids + block_ids
        self.holds[request_id] = HeldBlocks(block_ids, deadline)

    def release(self, request_id: str) -> list[int] | None:
        """The worker confirmed `request_id`: its held block ids (to free), else None."""
        held = self.holds.pop(request_id, None)
        return None if held is None else held.block_ids

    def is_held(self, request_id: str) -> bool:
        """Whether unconfirmed work of this request id may still touch blocks."""
        return request_id in self.holds

    def awaiting_confirmation(self) -> bool:
        """Whether a hold is still within its deadline (worth stepping for)."""
        if not self.holds:
            return False
        now = self.clock()
        return any(held.deadline > now for held in self.holds.values())
