"""Runs one scheduled step: KV loads, the forward pass, KV saves and sampling."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvrecover.kv_layout import KVCacheLayout, blocks_needed
from kvrecover.kv_transfer.base import KVConnectorBase
from kvrecover.kv_transfer.errors import (
    ConnectorErrorLog,
    checked_block_ids,
    checked_counters,
    checked_request_ids,
)
from kvrecover.models.config import ModelConfig
from kvrecover.models.loader import load_weights, skip_weight_init
from kvrecover.models.registry import build_model
from kvrecover.ops.backend import select_backend
from kvrecover.step_messages import ModelRunnerOutput, SchedulerOutput
from kvrecover.worker.cpu_threads import set_cpu_threads
from kvrecover.worker.kv_cache import allocate_kv_caches
from kvrecover.worker.sampler import SampledRows, Sampler
from kvrecover.worker.step_inputs import StepInputBuilder, StepInputs, reference_step_inputs

if TYPE_CHECKING:
    from kvrecover.step_messages import ScheduledRequest
    from kvrecover.worker.overlap import PendingDecode

logger = logging.getLogger(__name__)


class ModelRunner:
    """Owns the model, the KV cache tensors and the worker half of the connector.

    The kernels come from one `KernelBackend` (`ops.backend.select_backend`,
    from `attention_backend`: "auto", "torch" or "triton"), chosen here once and
    shared with the model. `batch_invariant` makes a request's numerics
    independent of its batch and chunking: on Triton through the fixed-order
    Triton matmul, on the CPU through the fixed-shape kernels that bf16/fp16 use
    by default (`ops.backend`). Unless `enforce_eager`, decode steps on CUDA
    replay CUDA graphs.
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
    ) -> None:
        self.backend = select_backend(
            attention_backend, device, batch_invariant=batch_invariant, dtype=dtype
        )
        if device.type == "cpu":
            set_cpu_threads()
        self.device = device
        self.dtype = dtype
        self.layout = layout
        self.max_model_len = max_model_len
        self.enforce_eager = enforce_eager
        self.batch_invariant = batch_invariant
        with torch.device(device), skip_weight_init():
            model = build_model(model_config, self.backend, max_model_len)
        load_weights(model, model_dir)
        self.model = model.to(dtype=dtype).eval()
        self.model.rotary.to(torch.float32)  # cos/sin tables stay float32, cast per use
        self.backend.prepare_weights(self.model)
        self.kv_caches: list[torch.Tensor] = []  # allocate_kv_cache, once the weights are in
        self.sampler = Sampler(device)
        self.connector: KVConnectorBase | None = None
        self._warned_save_failure = False
        self.connector_errors = ConnectorErrorLog(logger)
        self.inputs = None  # the Triton path's packed step inputs
        self.graphs = None
        self._token_buffers = None  # host buffers for overlapped decode tokens
        # Overlap decode steps without CUDA graphs too (an eager forward). It hides
        # nothing on the CPU, so it is off unless asked for: tests run the real overlapped
        # path on the CPU with it.
        self.eager_overlap = False
        self._failed_requests: dict[str, str] = {}  # the running step's, see ModelRunnerOutput
        if self.backend.name == "triton":
            from kvrecover.ops.triton_attention import tile_tokens

            group = model_config.num_attention_heads // model_config.num_key_value_heads
            self.inputs = StepInputBuilder(
                layout.block_size, tile_tokens(group), device, max_model_len
            )
            if device.type == "cuda" and not enforce_eager:
                from kvrecover.worker.cuda_graphs import DecodeGraphs

                max_blocks = blocks_needed(max_model_len, layout.block_size)
                self.graphs = DecodeGraphs(self._decode_step, self.inputs, max_blocks, device)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Allocate the paged KV cache. The engine calls this after construction, so a
        memory budget measured on the device already accounts for the weights."""
        self.kv_caches = allocate_kv_caches(self.layout, num_blocks, self.device)

    def attach_connector(self, connector: KVConnectorBase) -> None:
        """Give the runner the worker-role connector and the connector the cache."""
        self.connector = connector
        connector.register_kv_caches(self.kv_caches)

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and report sampled tokens and KV-transfer events."""
        output = ModelRunnerOutput()
        self._start_step(scheduler_output, output)
        if scheduler_output.scheduled:
            try:
                output.sampled_token_ids = self._forward(scheduler_output)
            except Exception as error:  # ends this step's requests, never the engine
                self._fail_step(scheduler_output, error, output)
        if self.connector is not None:
            self._finish_connector_step(scheduler_output, output)
        return output

    def can_overlap(self, scheduler_output: SchedulerOutput) -> bool:
        """Whether `launch_decode` may run this step: one sampled token per request, on
        a runner that overlaps decode (CUDA graphs for this batch size, or eagerly with
        `eager_overlap`). Greedy and random sampling both run on the device (`Sampler`),
        and a connector's hooks run at launch in their usual order, so loads, saves and
        async arrivals qualify too; a step that needs per-layer hooks runs eagerly."""
        scheduled = scheduler_output.scheduled
        if not scheduled or any(len(s.token_ids) != 1 or not s.sample for s in scheduled):
            return False
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
            sampled = self._decode_on_device(scheduler_output, source)
        except Exception as error:  # as in `execute`: these requests end, the engine goes on
            self._fail_step(scheduler_output, error, output)
            sampled = SampledRows(torch.zeros(len(scheduled), dtype=torch.long, device=self.device))
        if self.connector is not None:
            self._finish_connector_step(scheduler_output, output)
        if self._token_buffers is None:
            self._token_buffers = TokenBuffers(self.device)
        return self._token_buffers.launch([s.request_id for s in scheduled], sampled, output)

    def _start_step(self, scheduler_output: SchedulerOutput, output: ModelRunnerOutput) -> None:
        """Bind the step's connector metadata and start its loads."""
        connector = self.connector
        self._load_error = self._save_error = False
        self._failed_requests = output.failed_requests
        if connector is not None:
            self._guard(connector.bind_connector_metadata, scheduler_output.kv_connector_metadata,
                        on_error="load")
            if not self._load_error:
                self._guard(connector.start_load_kv, self.kv_caches, on_error="load")

    def _fail_step(self, scheduler_output: SchedulerOutput, error: Exception,
                   output: ModelRunnerOutput) -> None:
        scheduled = scheduler_output.scheduled
        logger.exception("a step of %d requests failed", len(scheduled))
        message = f"the step failed: {type(error).__name__}: {error}"
        for item in scheduled:
            output.failed_requests[item.request_id] = message

    def _decode_on_device(self, scheduler_output: SchedulerOutput,
                          source: tuple[torch.Tensor, list[int]] | None) -> SampledRows:
        """A decode step's tokens, left on the device: a graph replay, or an eager
        forward (with the connector's per-layer hooks) when the step cannot replay.
        With `source`, the input tokens are gathered there, as a graph replay does."""
        scheduled = scheduler_output.scheduled
        if self._can_replay(scheduler_output):
            logits, greedy = self.graphs.run(scheduled, source)
            return self._sample_on_device(logits, scheduled, greedy)
        inputs = self._step_inputs(scheduled)
        if source is not None:
            tokens, rows = source
            inputs.input_ids.copy_(tokens.index_select(0, torch.tensor(rows, device=self.device)))
        before_layer, after_layer = self._connector_hooks(inputs.attn)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn,
                            before_layer, after_layer)
        return self._sample_on_device(self.model.logits(hidden[inputs.sample_rows]), scheduled)

    def _forward(self, scheduler_output: SchedulerOutput) -> dict[str, int]:
        scheduled = scheduler_output.scheduled
        sampling = [s for s in scheduled if s.sample]
        greedy = None
        if self._can_replay(scheduler_output):
            logits, greedy = self.graphs.run(scheduled)
            if len(sampling) != len(scheduled):
                rows = torch.tensor([i for i, s in enumerate(scheduled) if s.sample],
                                    device=self.device)
                logits, greedy = logits[rows], greedy[rows]
        else:
            inputs = self._step_inputs(scheduled)
            before_layer, after_layer = self._connector_hooks(inputs.attn)
            hidden = self.model(
                inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn,
                before_layer, after_layer,
            )
            if not sampling:
                return {}
            logits = self.model.logits(hidden[inputs.sample_rows])
        if not sampling:
            return {}
        return self._sample(logits, sampling, greedy)

    def _step_inputs(self, scheduled: list[ScheduledRequest]) -> StepInputs:
        """The step's inputs on the device, in the form the backend's attention reads."""
        if self.inputs is None:
            return reference_step_inputs(scheduled, self.layout.block_size, self.device)
        layout = self.inputs.pack(scheduled)
        return self.inputs.views(layout, self.inputs.upload(layout))

    def _sample(
        self, logits: torch.Tensor, sampling: list, greedy: torch.Tensor | None = None
    ) -> dict[str, int]:
        """Request id -> token for the sampled rows, read back from the device. A row
        that cannot be sampled is reported in the step's `failed_requests` instead of
        failing the others."""
        tokens, errors = self._sample_on_device(logits, sampling, greedy).to_host()
        for row, message in errors.items():
            self._failed_requests[sampling[row].request_id] = message
        return {s.request_id: t for s, t in zip(sampling, tokens) if t is not None}

    def _sample_on_device(
        self, logits: torch.Tensor, sampling: list, greedy: torch.Tensor | None = None
    ) -> SampledRows:
        """The sampled rows' tokens on the device (both decode paths sample here);
        `greedy` (the graph's argmax) serves all-greedy steps."""
        if greedy is not None and all(s.sampling_params.is_greedy for s in sampling):
            return SampledRows(greedy)
        return self.sampler.sample(
            logits, [s.sampling_params for s in sampling], [s.sample_seed for s in sampling]
        )

    def _decode_step(self, inputs) -> tuple[torch.Tensor, torch.Tensor]:
        """The graphed part of a decode step: forward, LM head and argmax for every row."""
        from kvrecover.ops.triton_ops import greedy_tokens, upcast_greedy_tokens

        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn)
        logits = self.model.logits(hidden, upcast=False)
        if logits.dtype == torch.float32:
            return logits, greedy_tokens(logits)
        return upcast_greedy_tokens(logits)  # the float32 cast and the argmax in one pass

    def _can_replay(self, scheduler_output: SchedulerOutput) -> bool:
        """Graphs run only pure decode steps whose connector has nothing to load or save."""
        scheduled = scheduler_output.scheduled
        if self.graphs is None or self.graphs.bucket(len(scheduled)) is None:
            return False
        if any(len(s.token_ids) != 1 for s in scheduled):
            return False
        if self.connector is None or scheduler_output.kv_connector_metadata is None:
            return True
        metadata = scheduler_output.kv_connector_metadata
        try:
            return not metadata.loads_by_request() and not metadata.num_save_blocks()
        except Exception:
            return False  # let the eager path's hooks meet (and contain) the error

    def _connector_hooks(self, meta):
        """Per-layer load-wait and save callbacks for the model, or (None, None)."""
        connector = self.connector
        if connector is None:
            return None, None

        def before_layer(index: int) -> None:
            if not self._load_error:
                self._guard(connector.wait_for_layer_load, index, on_error="load")

        def after_layer(index: int) -> None:
            if not self._save_error:
                self._guard(connector.save_kv_layer, index, self.kv_caches[index], meta,
                            on_error="save")

        return before_layer, after_layer

    def _guard(self, method, *args, on_error: str) -> None:
        """Call a connector method; a connector exception must never crash the engine.

        A failing load method marks every load of the step invalid; a failing save
        method counts the step's saves as failed.
        """
        try:
            method(*args)
        except Exception as error:
            name = getattr(method, "__name__", repr(method))
            effect = "this step's loads fail" if on_error == "load" else "its saves are lost"
            self.connector_errors.report(name, f"raised {error!r}; {effect}", exc_info=True)
            if on_error == "load":
                self._load_error = True
            else:
                self._save_error = True

    def _finish_connector_step(
        self, scheduler_output: SchedulerOutput, output: ModelRunnerOutput
    ) -> None:
        connector = self.connector
        metadata = scheduler_output.kv_connector_metadata
        if not self._save_error:
            self._guard(connector.wait_for_save, on_error="save")
        errors = self.connector_errors
        try:
            # get_finished first: finishing an async load may reveal invalid blocks.
            sending, recving = connector.get_finished(scheduler_output.finished_request_ids)
            output.finished_sending = checked_request_ids(sending)
            output.finished_recving = checked_request_ids(recving)
        except Exception as error:  # unknown which loads ended: the engine's deadline decides
            errors.report("get_finished", f"failed: {error!r}; unreported loads end at "
                                          "their deadline", exc_info=True)
            output.kv_load_report_failed = True
        try:
            invalid = connector.get_block_ids_with_load_errors()
            output.invalid_block_ids = checked_block_ids(invalid, self.kv_caches[0].shape[1])
        except Exception as error:  # unknown which blocks failed: all that ended did
            errors.report("get_block_ids_with_load_errors",
                          f"failed: {error!r}; every load that ended failed", exc_info=True)
            output.kv_load_report_failed = True
        try:
            output.kv_save_failed_blocks = int(connector.get_save_failures() or 0)
        except Exception as error:
            errors.report("get_save_failures", f"failed: {error!r}", exc_info=True)
        try:
            output.kv_connector_stats = checked_counters(connector.get_connector_stats())
        except Exception as error:
            errors.report("get_connector_stats", f"failed: {error!r}", exc_info=True)
        if self._load_error or output.kv_load_report_failed:
            # Everything this step loads is suspect. Async loads started now stay in
            # flight until the connector reports them or the engine's deadline passes.
            try:
                loads = metadata.loads_by_request()
            except Exception as error:
                errors.report("loads_by_request", f"failed: {error!r}", exc_info=True)
                loads = {}
            for block_ids, _ in loads.values():
                output.invalid_block_ids.update(block_ids)
        if self._save_error:
            try:
                output.kv_save_failed_blocks += metadata.num_save_blocks()
            except Exception:
                output.kv_save_failed_blocks += 1
        if output.kv_save_failed_blocks and not self._warned_save_failure:
            self._warned_save_failure = True
            logger.warning(
                "KV save failed for %d block(s); outputs are unaffected, later loads of "
                "those blocks will miss", output.kv_save_failed_blocks,
            )
        self._guard(connector.clear_connector_metadata, on_error="save")
        output.kv_connector_errors = errors.take_count()
