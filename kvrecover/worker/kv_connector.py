"""The model runner's guarded view of the worker-role KV connector.

The twin of `engine/scheduler_connector.py`: a connector is someone else's code
talking to someone else's store, so every worker-side call is contained here and
every answer validated, and a connector bug never ends the engine. Per step the
runner calls `start_step` (bind the metadata, start the loads), runs the
forward with `layer_hooks` (wait for a layer's load before it reads the cache,
save it after it wrote it), and calls `finish_step`, which fills the step's
`ModelRunnerOutput` with the KV-transfer events:
- a load method that raised fails every load of the step (its blocks are invalid);
- a save method that raised counts the step's saves as failed (outputs are
  unaffected; later loads of those blocks miss);
- a report that raised or broke its contract (`get_finished`,
  `get_block_ids_with_load_errors`) marks the load report unusable: the engine
  then fails every load that ends in the step and lets deadlines end the rest.
Each kind of failure is logged once in full (`ConnectorErrorLog`) and counted in
`kv_connector_errors`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvrecover.kv_transfer.base import KVConnectorBase
from kvrecover.kv_transfer.errors import (
    ConnectorErrorLog,
    checked_block_ids,
    checked_counters,
    checked_request_ids,
)
from kvrecover.step_messages import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

LayerHook = Callable[[int], None]


class WorkerConnector:
    """Calls the worker-role connector for the model runner; contains its exceptions."""

    def __init__(self, connector: KVConnectorBase, kv_caches: list[torch.Tensor],
                 layer_caches: list[torch.Tensor] | None = None) -> None:
        self.connector = connector
        self.kv_caches = kv_caches  # the cache tensors (one per layer of a KV cache group)
        self.layer_caches = kv_caches if layer_caches is None else layer_caches  # layer i's
        self.errors = ConnectorErrorLog(logger)
        self._load_error = False  # this step's load methods raised: its loads failed
        self._save_error = False  # this step's save methods raised: its saves are lost
        self._warned_save_failure = False

    def start_step(self, scheduler_output: SchedulerOutput) -> None:
        """Bind the step's connector metadata and start its loads (before the forward)."""
        self._load_error = self._save_error = False
        self._guard(self.connector.bind_connector_metadata,
                    scheduler_output.kv_connector_metadata, on_error="load")
        if not self._load_error:
            self._guard(self.connector.start_load_kv, self.kv_caches, on_error="load")

    def needs_layer_hooks(self, scheduler_output: SchedulerOutput) -> bool:
        """Whether the step loads or saves anything, so its forward must run the per-layer
        hooks (a CUDA graph replay has none). Metadata that raises counts as yes: the
        eager path's hooks then meet (and contain) the error."""
        metadata = scheduler_output.kv_connector_metadata
        if metadata is None:
            return False
        try:
            return bool(metadata.loads_by_request()) or bool(metadata.num_save_blocks())
        except Exception:
            return True

    def layer_hooks(self, attn_meta: Any, layer_meta: Sequence[Any] | None = None
                    ) -> tuple[LayerHook, LayerHook]:
        """(before_layer, after_layer) for the model's forward: wait for layer i's load
        before it reads the cache; save layer i's KV after it wrote it (its cache tensor
        and the metadata of its KV cache group, `layer_meta[i]` where given)."""
        connector = self.connector

        def before_layer(index: int) -> None:
            if not self._load_error:
                self._guard(connector.wait_for_layer_load, index, on_error="load")

        def after_layer(index: int) -> None:
            if not self._save_error:
                meta = attn_meta if layer_meta is None else layer_meta[index]
                self._guard(connector.save_kv_layer, index, self.layer_caches[index], meta,
                            on_error="save")

        return before_layer, after_layer

    def finish_step(self, scheduler_output: SchedulerOutput, output: ModelRunnerOutput) -> None:
        """After the forward: wait for the saves, collect and validate the connector's
        reports into `output`, and clear the step's metadata."""
        connector = self.connector
        metadata = scheduler_output.kv_connector_metadata
        if not self._save_error:
            self._guard(connector.wait_for_save, on_error="save")
        errors = self.errors
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

    def _guard(self, method: Callable[..., Any], *args: Any, on_error: str) -> None:
        """Call a connector method; a connector exception must never crash the engine.

        A failing load method marks every load of the step invalid; a failing save
        method counts the step's saves as failed.
        """
        try:
            method(*args)
        except Exception as error:
            name = getattr(method, "__name__", repr(method))
            effect = "this step's loads fail" if on_error == "load" else "its saves are lost"
            self.errors.report(name, f"raised {error!r}; {effect}", exc_info=True)
            if on_error == "load":
                self._load_error = True
            else:
                self._save_error = True
