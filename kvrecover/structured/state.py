"""`GrammarState`: one request's position in its grammar (an xgrammar `GrammarMatcher`)."""

from __future__ import annotations

from typing import Any

import torch


class GrammarState:
    """The matcher of one request.

    The engine owns it: it `accept`s each token appended to the request (and, for a
    migrated request, `replay`s the earlier output first); the model runner only reads
    it, filling the request's row of a step's bitmask (`fill`) before sampling. A
    request's tokens are appended between steps, so the two never overlap.
    """

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into `bitmask[row]` (int32 words on the CPU, bit
        i of word w set when token 32 * w + i is allowed)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance past `token_id`; False (and unchanged) when the grammar forbids it."""
        return bool(self._matcher.accept_token(token_id))

    def replay(self, token_ids: list[int]) -> None:
        """Accept tokens generated earlier under this grammar (a migrated request's
        output); a ValueError when one of them does not fit it."""
        for position, token_id in enumerate(token_ids):
            if not self.accept(token_id):
                raise ValueError(
                    f"the resumed output does not follow the request's grammar: token "
                    f"{token_id} at resumed position {position} is not allowed there")

    @property
    def is_terminated(self) -> bool:
        """True once the grammar accepted a stop token (or cannot continue)."""
        return bool(self._matcher.is_terminated())
