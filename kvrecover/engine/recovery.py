"""KV load failure recovery: decides what a failed load rolls back, fails and uncaches.

This module alone decides (docs/ARCHITECTURE.md, recovery rules 1-7); it never touches blocks or
queues. The scheduler hands it the step's invalid block ids and the requests
that hold blocks, and gets back a `RecoveryPlan`; the scheduler applies the
plan (`kv_loads.py`) and the KV cache manager executes its block operations.

- Every request that counts an invalid block among its computed tokens is cut
  back to the start of its first invalid block (policy `recompute`) or ends with
  an error (policy `fail`). Invalid blocks leave the prefix cache, so no request
  treats them as computed until one recomputes them (rule 3).
- A request whose async load is still in flight is judged once the load ends:
  its invalid blocks are remembered until then (rule 2; rule 7 keeps its blocks).
- An async load past its deadline is a failure of all its blocks (rule 5); they
  stay held until the worker confirms, and the request recomputes in fresh ones.
- After a failure a request may ask the connector again only `retry_limit`
  times (rule 6).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from kvrecover.engine.request import Request, RequestStatus
from kvrecover.kv_layout import blocks_needed


@dataclass
class RequestRecovery:
    """Recovery's verdict for one request."""

    request_id: str
    rollback_to: int  # the request's num_computed_tokens from now on
    first_invalid_block: int  # index in its block table of the first block to redo
    num_invalid_blocks: int
    num_tokens_lost: int  # computed or loaded tokens that must be loaded or computed again
    fail: bool  # policy `fail`: end the request with `error`
    may_reconsult: bool  # it may ask the connector for its KV again
    error: str = ""
    # An expired async load may still write its blocks from `first_invalid_block` on:
    # hold them until the worker confirms, and recompute in fresh blocks (rules 5, 7).
    orphan_blocks: bool = False


@dataclass
class RecoveryPlan:
    """What the scheduler must do about one report of failed loads."""

    requests: list[RequestRecovery] = field(default_factory=list)
    uncache_block_ids: set[int] = field(default_factory=set)  # drop from the prefix cache
    num_failed_blocks: int = 0  # newly failed blocks (for the counters)


class KVLoadRecovery:
    """Applies the failure policy and the retry bound; remembers failures of in-flight loads."""

    def __init__(self, block_size: int, policy: str = "recompute", retry_limit: int = 1) -> None:
        self.block_size = block_size
        self.policy = policy
        self.retry_limit = retry_limit
        # Invalid blocks reported while the request's async load was in flight.
        self._deferred: dict[str, set[int]] = {}

    @property
    def has_deferred(self) -> bool:
        """Whether some in-flight load already has failed blocks waiting to be judged."""
        return bool(self._deferred)

    def may_consult_connector(self, request: Request) -> bool:
        """Rule 6: after `retry_limit` failed loads the prompt is computed locally."""
        return request.num_kv_load_failures <= self.retry_limit

    def plan(self, invalid_block_ids: Iterable[int], requests: Iterable[Request]) -> RecoveryPlan:
        """Judge a step's invalid blocks against every request that holds blocks."""
        invalid = set(invalid_block_ids)
        plan = RecoveryPlan(uncache_block_ids=set(invalid), num_failed_blocks=len(invalid))
        for request in requests:
            if request.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
                hit = invalid.intersection(request.block_ids)
                if hit:  # its load may still write these blocks: judge it once it ends
                    self._deferred.setdefault(request.request_id, set()).update(hit)
                continue
            bad = invalid | self._deferred.pop(request.request_id, set())
            verdict = self._judge(request, bad) if bad else None
            if verdict is not None:
                plan.requests.append(verdict)
        return plan

    def plan_expired_loads(self, requests: Iterable[Request]) -> RecoveryPlan:
        """Rule 5: each of these async loads outlived its deadline; all its blocks failed."""
        plan = RecoveryPlan()
        for request in requests:
            self._deferred.pop(request.request_id, None)
            start, end = request.pending_range
            first = start // self.block_size
            block_ids = request.block_ids[first : blocks_needed(end, self.block_size)]
            plan.uncache_block_ids.update(block_ids)
            plan.num_failed_blocks += len(block_ids)
            plan.requests.append(RequestRecovery(
                request.request_id, start, first, len(block_ids), end - start,
                fail=self.policy == "fail", may_reconsult=False,
                error=f"KV load of {len(block_ids)} block(s) did not finish before its deadline",
                orphan_blocks=True,
            ))
        return plan

    def plan_connector_error(self, request: Request, error: str) -> RequestRecovery:
        """The connector failed before any block of `request` was claimed: nothing to roll
        back; policy `fail` ends it, `recompute` computes its prompt locally."""
        return RequestRecovery(
            request.request_id, request.num_computed_tokens,
            blocks_needed(request.num_computed_tokens, self.block_size), 0, 0,
            fail=self.policy == "fail", may_reconsult=False, error=f"KV connector error: {error}",
        )

    def forget(self, request_id: str) -> None:
        """The request ended: drop what was remembered for it."""
        self._deferred.pop(request_id, None)

    def _judge(self, request: Request, invalid: set[int]) -> RequestRecovery | None:
        computed = request.block_ids[: blocks_needed(request.num_computed_tokens, self.block_size)]
        bad_positions = [i for i, block_id in enumerate(computed) if block_id in invalid]
        if not bad_positions:
            return None
        first_bad = bad_positions[0]
        cut = first_bad * self.block_size
        fail = self.policy == "fail"
        # Only a request that has not run past its load may ask again (rule 6 bounds it).
        may_reconsult = (
            not fail
            and request.status is RequestStatus.WAITING
            and request.num_kv_load_failures + 1 <= self.retry_limit
        )
        return RequestRecovery(
            request.request_id, cut, first_bad, len(bad_positions),
            request.num_computed_tokens - cut, fail=fail, may_reconsult=may_reconsult,
            error=f"KV load failed for {len(bad_positions)} block(s)",
        )
