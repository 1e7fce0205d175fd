"""Structured outputs' grammar bitmask as a step of the sampling pipeline (`TokenMask`).

It runs after the logits processors and before temperature, top-k and top-p
(`Sampler.sample_step`). The bitmask bans in place, so a step with grammars masks a
copy (its input may be the raw logits, which give the logprobs); a step without
grammars passes its logits through untouched.
"""

from __future__ import annotations

import torch

from kvrecover.step_messages import ScheduledRequest
from kvrecover.structured.bitmask import TokenBitmask


class GrammarMask:
    """Masks each row's logits with its request's grammar (`ScheduledRequest.grammar`)."""

    def __init__(self, bitmask: TokenBitmask) -> None:
        self.bitmask = bitmask

    def __call__(self, logits: torch.Tensor, rows: list[ScheduledRequest]) -> torch.Tensor:
        """New logits with the tokens each row's grammar forbids at -inf; `logits`
        itself when no row has a grammar."""
        grammars = [s.grammar for s in rows]
        if all(grammar is None for grammar in grammars):
            return logits
        masked = logits.clone()
        self.bitmask.apply(masked, grammars)
        return masked
