"""Blocks of ended requests that the connector is still sending.

`KVConnectorBase.request_finished` returning True means: the connector still reads
the request's blocks after it ended (an async save, a remote pull) and reports the
request in `finished_sending` once it is done. Until then the engine holds those
blocks: they are not freed and no other request gets them (a prefix-cache hit may
share a full block, read-only, as it may share any cached block).

Bounds (the connector is not trusted to report):
- the engine keeps stepping for a report (so the worker collects it) until the
  deadline, the connector's load deadline counted from the request's end; after it
  the blocks stay held until a report comes, as orphaned loads do (`held_blocks.py` holds both):
  reusing blocks a connector may still read could store wrong KV. A waiting request
  that cannot fit without them then ends with an error instead of waiting forever;
- an aborted request is held the same way (its send may be under way);
- a request id is not reused while its send is unconfirmed (a report could not tell
  the two apart);
- `Engine.close()` shuts the connectors down, which ends their sends; the blocks go
  with the cache.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from kvrecover.engine.held_blocks import BlockHolds


class PendingSends(BlockHolds):
    """The held blocks of ended requests whose sends are unconfirmed, by request id
    (`is_held`: whether the connector may still read blocks of an ended request of
    this id)."""

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(clock)
        self.timeout_s = timeout_s

    def hold_until_sent(self, request_id: str, block_ids: list[int]) -> None:
        """Hold `block_ids` (their references pass here) until `request_id` is reported sent."""
        self.hold(request_id, block_ids, self.clock() + self.timeout_s)

    def confirm(self, request_ids: Iterable[str]) -> list[int]:
        """The worker reported these requests sent: the block ids to release now
        (ids of requests not held here are ignored)."""
        released: list[int] = []
        for request_id in request_ids:
            released += self.release(request_id) or []
        return released
