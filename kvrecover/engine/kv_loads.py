"""The scheduler's side of KV loading: claims, async loads, failed blocks.

The scheduler owns the queues and the token budget; for everything about
external KV it calls this object: what the connector may supply for a request
(`scheduler_connector.py` validates it), parking async loads under the engine's
own deadline (`async_loads.py`), collecting each step's failed blocks (from the
worker and from connector bugs contained here) and carrying out the plan that
`recovery.py` decides. A request that recovery fails is handed back to the
scheduler through `end_with_error`. It also holds the blocks of ended requests
whose connector still sends them (`pending_sends.py`) until the worker reports them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from kvrecover.config import KVTransferConfig
from kvrecover.engine.async_loads import AsyncLoadTracker
from kvrecover.engine.kv_cache_manager import KVCacheManager
from kvrecover.engine.pending_sends import PendingSends
from kvrecover.engine.recompute_gaps import num_kept_tokens, truncate_kept
from kvrecover.engine.recovery import KVLoadRecovery, RecoveryPlan, RequestRecovery
from kvrecover.engine.request import Request, RequestStatus
from kvrecover.engine.scheduler_connector import ConnectorError, SchedulerConnector
from kvrecover.engine.stats import EngineStats
from kvrecover.kv_layout import NULL_BLOCK_ID, blocks_needed
from kvrecover.kv_transfer.base import DEFAULT_LOAD_TIMEOUT_S, KVConnectorBase, KVConnectorMetadata
from kvrecover.step_messages import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


def load_deadline_s(connector: KVConnectorBase | None) -> float:
    """The deadline the engine enforces on every async load: the connector's declared
    `load_timeout_s` (set from its extra config, or its own default), or the default
    when that is not a number of seconds in (0, 1e9)."""
    value = DEFAULT_LOAD_TIMEOUT_S if connector is None else connector.load_timeout_s
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e9:
        logger.error("KV connector load_timeout_s=%r is not a number of seconds; the engine "
                     "ends async loads after %.0f s", value, DEFAULT_LOAD_TIMEOUT_S)
        return DEFAULT_LOAD_TIMEOUT_S
    return float(value)


class KVLoads:
    """Claims external KV for the scheduler and applies recovery to what failed."""

    def __init__(
        self,
        kv_manager: KVCacheManager,
        stats: EngineStats,
        connector: KVConnectorBase | None,
        transfer: KVTransferConfig | None,
        end_with_error: Callable[[Request, str], None],
        clock: Callable[[], float] = time.monotonic,
        recurrent_state_at: Callable[[Request, int, int], bool] | None = None,
    ) -> None:
        self.kv_manager = kv_manager
        self.block_size = kv_manager.block_size
        self._windowed = any(kv_manager.windowed)
        self.stats = stats
        self.can_load = connector is not None and transfer is not None and transfer.is_consumer
        self.connector = None if connector is None else SchedulerConnector(
            connector, self.block_size)
        self.recovery = KVLoadRecovery(
            self.block_size,
            transfer.kv_load_failure_policy if transfer else "recompute",
            transfer.kv_load_retry_limit if transfer else 0,
            kv_manager.groups,
            transfer.kv_load_recompute if transfer else "prefix",
            recurrent_state_at,
        )
        self.tracker = AsyncLoadTracker(load_deadline_s(connector), clock)
        self.sends = PendingSends(self.tracker.timeout_s, clock)
        self._end_with_error = end_with_error
        self._claimed: list[Request] = []  # claimed external tokens in this step
        # Blocks a contained connector bug made untrustworthy; judged with the step's output.
        self._connector_invalid: set[int] = set()
        # Token ranges lost by requests that may ask the connector again: what its next
        # claim does not cover is recomputed (counted then, not when lost).
        self._lost_until_reclaim: dict[str, tuple[int, int]] = {}

    # ----- while scheduling ------------------------------------------------------------
    def external_tokens(self, request: Request, num_local: int) -> tuple[int, bool]:
        """The connector's validated claim; a connector error is a failure of `request`
        (under policy `fail` it ends the request)."""
        if not self.can_load or self.connector is None or request.connector_consulted:
            return 0, False
        if not self.recovery.may_consult_connector(request):
            return 0, False
        if self.tracker.is_orphaned(request.request_id):
            return 0, False  # an unconfirmed load of this id may still be reported
        try:
            return self.connector.matched_tokens(request, num_local)
        except ConnectorError as error:
            self._apply_verdict(request, self.recovery.plan_connector_error(request, str(error)))
            return 0, False

    def claim(self, request: Request, num_local: int, num_external: int) -> None:
        """Tell the connector where the request's external tokens go, and count them
        computed. If it fails, all of them are invalid (judged with the step's output)."""
        request.num_computed_tokens = num_local
        lost = self._lost_until_reclaim.pop(request.request_id, None)
        if lost is not None:
            start, end = lost
            self.stats.kv_load_recomputed_tokens += max(0, end - max(start, num_local + num_external))
        failed = False
        if self.connector is not None and not request.connector_consulted:
            request.connector_consulted = True
            try:
                self.connector.update_state_after_alloc(
                    request, list(request.block_ids), num_external)
            except ConnectorError:
                failed = True
        if num_external:
            request.pending_external = (num_local, num_local + num_external)
            request.num_computed_tokens = num_local + num_external
            self._claimed.append(request)
            self.stats.kv_load_bytes += (
                len(self.external_block_ids(request)) * self.kv_manager.block_nbytes)
            if failed:  # whether and where it loads is unknown
                self._connector_invalid.update(self.external_block_ids(request))

    def park(self, request: Request) -> None:
        """The request waits for its async load; the engine's deadline starts now."""
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.tracker.start(request.request_id)

    def build_connector_meta(self, output: SchedulerOutput) -> KVConnectorMetadata | None:
        """This step's connector metadata. If building it fails, this step's loads are
        failures (the in-flight ones are judged once they end or expire, rule 7)."""
        claimed, self._claimed = self._claimed, []
        if self.connector is None:
            return None
        try:
            return self.connector.build_connector_meta(output)
        except ConnectorError:
            for request in claimed:
                self._connector_invalid.update(self.external_block_ids(request))
            return KVConnectorMetadata()

    def expire(self, requests: dict[str, Request]) -> list[Request]:
        """Rule 5: async loads past the deadline failed as a whole. Their blocks stay
        held until the worker confirms (rule 7); each request goes on in fresh blocks
        (or fails, per policy). Returns them: the worker is told to cancel their loads."""
        expired = [requests[request_id] for request_id in self.tracker.expired()]
        if not expired:
            return []
        plan = self.recovery.plan_expired_loads(expired)
        for request, verdict in zip(expired, plan.requests):
            logger.warning("request %s: async KV load unfinished after %.1fs",
                           request.request_id, self.tracker.timeout_s)
            orphaned = self.kv_manager.take_blocks(request, verdict.first_invalid_block)
            self.tracker.orphan(request.request_id, orphaned)
            request.pending_external = None
            request.status = RequestStatus.WAITING
        self._apply_plan(plan, requests)
        return expired

    def abort(self, request: Request) -> None:
        """An aborted request's in-flight load may still write its blocks: hold them."""
        if request.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
            self.tracker.orphan(request.request_id, self.kv_manager.take_blocks(request, 0))

    def request_finished(self, request: Request) -> None:
        """A request ended (any reason): tell the connector, forget its failures. If the
        connector keeps the blocks, they leave the request and are held until it reports
        the request sent (`finish_sends`)."""
        if self.connector is not None:
            keep = self.connector.request_finished(request, list(request.block_ids))
            if keep and request.holds_blocks:
                self.sends.hold_until_sent(request.request_id, self.kv_manager.take_blocks(request, 0))
        self.recovery.forget(request.request_id)
        self._lost_until_reclaim.pop(request.request_id, None)

    # ----- with the step's output -----------------------------------------------------------
    def finish_loads(self, finished_recving: Iterable[str], requests: dict[str, Request]
                     ) -> list[Request]:
        """Requests whose async load ended become schedulable; orphaned blocks are freed."""
        ready = []
        for request_id in finished_recving:
            orphaned = self.tracker.confirm(request_id)
            if orphaned is not None:  # the worker confirmed: the blocks are safe to reuse
                self.kv_manager.release_blocks(orphaned)
                continue
            request = requests.get(request_id)
            if request is not None and request.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
                self.tracker.finish(request_id)
                request.status = RequestStatus.WAITING
                ready.append(request)
        return ready

    def finish_sends(self, finished_sending: Iterable[str]) -> None:
        """Release the blocks of the ended requests the worker reported sent."""
        if self.sends.holds:
            self.kv_manager.release_blocks(self.sends.confirm(finished_sending))

    def recover(self, output: ModelRunnerOutput, loaded: list[Request],
                queues: Iterable[Iterable[Request]], requests: dict[str, Request]) -> set[str]:
        """Judge the step's failed blocks against every request in `queues` that holds
        blocks and apply the plan; returns the ids of the requests it rolled back or
        failed (their sampled tokens are void)."""
        invalid = set(output.invalid_block_ids) | self._connector_invalid
        self._connector_invalid = set()
        if output.kv_load_report_failed:  # no usable report: every load that ended failed
            for request in loaded:
                invalid.update(self.external_block_ids(request))
        if not invalid and not self.recovery.has_deferred:
            return set()
        holders = [r for queue in queues for r in queue if r.holds_blocks]
        return self._apply_plan(self.recovery.plan(invalid, holders), requests)

    def account_loaded(self, loaded: list[Request]) -> None:
        """Count what the loads that ended in this step really supplied, and cache it."""
        for request in loaded:
            start, end = request.pending_range
            self.stats.prompt_tokens_external += max(0, min(request.num_computed_tokens, end) - start)
            if request.kept_ranges:  # loaded valid blocks after a hole (scope "blocks")
                self.stats.prompt_tokens_external += num_kept_tokens(request.kept_ranges, start, end)
            request.pending_external = None
            self.kv_manager.cache_computed_blocks(request)

    def connector_stats(self) -> dict[str, int]:
        """The scheduler-role connector's own counter increments since the last call."""
        return {} if self.connector is None else self.connector.connector_stats()

    def take_error_count(self) -> int:
        """Scheduler-side connector failures since the last call."""
        return 0 if self.connector is None else self.connector.errors.take_count()

    def external_block_ids(self, request: Request) -> list[int]:
        """The blocks the request's pending external tokens are loaded into (every group's)."""
        start, end = request.pending_range
        first, last = start // self.block_size, blocks_needed(end, self.block_size)
        if not self._windowed:  # full attention: no null block in any table
            return [b for table in request.block_tables for b in table[first:last]]
        return [b for table in request.block_tables for b in table[first:last]
                if b != NULL_BLOCK_ID]

    # ----- applying recovery's decisions ---------------------------------------------------
    def _apply_plan(self, plan: RecoveryPlan, requests: dict[str, Request]) -> set[str]:
        self.kv_manager.uncache_blocks(plan.uncache_block_ids)
        self.stats.kv_load_failed_blocks += plan.num_failed_blocks
        for verdict in plan.requests:
            self._apply_verdict(requests[verdict.request_id], verdict)
        return {verdict.request_id for verdict in plan.requests if verdict.voids_step}

    def _apply_verdict(self, request: Request, verdict: RequestRecovery) -> None:
        request.num_kv_load_failures += 1
        if verdict.fail:
            logger.warning("request %s: %s; policy 'fail' ends it with an error",
                           request.request_id, verdict.error)
            self.stats.kv_load_failed_requests += 1
            self._end_with_error(request, verdict.error)
            return
        if verdict.drop_block_ids:
            self.kv_manager.drop_blocks(request, verdict.drop_block_ids)
        num_lost = verdict.num_tokens_lost
        request.kept_ranges = verdict.kept_ranges
        if not verdict.orphan_blocks:
            self.kv_manager.make_private_from(request, verdict.first_invalid_block,
                                              verdict.kept_block_indices(self.block_size))
            if request.kept_ranges:  # without a spare block the tail went, kept part too
                num_lost += truncate_kept(request, len(request.block_ids) * self.block_size)
        request.num_computed_tokens = verdict.rollback_to
        self.stats.kv_load_recovered_requests += 1
        if verdict.may_reconsult:  # the connector may load them again: count at that claim
            request.connector_consulted = False
            start, end = verdict.rollback_to, verdict.rollback_to + verdict.num_tokens_lost
            earlier = self._lost_until_reclaim.get(request.request_id)
            if earlier is not None:  # lost again before its claim: [start, end) grows
                start, end = min(start, earlier[0]), max(end, earlier[1])
            self._lost_until_reclaim[request.request_id] = (start, end)
        else:
            self.stats.kv_load_recomputed_tokens += num_lost
        logger.info("request %s: %s; rolled back to token %d, %d token(s) to reload or "
                    "recompute", request.request_id, verdict.error, verdict.rollback_to,
                    num_lost)
