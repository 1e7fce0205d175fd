"""KV load failure recovery: decides what a failed load rolls back, fails and uncaches.

This module alone decides (docs/ARCHITECTURE.md, recovery rules 1-7); it never touches blocks or
queues. The scheduler hands it the step's invalid block ids and the requests
that hold blocks, and gets back a `RecoveryPlan`; the scheduler applies the
plan (`kv_loads.py`) and the KV cache manager executes its block operations.

- Every request that counts an invalid block among its computed tokens is cut
  back to its longest prefix whose whole state is valid (policy `recompute`; rule 8)
  or ends with an error (policy `fail`). A full-attention group needs every block
  before that point, a windowed group (`kv_groups.py`) only the blocks its window
  reads from it, held and valid: a lost block that no window reads again costs
  nothing, and with one group of full attention the point is the start of the
  first invalid block. Invalid blocks leave the prefix cache, so no request
  treats them as computed until one recomputes them (rule 3).
- A request whose async load is still in flight is judged once the load ends:
  its invalid blocks are remembered until then (rule 2; rule 7 keeps its blocks).
- An async load past its deadline is a failure of all its blocks (rule 5); they
  stay held until the worker confirms, and the request recomputes in fresh ones.
- After a failure a request may ask the connector again only `retry_limit`
  times (rule 6).
- Scope "blocks" (`kv_load_recompute`, full-attention models only): the cut is the
  same, but the valid blocks the judged load brought after it are kept
  (`recompute_gaps.py`); the request recomputes only the gaps, and such a request
  does not ask the connector again.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from kvrecover.engine.recompute_gaps import num_kept_tokens, plan_kept_ranges, supports_blocks_scope
from kvrecover.engine.request import Request, RequestStatus
from kvrecover.kv_groups import KVCacheGroup
from kvrecover.kv_layout import NULL_BLOCK_ID, blocks_needed


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
    # Failed blocks below the rollback point that no window reads from there: released
    # (they become the null block), nothing is recomputed for them (rule 8).
    drop_block_ids: list[int] = field(default_factory=list)
    # Scope "blocks": valid loaded token ranges above `rollback_to` that stay computed
    # (`recompute_gaps.py`); the request computes only the gaps between them.
    kept_ranges: list[tuple[int, int]] = field(default_factory=list)

    def kept_block_indices(self, block_size: int) -> set[int]:
        """The block positions of the kept ranges (whole blocks)."""
        return {index for start, end in self.kept_ranges
                for index in range(start // block_size, end // block_size)}

    @property
    def voids_step(self) -> bool:
        """Whether the request's part of the step that reported it is void (it ends, or
        rolls back below what that step computed)."""
        return self.fail or self.num_tokens_lost > 0


@dataclass
class RecoveryPlan:
    """What the scheduler must do about one report of failed loads."""

    requests: list[RequestRecovery] = field(default_factory=list)
    uncache_block_ids: set[int] = field(default_factory=set)  # drop from the prefix cache
    num_failed_blocks: int = 0  # newly failed blocks (for the counters)


class KVLoadRecovery:
    """Applies the failure policy and the retry bound; remembers failures of in-flight loads."""

    def __init__(self, block_size: int, policy: str = "recompute", retry_limit: int = 1,
                 groups: Sequence[KVCacheGroup] = (KVCacheGroup(None, ()),),
                 recompute: str = "prefix",
                 recurrent_state_at: Callable[[Request, int, int], bool] | None = None) -> None:
        self.block_size = block_size
        self.groups = tuple(groups)
        # A hybrid model's linear-attention layers resume at P only from their state at P:
        # whether it is to be had for the request there, given where its first invalid
        # block starts (the scheduler's `StateCheckpoints.can_resume`).
        self.recurrent_state_at = recurrent_state_at
        self.policy = policy
        self.retry_limit = retry_limit
        # Scope "blocks" keeps valid loaded blocks after a hole; windowed and hybrid
        # models fall back to "prefix" (`recompute_gaps.supports_blocks_scope`).
        self.keeps_blocks = (recompute == "blocks" and policy == "recompute"
                             and supports_blocks_scope(self.groups, recurrent_state_at is not None))
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
                hit = invalid.intersection(itertools.chain.from_iterable(request.block_tables))
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
            last = blocks_needed(end, self.block_size)
            block_ids = [b for table in request.block_tables for b in table[first:last]
                         if b != NULL_BLOCK_ID]
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
        block_size = self.block_size
        computed = request.num_computed_tokens
        earlier_kept = request.kept_ranges  # only ever set under scope "blocks"
        # Kept ranges count as computed: a hole in them is a failure of the request too.
        horizon = max(computed, earlier_kept[-1][1]) if earlier_kept else computed
        bad = [(g, i) for g, table in enumerate(request.block_tables)
               for i, block_id in enumerate(table[:blocks_needed(horizon, block_size)])
               if block_id in invalid]
        if not bad:
            return None
        rollback_to = self.rollback_point(request, invalid)
        first = (blocks_needed(computed, block_size) if rollback_to == computed
                 else rollback_to // block_size)
        dropped = [request.block_tables[g][i] for g, i in bad if i < first]
        kept: list[tuple[int, int]] = []
        if self.keeps_blocks:
            kept = plan_kept_ranges(rollback_to, request.pending_external, earlier_kept,
                                    {i for _, i in bad}, block_size, request.num_tokens)
        # A lost block that no window reads again costs nothing: no error, even under `fail`.
        fail = self.policy == "fail" and rollback_to < computed
        # Only a request that has not run past its load may ask again (rule 6 bounds it);
        # one that keeps loaded blocks after a hole recomputes the holes instead.
        may_reconsult = (
            not fail
            and not kept
            and request.status is RequestStatus.WAITING
            and request.num_kv_load_failures + 1 <= self.retry_limit
        )
        num_lost = (computed + num_kept_tokens(earlier_kept)) - (rollback_to + num_kept_tokens(kept))
        return RequestRecovery(
            request.request_id, rollback_to, first, len(bad),
            num_lost, fail=fail, may_reconsult=may_reconsult,
            error=f"KV load failed for {len(bad)} block(s)", drop_block_ids=dropped,
            kept_ranges=kept,
        )

    def rollback_point(self, request: Request, invalid: set[int]) -> int:
        """Rule 8: the longest prefix P <= num_computed_tokens whose whole state is valid.

        A full-attention group needs every block below P; a windowed group the blocks
        its window reads from P on (`KVCacheGroup.can_resume_at`). P is block-aligned
        unless it is num_computed_tokens itself (nothing to redo); 0 always qualifies.
        A model with recurrent layers also needs their state at exactly P
        (`recurrent_state_at(request, P, start of the first invalid block)`; the request
        holds it at num_computed_tokens).
        """
        block_size = self.block_size
        computed = request.num_computed_tokens
        limit = computed
        windowed = []
        for group, table in zip(self.groups, request.block_tables):
            if group.window is not None:
                windowed.append((group, table))
                continue
            for index, block_id in enumerate(table[: blocks_needed(limit, block_size)]):
                if block_id in invalid:
                    limit = index * block_size
                    break
        first_invalid = limit
        computed_from = self._computed_on_load(request)
        if computed_from is not None and computed_from < limit and any(
                group.reads_any(computed_from, block_size, table, invalid)
                for group, table in windowed):
            # The tokens this step computed on top of a sync load read an invalid block
            # through a window (and every later token reads them): none of them is valid.
            limit = computed_from
        candidates = [limit] if limit == computed else []
        candidates += range((min(limit, computed - 1) // block_size) * block_size, -1, -block_size)
        state_at = self.recurrent_state_at
        for position in candidates:
            if position > limit:
                continue
            if (state_at is not None and 0 < position < computed
                    and not state_at(request, position, first_invalid)):
                continue
            if all(group.can_resume_at(position, block_size, table, invalid, NULL_BLOCK_ID)
                   for group, table in windowed):
                return position
        return 0

    @staticmethod
    def _computed_on_load(request: Request) -> int | None:
        """Where the tokens computed in the same step as the request's sync load start
        (the load's end), when that step computed any; None otherwise."""
        if request.pending_external is None:
            return None
        end = request.pending_external[1]
        return end if end < request.num_computed_tokens else None
