"""CUDA graphs for decode steps: one captured forward + LM head + argmax per batch-size bucket.

A decode step of B requests replays the graph of the smallest bucket >= B,
padded with dummy requests that write only into the null block (and, in a hybrid
model's recurrent layers, bring 0 rows, so they write no state). A bucket's
graph is captured the first time a step of its size runs. Inputs live in one
static device buffer (the backend's `ops.interface.GraphStepInputs`); the block table's width is read
by the kernel from that buffer, so one graph serves every context length.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvrecover.ops.interface import GraphStepInputs, RecurrentRequestRows, StepInputs
from kvrecover.step_messages import ScheduledRequest

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # [bucket, vocab] float32, written by every replay
    greedy: torch.Tensor  # [bucket] argmax of each row of logits


class DecodeGraphs:
    """Captures and replays decode steps (`forward(inputs) -> (logits, greedy tokens)`)."""

    def __init__(
        self,
        forward: Callable[[StepInputs], tuple[torch.Tensor, torch.Tensor]],
        builder: GraphStepInputs,
        max_blocks_per_seq: int,
        device: torch.device,
        num_kv_groups: int = 1,
    ) -> None:
        self.forward = forward
        self.num_kv_groups = num_kv_groups  # one block table each
        self.builder = builder
        self.max_blocks_per_seq = max_blocks_per_seq
        self.device = device
        self.graphs: dict[int, _Graph] = {}
        self.pool: _POOL_HANDLE | None = None
        self.buffer: torch.Tensor | None = None

    @staticmethod
    def bucket(batch_size: int) -> int | None:
        """The graph size a decode batch of `batch_size` replays, or None if too large."""
        for size in BUCKETS:
            if size >= batch_size:
                return size
        return None

    def run(
        self,
        scheduled: list[ScheduledRequest],
        token_source: tuple[torch.Tensor, list[int]] | None = None,
        recurrent: Sequence[RecurrentRequestRows] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay (capturing first if needed) a one-token-per-request step.

        With `token_source` = (tokens on the device, row per request), the input
        tokens are gathered on the device instead of taken from `scheduled`: the
        host need not wait for the step that samples them. `recurrent`: a hybrid
        model's request rows of the step (`RecurrentStates.step`), packed with the rest.
        Returns the logits [B, V] and their argmax [B] (views valid until the next replay).
        """
        size = self.bucket(len(scheduled))
        if size is None:
            raise ValueError(f"a decode batch of {len(scheduled)} requests is larger than the "
                             f"largest graph ({BUCKETS[-1]}); run it eagerly")
        graph = self.graphs.get(size) or self._capture(size)
        buffer = self._step_buffer()
        rows = None if token_source is None else token_source[1]
        layout = self.builder.pack(scheduled, pad_to=size, input_ids=rows, recurrent=recurrent)
        self.builder.upload(layout, buffer)
        if token_source is not None:
            start = layout.offsets["ids"]
            ids = buffer[start : start + len(scheduled)]
            ids.copy_(token_source[0].index_select(0, ids))  # uploaded rows -> token ids
        graph.graph.replay()
        return graph.logits[: len(scheduled)], graph.greedy[: len(scheduled)]

    def _step_buffer(self) -> torch.Tensor:
        """The input buffer every graph reads, allocated at the first capture."""
        if self.buffer is None:
            # Sized for the largest bucket at full context; never reallocated (graphs hold its address).
            probe = self.builder.pack([], pad_to=BUCKETS[-1])
            extra = BUCKETS[-1] * (self.max_blocks_per_seq - 1) * self.num_kv_groups
            self.buffer = torch.empty(probe.size + extra, dtype=torch.int32, device=self.device)
        return self.buffer

    def clear(self) -> None:
        """Drop every captured graph (they read tensors that were replaced); the memory
        pool stays for the next captures."""
        self.graphs.clear()

    def _capture(self, size: int) -> _Graph:
        buffer = self._step_buffer()
        layout = self.builder.pack([], pad_to=size)
        self.builder.upload(layout, buffer)
        inputs = self.builder.views(layout, buffer)
        self.forward(inputs)  # warm-up: compiles kernels and sets up cuBLAS outside the capture
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            logits, greedy = self.forward(inputs)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[size] = captured = _Graph(graph, logits, greedy)
        return captured
