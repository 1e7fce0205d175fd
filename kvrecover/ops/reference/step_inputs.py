"""Step inputs of the torch reference attention and the CPU-invariant kernels.

Token ids, positions, the rows to sample and an `AttentionMetadata`, built per
request (never per token) in Python and copied to the device.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from kvrecover.ops.interface import GraphStepInputs, ScheduledTokens, StepInputs, StepInputSpec
from kvrecover.ops.reference.attention_metadata import AttentionMetadata


class ReferenceStepInputs:
    """The `ops.interface.StepInputBuilder` of the reference and CPU backends (no graphs)."""

    def __init__(self, spec: StepInputSpec) -> None:
        self.block_size = spec.block_size
        self.device = spec.device

    def build(self, scheduled: Sequence[ScheduledTokens]) -> StepInputs:
        """The step's inputs on the device."""
        return reference_step_inputs(scheduled, self.block_size, self.device)

    def for_graphs(self) -> GraphStepInputs | None:
        """None: these steps always run eagerly."""
        return None


def reference_step_inputs(
    scheduled: Sequence[ScheduledTokens], block_size: int, device: torch.device
) -> StepInputs:
    """The inputs of one step for the torch reference attention (per request, never per
    token, in Python)."""
    query_lens = [len(s.token_ids) for s in scheduled]
    num_computed = [s.num_computed_tokens for s in scheduled]
    lengths = torch.tensor(query_lens)
    ends = torch.cumsum(lengths, 0)
    token_ids = torch.tensor(list(itertools.chain.from_iterable(s.token_ids for s in scheduled)))
    # Position of each row: its request's first position plus its offset in the request.
    positions = torch.arange(int(ends[-1])) + torch.repeat_interleave(
        torch.tensor(num_computed) - (ends - lengths), lengths
    )
    sample = torch.tensor([s.sample for s in scheduled])
    num_groups = len(scheduled[0].tables)
    group_attn = [
        AttentionMetadata.build(
            num_computed, query_lens, [s.tables[g] for s in scheduled], block_size, device)
        for g in range(num_groups)
    ]
    return StepInputs(
        token_ids.to(device), positions.to(device), (ends[sample] - 1).to(device), group_attn[0],
        group_attn if num_groups > 1 else [],
    )
