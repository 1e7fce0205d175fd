"""Decode steps whose sampled tokens reach the host while the next step already runs.

The engine launches step N+1 before it reads step N's tokens (N+1 takes them
from the device), so the device never idles while the host schedules and
applies results. Each launched step copies its greedy tokens into one of two
pinned host buffers: at most two steps are ever in flight.
"""

from __future__ import annotations

import torch

from kvrecover.engine.scheduler_output import ModelRunnerOutput


class PendingDecode:
    """A launched decode step; `result()` waits for its tokens."""

    def __init__(self, request_ids: list[str], device_tokens: torch.Tensor, host: torch.Tensor) -> None:
        self.request_ids = request_ids
        # [B], a graph output: the next replay of that graph overwrites it, after (in stream
        # order) every read of it that was launched before.
        self.device_tokens = device_tokens
        self._host = host[: len(request_ids)]
        self._host.copy_(device_tokens, non_blocking=True)
        self._ready = torch.cuda.Event()
        self._ready.record()

    def rows(self) -> dict[str, int]:
        """Each request's row in `device_tokens`."""
        return {request_id: row for row, request_id in enumerate(self.request_ids)}

    def result(self) -> ModelRunnerOutput:
        """Wait for the step and report its tokens."""
        self._ready.synchronize()
        return ModelRunnerOutput(sampled_token_ids=dict(zip(self.request_ids, self._host.tolist())))


class TokenBuffers:
    """Two pinned host buffers used in turn by consecutive pending steps."""

    def __init__(self, max_batch: int) -> None:
        self._buffers = [torch.empty(max_batch, dtype=torch.int32, pin_memory=True) for _ in range(2)]
        self._turn = 0

    def next(self) -> torch.Tensor:
        self._turn ^= 1
        return self._buffers[self._turn]
