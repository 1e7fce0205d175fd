"""A tensor-parallel group over one torch.distributed process group (gloo on the CPU,
NCCL on CUDA); it is the `models.parallel_layers.TensorParallelGroup` the layers call.

The c10d process group object is created directly from the rendezvous store instead
of through `init_process_group`, so nothing global is set: several engines can live
in one process one after the other (tests, a server restarting its engine).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist


class C10dGroup(Protocol):
    """What this module uses of a c10d backend object (`ProcessGroupGloo`/`NCCL`)."""

    def allreduce(self, tensors: list[torch.Tensor]) -> Any: ...

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor]) -> Any: ...

    def abort(self) -> None: ...

    def shutdown(self) -> None: ...


def create_process_group(store: dist.Store, rank: int, size: int, device: torch.device,
                         timeout_s: float) -> C10dGroup:
    """Join the group of `size` ranks as `rank`: gloo for CPU tensors, NCCL for CUDA
    ones. Returns once every rank joined; raises after `timeout_s` otherwise."""
    timeout = timedelta(seconds=timeout_s)
    prefixed = dist.PrefixStore("kvrecover-tp", store)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = cast(C10dGroup, dist.ProcessGroupNCCL(prefixed, rank, size, options))
        # NCCL connects lazily: one all-reduce now, so a rank that cannot join fails here.
        probe = torch.zeros(1, device=device)
        group.allreduce([probe]).wait()
        torch.cuda.synchronize(device)
        return group
    return cast(C10dGroup, dist.ProcessGroupGloo(prefixed, rank, size, timeout))


class DistributedGroup:
    """`size` ranks over `process_group`; the collectives the parallel layers call.

    With `fixed_order` (batch-invariant numerics) an all-reduce gathers every rank's
    tensor and sums them in rank order, so the result's bits do not depend on the
    message size or the transport's reduction algorithm."""

    def __init__(self, process_group: C10dGroup, rank: int, size: int, *,
                 fixed_order: bool = False) -> None:
        self.process_group = process_group
        self.rank = rank
        self.size = size
        self.fixed_order = fixed_order

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over ranks (`tensor` is overwritten with it unless `fixed_order`)."""
        if self.fixed_order:
            parts = self._all_gather(tensor)
            total = parts[0]
            for part in parts[1:]:
                total = total + part
            return total
        self.process_group.allreduce([tensor]).wait()
        return tensor

    def gather_to_first(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """Every rank's `tensor` concatenated along the last dim, on rank 0."""
        parts = self._all_gather(tensor)
        return torch.cat(parts, dim=-1) if self.rank == 0 else None

    def _all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        self.process_group.allgather([parts], [tensor]).wait()
        return parts

    def abort(self) -> None:
        """Break the group off after a failure: pending collectives end, nothing waits."""
        try:
            self.process_group.abort()
        except (RuntimeError, AttributeError):  # already broken, or an older backend
            pass

    def shutdown(self) -> None:
        """Close the group after the last step."""
        try:
            self.process_group.shutdown()
        except (RuntimeError, AttributeError):
            pass
