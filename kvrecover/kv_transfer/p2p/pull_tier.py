"""A P2P connector as the first tier of a TieredConnector (`connectors[0]` a
NixlConnector): a pull first, the block stores behind it.

The scheduler role claims the larger of the pull's and the stores' prefixes; the
stores' load covers every claimed block (each group's, as a store load does) and the
pull its own. On the worker the load's reader thread pulls first (`PullTier.pull`,
bounded by the load's deadline; it reads into staging buffers and copies the blocks it
verified into the cache under the load's fence, `ReadCancel`: a load given up gets
nothing more written), so those are in the cache already (`IN_CACHE`), every other block of the load is read from the stores tier by tier, and
only what every tier lost is invalid (recomputed). A producer's TieredConnector keeps
its prompts for pulls through the same connector (and saves them into the stores).

A hybrid's pull reads its recurrent state with the blocks; `pull` keeps what it
verified (`pulled_state`) for the load's state read, which takes it instead of the
store's when it is at the load's end (the TieredConnector installs it, on the engine's
thread; never from here).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from kvrecover.kv_transfer.p2p.nixl_connector import NixlConnector, NixlMetadata, Pull
from kvrecover.kv_transfer.stores.block_store import StoredBlock
from kvrecover.kv_transfer.stores.reader_threads import ReadCancel

if TYPE_CHECKING:
    from kvrecover.kv_transfer.request_view import KVRequestView

logger = logging.getLogger(__name__)

# What a tier read returns for a block the pull already put, verified, in the cache.
IN_CACHE = StoredBlock(torch.empty(0), 0)


class PullTier:
    """The P2P connector in front of a TieredConnector's stores (both roles)."""

    def __init__(self, connector: NixlConnector) -> None:
        self.connector = connector
        self._claims: dict[str, int] = {}
        self._pulls: dict[str, Pull] = {}  # worker: pulls not yet run, by request id
        # Worker, a hybrid's: each pull's state (position, verified payload or None).
        self._states: dict[str, tuple[int, bytes | None]] = {}
        self._lock = threading.Lock()

    # ----- scheduler role ---------------------------------------------------------------
    def claim(self, request: KVRequestView, num_computed_tokens: int) -> int:
        """How many tokens after `num_computed_tokens` the pull can supply (0 for a
        request without a reference, or with a malformed one: the stores may still)."""
        try:
            tokens, _ = self.connector.get_num_new_matched_tokens(request, num_computed_tokens)
        except ValueError as error:
            logger.warning("request %s: %s; its KV is not pulled", request.request_id, error)
            tokens = 0
        self._claims[request.request_id] = tokens
        return tokens

    def plan(self, request: KVRequestView, block_ids: list[int],
             num_external_tokens: int) -> None:
        """The pull of the claim's blocks it covers, for the next metadata."""
        tokens = min(self._claims.pop(request.request_id, 0), num_external_tokens)
        self.connector.update_state_after_alloc(request, block_ids, tokens)

    def forget(self, request: KVRequestView) -> None:
        """The request ended before its claim was planned."""
        self._claims.pop(request.request_id, None)

    # ----- worker role ------------------------------------------------------------------
    def take(self, metadata: NixlMetadata) -> None:
        """The step's pulls, run later by the reader of each request's load."""
        with self._lock:
            self._pulls.update((pull.request_id, pull) for pull in metadata.pulls)

    def pull(self, request_ids: Iterable[str], timeout_s: float,
             fence: ReadCancel | None = None) -> tuple[set[int], set[int]]:
        """Run the pulls of these requests (a load's reader thread; `fence` the load's
        `cancelled`: once it is set nothing more is copied into the cache); (local
        blocks verified in the cache, local blocks that failed)."""
        with self._lock:
            pulls = [self._pulls.pop(r) for r in request_ids if r in self._pulls]
        if not pulls:
            return set(), set()
        failed = self.connector.pull_blocks(pulls, timeout_s, fence)
        loaded = {b for pull in pulls for b in pull.block_ids} - failed
        with self._lock:
            if fence is None or not fence.is_set():  # a load given up keeps no state
                self._states.update((p.request_id, (p.state_position, p.state_payload))
                                    for p in pulls if p.state_position is not None)
        return loaded, failed

    def pulled_state(self, request_id: str, position: int | None) -> bytes | None:
        """The verified state this request's pull read at `position` (taken: asked once),
        else None (no pull, another position, or it failed: the stores' turn)."""
        with self._lock:
            pulled = self._states.pop(request_id, None)
        return pulled[1] if pulled is not None and pulled[0] == position else None

    def forget_states(self, request_ids: Iterable[str]) -> None:
        """Drop the pulled states of these requests (they ended)."""
        with self._lock:
            for request_id in request_ids:
                self._states.pop(request_id, None)

    def drop_pulls(self) -> None:
        """Forget pulls never run (shutdown)."""
        with self._lock:
            self._pulls.clear()
            self._states.clear()
