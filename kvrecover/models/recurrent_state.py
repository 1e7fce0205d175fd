"""What a linear-attention (recurrent) layer keeps per request, and what it gets each step.

A recurrent layer declares its per-request state as `StateSpec`s; the worker holds
one slot of each for every running request (`worker/recurrent_states.py`) and hands
the layer, in place of attention metadata, a `RecurrentLayerStep`: its state tensors
and, per request of the step, its rows of the flat batch, its first position and
its slot. The layer reads the state at that position and leaves it at the end of
the request's rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

MAX_DELTA_CHUNK = 64  # Hugging Face's chunk of the gated delta rule


@dataclass(frozen=True)
class StateSpec:
    """One per-request state tensor of a layer: its name, its shape per request, its
    dtype (None: the model's), and whether a checkpoint at a block boundary keeps it
    (False: it is empty at every block boundary, like a partial chunk's inputs)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype | None = None
    checkpointed: bool = True


@dataclass(frozen=True)
class RequestRows:
    """One request's part of a step: rows [start_row, end_row) of the flat batch, the
    position of its first row, its state slot, and (position, checkpoint slot) of each
    block boundary inside its rows whose state the layer copies into a checkpoint."""

    start_row: int
    end_row: int
    position: int
    slot: int
    checkpoints: tuple[tuple[int, int], ...] = ()


@dataclass
class RecurrentLayerStep:
    """A recurrent layer's view of one step: its state tensors (name -> [slots, *shape])
    and the step's requests, in batch order. `chunk_size` is the delta rule's chunk C
    (chunks aligned to absolute positions; C divides the KV block size)."""

    tensors: dict[str, torch.Tensor]
    requests: list[RequestRows]
    chunk_size: int
    # The checkpoints of the checkpointed specs: name -> [checkpoint slots, *shape].
    checkpoints: dict[str, torch.Tensor] = field(default_factory=dict)


def delta_chunk_size(block_size: int) -> int:
    """The delta rule's chunk C for KV blocks of `block_size` tokens: the largest divisor
    of the block size up to `MAX_DELTA_CHUNK`, so that every block boundary is a chunk
    boundary (where a request's recurrent state is complete)."""
    return max(c for c in range(1, min(block_size, MAX_DELTA_CHUNK) + 1) if block_size % c == 0)
