"""Runs one scheduled step: KV loads, the forward pass, KV saves and sampling.

One forward path (`_forward`: a CUDA-graph replay where the step allows it, else an
eager forward with the connector's per-layer hooks) and one sampling path
(`_sample`: the graph's greedy tokens for an all-greedy step, else `Sampler`)
serve both the synchronous step (`execute`) and the overlapped one
(`launch_decode`). The kernels come from the backend's declared interface
(`ops.interface`); the connector is reached through its guard
(`worker.kv_connector`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvrecover.kv_groups import layer_slot_map
from kvrecover.kv_layout import KVCacheLayout, blocks_needed
from kvrecover.kv_transfer.base import KVConnectorBase
from kvrecover.models.config import ModelConfig
from kvrecover.models.loader import load_weights, skip_weight_init
from kvrecover.models.parallel_layers import SINGLE_RANK, TensorParallelGroup, shard_heads
from kvrecover.models.recurrent_state import StateSpec, delta_chunk_size
from kvrecover.models.registry import build_model, model_class
from kvrecover.ops.backend import select_backend
from kvrecover.ops.interface import StepInputs, StepInputSpec
from kvrecover.step_messages import ModelRunnerOutput, SchedulerOutput
from kvrecover.structured.bitmask import TokenBitmask
from kvrecover.worker.cpu_threads import set_cpu_threads
from kvrecover.worker.grammar_mask import GrammarMask
from kvrecover.worker.kv_cache import allocate_kv_caches
from kvrecover.worker.kv_connector import WorkerConnector
from kvrecover.worker.prompt_logprobs import (
    PendingPromptLogprobs,
    add_logprobs,
    score_prompt_tokens,
)
from kvrecover.worker.recurrent_states import (
    INITIAL_SLOTS,
    RecurrentStates,
    request_state_bytes,
)
from kvrecover.worker.sampler import SampledRows, Sampler

if TYPE_CHECKING:
    from kvrecover.step_messages import ScheduledRequest
    from kvrecover.worker.cuda_graphs import DecodeGraphs
    from kvrecover.worker.overlap import PendingDecode, TokenBuffers

# At most this share of a GPU's free memory (after the weights) goes to the running
# requests' recurrent states when max_num_seqs is the device's default.
STATE_MEMORY_SHARE = 0.25
logger = logging.getLogger(__name__)


class ModelRunner:
    """Owns the model, the KV cache tensors and the worker half of the connector.

    The kernels come from one `KernelBackend` (`ops.backend.select_backend`,
    from `attention_backend`: "auto", "torch" or "triton", and `native_kernels`),
    chosen here once and shared with the model; a model that needs a feature the
    backend lacks is refused here, before its weights load. `batch_invariant`
    makes a request's numerics independent of its batch and chunking: on Triton
    through the fixed-order Triton matmul, on the CPU through the fixed-shape
    kernels that bf16/fp16 use by default (`ops.backend`). Unless
    `enforce_eager`, decode steps on CUDA replay CUDA graphs where the backend's
    step inputs support them. A hybrid model's recurrent states live in
    `recurrent_states` (`worker/recurrent_states.py`, with `num_state_checkpoints`
    checkpoint slots); its decode steps replay graphs too, their recurrent plan (rows,
    slots, checkpoints) packed into the graph's static inputs.
    """

    def __init__(
        self,
        model_config: ModelConfig,
        model_dir: Path,
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
        layout: KVCacheLayout,
        *,
        enforce_eager: bool = False,
        batch_invariant: bool = False,
        attention_backend: str = "auto",
        native_kernels: bool | None = None,
        tp: TensorParallelGroup = SINGLE_RANK,
        num_state_checkpoints: int = 0,
        max_num_seqs: int | None = None,
        max_num_seqs_fixed: bool = False,
    ) -> None:
        features = model_class(model_config.architecture).required_features(model_config)
        self.backend = select_backend(
            attention_backend, device, batch_invariant=batch_invariant, dtype=dtype,
            native_kernels=native_kernels, moe=features.moe,
        )
        self.backend.check_supports(features, model_config.architecture)
        if device.type == "cpu":
            set_cpu_threads(tp.size)
        self.device = device
        self.dtype = dtype
        self.layout = layout
        self.max_model_len = max_model_len
        self.enforce_eager = enforce_eager
        self.batch_invariant = batch_invariant
        self.tp = tp
        with torch.device(device), skip_weight_init():
            model = build_model(model_config, self.backend, max_model_len, tp)
        load_weights(model, model_dir)
        self.model = model.to(dtype=dtype).eval()
        for tables in self.model.rotary_tables():
            tables.to(torch.float32)  # cos/sin tables stay float32, cast per use
        self.backend.prepare_weights(self.model)
        self.kv_caches: list[torch.Tensor] = []  # allocate_kv_cache, once the weights are in
        # Layer i's cache tensor and KV cache group (`kv_groups.py`): a block id spans the
        # cache tensors, layer j of each group using tensor j. A recurrent layer has none.
        slots = layer_slot_map(layout.kv_groups, model_config.num_hidden_layers)
        self._layer_tensors = [None if slot is None else slot.tensor for slot in slots]
        self._layer_groups = [None if slot is None else slot.group for slot in slots]
        self.layer_caches: list[torch.Tensor] = []
        # A hybrid model's per-request recurrent states (its linear-attention layers).
        specs = self.model.recurrent_state_specs(delta_chunk_size(layout.block_size))
        self.recurrent_states = (_recurrent_states(specs, dtype, device, layout.block_size,
                                                   num_state_checkpoints, max_num_seqs,
                                                   max_num_seqs_fixed)
                                 if specs else None)
        self.sampler = Sampler(device)
        self.grammar_bitmask = TokenBitmask(device)  # structured outputs' masks, see _sample
        self.sampler.token_masks.append(GrammarMask(self.grammar_bitmask))
        self.kv_connector: WorkerConnector | None = None
        self.graphs: DecodeGraphs | None = None
        self._token_buffers: TokenBuffers | None = None  # host buffers for overlapped decode tokens
        # Overlap decode steps without CUDA graphs too (an eager forward). It hides
        # nothing on the CPU, so it is off unless asked for: tests run the real overlapped
        # path on the CPU with it.
        self.eager_overlap = False
        self._failed_requests: dict[str, str] = {}  # the running step's, see ModelRunnerOutput
        heads = shard_heads(model_config.num_attention_heads, model_config.num_key_value_heads,
                            tp.size, tp.rank)
        self.inputs = self.backend.step_inputs(StepInputSpec(
            layout.block_size, heads.num_heads, heads.num_kv_heads, max_model_len, device,
            len(layout.kv_groups), recurrent=self.recurrent_states is not None,
        ))
        graph_inputs = self.inputs.for_graphs()
        # The state pool's size the graphs were captured with (they hold its tensors).
        self._graph_slots = 0 if self.recurrent_states is None else self.recurrent_states.num_slots
        # Graphs and overlap replay one rank's step alone; ranks step together (eagerly).
        if (device.type == "cuda" and not enforce_eager and graph_inputs is not None
                and tp.size == 1):
            from kvrecover.worker.cuda_graphs import DecodeGraphs

            max_blocks = blocks_needed(max_model_len, layout.block_size)
            self.graphs = DecodeGraphs(self._decode_step, graph_inputs, max_blocks, device,
                                       len(layout.kv_groups))

    @property
    def connector(self) -> KVConnectorBase | None:
        """The worker-role connector (`attach_connector`), or None."""
        return None if self.kv_connector is None else self.kv_connector.connector

    @property
    def state_slot_limit(self) -> int | None:
        """The most requests whose recurrent states this runner holds at once: its pool's
        slots on a GPU (allocated once, before the KV cache: `_recurrent_states`), which
        the engine cuts `max_num_seqs` to; None where the pool grows (the CPU) or the
        model has no recurrent layers."""
        pool = self.recurrent_states
        return pool.num_slots if pool is not None and pool.device.type == "cuda" else None

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Allocate the paged KV cache. The engine calls this after construction, so a
        memory budget measured on the device already accounts for the weights."""
        self.kv_caches = allocate_kv_caches(self.layout, num_blocks, self.device)
        no_cache = torch.empty(0, device=self.device)  # a recurrent layer's: it has no KV
        self.layer_caches = [no_cache if t is None else self.kv_caches[t]
                             for t in self._layer_tensors]

    def release(self) -> None:
        """Drop every tensor this runner holds: the KV cache (emptying the list that
        `kv_connector` and the connector registered), the weights, the CUDA graphs
        with their memory pool, the step-input and token buffers. `Engine.close` calls
        this once, after the connector shut down; the runner runs no step afterwards."""
        self.kv_caches.clear()
        self.layer_caches.clear()  # the same tensors, by layer (the connector holds this list too)
        self.graphs = None
        self._token_buffers = None
        # Gone rather than None: nothing may run on a released runner (the engine
        # refuses to step once closed), and an AttributeError says so if it did.
        del self.model, self.inputs, self.sampler

    def attach_connector(self, connector: KVConnectorBase) -> None:
        """Give the runner the worker-role connector and the connector the cache."""
        self.kv_connector = WorkerConnector(connector, self.kv_caches, self.layer_caches)
        connector.register_kv_caches(self.kv_caches)
        if self.recurrent_states is not None:
            connector.register_recurrent_states(self.recurrent_states)

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and report sampled tokens and KV-transfer events."""
        output = ModelRunnerOutput()
        self._start_step(scheduler_output, output)
        scheduled = scheduler_output.scheduled
        if scheduled:
            sampling = [s for s in scheduled if s.sample]
            logits = greedy = None
            scored: list[PendingPromptLogprobs] = []
            try:
                logits, greedy = self._forward(scheduler_output, prompt_scores=scored)
            except Exception as error:  # ends this step's requests, never the engine ...
                if self.tp.size > 1:  # ... unless other ranks wait in its collectives
                    raise
                self._fail_step(scheduler_output, error, output)
            # None when no row samples or the forward failed, and off rank 0.
            if logits is not None:
                try:
                    sampled = self._sample(logits, sampling, greedy)
                    tokens, errors = sampled.to_host()
                    for row, message in errors.items():
                        output.failed_requests[sampling[row].request_id] = message
                    output.sampled_token_ids = {
                        s.request_id: t for s, t in zip(sampling, tokens) if t is not None
                    }
                    add_logprobs(output, sampled, [s.request_id for s in sampling])
                except Exception as error:  # rank 0's alone: the group is unaffected
                    self._fail_step(scheduler_output, error, output)
            try:
                for pending in scored:  # read after the tokens: the step's one wait
                    pending.add_to(output)
            except Exception as error:
                self._fail_step(scheduler_output, error, output)
        if self.kv_connector is not None:
            self.kv_connector.finish_step(scheduler_output, output)
        return output

    def can_overlap(self, scheduler_output: SchedulerOutput) -> bool:
        """Whether `launch_decode` may run this step: one sampled token per request, on
        a runner that overlaps decode (CUDA graphs for this batch size, or eagerly with
        `eager_overlap`). Greedy and random sampling both run on the device (`Sampler`),
        and a connector's hooks run at launch in their usual order, so loads, saves and
        async arrivals qualify too; a step that needs per-layer hooks runs eagerly. A
        step with a structured-output request does not overlap (its grammar must accept
        this step's token before the next mask exists); it still replays its graph."""
        scheduled = scheduler_output.scheduled
        if self.tp.size > 1 or self.recurrent_states is not None:
            return False  # a recurrent state cannot take back a step that turns out void
        if not scheduled or any(len(s.token_ids) != 1 or not s.sample for s in scheduled):
            return False
        if any(s.grammar is not None for s in scheduled):
            return False  # a grammar's next mask needs this step's token on the host
        return self.eager_overlap or (
            self.graphs is not None and self.graphs.bucket(len(scheduled)) is not None
        )

    @torch.inference_mode()
    def launch_decode(
        self, scheduler_output: SchedulerOutput, previous: PendingDecode | None = None
    ) -> PendingDecode:
        """Start a step that `can_overlap` accepted, without waiting for its tokens.

        With `previous`, every request's input is the token `previous` samples for it.
        The connector's hooks run here, in `execute`'s order, so the pending step's
        output carries the step's KV-transfer events; only the tokens wait.
        """
        from kvrecover.worker.overlap import TokenBuffers

        scheduled = scheduler_output.scheduled
        output = ModelRunnerOutput()
        self._start_step(scheduler_output, output)
        source = None
        if previous is not None:
            rows = previous.rows()
            source = (previous.device_tokens, [rows[s.request_id] for s in scheduled])
        try:
            logits, greedy = self._forward(scheduler_output, source)
            if logits is None:
                raise ValueError("launch_decode needs a step in which every request samples "
                                 "(see can_overlap)")
            sampled = self._sample(logits, scheduled, greedy)
        except Exception as error:  # as in `execute`: these requests end, the engine goes on
            self._fail_step(scheduler_output, error, output)
            sampled = SampledRows(torch.zeros(len(scheduled), dtype=torch.long, device=self.device))
        if self.kv_connector is not None:
            self.kv_connector.finish_step(scheduler_output, output)
        if self._token_buffers is None:
            self._token_buffers = TokenBuffers(self.device)
        return self._token_buffers.launch([s.request_id for s in scheduled], sampled, output)

    def _start_step(self, scheduler_output: SchedulerOutput, output: ModelRunnerOutput) -> None:
        """Note where the step's failed rows go; bind the connector metadata, start loads."""
        self._failed_requests = output.failed_requests
        self.sampler.processors.release(scheduler_output.finished_request_ids)
        if self.recurrent_states is not None:
            self.recurrent_states.release(scheduler_output.finished_request_ids)
            self.recurrent_states.release(scheduler_output.preempted_request_ids)
        if self.kv_connector is not None:
            self.kv_connector.start_step(scheduler_output)

    def _fail_step(self, scheduler_output: SchedulerOutput, error: Exception,
                   output: ModelRunnerOutput) -> None:
        scheduled = scheduler_output.scheduled
        logger.exception("a step of %d requests failed", len(scheduled))
        message = f"the step failed: {type(error).__name__}: {error}"
        for item in scheduled:
            output.failed_requests[item.request_id] = message

    def _forward(
        self, scheduler_output: SchedulerOutput,
        source: tuple[torch.Tensor, list[int]] | None = None,
        prompt_scores: list[PendingPromptLogprobs] | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The one forward path: (float32 logits of the sampled rows, their greedy tokens
        where a graph replay computed them, else None); logits None when no row samples.

        A graph replays a pure decode step that needs no connector hooks; any other step
        runs eagerly, with the connector's per-layer hooks. With `source` = (tokens on
        the device, row per request), the input tokens are gathered there. The prompt
        logprobs of requests that ask for them (from the logits of their prompt rows
        only), still on the device, are appended to `prompt_scores`.
        """
        scheduled = scheduler_output.scheduled
        if self.graphs is not None and self._can_replay(scheduler_output):
            logits, greedy = self.graphs.run(scheduled, source, self._recurrent_rows(scheduled))
            if not all(s.sample for s in scheduled):
                rows = [i for i, s in enumerate(scheduled) if s.sample]
                if not rows:
                    return None, None
                index = torch.tensor(rows, device=self.device)
                logits, greedy = logits[index], greedy[index]
            return logits, greedy
        inputs = self._step_inputs(scheduled)
        if source is not None:
            tokens, rows = source
            inputs.input_ids.copy_(tokens.index_select(0, torch.tensor(rows, device=self.device)))
        before_layer = after_layer = None
        layer_meta = self._layer_meta(inputs, scheduled)
        if self.kv_connector is not None:
            before_layer, after_layer = self.kv_connector.layer_hooks(inputs.attn, layer_meta)
        hidden = self.model(inputs.input_ids, inputs.positions, self.layer_caches, inputs.attn,
                            before_layer, after_layer, layer_meta)
        if prompt_scores is not None:
            scored = score_prompt_tokens(scheduled, hidden, self.model.logits)
            if scored is not None:
                prompt_scores.append(scored)
        if not any(s.sample for s in scheduled):
            return None, None
        return self.model.logits(hidden[inputs.sample_rows]), None  # None off rank 0

    def _step_inputs(self, scheduled: list[ScheduledRequest]) -> StepInputs:
        """The step's inputs on the device, in the form the backend's attention reads."""
        return self.inputs.build(scheduled)

    def _sample(
        self, logits: torch.Tensor, sampling: list[ScheduledRequest],
        greedy: torch.Tensor | None = None,
    ) -> SampledRows:
        """The one sampling path: the sampled rows' tokens (and logprobs), left on the
        device (`Sampler.sample_step`: logits processors, the grammar mask, then the
        draw). `greedy` (a graph's argmax) serves an all-greedy step whose logits
        nothing changed. Grammar masks are filled on the host after the forward pass was
        launched, so on a GPU they overlap it."""
        return self.sampler.sample_step(logits, sampling, greedy)

    def _decode_step(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """The graphed part of a decode step: forward, LM head and greedy tokens for every
        row (the float32 cast and the argmax from the backend's sampling kernels)."""
        hidden = self.model(inputs.input_ids, inputs.positions, self.layer_caches, inputs.attn,
                            layer_meta=self._layer_meta(inputs))
        logits = self.model.logits(hidden, upcast=False)
        if logits is None:  # graphs run at tensor_parallel_size 1 only
            raise RuntimeError("a graphed decode step needs the whole vocabulary's logits")
        return self.backend.sampling.upcast_greedy(logits)

    def _recurrent_rows(self, scheduled: list[ScheduledRequest]) -> list[Any] | None:
        """A graphed step's recurrent request rows (None for a model without recurrent
        layers): `RecurrentStates.advance` assigns slots and zeroes or restores the states
        of requests that start at 0 or from a checkpoint, eagerly, before the replay. A
        pool that grew replaced its tensors: the graphs that read the old ones are dropped."""
        states = self.recurrent_states
        if states is None:
            return None
        rows = states.advance(scheduled)
        if states.num_slots != self._graph_slots and self.graphs is not None:
            self.graphs.clear()
            self._graph_slots = states.num_slots
        return rows

    def _layer_meta(self, inputs: StepInputs,
                    scheduled: list[ScheduledRequest] | None = None) -> list[Any] | None:
        """Each layer's record: its group's attention record, or a recurrent layer's
        `RecurrentLayerStep` (for the `scheduled` requests; without them, a graphed
        step's, from the plan prebuilt in its inputs); None for a model of one
        attention group and no recurrent layer."""
        if self.recurrent_states is not None:
            if scheduled is not None:
                steps = self.recurrent_states.step(scheduled)
            elif inputs.recurrent is not None:
                steps = self.recurrent_states.layer_steps(inputs.recurrent)
            else:
                raise RuntimeError("a step of a hybrid model needs its requests or a "
                                   "prebuilt recurrent plan")
            group_attn = inputs.group_attn or [inputs.attn]
            return [steps[i] if g is None else group_attn[g]
                    for i, g in enumerate(self._layer_groups)]
        if not inputs.group_attn:
            return None
        return [inputs.group_attn[g] for g in self._layer_groups if g is not None]

    def _can_replay(self, scheduler_output: SchedulerOutput) -> bool:
        """Graphs run only pure decode steps whose connector has nothing to load or save."""
        scheduled = scheduler_output.scheduled
        if self.graphs is None or self.graphs.bucket(len(scheduled)) is None:
            return False
        if any(len(s.token_ids) != 1 or s.prompt_token_ids is not None for s in scheduled):
            return False  # a prompt row's logits are needed (prompt logprobs): run eagerly
        connector = self.kv_connector
        return connector is None or not connector.needs_layer_hooks(scheduler_output)


def _recurrent_states(specs: dict[int, list[StateSpec]], dtype: torch.dtype, device: torch.device,
                      block_size: int, num_checkpoints: int, max_num_seqs: int | None,
                      seqs_fixed: bool) -> RecurrentStates:
    """The recurrent-state pool. On a GPU it holds a slot for each of `max_num_seqs`
    requests from the start: the KV cache takes the memory left after it, and a pool
    that doubled in the middle of a run would find that memory gone. Unless the user
    fixed `max_num_seqs` (`seqs_fixed`), the slots take at most `STATE_MEMORY_SHARE`
    of the free memory; the engine then runs no more requests at once than there are
    slots."""
    slots = INITIAL_SLOTS
    per_request = request_state_bytes(specs, dtype)
    if device.type == "cuda" and max_num_seqs:
        slots = max_num_seqs
        if not seqs_fixed:
            free = torch.cuda.mem_get_info(device)[0]
            slots = max(1, min(slots, int(free * STATE_MEMORY_SHARE) // per_request))
    try:
        return RecurrentStates(specs, dtype, device, delta_chunk_size(block_size),
                               num_checkpoints, initial_slots=slots)
    except torch.cuda.OutOfMemoryError as error:
        need = slots * per_request / 2**30
        raise ValueError(
            f"the recurrent states of max_num_seqs={slots} requests need {need:.2f} GiB, "
            f"which does not fit on {device} beside the weights: lower max_num_seqs"
        ) from error
