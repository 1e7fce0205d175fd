"""One tensor-parallel rank's process: `python -m kvrecover.worker.rank_worker <fd>`.

Started by rank 0 (`TensorParallelRunner`, through `distributed.rank_process`), it
reads its `RankSpec` from the channel at `fd`, joins the group, loads its shard, and
then (telling rank 0 its recurrent-state slot limit, `ModelRunner.state_slot_limit`)
answers rank 0's messages one by one: "allocate" (the KV cache, then its own
worker-role connector over its own KV layout), "step" (run its shard of the step,
answer with a `RankReport`), "shutdown". Any error ends the process after a "failed"
message; the channel closing (rank 0's process died) ends it quietly.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback

import torch

from kvrecover.distributed.group import DistributedGroup, create_process_group
from kvrecover.distributed.messages import RankReport, pack, unpack
from kvrecover.distributed.rank_process import rank_channel
from kvrecover.distributed.rendezvous import join_store
from kvrecover.kv_transfer.base import KVConnectorBase, KVConnectorRole
from kvrecover.kv_transfer.registry import connector_class
from kvrecover.worker.model_runner import ModelRunner
from kvrecover.worker.parallel_runner import RankSpec

logger = logging.getLogger(__name__)


def run_rank(fd: int) -> int:
    """The rank's whole life; its exit code."""
    channel = rank_channel(fd)
    try:
        start = unpack(channel.recv_bytes())
        spec = start.body
        if start.kind != "start" or not isinstance(spec, RankSpec):
            raise ValueError(f"expected a start message, got {start.kind!r}")
        if spec.device.type == "cuda":
            torch.cuda.set_device(spec.device)
        torch.manual_seed(spec.seed)
        store = join_store(spec.store_port, spec.start_timeout_s)
        channel.send_bytes(pack("joining"))
        process_group = create_process_group(store, spec.rank, spec.size, spec.device,
                                             spec.rank_timeout_s)
        group = DistributedGroup(process_group, spec.rank, spec.size,
                                 fixed_order=spec.batch_invariant)
        runner = spec.build_runner(group)
        channel.send_bytes(pack("ready", runner.state_slot_limit))
        _serve(channel, spec, runner)
        group.shutdown()
        return 0
    except (EOFError, BrokenPipeError, ConnectionResetError):  # rank 0 is gone: so are we
        return 0
    except BaseException as error:
        message = f"{type(error).__name__}: {error}"
        traceback.print_exc(file=sys.stderr)
        try:
            channel.send_bytes(pack("failed", message))
        except OSError:
            pass
        return 1


def _serve(channel, spec: RankSpec, runner: ModelRunner) -> None:
    """Answer rank 0's messages until "shutdown"."""
    connector: KVConnectorBase | None = None
    try:
        while True:
            message = unpack(channel.recv_bytes())
            if message.kind == "step":
                output = runner.execute(message.body)
                channel.send_bytes(pack("report", RankReport.of(output)))
            elif message.kind == "allocate":
                runner.allocate_kv_cache(int(message.body))
                if spec.transfer is not None:
                    connector = connector_class(spec.transfer)(
                        spec.transfer, KVConnectorRole.WORKER, spec.layout)
                    runner.attach_connector(connector)
                channel.send_bytes(pack("allocated"))
            elif message.kind == "shutdown":
                return
            else:
                raise ValueError(f"unknown message {message.kind!r}")
    finally:
        if connector is not None:
            try:
                connector.shutdown()
            except Exception:  # the process ends anyway; the connector's bug is logged
                logger.exception("KV connector %s failed to shut down",
                                 type(connector).__name__)


if __name__ == "__main__":
    code = run_rank(int(sys.argv[1]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no teardown of a group whose peers may be gone (gloo aborts there)
