"""Continuous batching with chunked prefill, prefix caching, KV loading and recovery.

Each step the scheduler spends a token budget (`max_num_batched_tokens`): first
on running requests (decodes and unfinished prefill chunks, preempting the
newest running requests when blocks run out), then on waiting ones, which is
where local prefix-cache hits and the connector's external tokens are claimed.
A request whose KV loads asynchronously parks in WAITING_FOR_REMOTE_KVS, holding
its blocks, until the worker reports the load finished.
"""

from __future__ import annotations

import logging
from collections import deque

from kvrecover.config import KVTransferConfig, SchedulerConfig
from kvrecover.engine.kv_cache_manager import KVCacheManager
from kvrecover.engine.recovery import KVLoadRecovery
from kvrecover.engine.request import Request, RequestStatus
from kvrecover.engine.scheduler_output import (
    PENDING_TOKEN,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)
from kvrecover.engine.stats import EngineStats
from kvrecover.kv_transfer.base import KVConnectorBase

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
    ) -> None:
        self.config = config
        self.kv_manager = kv_manager
        self.stats = stats
        self.connector = connector
        self.kv_transfer_config = kv_transfer_config
        self.can_load = connector is not None and kv_transfer_config.is_consumer
        policy = kv_transfer_config.kv_load_failure_policy if kv_transfer_config else "recompute"
        retry_limit = kv_transfer_config.kv_load_retry_limit if kv_transfer_config else 0
        self.recovery = KVLoadRecovery(kv_manager, policy, retry_limit, stats)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Aborted while an async load may still write their blocks (DESIGN rule 7).
        self.aborted_in_flight: dict[str, Request] = {}
        self._finished_since_last_step: set[str] = set()

    # ----- requests -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a new request (its id must be unused)."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_request(self, request_id: str) -> Request | None:
        """End a request now; its blocks are kept while an async load may write them."""
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return None
        in_flight = request.status is RequestStatus.WAITING_FOR_REMOTE_KVS
        request.status = RequestStatus.FINISHED_ABORTED
        if in_flight:
            self.waiting.remove(request)
            self.aborted_in_flight[request_id] = request
            self._finished_since_last_step.add(request_id)
        else:
            self._finish(request)
        return request

    def has_unfinished(self) -> bool:
        """Whether any request still needs steps (in-flight aborted loads included)."""
        return bool(self.waiting or self.running or self.aborted_in_flight)

    def pop_finished(self, request_id: str) -> Request | None:
        """Forget a finished request once its output has been handed out."""
        request = self.requests.get(request_id)
        if request is not None and request.is_finished and request_id not in self.aborted_in_flight:
            return self.requests.pop(request_id)
        return None

    # ----- scheduling ------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this step's work within the token budget."""
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
        if self.stats.num_preemptions == preemptions_before:
            self._schedule_waiting(scheduled, budget)
        output = SchedulerOutput(scheduled, self._finished_since_last_step)
        self._finished_since_last_step = set()
        if self.connector is not None:
            output.kv_connector_metadata = self.connector.build_connector_meta(output)
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
        if self.waiting or self.aborted_in_flight:
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
            victim = self.running.pop()
            self._preempt(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.kv_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.connector_consulted = False
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(request)

    def _schedule_waiting(self, scheduled: list[ScheduledRequest], budget: int) -> None:
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.popleft()
            if request.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
                skipped.append(request)
                continue
            hits = [] if request.block_ids else self.kv_manager.find_cached_prefix(request)
            num_local = len(hits) * self.kv_manager.block_size if hits else request.num_computed_tokens
            num_external, load_async = self._external_tokens(request, num_local)
            if load_async and num_external > 0:
                if not self.kv_manager.allocate(request, num_local + num_external, hits):
                    self.waiting.appendleft(request)
                    break
                self._claim(request, num_local, len(hits), num_external)
                request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                skipped.append(request)
                continue
            num_new = min(request.num_tokens - num_local - num_external, budget)
            num_needed = num_local + num_external + num_new
            if not self.kv_manager.allocate(request, num_needed, hits):
                if scheduled or not self._release_parked_blocks(request, num_needed, hits):
                    self.waiting.appendleft(request)
                    break
            self._claim(request, num_local, len(hits), num_external)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(self._slice(request, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))

    def _release_parked_blocks(self, request: Request, num_tokens: int, hits: list) -> bool:
        """Nothing runs, yet `request` does not fit: the blocks are held by waiting
        requests whose loads finished. Restart those (newest first) until it fits,
        so the engine never stalls. In-flight loads keep their blocks (rule 7)."""
        for parked in reversed(self.waiting):
            if parked.status is RequestStatus.WAITING_FOR_REMOTE_KVS or not parked.block_ids:
                continue
            self.kv_manager.free(parked)
            parked.num_computed_tokens = 0
            parked.connector_consulted = False
            if self.kv_manager.allocate(request, num_tokens, hits):
                return True
        return False

    def _external_tokens(self, request: Request, num_local: int) -> tuple[int, bool]:
        if not self.can_load or request.connector_consulted:
            return 0, False
        if request.num_kv_load_failures > self.recovery.retry_limit:
            return 0, False
        try:
            num_external, load_async = self.connector.get_num_new_matched_tokens(request, num_local)
        except Exception:  # a broken store is a miss, never an engine crash
            logger.exception("request %s: connector lookup failed; computing locally",
                             request.request_id)
            return 0, False
        # The last token is always computed here: its logits give the next token.
        num_external = max(0, min(int(num_external), request.num_tokens - 1 - num_local))
        return num_external, bool(load_async)

    def _claim(self, request: Request, num_local: int, num_hit_blocks: int, num_external: int) -> None:
        """Count local hits and tell the connector where the external tokens go."""
        if num_hit_blocks:
            self.stats.prefix_cache_hit_tokens += num_local
        request.num_computed_tokens = num_local
        if self.connector is not None and not request.connector_consulted:
            request.connector_consulted = True
            self.connector.update_state_after_alloc(request, list(request.block_ids), num_external)
        if num_external:
            request.pending_external = (num_local, num_local + num_external)
            request.num_computed_tokens = num_local + num_external

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
        invalid = set(output.invalid_block_ids)
        for request in loaded:
            invalid |= request.deferred_invalid_block_ids
            request.deferred_invalid_block_ids = set()
        actions = self._recover(invalid) if invalid else {}
        for request in loaded:
            start, end = request.pending_external
            self.stats.prompt_tokens_external += max(0, min(request.num_computed_tokens, end) - start)
            request.pending_external = None
            self.kv_manager.cache_computed_blocks(request)
        self.stats.kv_save_failed_blocks += output.kv_save_failed_blocks
        progressed: list[Request] = []
        for request_id, action in actions.items():
            if action.failed:
                request = self.requests[request_id]
                request.status = RequestStatus.FINISHED_ERROR
                self._finish(request)
                progressed.append(request)
        for request in stepped:
            if request.request_id in actions:
                continue  # its step read invalid KV: the sampled token is discarded
            token = output.sampled_token_ids.get(request.request_id)
            if token is not None and request.num_computed_tokens == request.num_tokens:
                request.append_output_token(token)
                self.stats.generation_tokens += 1
                progressed.append(request)
            self.kv_manager.cache_computed_blocks(request)
            if request.is_finished:
                self._finish(request)
        return progressed

    def _recover(self, invalid: set[int]) -> dict:
        """Apply the failure policy to every request holding an invalid block."""
        holders = [r for r in self.running if r.block_ids]
        for request in self.waiting:
            if request.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
                # Its blocks may still be written by the load: act once it finishes.
                request.deferred_invalid_block_ids |= invalid.intersection(request.block_ids)
            elif request.block_ids:
                holders.append(request)
        return self.recovery.apply(invalid, holders)

    def _finish_async_loads(self, finished_recving: set[str]) -> list[Request]:
        """Move requests whose async load ended back to schedulable; free aborted ones."""
        ready = []
        for request_id in finished_recving:
            aborted = self.aborted_in_flight.pop(request_id, None)
            if aborted is not None:  # the worker confirmed: its blocks are safe to reuse
                if self.connector is not None:
                    self.connector.request_finished(aborted, list(aborted.block_ids))
                self.kv_manager.free(aborted)
                self.requests.pop(request_id, None)
                continue
            request = self.requests.get(request_id)
            if request is not None and request.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
                request.status = RequestStatus.WAITING
                ready.append(request)
        return ready

    def _finish(self, request: Request) -> None:
        """Release a finished request's blocks and drop it from the queues."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if self.connector is not None:
            self.connector.request_finished(request, list(request.block_ids))
        self.kv_manager.free(request)
        self._finished_since_last_step.add(request.request_id)
