"""Decode steps whose sampled tokens reach the host while the next step already runs.

The engine launches step N+1 before it reads step N's tokens (N+1 takes them
from the device), so the device never idles while the host schedules and
applies results. Greedy and randomly sampled rows alike are sampled on the
device (`Sampler.sample`); each launched step copies its tokens (and, for random
draws, whether each was valid) into one of two host buffers: at most two steps
are ever in flight. A connector's hooks run when the step is launched, in their
usual order, so the step's KV-transfer events are known before its tokens.
On a GPU the buffers are pinned and an event marks the copy done; on the CPU
(where the model runner can run the same path eagerly, see
`ModelRunner.eager_overlap`) they are plain tensors and the copy is done when it
returns. `TokenBuffers` chooses once.
"""

from __future__ import annotations

import torch

from kvrecover.step_messages import ModelRunnerOutput
from kvrecover.worker.prompt_logprobs import add_logprobs
from kvrecover.worker.sampler import SampledRows, host_results


class _DoneEvent:
    """Stands in for a CUDA event where work completes before the call returns."""

    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


class PendingDecode:
    """A launched decode step; `result()` waits for its tokens.

    `output` already holds the step's KV-transfer events (the connector's hooks ran
    at launch) and the rows that failed there; the tokens, and which random draws
    were invalid, arrive with `result()`.
    """

    def __init__(
        self, request_ids: list[str], sampled: SampledRows, output: ModelRunnerOutput,
        host: torch.Tensor, ready: torch.cuda.Event | _DoneEvent,
    ) -> None:
        self.request_ids = request_ids
        # [B], a graph output on the all-greedy path: the next replay of that graph
        # overwrites it, after (in stream order) every read of it launched before.
        self.device_tokens = sampled.tokens
        self._sampled = sampled
        self._errors = sampled.errors
        self._output = output
        count = len(request_ids)
        self._tokens = host[0, :count]
        self._tokens.copy_(sampled.tokens, non_blocking=True)
        self._valid = None
        if sampled.valid is not None:
            self._valid = host[1, :count]
            self._valid.copy_(sampled.valid, non_blocking=True)
        self._ready = ready
        self._ready.record()

    @property
    def finished_recving(self) -> set[str]:
        """The async loads this step's connector hooks reported finished (known at launch)."""
        return self._output.finished_recving

    def rows(self) -> dict[str, int]:
        """Each request's row in `device_tokens`."""
        return {request_id: row for row, request_id in enumerate(self.request_ids)}

    def result(self) -> ModelRunnerOutput:
        """Wait for the step and report its tokens (a row that could not be sampled is
        one of `failed_requests`, as on the synchronous path)."""
        self._ready.synchronize()
        valid = None if self._valid is None else self._valid.tolist()
        tokens, errors = host_results(self._tokens.tolist(), valid, self._errors)
        output = self._output
        for row, message in errors.items():
            output.failed_requests[self.request_ids[row]] = message
        output.sampled_token_ids = {
            request_id: token for request_id, token in zip(self.request_ids, tokens)
            if token is not None
        }
        # The step is done: reading its logprobs waits for nothing more.
        add_logprobs(output, self._sampled, self.request_ids)
        return output


class TokenBuffers:
    """Two host buffers used in turn by consecutive pending steps (pinned on a GPU),
    each with a row of tokens and a row of validity flags.

    A buffer grows when a batch outgrows it; the other one, possibly still being
    copied into, is left alone."""

    def __init__(self, device: torch.device, max_batch: int = 512) -> None:
        self._pin = device.type == "cuda"
        self._event = torch.cuda.Event if self._pin else _DoneEvent
        self._buffers = [self._allocate(max_batch) for _ in range(2)]
        self._turn = 0

    def _allocate(self, size: int) -> torch.Tensor:
        return torch.empty((2, size), dtype=torch.int32, pin_memory=self._pin)

    def launch(
        self, request_ids: list[str], sampled: SampledRows, output: ModelRunnerOutput
    ) -> PendingDecode:
        """Start copying a launched step's tokens into the next buffer."""
        self._turn ^= 1
        if self._buffers[self._turn].shape[1] < len(request_ids):
            self._buffers[self._turn] = self._allocate(len(request_ids))
        return PendingDecode(
            request_ids, sampled, output, self._buffers[self._turn], self._event()
        )
