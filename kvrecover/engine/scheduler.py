"""Continuous batching with chunked prefill, prefix caching, KV loading and recovery.

Each step the scheduler spends a token budget (`max_num_batched_tokens`): first
on running requests (decodes and unfinished prefill chunks, preempting the
newest running requests when blocks run out), then on waiting ones, which is
where local prefix-cache hits and the connector's external tokens are claimed.
A request whose KV loads asynchronously parks in WAITING_FOR_REMOTE_KVS, holding
its blocks, until the worker reports the load finished or the engine's deadline
for it passes (`async_loads.py`).

Failed loads: the scheduler collects the step's invalid blocks (from the worker,
and from connector bugs it contained itself) and applies the plan that
`recovery.py` returns; connector calls go through `scheduler_connector.py`.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

from kvrecover.config import DEFAULT_LOAD_TIMEOUT_S, KVTransferConfig, SchedulerConfig
from kvrecover.engine.async_loads import AsyncLoadTracker
from kvrecover.engine.kv_cache_manager import KVCacheManager, blocks_needed
from kvrecover.engine.recovery import KVLoadRecovery, RecoveryPlan, RequestRecovery
from kvrecover.engine.request import Request, RequestStatus
from kvrecover.engine.scheduler_connector import ConnectorError, SchedulerConnector
from kvrecover.engine.scheduler_output import (
    PENDING_TOKEN,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)
from kvrecover.engine.stats import EngineStats
from kvrecover.kv_transfer.base import KVConnectorBase, KVConnectorMetadata

logger = logging.getLogger(__name__)


class Scheduler:
    """Decides, step by step, which tokens of which requests the worker computes."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv_manager: KVCacheManager,
        stats: EngineStats,
        connector: KVConnectorBase | None = None,
        kv_transfer_config: KVTransferConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.kv_manager = kv_manager
        self.stats = stats
        self.connector = connector
        self.kv_transfer_config = transfer = kv_transfer_config
        self.can_load = connector is not None and transfer is not None and transfer.is_consumer
        self._connector = None if connector is None else SchedulerConnector(
            connector, kv_manager.block_size)
        self.recovery = KVLoadRecovery(
            kv_manager.block_size,
            transfer.kv_load_failure_policy if transfer else "recompute",
            transfer.kv_load_retry_limit if transfer else 0,
        )
        self.loads = AsyncLoadTracker(
            transfer.load_timeout_s if transfer else DEFAULT_LOAD_TIMEOUT_S, clock)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_since_last_step: set[str] = set()
        # Requests that claimed external tokens in the step being scheduled.
        self._claimed: list[Request] = []
        # Blocks a contained connector bug made untrustworthy; judged with the step's output.
        self._connector_invalid: set[int] = set()
        # Requests ended while scheduling (reported with the step's output).
        self._ended_while_scheduling: list[Request] = []

    # ----- requests -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a new request (its id must be unused)."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_request(self, request_id: str) -> Request | None:
        """End a request now; blocks an async load may still write stay held (rule 7)."""
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return None
        if request.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
            self.loads.orphan(request_id, self.kv_manager.take_blocks(request, 0))
        request.status = RequestStatus.FINISHED_ABORTED
        self._finish(request)
        return request

    def has_unfinished(self) -> bool:
        """Whether any request still needs steps (or an aborted load its confirmation)."""
        return bool(self.waiting or self.running) or self.loads.awaiting_confirmation()

    def loads_in_flight(self) -> bool:
        """Whether a step may end with nothing done because async loads are pending."""
        return self.loads.awaiting_confirmation() or any(
            r.status is RequestStatus.WAITING_FOR_REMOTE_KVS for r in self.waiting
        )

    def pop_finished(self, request_id: str) -> Request | None:
        """Forget a finished request once its output has been handed out."""
        request = self.requests.get(request_id)
        if request is not None and request.is_finished:
            return self.requests.pop(request_id)
        return None

    # ----- scheduling ------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this step's work within the token budget."""
        self._expire_loads()
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preemptions_before = self.stats.num_preemptions
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._allocate_or_preempt(request, request.num_computed_tokens + num_new):
                break  # the request itself was preempted: it was the last running one
            scheduled.append(self._slice(request, num_new))
            budget -= num_new
            index += 1
        # After a preemption the freed blocks go to running requests first; but when
        # the last running request preempted itself, the waiting ones must go on.
        if self.stats.num_preemptions == preemptions_before or not scheduled:
            stalled = self._schedule_waiting(scheduled, budget)
            if stalled is not None and not scheduled and not self.running:
                self._fail_stalled(stalled)
        output = SchedulerOutput(scheduled, self._finished_since_last_step)
        self._finished_since_last_step = set()
        if self._connector is not None:
            output.kv_connector_metadata = self._build_connector_meta(output)
        self._claimed = []
        return output

    def schedule_next_decode(self, previous: SchedulerOutput) -> SchedulerOutput | None:
        """Schedule the decode step after `previous` while `previous` still runs.

        Every request of `previous` must be decoding one token. Each one that
        does not end by length in `previous` decodes again, its input being the
        token `previous` samples (`PENDING_TOKEN` until it lands). A request
        that turns out to stop on that token simply has the extra step's result
        dropped. Returns None (schedule normally once `previous` lands) when
        requests are waiting or the cache would need preemption.
        """
        if self.waiting or self.loads.orphans:
            return None
        scheduled: list[ScheduledRequest] = []
        for item in previous.scheduled:
            request = self.requests.get(item.request_id)
            if request is None or request.is_finished:
                continue
            num_outputs = len(request.output_token_ids) + 1  # once `previous` lands
            if (
                num_outputs >= request.sampling_params.max_tokens
                or request.num_tokens + 1 >= request.max_model_len
            ):
                continue  # ends by length in `previous`
            position = item.num_computed_tokens + 1
            if not self.kv_manager.allocate(request, position + 1):
                return None
            scheduled.append(ScheduledRequest(
                request_id=request.request_id,
                token_ids=[PENDING_TOKEN],
                num_computed_tokens=position,
                block_ids=list(request.block_ids),
                sample=True,
                sampling_params=request.sampling_params,
                sample_seed=request.next_sample_seed(num_outputs),
            ))
        if not scheduled:
            return None
        output = SchedulerOutput(scheduled, self._finished_since_last_step)
        self._finished_since_last_step = set()
        return output

    def _allocate_or_preempt(self, request: Request, num_tokens: int) -> bool:
        """Grow the request's blocks, preempting the newest running requests if needed."""
        while not self.kv_manager.allocate(request, num_tokens):
            if self.running[-1] is request and self._release_parked_blocks(request, num_tokens, []):
                return True  # restarting parked requests beats preempting the last runner
            victim = self.running.pop()
            self._preempt(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.kv_manager.free(request)
        request.restart()
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(request)

    def _schedule_waiting(self, scheduled: list[ScheduledRequest], budget: int) -> Request | None:
        """Admit waiting requests within the budget; returns the one that found no blocks."""
        skipped: list[Request] = []
        stalled = None
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.popleft()
            if request.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
                skipped.append(request)
                continue
            hits = [] if request.block_ids else self.kv_manager.find_cached_prefix(request)
            num_local = len(hits) * self.kv_manager.block_size if hits else request.num_computed_tokens
            num_external, load_async = self._external_tokens(request, num_local)
            if request.is_finished:
                continue  # the connector failed it under policy `fail`
            load_async = load_async and num_external > 0
            num_new = 0 if load_async else min(request.num_tokens - num_local - num_external, budget)
            num_needed = num_local + num_external + num_new
            if not self.kv_manager.allocate(request, num_needed, hits):
                # Nothing runs: make room from parked requests, else wait (small caches
                # are slower, never stuck).
                if scheduled or not self._release_parked_blocks(request, num_needed, hits):
                    self.waiting.appendleft(request)
                    stalled = request
                    break
            self._claim(request, num_local, len(hits), num_external)
            if load_async:
                request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                self.loads.start(request.request_id)
                skipped.append(request)
                continue
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(self._slice(request, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))
        return stalled

    def _release_parked_blocks(self, request: Request, num_tokens: int, hits: list) -> bool:
        """Nothing runs, yet `request` does not fit: the blocks are held by waiting
        requests whose loads finished. Restart those (newest first) until it fits,
        so the engine never stalls. In-flight loads keep their blocks (rule 7)."""
        for parked in reversed(self.waiting):
            if parked.status is RequestStatus.WAITING_FOR_REMOTE_KVS or not parked.block_ids:
                continue
            self.kv_manager.free(parked)
            parked.restart()
            if self.kv_manager.allocate(request, num_tokens, hits):
                return True
        return False

    def _fail_stalled(self, request: Request) -> None:
        """Nothing runs, nothing is in flight and `request` still finds no blocks: they
        are held for loads the connector never confirmed. End it rather than spin."""
        if self.loads_in_flight():
            return  # a load will finish (or expire) and free blocks
        self.waiting.remove(request)
        self._end_with_error(request, "the KV cache blocks it needs are held by async KV "
                                      "loads that the connector never confirmed")
        self._ended_while_scheduling.append(request)

    def _external_tokens(self, request: Request, num_local: int) -> tuple[int, bool]:
        """The connector's validated claim; a connector error is a failure of `request`."""
        if not self.can_load or request.connector_consulted:
            return 0, False
        if not self.recovery.may_consult_connector(request) or self.loads.is_orphaned(
            request.request_id
        ):
            return 0, False
        try:
            return self._connector.matched_tokens(request, num_local)
        except ConnectorError as error:
            verdict = self.recovery.plan_connector_error(request, str(error))
            self._apply_verdict(request, verdict)
            if request.is_finished:
                self._ended_while_scheduling.append(request)
            return 0, False

    def _claim(self, request: Request, num_local: int, num_hit_blocks: int, num_external: int) -> None:
        """Count local hits and tell the connector where the external tokens go."""
        if num_hit_blocks:
            self.stats.prefix_cache_hit_tokens += num_local
        request.num_computed_tokens = num_local
        failed = False
        if self._connector is not None and not request.connector_consulted:
            request.connector_consulted = True
            try:
                self._connector.update_state_after_alloc(
                    request, list(request.block_ids), num_external)
            except ConnectorError:
                failed = True
        if num_external:
            request.pending_external = (num_local, num_local + num_external)
            request.num_computed_tokens = num_local + num_external
            self._claimed.append(request)
            if failed:  # whether and where it loads is unknown: all of it is invalid
                self._connector_invalid.update(self._external_block_ids(request))

    def _build_connector_meta(self, output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's connector metadata. If building it fails, this step's loads are
        failures (the in-flight ones are judged once they end or expire, rule 7)."""
        try:
            return self._connector.build_connector_meta(output)
        except ConnectorError:
            for request in self._claimed:
                self._connector_invalid.update(self._external_block_ids(request))
            return KVConnectorMetadata()

    def _external_block_ids(self, request: Request) -> list[int]:
        """The blocks the request's pending external tokens are loaded into."""
        start, end = request.pending_external
        block_size = self.kv_manager.block_size
        return request.block_ids[start // block_size : blocks_needed(end, block_size)]

    def _slice(self, request: Request, num_new: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=request.token_ids[start : start + num_new],
            num_computed_tokens=start,
            block_ids=list(request.block_ids),
            sample=start + num_new == request.num_tokens,
            sampling_params=request.sampling_params,
            sample_seed=request.next_sample_seed(),
        )

    # ----- results ----------------------------------------------------------------
    def update_from_output(
        self, scheduler_output: SchedulerOutput, output: ModelRunnerOutput
    ) -> list[Request]:
        """Apply a step's results: advance, recover from failed loads, append tokens.

        Returns the requests that produced a token or finished in this step.
        """
        progressed, self._ended_while_scheduling = self._ended_while_scheduling, []
        stepped: list[Request] = []
        for item in scheduler_output.scheduled:
            request = self.requests.get(item.request_id)
            if request is None or request.is_finished:
                continue  # aborted during the step
            request.num_computed_tokens += len(item.token_ids)
            prompt_end = min(request.num_prompt_tokens, request.num_computed_tokens)
            self.stats.prompt_tokens_computed += max(0, prompt_end - item.num_computed_tokens)
            stepped.append(request)
        loaded = [r for r in stepped if r.pending_external is not None]
        loaded += self._finish_async_loads(output.finished_recving)
        invalid = set(output.invalid_block_ids) | self._connector_invalid
        self._connector_invalid = set()
        if output.kv_load_report_failed:  # no usable report: every load that ended failed
            for request in loaded:
                invalid.update(self._external_block_ids(request))
        recovered: set[str] = set()
        if invalid or self.recovery.has_deferred:
            holders = [r for r in self.running if r.block_ids]
            holders += [r for r in self.waiting if r.block_ids]
            recovered = self._apply_plan(self.recovery.plan(invalid, holders), progressed)
        for request in loaded:
            start, end = request.pending_external
            self.stats.prompt_tokens_external += max(0, min(request.num_computed_tokens, end) - start)
            request.pending_external = None
            self.kv_manager.cache_computed_blocks(request)
        self.stats.kv_save_failed_blocks += output.kv_save_failed_blocks
        for request in stepped:
            if request.request_id in recovered:
                continue  # its step read invalid KV: the sampled token is discarded
            token = output.sampled_token_ids.get(request.request_id)
            if token is not None and request.num_computed_tokens == request.num_tokens:
                request.append_output_token(token)
                self.stats.generation_tokens += 1
                progressed.append(request)
            self.kv_manager.cache_computed_blocks(request)
            if request.is_finished:
                self._finish(request)
        self.stats.kv_connector_errors += output.kv_connector_errors
        if self._connector is not None:
            self.stats.kv_connector_errors += self._connector.errors.take_count()
        return progressed

    def _apply_plan(self, plan: RecoveryPlan, progressed: list[Request]) -> set[str]:
        """Carry out recovery's plan; returns the ids of the requests it touched."""
        self.kv_manager.uncache_blocks(plan.uncache_block_ids)
        self.stats.kv_load_failed_blocks += plan.num_failed_blocks
        for verdict in plan.requests:
            request = self.requests[verdict.request_id]
            self._apply_verdict(request, verdict)
            if request.is_finished:
                progressed.append(request)
        return {verdict.request_id for verdict in plan.requests}

    def _apply_verdict(self, request: Request, verdict: RequestRecovery) -> None:
        request.num_kv_load_failures += 1
        if verdict.fail:
            logger.warning("request %s: %s; policy 'fail' ends it with an error",
                           request.request_id, verdict.error)
            self.stats.kv_load_failed_requests += 1
            self._end_with_error(request, verdict.error)
            return
        if not verdict.orphan_blocks:
            self.kv_manager.make_private_from(request, verdict.first_invalid_block)
        request.num_computed_tokens = verdict.rollback_to
        if verdict.may_reconsult:
            request.connector_consulted = False
        self.stats.kv_load_recovered_requests += 1
        self.stats.kv_load_recomputed_tokens += verdict.num_tokens_lost
        logger.info("request %s: %s; rolled back to token %d, %d token(s) to reload or "
                    "recompute", request.request_id, verdict.error, verdict.rollback_to,
                    verdict.num_tokens_lost)

    def _expire_loads(self) -> None:
        """Rule 5: an async load past the engine's deadline failed as a whole. Its blocks
        stay held until the worker confirms (rule 7); the request goes on in fresh blocks
        (or fails, per policy), and the worker is told to cancel the load."""
        expired = [self.requests[request_id] for request_id in self.loads.expired()]
        if not expired:
            return
        plan = self.recovery.plan_expired_loads(expired)
        for request, verdict in zip(expired, plan.requests):
            logger.warning("request %s: async KV load unfinished after %.1fs",
                           request.request_id, self.loads.timeout_s)
            orphaned = self.kv_manager.take_blocks(request, verdict.first_invalid_block)
            self.loads.orphan(request.request_id, orphaned)
            request.pending_external = None
            request.status = RequestStatus.WAITING
            self._finished_since_last_step.add(request.request_id)
        self._apply_plan(plan, self._ended_while_scheduling)

    def _finish_async_loads(self, finished_recving: set[str]) -> list[Request]:
        """Move requests whose async load ended back to schedulable; free orphaned blocks."""
        ready = []
        for request_id in finished_recving:
            orphaned = self.loads.confirm(request_id)
            if orphaned is not None:  # the worker confirmed: the blocks are safe to reuse
                self.kv_manager.release_blocks(orphaned)
                continue
            request = self.requests.get(request_id)
            if request is not None and request.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
                self.loads.finish(request_id)
                request.status = RequestStatus.WAITING
                ready.append(request)
        return ready

    def _end_with_error(self, request: Request, error: str) -> None:
        request.error = error
        request.error_type = "kv_load_failed"
        request.status = RequestStatus.FINISHED_ERROR
        self._finish(request)

    def _finish(self, request: Request) -> None:
        """Release a finished request's blocks and drop it from the queues."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if self._connector is not None:
            self._connector.request_finished(request, list(request.block_ids))
        self.recovery.forget(request.request_id)
        self.kv_manager.free(request)
        self._finished_since_last_step.add(request.request_id)
