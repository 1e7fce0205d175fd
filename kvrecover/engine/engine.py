"""The step-level engine: add requests, step, collect outputs."""

from __future__ import annotations

import logging
import time
import weakref
from typing import TYPE_CHECKING

import torch

from kvrecover.config import EngineArgs
from kvrecover.engine.inputs import check_request, prompt_tokens
from kvrecover.engine.kv_cache_manager import KVCacheManager
from kvrecover.engine.request import Request, RequestStatus
from kvrecover.engine.resolve import ResolvedConfig, resolve_config
from kvrecover.engine.scheduler import Scheduler
from kvrecover.engine.snapshot import EngineSnapshot
from kvrecover.engine.stats import EngineStats
from kvrecover.kv_layout import update_block_hashes
from kvrecover.kv_transfer.base import KVConnectorRole
from kvrecover.options import validate
from kvrecover.outputs import CompletionOutput, RequestOutput
from kvrecover.sampling import SamplingParams
from kvrecover.step_messages import ModelRunnerOutput, SchedulerOutput
from kvrecover.tokenizer import Tokenizer
from kvrecover.worker.model_runner import ModelRunner

if TYPE_CHECKING:
    from kvrecover.worker.overlap import PendingDecode

logger = logging.getLogger(__name__)


class Engine:
    """Drives scheduler and model runner one step at a time.

    Requests may be added or aborted between steps. `step()` returns the
    requests that produced a token or finished in that step.
    """

    def __init__(self, args: EngineArgs | ResolvedConfig) -> None:
        """Assemble the engine from `args` resolved (`engine/resolve.py`), or from a
        `ResolvedConfig` built before: tokenizer, model runner and KV cache, block
        manager, connector roles, scheduler."""
        config = args if isinstance(args, ResolvedConfig) else resolve_config(args)
        self.config = config
        self.args = args = config.args
        self.model_dir, self.model_config = config.model_dir, config.model_config
        self.device, self.dtype = config.device, config.dtype
        self.max_model_len = config.max_model_len
        self.scheduler_config = config.scheduler_config
        self.layout = config.layout
        self.tokenizer = Tokenizer(self.model_dir)
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        torch.manual_seed(args.seed)
        self.model_runner = ModelRunner(
            self.model_config, self.model_dir, self.device, self.dtype, self.max_model_len,
            self.layout, enforce_eager=args.enforce_eager, batch_invariant=args.batch_invariant,
            attention_backend=config.attention_backend, native_kernels=args.native_kernels,
        )
        # After the weights: a GPU's budget is what they left free.
        self.model_runner.allocate_kv_cache(config.kv_sizing.num_blocks(self.device))
        self.num_blocks = self.model_runner.kv_caches[0].shape[1]
        self.stats = EngineStats()
        kv_manager = KVCacheManager(self.num_blocks, args.block_size, args.enable_prefix_caching,
                                    self.layout.kv_groups, self.layout.block_nbytes)
        self.num_kv_groups = kv_manager.num_groups
        connector = None
        plan = config.connector
        if plan is not None:
            connector = plan.create(KVConnectorRole.SCHEDULER, self.layout)
            self.model_runner.attach_connector(plan.create(KVConnectorRole.WORKER, self.layout))
        transfer = plan.transfer if plan is not None else None
        self.scheduler = Scheduler(self.scheduler_config, kv_manager, self.stats, connector, transfer)
        self._request_counter = 0
        # Prefix caching and connectors key blocks by their chain hash: hash the
        # prompt once here; connectors only read `request.block_hashes`.
        self._hash_prompts = args.enable_prefix_caching or connector is not None
        # A launched, overlapped decode step: (its schedule, its pending tokens).
        self._in_flight: tuple[SchedulerOutput, PendingDecode] | None = None
        self.closed = False
        # Shuts the connectors down on close(), when the engine is garbage collected, or
        # at interpreter exit, whichever comes first: no loader thread may still be inside
        # torch while the interpreter tears down (that aborts the process).
        connectors = [c for c in (self.model_runner.connector, connector) if c is not None]
        self._shutdown_connectors = weakref.finalize(self, _shutdown, connectors)

    # ----- requests ------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | dict | list[int],
        sampling_params: SamplingParams | None = None,
    ) -> None:
        """Tokenize (if needed), validate and queue a request."""
        if self.closed:
            raise RuntimeError("the engine is closed; create a new LLM")
        sampling_params = sampling_params or SamplingParams()
        if not isinstance(sampling_params, SamplingParams):
            raise ValueError("sampling_params must be a kvrecover.SamplingParams")
        validate(sampling_params)  # again: the dataclass may have been changed since
        text, token_ids = prompt_tokens(prompt, self.tokenizer)
        check_request(
            str(request_id), token_ids, sampling_params, max_model_len=self.max_model_len,
            vocab_size=self.model_config.vocab_size, block_size=self.args.block_size,
            num_blocks=self.num_blocks, blocks_for=self.scheduler.kv_manager.max_blocks_needed,
        )
        seed = sampling_params.seed
        if seed is None:
            seed = self.args.seed * 1_000_003 + self._request_counter
        self._request_counter += 1
        request = Request(
            str(request_id), text, token_ids, sampling_params, self.eos_token_ids, seed,
            self.max_model_len, self.num_kv_groups,
        )
        if self._hash_prompts:
            update_block_hashes(request.block_hashes, token_ids, self.args.block_size)
        self.scheduler.add_request(request)

    def abort_request(self, request_id: str) -> None:
        """Stop a request; a later `step()` no longer reports it."""
        request = self.scheduler.abort_request(str(request_id))
        if request is not None:
            self.scheduler.pop_finished(request.request_id)

    def has_unfinished(self) -> bool:
        """Whether `step()` still has work (never, once closed)."""
        if self.closed:
            return False
        return self._in_flight is not None or self.scheduler.has_unfinished()

    def snapshot(self) -> EngineSnapshot:
        """The counters, queue sizes and KV cache use now; call between steps."""
        return EngineSnapshot.of(self.scheduler, self.stats)

    def close(self) -> None:
        """Stop for good: land an in-flight step, then shut both connector roles down
        (their in-flight loads cancelled, loader threads joined). Idempotent; unfinished
        requests are dropped. `LLM.close()` and interpreter exit call this."""
        if self.closed:
            return
        self.closed = True
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            in_flight[1].result()
        self._shutdown_connectors()

    # ----- stepping ------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run and post-process one step."""
        if self.closed:
            raise RuntimeError("the engine is closed; create a new LLM")
        if self._in_flight is not None:
            return self._land_in_flight(self._in_flight)
        scheduler_output = self.scheduler.schedule()
        if self.model_runner.can_overlap(scheduler_output):
            self._in_flight = (scheduler_output, self._launch(scheduler_output))
            return self._land_in_flight(self._in_flight)
        runner_output = self.model_runner.execute(scheduler_output)
        return self._apply(scheduler_output, runner_output)

    def _launch(self, scheduler_output: SchedulerOutput,
                previous: PendingDecode | None = None) -> PendingDecode:
        self.stats.overlapped_steps += 1
        return self.model_runner.launch_decode(scheduler_output, previous)

    def _land_in_flight(
        self, in_flight: tuple[SchedulerOutput, PendingDecode]
    ) -> list[RequestOutput]:
        """Finish the launched decode step `in_flight`, launching the one after it first (when the
        scheduler can tell it already) so the device never waits for the host.

        Applying the landed step may roll back (recovery) or end a request that the
        step just launched continues: the scheduler then discards that request's part
        of it when it lands (`Scheduler.update_from_output`)."""
        scheduler_output, pending = in_flight
        self._in_flight = None
        following = self.scheduler.schedule_next_decode(scheduler_output,
                                                        pending.finished_recving)
        if following is not None:
            self._in_flight = (following, self._launch(following, pending))
        outputs = self._apply(scheduler_output, pending.result())
        requests = self.scheduler.requests
        launched = self._in_flight
        if launched is not None and all(
            (request := requests.get(s.request_id)) is None or request.is_finished
            for s in launched[0].scheduled
        ):
            # Every request it continues stopped on its last token: nothing to report.
            launched[1].result()
            self._in_flight = None
        return outputs

    def _apply(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[RequestOutput]:
        progressed = self.scheduler.update_from_output(scheduler_output, runner_output)
        if not (scheduler_output.scheduled or progressed or runner_output.finished_recving):
            self._check_progress()
        outputs = [self._output(request) for request in progressed]
        for request in progressed:
            if request.is_finished:
                self.scheduler.pop_finished(request.request_id)
        return outputs

    def _check_progress(self) -> None:
        """An idle step is fine only while KV transfers (async loads, sends) are in flight."""
        if self.scheduler.transfers_in_flight():
            time.sleep(0.0005)  # let the loader threads run instead of spinning
        elif self.scheduler.waiting:
            # The scheduler fails a request it cannot place; reaching this is a bug.
            raise RuntimeError("the scheduler could not place any waiting request")

    def _output(self, request: Request) -> RequestOutput:
        finished = request.is_finished
        text = self.tokenizer.decode(request.output_token_ids) if finished else ""
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=list(request.output_token_ids),
            finish_reason=request.status.finish_reason,
        )
        if request.status is RequestStatus.FINISHED_ERROR:
            completion.text, completion.token_ids = "", []
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            error=request.error,
            error_type=request.error_type,
        )


def _shutdown(connectors: list) -> None:
    for connector in connectors:  # worker role first: it owns the loader threads
        try:
            connector.shutdown()
        except Exception:  # closing must finish; the connector's bug is logged
            logger.exception("KV connector %s failed to shut down", type(connector).__name__)
