"""Rank 0's model runner under tensor parallelism: its own shard in this process, the
other ranks in processes of their own, stepped together.

Rank 0 runs in the engine's process because it samples: the gathered logits never
leave the process, and a step costs one message out and one small report back per
other rank (bench/tensor_parallel_step.py measures both). Per step `execute` writes
the step's `SchedulerOutput`, pickled once, to every rank's channel
(`distributed.rank_process`), runs rank 0's shard (the forward's collectives meet
the other ranks there), then reads every rank's `RankReport` and folds them into
rank 0's output (`distributed.rank_reports`: the union of invalid blocks, loads
finished only when finished everywhere). Any failure of the group (a rank died,
failed, or missed a deadline; rank 0's own forward raised) aborts the group, stops
every rank process and raises `RankFailedError`; the runner is then closed.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvrecover.config import RANK_TIMEOUT_S, KVTransferConfig
from kvrecover.distributed.errors import RankFailedError
from kvrecover.distributed.group import DistributedGroup, create_process_group
from kvrecover.distributed.messages import RankReport, pack
from kvrecover.distributed.rank_process import RankProcess
from kvrecover.distributed.rank_reports import RankReports
from kvrecover.distributed.rank_watch import RankWatch
from kvrecover.distributed.rendezvous import open_store
from kvrecover.kv_layout import KVCacheLayout
from kvrecover.kv_transfer.base import KVConnectorBase
from kvrecover.models.config import ModelConfig
from kvrecover.models.parallel_layers import TensorParallelGroup
from kvrecover.step_messages import ModelRunnerOutput, SchedulerOutput
from kvrecover.worker.model_runner import ModelRunner
from kvrecover.worker.recurrent_states import RecurrentStates

if TYPE_CHECKING:
    from kvrecover.worker.overlap import PendingDecode

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 300.0  # a rank's start-up: interpreter, rendezvous, weights, kernel builds
STOP_GRACE_S = 5.0  # a rank's exit after the shutdown message, before it is killed
RANK_MODULE = "kvrecover.worker.rank_worker"


@dataclass(frozen=True)
class RankSpec:
    """Everything a rank needs to build its model runner (sent to it at start-up)."""

    model_config: ModelConfig
    model_dir: Path
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    layout: KVCacheLayout  # this rank's
    enforce_eager: bool
    batch_invariant: bool
    attention_backend: str
    native_kernels: bool | None
    transfer: KVTransferConfig | None
    seed: int
    size: int
    rank: int = 0
    store_port: int = 0
    start_timeout_s: float = START_TIMEOUT_S
    # A collective's wait, or a rank's step report after rank 0 finished the step
    # (EngineArgs.rank_timeout_s); JIT compiles run on every rank at once, so a first
    # step's compiling hardly shifts one rank against another.
    rank_timeout_s: float = RANK_TIMEOUT_S
    # A hybrid model's recurrent-state pool (`ModelRunner`'s options of the same names):
    # every rank keeps the slots and checkpoints of its own heads' states, and applies
    # the step's slot and checkpoint records as rank 0 does.
    num_state_checkpoints: int = 0
    max_num_seqs: int | None = None
    max_num_seqs_fixed: bool = False

    def for_rank(self, rank: int, store_port: int) -> RankSpec:
        """The spec of rank `rank` (its layout; on CUDA the GPU `rank` after rank 0's)."""
        device = self.device
        if device.type == "cuda":
            device = torch.device("cuda", (device.index or 0) + rank)
        return replace(self, rank=rank, store_port=store_port, device=device,
                       layout=replace(self.layout, tensor_parallel_rank=rank))

    def build_runner(self, tp: TensorParallelGroup) -> ModelRunner:
        """This rank's model runner, its shard loaded."""
        return ModelRunner(
            self.model_config, self.model_dir, self.device, self.dtype, self.max_model_len,
            self.layout, enforce_eager=self.enforce_eager,
            batch_invariant=self.batch_invariant, attention_backend=self.attention_backend,
            native_kernels=self.native_kernels, tp=tp,
            num_state_checkpoints=self.num_state_checkpoints, max_num_seqs=self.max_num_seqs,
            max_num_seqs_fixed=self.max_num_seqs_fixed,
        )


class TensorParallelRunner:
    """The engine's model runner at tensor_parallel_size > 1 (see the module docstring);
    it offers what the engine uses of `ModelRunner`."""

    def __init__(self, spec: RankSpec) -> None:
        self.spec = spec
        self.rank_timeout_s = spec.rank_timeout_s
        self.reports = RankReports(spec.size)
        self.ranks: list[RankProcess] = []
        self.group: DistributedGroup | None = None
        self.watch: RankWatch | None = None
        self.failure: RankFailedError | None = None
        self.closed = False
        timeout = spec.start_timeout_s
        store = open_store(None, timeout)
        try:
            for rank in range(1, spec.size):
                process = RankProcess.start(rank, RANK_MODULE)
                self.ranks.append(process)
                process.send(pack("start", spec.for_rank(rank, store.port)))
            for process in self.ranks:
                process.receive(timeout, "starting")
            group = create_process_group(store, 0, spec.size, spec.device,
                                         spec.rank_timeout_s)
            self.group = DistributedGroup(group, 0, spec.size,
                                          fixed_order=spec.batch_invariant)
            self.watch = RankWatch([p.process.pid for p in self.ranks], self.group.abort)
            self.runner = spec.build_runner(self.group)
            # Each rank sized its own state pool from its own GPU's free memory.
            self._rank_state_slot_limits = [process.receive(timeout, "loading its weights").body
                                            for process in self.ranks]
        except BaseException:
            self._stop(abort=True)
            raise
        self.store = store  # the ranks' group outlives no store: keep it with the runner

    # ----- what the engine uses of ModelRunner ---------------------------------------------
    @property
    def kv_caches(self) -> list[torch.Tensor]:
        """Rank 0's KV cache tensors."""
        return self.runner.kv_caches

    @property
    def recurrent_states(self) -> RecurrentStates | None:
        """Rank 0's recurrent-state pool (a hybrid model's), or None; every rank holds
        one of the same slots for its own heads."""
        return self.runner.recurrent_states

    @property
    def state_slot_limit(self) -> int | None:
        """The fewest recurrent-state slots of any rank (`ModelRunner.state_slot_limit`):
        no rank may be asked to hold more requests' states than its pool has."""
        limits = [self.runner.state_slot_limit, *self._rank_state_slot_limits]
        return min((limit for limit in limits if limit is not None), default=None)

    @property
    def connector(self) -> KVConnectorBase | None:
        """Rank 0's worker-role connector, or None."""
        return self.runner.connector

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Allocate every rank's KV cache (the same block count on each); the other
        ranks then create their worker-role connectors, if there is one."""
        self.runner.allocate_kv_cache(num_blocks)
        self._broadcast("allocate", num_blocks, "allocating its KV cache")

    def attach_connector(self, connector: KVConnectorBase) -> None:
        """Rank 0's worker-role connector (the other ranks made theirs in `allocate_kv_cache`)."""
        self.runner.attach_connector(connector)

    def can_overlap(self, scheduler_output: SchedulerOutput) -> bool:
        """Never: the ranks step together, eagerly."""
        return False

    def launch_decode(self, scheduler_output: SchedulerOutput,
                      previous: PendingDecode | None = None) -> PendingDecode:
        """Never called (`can_overlap` is False)."""
        raise RuntimeError("tensor-parallel steps are not overlapped (can_overlap is False)")

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every rank; rank 0's output with every rank's KV events."""
        if self.failure is not None:
            raise self.failure
        if self.closed:
            raise RuntimeError("the tensor-parallel runner is closed")
        payload = pack("step", _for_other_ranks(scheduler_output))
        try:
            for process in self.ranks:
                process.send(payload)
            started = time.monotonic()
            try:
                output = self.runner.execute(scheduler_output)
            except Exception as error:  # a collective broke, or rank 0's own forward raised
                raise self._cause(error, time.monotonic() - started) from error
            reports = [process.receive(self.rank_timeout_s, "running a step").body
                       for process in self.ranks]
        except RankFailedError as failure:
            self._fail(failure)
            raise
        if not all(isinstance(report, RankReport) for report in reports):
            broken = RankFailedError("a rank answered a step with something not a report")
            self._fail(broken)
            raise broken
        self.reports.merge(output, reports)
        return output

    def check_ranks(self) -> RankFailedError | None:
        """The group's failure, if any: a rank process that exited counts (found
        without waiting, between steps)."""
        if self.failure is None and not self.closed:
            for process in self.ranks:
                status = process.exit_status()
                if status is not None:
                    self._fail(RankFailedError(f"rank {process.rank} died ({status})"))
                    break
        return self.failure

    def close(self) -> None:
        """Stop every rank (their connectors shut down first) and close the group.
        Idempotent."""
        if self.closed:
            return
        self.closed = True
        if self.watch is not None:
            self.watch.stop()  # the ranks are about to exit: that is no failure
        if self.failure is None:
            for process in self.ranks:
                try:
                    process.send(pack("shutdown"))
                except RankFailedError:
                    pass
        self._stop(abort=self.failure is not None)

    def release(self) -> None:
        """Stop the ranks (they free their own memory as they exit) and drop rank 0's
        tensors (`ModelRunner.release`)."""
        self.close()
        self.runner.release()

    # ----- failures ----------------------------------------------------------------
    def _broadcast(self, kind: str, body: object, waiting_for: str) -> None:
        payload = pack(kind, body)
        try:
            for process in self.ranks:
                process.send(payload)
            for process in self.ranks:
                process.receive(self.spec.start_timeout_s, waiting_for)
        except RankFailedError as failure:
            self._fail(failure)
            raise

    def _cause(self, error: Exception, waited_s: float) -> RankFailedError:
        """The failure behind rank 0's error after `waited_s` in its forward: a rank that
        died or failed says so on its channel right away; after the deadline, a rank that
        stays silent is the one a collective waited for (stopped or hung); otherwise rank
        0's own forward raised."""
        failures, silent = [], []
        for process in self.ranks:
            failure = process.failure_within(1.0, "running a step")
            if failure is None:
                silent.append(process)
            else:
                failures.append(failure)
        if silent and waited_s >= 0.9 * self.rank_timeout_s:  # the others timed out too
            return silent[0].missed_deadline(self.rank_timeout_s, "running a step")
        if failures:
            return failures[0]
        return RankFailedError(f"rank 0's forward failed: {type(error).__name__}: {error}")

    def _fail(self, failure: RankFailedError) -> None:
        logger.error("tensor-parallel group failed: %s", failure)
        self.failure = failure
        self.closed = True
        self._stop(abort=True)

    def _stop(self, abort: bool) -> None:
        if self.watch is not None:
            self.watch.stop()
        if self.group is not None:
            if abort:
                self.group.abort()
        for process in self.ranks:
            process.stop(0.0 if abort else STOP_GRACE_S)
        if self.group is not None and not abort:
            self.group.shutdown()


def _for_other_ranks(scheduler_output: SchedulerOutput) -> SchedulerOutput:
    """The step as the other ranks get it: without the grammar matchers (only rank 0
    samples; a matcher, xgrammar's, cannot be pickled). The same object when no
    request has one."""
    if all(s.grammar is None for s in scheduler_output.scheduled):
        return scheduler_output
    return replace(scheduler_output,
                   scheduled=[replace(s, grammar=None) for s in scheduler_output.scheduled])
