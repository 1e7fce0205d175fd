"""A step's allowed-token bitmask: filled on the host, applied to the logits on the device.

The model runner calls `TokenBitmask.apply` after it launched the step's forward pass
and before sampling: on a GPU the forward runs while the host fills the masks (the
kernels are queued, nothing waits), so filling costs no device time; the mask then goes
up from pinned memory in one copy, and the logits of the constrained rows are set to
-inf where the mask bans a token, in stream order before the sampler reads them. Rows
without a grammar are not touched. Logits wider than the mask (the model's padded
vocabulary) are banned past it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvrecover.structured.state import GrammarState

BITS_PER_WORD = 32


class TokenBitmask:
    """The runner's reusable host buffer for the masks of one step's constrained rows."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pin = device.type == "cuda"
        self._host: torch.Tensor | None = None
        self._shifts = torch.arange(BITS_PER_WORD, dtype=torch.int32, device=device)

    def _buffer(self, rows: int, words: int) -> torch.Tensor:
        host = self._host
        if host is None or host.shape[0] < rows or host.shape[1] != words:
            host = torch.empty((max(rows, 16), words), dtype=torch.int32, pin_memory=self._pin)
            self._host = host
        return host[:rows]

    def apply(self, logits: torch.Tensor, grammars: Sequence[GrammarState | None]) -> None:
        """Ban, in place, every token that row i's grammar does not allow next
        (`grammars[i]`, None for an unconstrained row). `logits` is [rows, vocab]."""
        rows = [row for row, grammar in enumerate(grammars) if grammar is not None]
        if not rows:
            return
        vocab = logits.shape[-1]
        words = (vocab + BITS_PER_WORD - 1) // BITS_PER_WORD
        host = self._buffer(len(rows), words)
        for slot, row in enumerate(rows):
            grammar = grammars[row]
            if grammar is not None:
                grammar.fill(host, slot)
        mask = host.to(self.device, non_blocking=True)
        allowed = ((mask.unsqueeze(-1) >> self._shifts) & 1).bool().flatten(1)[:, :vocab]
        if len(rows) == logits.shape[0]:
            logits.masked_fill_(~allowed, float("-inf"))
            return
        index = torch.tensor(rows, device=self.device)
        logits.index_copy_(0, index,
                           logits.index_select(0, index).masked_fill(~allowed, float("-inf")))
