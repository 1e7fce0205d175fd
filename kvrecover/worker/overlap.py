"""Decode steps whose sampled tokens reach the host while the next step already runs.

The engine launches step N+1 before it reads step N's tokens (N+1 takes them
from the device), so the device never idles while the host schedules and
applies results. Each launched step copies its greedy tokens into one of two
host buffers: at most two steps are ever in flight. On a GPU the buffers are
pinned and an event marks the copy done; on the CPU (where the model runner can
run the same path eagerly, see `ModelRunner.eager_overlap`) they are plain
tensors and the copy is done when it returns. `TokenBuffers` chooses once.
"""

from __future__ import annotations

import torch

from kvrecover.engine.scheduler_output import ModelRunnerOutput


class _DoneEvent:
    """Stands in for a CUDA event where work completes before the call returns."""

    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


class PendingDecode:
    """A launched decode step; `result()` waits for its tokens."""

    def __init__(
        self, request_ids: list[str], device_tokens: torch.Tensor, host: torch.Tensor,
        ready: torch.cuda.Event | _DoneEvent,
    ) -> None:
        self.request_ids = request_ids
        # [B], a graph output: the next replay of that graph overwrites it, after (in stream
        # order) every read of it that was launched before.
        self.device_tokens = device_tokens
        self._host = host[: len(request_ids)]
        self._host.copy_(device_tokens, non_blocking=True)
        self._ready = ready
        self._ready.record()

    def rows(self) -> dict[str, int]:
        """Each request's row in `device_tokens`."""
        return {request_id: row for row, request_id in enumerate(self.request_ids)}

    def result(self) -> ModelRunnerOutput:
        """Wait for the step and report its tokens."""
        self._ready.synchronize()
        return ModelRunnerOutput(sampled_token_ids=dict(zip(self.request_ids, self._host.tolist())))


class TokenBuffers:
    """Two host buffers used in turn by consecutive pending steps (pinned on a GPU).

    A buffer grows when a batch outgrows it; the other one, possibly still being
    copied into, is left alone."""

    def __init__(self, device: torch.device, max_batch: int = 512) -> None:
        self._pin = device.type == "cuda"
        self._event = torch.cuda.Event if self._pin else _DoneEvent
        self._buffers = [self._allocate(max_batch) for _ in range(2)]
        self._turn = 0

    def _allocate(self, size: int) -> torch.Tensor:
        return torch.empty(size, dtype=torch.int32, pin_memory=self._pin)

    def launch(self, request_ids: list[str], device_tokens: torch.Tensor) -> PendingDecode:
        """Start copying a launched step's tokens into the next buffer."""
        self._turn ^= 1
        if self._buffers[self._turn].numel() < len(request_ids):
            self._buffers[self._turn] = self._allocate(len(request_ids))
        return PendingDecode(request_ids, device_tokens, self._buffers[self._turn], self._event())
