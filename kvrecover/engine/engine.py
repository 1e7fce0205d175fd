"""The step-level engine: add requests, step, collect outputs."""

from __future__ import annotations

import gc
import logging
import threading
import time
import weakref
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from kvrecover.config import EngineArgs, SchedulerConfig
from kvrecover.distributed.errors import RankFailedError
from kvrecover.engine.inputs import check_request, logits_spec, prompt_tokens
from kvrecover.engine.kv_cache_manager import KVCacheManager
from kvrecover.engine.request import Request, RequestStatus
from kvrecover.engine.resolve import ResolvedConfig, resolve_config
from kvrecover.engine.scheduler import Scheduler
from kvrecover.engine.snapshot import EngineSnapshot
from kvrecover.engine.state_checkpoints import StateCheckpoints
from kvrecover.engine.stats import EngineStats
from kvrecover.kv_layout import update_block_hashes
from kvrecover.kv_transfer.base import KVConnectorRole
from kvrecover.options import validate
from kvrecover.outputs import CompletionOutput, RequestOutput, choice_request_id
from kvrecover.sampling import SamplingParams, choice_seed
from kvrecover.step_messages import ModelRunnerOutput, SchedulerOutput
from kvrecover.structured.params import StructuredOutputsParams
from kvrecover.structured.state import GrammarState
from kvrecover.tokenizer import Tokenizer
from kvrecover.worker.model_runner import ModelRunner
from kvrecover.worker.parallel_runner import RankSpec, TensorParallelRunner

if TYPE_CHECKING:
    from kvrecover.structured.compiler import GrammarCompiler
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
        self.model_runner: ModelRunner | TensorParallelRunner = _model_runner(config)
        self.scheduler_config = _fit_state_slots(self.scheduler_config, self.model_runner)
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
        checkpoints = (hybrid_checkpoints(config)
                       if self.model_config.recurrent_layers() else None)
        self.scheduler = Scheduler(self.scheduler_config, kv_manager, self.stats, connector, transfer,
                                   state_checkpoints=checkpoints)
        self._request_counter = 0
        self._choices: dict[str, list[str]] = {}  # an n > 1 request's id -> its choices' ids
        self._grammars: GrammarCompiler | None = None  # built by the first structured request
        self._grammars_lock = threading.Lock()  # compile_grammar may run on another thread
        # Prefix caching and connectors key blocks by their chain hash: hash the
        # prompt once here; connectors only read `request.block_hashes`.
        self._hash_prompts = args.enable_prefix_caching or connector is not None
        # A launched, overlapped decode step: (its schedule, its pending tokens).
        self._in_flight: tuple[SchedulerOutput, PendingDecode] | None = None
        self.closed = False
        self.failure: str | None = None  # why the engine stopped by itself (`check_health`)
        # Shuts the connectors down on close(), when the engine is garbage collected, or
        # at interpreter exit, whichever comes first: no loader thread may still be inside
        # torch while the interpreter tears down (that aborts the process).
        connectors = [c for c in (self.model_runner.connector, connector) if c is not None]
        self._shutdown_connectors = weakref.finalize(self, _shutdown, connectors,
                                                     self.model_runner)

    # ----- requests ------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | dict | list[int],
        sampling_params: SamplingParams | None = None,
    ) -> None:
        """Tokenize (if needed), validate and queue a request. With `n` > 1 it is queued
        as `n` choices, each a request of its own (`outputs.choice_request_id`; choice
        i seeded `choice_seed(seed, i)`); choices after the first wait for the first
        one's prompt KV and take it from the prefix cache. `abort_request` of the
        request id aborts every choice."""
        if self.closed:
            raise RuntimeError(f"{self.failure or 'the engine is closed'}; create a new LLM")
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
        spec = logits_spec(sampling_params, token_ids, self.eos_token_ids, self.tokenizer)
        n = sampling_params.n
        ids = [choice_request_id(str(request_id), i, n) for i in range(n)]
        if n > 1:
            used = [i for i in [str(request_id), *ids] if i in self.scheduler.requests
                    or i in self._choices]
            if used:
                raise ValueError(f"request id {used[0]!r} is already in use")
        base_seed = sampling_params.seed
        requests: list[Request] = []  # all built (grammars compiled) before any is queued
        for index, choice_id in enumerate(ids):
            seed = None if base_seed is None else choice_seed(base_seed, index)
            if seed is None:
                seed = self.args.seed * 1_000_003 + self._request_counter + index
            request = Request(
                choice_id, text, token_ids, sampling_params, self.eos_token_ids, seed,
                self.max_model_len, self.num_kv_groups, choice_index=index,
                logits_spec=spec,
            )
            request.grammar = self._grammar(sampling_params, token_ids)  # one per choice
            if self._hash_prompts:
                update_block_hashes(request.block_hashes, token_ids, self.args.block_size)
            if requests and self.args.enable_prefix_caching:
                request.prefill_after = requests[0]
            requests.append(request)
        self._request_counter += n
        if n > 1:
            self._choices[str(request_id)] = ids
        for request in requests:
            self.scheduler.add_request(request)

    def _grammar(self, params: SamplingParams, token_ids: list[int]) -> GrammarState | None:
        """The matcher of a request with `structured_outputs`, past its replayed prompt
        tokens; a ValueError when the spec does not compile or the replay does not fit."""
        spec = params.structured_outputs
        if spec is None:
            return None
        if spec.replay_prompt_tokens >= len(token_ids):
            raise ValueError("structured_outputs.replay_prompt_tokens must be shorter than the "
                             f"prompt ({len(token_ids)} tokens), got {spec.replay_prompt_tokens}")
        grammar = self._grammar_compiler().matcher(spec)
        if spec.replay_prompt_tokens:
            grammar.replay(token_ids[-spec.replay_prompt_tokens:])
        return grammar

    def compile_grammar(self, spec: StructuredOutputsParams) -> None:
        """Compile and cache `spec`'s grammar ahead of `add_request`; a ValueError naming
        the problem when it does not compile. The one method that may run on another
        thread than the engine's: the server compiles on a worker thread, so a slow
        compile (or the first one, which loads the tokenizer) never holds up a step."""
        self._grammar_compiler().compile(spec)

    def _grammar_compiler(self) -> GrammarCompiler:
        with self._grammars_lock:
            if self._grammars is None:
                from kvrecover.structured.compiler import GrammarCompiler

                self._grammars = GrammarCompiler(
                    self.model_dir, self.model_config.vocab_size, sorted(self.eos_token_ids))
            return self._grammars

    def abort_request(self, request_id: str) -> None:
        """Stop a request (every choice of an `n` > 1 one, or one choice by its own id);
        a later `step()` no longer reports it."""
        for choice_id in self._choices.pop(str(request_id), [str(request_id)]):
            request = self.scheduler.abort_request(choice_id)
            if request is not None:
                self.scheduler.pop_finished(request.request_id)

    def has_unfinished(self) -> bool:
        """Whether `step()` still has work (never, once closed)."""
        if self.closed:
            return False
        return self._in_flight is not None or self.scheduler.has_unfinished()

    def awaits_only_sends(self) -> bool:
        """Whether all that keeps `has_unfinished` true is blocks held for a connector's
        sends of ended requests (a P2P producer's kept prompts, until pulled or their
        lease ends): no request, no step in flight, no unconfirmed load."""
        scheduler = self.scheduler
        return (self._in_flight is None and not scheduler.waiting and not scheduler.running
                and not scheduler.loads.awaiting_confirmation())

    def snapshot(self) -> EngineSnapshot:
        """The counters, queue sizes and KV cache use now; call between steps."""
        return EngineSnapshot.of(self.scheduler, self.stats)

    def close(self) -> None:
        """Stop for good: land an in-flight step, shut both connector roles down (their
        in-flight loads cancelled, loader threads joined), then free the device memory:
        the KV cache, the weights and the CUDA graphs (`ModelRunner.release`), returned
        to the driver on CUDA so that another engine in this process can take it.
        Idempotent; unfinished requests are dropped; the counters stay readable.
        `LLM.close()` and interpreter exit call this."""
        if self.closed:
            return
        self.closed = True
        in_flight, self._in_flight = self._in_flight, None
        try:
            if in_flight is not None:
                in_flight[1].result()
        finally:  # a step that failed on the device still lets go of everything
            self._shutdown_connectors()
            self.model_runner.release()
            if self.device.type == "cuda":
                gc.collect()  # tensors in reference cycles (graph pools, pending steps) go first
                torch.cuda.empty_cache()

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
        try:
            runner_output = self.model_runner.execute(scheduler_output)
        except RankFailedError as failure:
            return self._fail(failure)
        return self._apply(scheduler_output, runner_output)

    def check_health(self) -> str | None:
        """None while the engine can step; else why not (a tensor-parallel rank died:
        the engine then ends its requests and closes, as a failed step does). Cheap: a
        server calls it between steps, so a rank that dies while idle is noticed."""
        runner = self.model_runner
        if self.failure is None and isinstance(runner, TensorParallelRunner):
            failure = runner.check_ranks()
            if failure is not None:
                self._fail(failure)
        return self.failure

    def _fail(self, failure: RankFailedError) -> list[RequestOutput]:
        """The model runner cannot run another step: end every request with an error
        naming the failure, and close."""
        self.failure = f"the engine stopped: {failure}"
        ended = self.scheduler.end_all_with_error(self.failure)
        outputs = [self._output(request) for request in ended]
        for request in ended:
            self.scheduler.pop_finished(request.request_id)
        self.close()
        return outputs

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
        if self._choices and any(request.is_finished for request in progressed):
            requests = self.scheduler.requests
            for parent in [p for p, ids in self._choices.items()
                           if not any(i in requests for i in ids)]:
                del self._choices[parent]
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
        logprobs = request.output_logprobs
        completion = CompletionOutput(
            index=request.choice_index,
            text=text,
            token_ids=list(request.output_token_ids),
            finish_reason=request.status.finish_reason,
            logprobs=None if logprobs is None else list(logprobs),
        )
        if request.status is RequestStatus.FINISHED_ERROR:
            completion.text, completion.token_ids = "", []
            completion.logprobs = None if logprobs is None else []
        prompt_logprobs = request.prompt_logprobs
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            error=request.error,
            error_type=request.error_type,
            prompt_logprobs=None if prompt_logprobs is None else list(prompt_logprobs),
            kv_transfer_params=request.kv_transfer_params,
        )


def num_state_checkpoints(config: ResolvedConfig) -> int:
    """A hybrid model's recurrent-state checkpoint slots: none without prefix caching
    or a connector (nothing would resume from them, or store them)."""
    args = config.args
    if not config.model_config.recurrent_layers() or not (
            args.enable_prefix_caching or config.connector is not None):
        return 0
    return args.num_state_checkpoints


def _fit_state_slots(scheduler_config: SchedulerConfig,
                     runner: ModelRunner | TensorParallelRunner) -> SchedulerConfig:
    """The scheduler's config with `max_num_seqs` cut to the recurrent-state slots a
    GPU's model runner could hold (a hybrid model with the device's default; under
    tensor parallelism the fewest of any rank, `TensorParallelRunner.state_slot_limit`)."""
    slots, pool = runner.state_slot_limit, runner.recurrent_states
    if slots is None or pool is None or slots >= scheduler_config.max_num_seqs:
        return scheduler_config
    logger.info("max_num_seqs %d -> %d: the recurrent states of %d requests take %.2f GiB",
                scheduler_config.max_num_seqs, slots, slots,
                slots * pool.bytes_per_request / 2**30)
    return replace(scheduler_config, max_num_seqs=slots)


def hybrid_checkpoints(config: ResolvedConfig) -> StateCheckpoints:
    """A hybrid model's scheduler-side state checkpoints; with a connector, the boundaries
    every `state_interval_blocks` that it stores (producer) and, if it keeps a failed
    load's resume state (`keeps_resume_states`), resumes from (consumer).

    Under tensor parallelism a failed load resumes only from a checkpoint every rank
    holds (or 0): each rank's connector keeps a resume state by its *own* first failed
    block, so a block that failed on one rank leaves the others without the state the
    union of their reports would resume from (rule 9: one rollback point for all)."""
    plan = config.connector
    transfer = None if plan is None else plan.transfer
    interval = None if transfer is None else transfer.state_interval_blocks
    resumes = (plan is not None and config.args.tensor_parallel_size == 1
               and plan.connector_class.resume_states_kept(plan.transfer))
    return StateCheckpoints(
        num_state_checkpoints(config), config.args.block_size,
        store_interval=interval if transfer is not None and transfer.is_producer else None,
        load_interval=interval if resumes and transfer is not None and transfer.is_consumer
        else None)


def _model_runner(config: ResolvedConfig) -> ModelRunner | TensorParallelRunner:
    """The model runner: this process's alone, or rank 0's of a tensor-parallel group."""
    args = config.args
    if config.tensor_parallel_size == 1:
        return ModelRunner(
            config.model_config, config.model_dir, config.device, config.dtype,
            config.max_model_len, config.layout, enforce_eager=args.enforce_eager,
            batch_invariant=args.batch_invariant, attention_backend=config.attention_backend,
            native_kernels=args.native_kernels,
            num_state_checkpoints=num_state_checkpoints(config),
            max_num_seqs=config.scheduler_config.max_num_seqs,
            max_num_seqs_fixed=args.max_num_seqs is not None,
        )
    return TensorParallelRunner(RankSpec(
        config.model_config, config.model_dir, config.device, config.dtype,
        config.max_model_len, config.layout, args.enforce_eager, args.batch_invariant,
        config.attention_backend, args.native_kernels, args.kv_transfer_config, args.seed,
        config.tensor_parallel_size,
        num_state_checkpoints=num_state_checkpoints(config),
        max_num_seqs=config.scheduler_config.max_num_seqs,
        max_num_seqs_fixed=args.max_num_seqs is not None,
        rank_timeout_s=args.rank_timeout_s,
    ))


def _shutdown(connectors: list, runner: ModelRunner | TensorParallelRunner) -> None:
    if isinstance(runner, TensorParallelRunner):  # the other ranks' connectors first
        runner.close()
    for connector in connectors:  # worker role first: it owns the loader threads
        try:
            connector.shutdown()
        except Exception:  # closing must finish; the connector's bug is logged
            logger.exception("KV connector %s failed to shut down", type(connector).__name__)
