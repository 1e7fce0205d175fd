"""Continuous batching with chunked prefill, prefix caching, KV loading and recovery.

Each step the scheduler spends a token budget (`max_num_batched_tokens`): first
on running requests (decodes and unfinished prefill chunks, preempting the
newest running requests when blocks run out), then on waiting ones, which is
where local prefix-cache hits and the connector's external tokens are claimed.
A request whose KV loads asynchronously parks in WAITING_FOR_REMOTE_KVS, holding
its blocks, until the worker reports the load finished or the engine's deadline
for it passes (`async_loads.py`).

Everything about external KV (claims, async loads, failed blocks and their
recovery, the blocks a connector still sends after a request ended) goes through
`kv_loads.py`.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Collection

from kvrecover.config import KVTransferConfig, SchedulerConfig
from kvrecover.engine.kv_cache_manager import KVCacheManager, PrefixHit
from kvrecover.engine.kv_loads import KVLoads
from kvrecover.engine.recompute_gaps import compute_limit, skip_kept
from kvrecover.engine.request import Request, RequestStatus
from kvrecover.engine.state_checkpoints import StateCheckpoints
from kvrecover.engine.stats import EngineStats
from kvrecover.kv_transfer.base import KVConnectorBase
from kvrecover.step_messages import (
    PENDING_TOKEN,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)

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
        state_checkpoints: StateCheckpoints | None = None,
    ) -> None:
        self.config = config
        self.kv_manager = kv_manager
        self.stats = stats
        self.connector = connector
        self.kv_transfer_config = kv_transfer_config
        self.kv_loads = KVLoads(kv_manager, stats, connector, kv_transfer_config,
                                self._end_with_error, clock,
                                recurrent_state_at=None if state_checkpoints is None
                                else state_checkpoints.can_resume)
        self.recovery = self.kv_loads.recovery
        # A windowed group holds only its window: a smaller chunk needs fewer blocks.
        self._windowed = any(kv_manager.windowed)
        self.loads = self.kv_loads.tracker
        # A hybrid model's recurrent-state checkpoints: a prefix is reused only with its state.
        self.state_checkpoints = state_checkpoints
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_since_last_step: set[str] = set()
        self._preempted_since_last_step: set[str] = set()  # the worker frees their states
        # Requests ended outside the token loop (failed loads, connector errors),
        # reported with the step's output.
        self._ended: list[Request] = []

    # ----- requests -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a new request (its id must be unused, also by unconfirmed async loads)."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if self.loads.is_orphaned(request.request_id):
            # The connector could not tell the old load's report from a new one's.
            raise ValueError(f"request id {request.request_id!r} is still in use by an "
                             "async KV load that the connector has not confirmed")
        if self.kv_loads.sends.is_held(request.request_id):
            raise ValueError(f"request id {request.request_id!r} is still in use by a KV "
                             "send that the connector has not reported finished")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_request(self, request_id: str) -> Request | None:
        """End a request now; blocks an async load may still write stay held (rule 7)."""
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return None
        self.kv_loads.abort(request)
        request.status = RequestStatus.FINISHED_ABORTED
        self._finish(request)
        return request

    def end_all_with_error(self, error: str) -> list[Request]:
        """End every unfinished request with an internal error (the engine cannot run
        another step); returns them. Blocks an async load may still write stay held."""
        unfinished = [*self.running, *self.waiting]
        for request in unfinished:
            self._end_with_internal_error(request, error)
        ended, self._ended = self._ended, []  # with those ended before and not yet reported
        return ended

    def has_unfinished(self) -> bool:
        """Whether any request still needs steps (or an aborted load or an ended
        request's send its confirmation, within the deadline)."""
        return bool(self.waiting or self.running) or self._awaiting_confirmation()

    def transfers_in_flight(self) -> bool:
        """Whether a step may end with nothing done because async loads (or sends of
        ended requests' blocks) are pending."""
        return self._awaiting_confirmation() or any(
            r.status is RequestStatus.WAITING_FOR_REMOTE_KVS for r in self.waiting
        )

    def _awaiting_confirmation(self) -> bool:
        return self.loads.awaiting_confirmation() or self.kv_loads.sends.awaiting_confirmation()

    def pop_finished(self, request_id: str) -> Request | None:
        """Forget a finished request once its output has been handed out."""
        request = self.requests.get(request_id)
        if request is not None and request.is_finished:
            return self.requests.pop(request_id)
        return None

    # ----- scheduling ------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this step's work within the token budget."""
        if self.state_checkpoints is not None:
            self.state_checkpoints.begin_step()
        for request in self.kv_loads.expire(self.requests):
            self._finished_since_last_step.add(request.request_id)  # the worker may cancel
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preemptions_before = self.stats.num_preemptions
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            wanted = min(compute_limit(request) - request.num_computed_tokens, budget)
            num_new = self._allocate_or_preempt(request, wanted)
            if num_new is None:
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
        output = SchedulerOutput(scheduled, self._finished_since_last_step,
                                 preempted_request_ids=self._preempted_since_last_step)
        self._finished_since_last_step, self._preempted_since_last_step = set(), set()
        output.kv_connector_metadata = self.kv_loads.build_connector_meta(output)
        return output

    def schedule_next_decode(self, previous: SchedulerOutput,
                             loads_done: Collection[str] = ()) -> SchedulerOutput | None:
        """Schedule the decode step after `previous` while `previous` still runs.

        Every request of `previous` must be decoding one token. Each one that
        does not end by length in `previous` decodes again, its input being the
        token `previous` samples (`PENDING_TOKEN` until it lands). A request
        that turns out to stop on that token simply has the extra step's result
        dropped. Returns None (schedule normally once `previous` lands) when a
        waiting request could be admitted, an async load has passed its deadline,
        a running request is not in `previous` (one that recovery rolled back
        after `previous` was scheduled, or one the token budget left out), or the
        cache would need preemption. Requests parked for their async loads wait,
        unless `loads_done` (the loads `previous` reports finished, known at its
        launch) holds theirs: they join the step after `previous` instead.
        """
        if self.loads.orphans or self.loads.expired() or any(
            request.status is not RequestStatus.WAITING_FOR_REMOTE_KVS
            or request.request_id in loads_done
            for request in self.waiting
        ):
            return None
        if self.state_checkpoints is not None:
            self.state_checkpoints.begin_step()
        scheduled: list[ScheduledRequest] = []
        num_continued = 0
        for item in previous.scheduled:
            request = self.requests.get(item.request_id)
            if request is None or request.is_finished:
                continue
            if self._is_void(item, request):
                return None  # rolled back since `previous` was scheduled: recompute it first
            if request.logits_spec is not None and request.logits_spec.needs_output_on_host:
                return None  # its sampling reads the token `previous` is still sampling
            if request.grammar is not None:
                return None  # its mask needs `previous`'s token accepted on the host first
            num_continued += 1
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
                block_tables=self._tables_of(request),
                sample=True,
                sampling_params=request.sampling_params,
                sample_seed=request.next_sample_seed(num_outputs),
                num_output_tokens=num_outputs,
                logits_spec=request.logits_spec,
                output_token_ids=None if request.logits_spec is None else request.output_token_ids,
            ))
        if not scheduled or num_continued != len(self.running):
            return None
        output = SchedulerOutput(scheduled, self._finished_since_last_step)
        self._finished_since_last_step = set()
        output.kv_connector_metadata = self.kv_loads.build_connector_meta(output)
        return output

    def _allocate_or_preempt(self, request: Request, num_new: int) -> int | None:
        """Grow the request's blocks for `num_new` more tokens, preempting the newest
        running requests if needed; returns how many tokens it got blocks for (fewer when
        only a smaller chunk fits), None when it preempted the request itself."""
        start = request.num_computed_tokens
        while not self.kv_manager.allocate(request, start + num_new):
            if self.running[-1] is request:
                # A smaller chunk beats preempting the last runner: a windowed group
                # needs fewer blocks for it, and a restart would lose the prefill so far.
                smaller = self._fitting_chunk(request, start, num_new)
                if smaller and self.kv_manager.allocate(request, start + smaller):
                    return smaller
                if self._release_parked_blocks(request, start + num_new, None):
                    return num_new  # restarting parked requests beats preempting it
            victim = self.running.pop()
            self._preempt(victim)
            if victim is request:
                return None
        return num_new

    def _fitting_chunk(self, request: Request, start: int, num_new: int,
                       hits: PrefixHit | None = None, load_end: int | None = None) -> int:
        """The largest chunk below `num_new` tokens whose blocks the request (computed up
        to `start`) can get now; 0 when not even one token fits, or when the model has
        no window (every block of the request is needed in the end, whatever the chunk).
        The blocks a chunk needs grow with its length, so a bisection finds it."""
        if not self._windowed:
            return 0
        low, high = 0, num_new - 1
        while low < high:
            middle = (low + high + 1) // 2
            if self.kv_manager.can_allocate(request, start + middle, hits, load_end):
                low = middle
            else:
                high = middle - 1
        return low

    def _preempt(self, request: Request) -> None:
        self.kv_manager.free(request)
        request.restart()
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        self._preempted_since_last_step.add(request.request_id)
        self.waiting.appendleft(request)

    def _restore_recovered_states(self, scheduler_output: SchedulerOutput,
                                  recovered: set[str]) -> None:
        """Rule 8 for a hybrid model: forget the checkpoints a voided step wrote (computed
        on invalid KV) and resume each rolled-back request from its checkpoint."""
        checkpoints = self.state_checkpoints
        if checkpoints is None:
            return
        for item in scheduler_output.scheduled:
            if item.request_id in recovered:
                checkpoints.discard(item.save_checkpoints)
        for request_id in recovered:
            request = self.requests.get(request_id)
            if request is not None and not request.is_finished:
                checkpoints.restore_at(request, request.num_computed_tokens)

    def _schedule_waiting(self, scheduled: list[ScheduledRequest], budget: int) -> Request | None:
        """Admit waiting requests within the budget; returns the one that found no blocks."""
        skipped: list[Request] = []
        stalled = None
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.popleft()
            if request.status is RequestStatus.WAITING_FOR_REMOTE_KVS or request.waits_for_sibling:
                skipped.append(request)
                continue
            request.prefill_after = None
            # A request scoring its prompt computes every position itself.
            computes_all = request.needs_every_prompt_position
            hits = None if request.holds_blocks or computes_all else \
                self.kv_manager.find_cached_prefix(request)
            if hits is not None and self.state_checkpoints is not None:
                hits = self.state_checkpoints.usable_prefix(request, hits)
            num_local = hits.num_tokens if hits else request.num_computed_tokens
            num_external, load_async = (0, False) if computes_all else \
                self.kv_loads.external_tokens(request, num_local)
            if request.is_finished:
                continue  # the connector failed it under policy `fail`
            load_async = load_async and num_external > 0
            num_new = 0 if load_async else min(
                compute_limit(request) - num_local - num_external, budget)
            num_needed = num_local + num_external + num_new
            load_end = num_local + num_external if num_external else None
            if not self.kv_manager.allocate(request, num_needed, hits, load_end):
                # Nothing runs: a smaller first chunk (a windowed group holds only its
                # window), else room from parked requests, else wait (small caches are
                # slower, never stuck).
                smaller = 0 if scheduled or load_async else self._fitting_chunk(
                    request, num_needed - num_new, num_new, hits, load_end)
                if smaller and self.kv_manager.allocate(
                        request, num_needed - num_new + smaller, hits, load_end):
                    num_new = smaller
                elif scheduled or not self._release_parked_blocks(
                        request, num_needed, hits, load_end):
                    self.waiting.appendleft(request)
                    stalled = request
                    break
            self._claim(request, num_local, len(hits) if hits else 0, num_external)
            if load_async:
                self.kv_loads.park(request)
                skipped.append(request)
                continue
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(self._slice(request, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))
        return stalled

    def _release_parked_blocks(self, request: Request, num_tokens: int,
                               hits: PrefixHit | None, load_end: int | None = None) -> bool:
        """Nothing runs, yet `request` does not fit: the blocks are held by waiting
        requests whose loads finished. Restart those (newest first) until it fits,
        so the engine never stalls. In-flight loads keep their blocks (rule 7)."""
        for parked in reversed(self.waiting):
            if parked.status is RequestStatus.WAITING_FOR_REMOTE_KVS or not parked.holds_blocks:
                continue
            self.kv_manager.free(parked)
            parked.restart()
            if self.kv_manager.allocate(request, num_tokens, hits, load_end):
                return True
        return False

    def _fail_stalled(self, request: Request) -> None:
        """Nothing runs, nothing is in flight and `request` still finds no blocks: they
        are held for loads or sends the connector never confirmed. End it rather than spin."""
        if self.transfers_in_flight():
            return  # a load or send will finish (or pass its deadline) and free blocks
        self.waiting.remove(request)
        if self.loads.orphans or self.kv_loads.sends.holds:
            self._end_with_error(request, "the KV cache blocks it needs are held by async KV "
                                          "loads or sends that the connector never confirmed")
            return
        # Admission checked that the request fits alone: only a bug gets here.
        free = self.kv_manager.pool.num_free_blocks
        self._end_with_internal_error(request, f"the KV cache has no room for its next chunk "
                                               f"({free} free blocks)")

    def _claim(self, request: Request, num_local: int, num_hit_blocks: int, num_external: int) -> None:
        """Count local hits and claim the external tokens."""
        if num_hit_blocks:
            self.stats.prefix_cache_hit_tokens += num_local
        self.kv_loads.claim(request, num_local, num_external)

    def _slice(self, request: Request, num_new: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        spec = request.logits_spec
        scores_prompt = request.prompt_logprobs is not None and start < request.num_prompt_tokens - 1
        item = ScheduledRequest(
            request_id=request.request_id,
            token_ids=request.token_ids[start : start + num_new],
            num_computed_tokens=start,
            block_ids=list(request.block_ids),
            block_tables=self._tables_of(request),
            sample=start + num_new == request.num_tokens,
            sampling_params=request.sampling_params,
            sample_seed=request.next_sample_seed(),
            num_output_tokens=len(request.output_token_ids),
            logits_spec=spec,
            output_token_ids=None if spec is None else request.output_token_ids,
            prompt_token_ids=request.prompt_token_ids if scores_prompt else None,
            grammar=request.grammar,
        )
        if self.state_checkpoints is not None:
            self.state_checkpoints.plan(request, item)
        return item

    @staticmethod
    def _tables_of(request: Request) -> list[list[int]]:
        """Every group's block table for a step message (empty: one group, `block_ids`)."""
        tables = request.block_tables
        return [] if len(tables) == 1 else [list(table) for table in tables]

    # ----- results ----------------------------------------------------------------
    def update_from_output(
        self, scheduler_output: SchedulerOutput, output: ModelRunnerOutput
    ) -> list[Request]:
        """Apply a step's results: advance, recover from failed loads, append tokens,
        and end with an internal error the requests whose part failed in the runner
        (unless recovery rolled them back: then that part is void).

        Returns the requests that produced a token or finished in this step.
        """
        stepped: list[Request] = []
        failing: list[Request] = []  # their part of the step failed (`failed_requests`)
        for item in scheduler_output.scheduled:
            request = self.requests.get(item.request_id)
            if request is None or request.is_finished:
                continue  # aborted during the step
            if self._is_void(item, request):
                continue  # its failure, if any, is void too
            if item.request_id in output.failed_requests:
                failing.append(request)
                if self.state_checkpoints is not None:
                    self.state_checkpoints.discard(item.save_checkpoints)
                continue
            request.num_computed_tokens += len(item.token_ids)
            prompt_end = min(request.num_prompt_tokens, request.num_computed_tokens)
            self.stats.prompt_tokens_computed += max(0, prompt_end - item.num_computed_tokens)
            if request.kept_ranges:
                skip_kept(request)  # it filled a gap: jump over the kept blocks after it
            stepped.append(request)
        loaded = [r for r in stepped if r.pending_external is not None]
        loaded += self.kv_loads.finish_loads(output.finished_recving, self.requests)
        self.kv_loads.finish_sends(output.finished_sending)
        queues = (self.running, self.waiting)
        recovered = self.kv_loads.recover(output, loaded, queues, self.requests)
        if self.state_checkpoints is not None and recovered:
            self._restore_recovered_states(scheduler_output, recovered)
        self.kv_loads.account_loaded(loaded)
        self.stats.kv_save_failed_blocks += output.kv_save_failed_blocks
        self.stats.add_connector_stats(output.kv_connector_stats)
        self.stats.add_connector_stats(self.kv_loads.connector_stats())
        progressed: list[Request] = []
        for request in stepped:
            if request.request_id in recovered:
                continue  # its step read invalid KV: the sampled token is discarded
            scored = output.prompt_logprobs.get(request.request_id)
            if scored is not None and request.prompt_logprobs is not None:
                first, records = scored
                request.prompt_logprobs[first : first + len(records)] = records
            token = output.sampled_token_ids.get(request.request_id)
            if token is not None and request.num_computed_tokens == request.num_tokens:
                if request.sampling_params.max_tokens == 0:
                    request.status = RequestStatus.FINISHED_LENGTH  # it scored the prompt alone
                else:
                    request.append_output_token(token, output.logprobs.get(request.request_id))
                    self.stats.generation_tokens += 1
                progressed.append(request)
            self.kv_manager.cache_computed_blocks(request)
            if request.is_finished:
                self._finish(request)
        for request in failing:
            if request.request_id in recovered:
                # Its part read blocks this step reported invalid: void, like the token,
                # and so is its failure (NaN logits from a failed load). Its load ended.
                request.pending_external = None
            else:
                self._end_with_internal_error(request, output.failed_requests[request.request_id])
        self.stats.kv_connector_errors += output.kv_connector_errors
        self.stats.kv_connector_errors += self.kv_loads.take_error_count()
        progressed += self._ended
        self._ended = []
        return progressed

    def void_request_ids(self, scheduler_output: SchedulerOutput) -> set[str]:
        """Requests whose part of this (overlapped) step is void: recovery rolled them
        back after the step was scheduled, so nothing it did for them may be applied,
        its failures included."""
        requests = self.requests
        return {
            item.request_id for item in scheduler_output.scheduled
            if (request := requests.get(item.request_id)) is not None
            and self._is_void(item, request)
        }

    @staticmethod
    def _is_void(item: ScheduledRequest, request: Request) -> bool:
        # A rollback always cuts below the start of a step scheduled before it.
        return not request.is_finished and request.num_computed_tokens != item.num_computed_tokens

    def _end_with_internal_error(self, request: Request, error: str) -> None:
        """End a request whose part of a step failed in the runner (a bad request never
        poisons the engine); blocks an async load may still write stay held (rule 7)."""
        self.kv_loads.abort(request)
        request.error, request.error_type = error, "internal_error"
        request.status = RequestStatus.FINISHED_ERROR
        self._finish(request)
        self._ended.append(request)

    def _end_with_error(self, request: Request, error: str) -> None:
        """End a request whose KV could not be loaded (reported with the step's output)."""
        request.error = error
        request.error_type = "kv_load_failed"
        request.status = RequestStatus.FINISHED_ERROR
        self._finish(request)
        self._ended.append(request)

    def _finish(self, request: Request) -> None:
        """Release a finished request's blocks and drop it from the queues."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv_loads.request_finished(request)
        self.kv_manager.free(request)
        self._finished_since_last_step.add(request.request_id)
        if self.state_checkpoints is not None:
            self.state_checkpoints.forget(request.request_id)
