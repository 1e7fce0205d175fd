"""A step's allowed-token bitmask: filled on the host, applied to the logits on the device.

The model runner calls `TokenBitmask.apply` after it launched the step's forward pass
and before sampling: on a GPU the forward runs while the host fills the masks (the
kernels are queued, nothing waits), so filling costs no device time; the mask then goes
up from pinned memory in one copy, and the logits of the constrained rows are set to
-inf where the mask bans a token, in stream order before the sampler reads them (one
mask for the whole batch: a row without a grammar allows every token, so it is not
changed). The mask is as wide as the logits: the grammar compiler sizes the
tokenizer's info to the model's vocabulary, so its padding rows are banned.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvrecover.structured.state import GrammarState

BITS_PER_WORD = 32


class TokenBitmask:
    """The runner's reusable host buffer for one step's masks, and the kernel that
    applies them, chosen once from the device: on the CPU xgrammar's own C++ kernel
    (fastest there), elsewhere `apply_bitmask` in torch (a few elementwise kernels in
    stream order, no JIT build, identical results; `use_torch` forces it)."""

    def __init__(self, device: torch.device, use_torch: bool | None = None) -> None:
        self.device = device
        self._pin = device.type == "cuda"
        self._host: torch.Tensor | None = None
        self._use_torch = device.type != "cpu" if use_torch is None else use_torch
        self._bits = torch.tensor([1 << i for i in range(BITS_PER_WORD)],
                                  dtype=torch.int64, device=device).to(torch.int32)

    def _buffer(self, rows: int, words: int) -> torch.Tensor:
        host = self._host
        if host is None or host.shape[0] < rows or host.shape[1] != words:
            host = torch.empty((max(rows, 16), words), dtype=torch.int32, pin_memory=self._pin)
            self._host = host
        return host[:rows]

    def apply(self, logits: torch.Tensor, grammars: Sequence[GrammarState | None]) -> None:
        """Ban, in place, every token that row i's grammar does not allow next
        (`grammars[i]`, None for an unconstrained row, whose mask allows everything).
        `logits` is [rows, vocab]. The host buffer is reused by the next call: the runner
        reads this step's tokens (which waits for the upload) before it comes."""
        if all(grammar is None for grammar in grammars):
            return
        vocab = logits.shape[-1]
        words = (vocab + BITS_PER_WORD - 1) // BITS_PER_WORD
        host = self._buffer(len(grammars), words)
        host.fill_(-1)  # all bits set: every token allowed
        for row, grammar in enumerate(grammars):
            if grammar is not None:
                grammar.fill(host, row)
        if not self._use_torch:
            from kvrecover.structured.compiler import load_xgrammar

            load_xgrammar().apply_token_bitmask_inplace(logits, host, vocab_size=vocab)
            return
        apply_bitmask(logits, host.to(self.device, non_blocking=True), self._bits)


def apply_bitmask(logits: torch.Tensor, mask: torch.Tensor, bits: torch.Tensor) -> None:
    """`logits[r, t] = -inf` where bit t of row r of `mask` ([rows, words] int32, on the
    logits' device) is clear; `bits` holds 1 << i for i in 0..31 as int32."""
    vocab = logits.shape[-1]
    allowed = (mask.unsqueeze(-1) & bits).flatten(1)[:, :vocab] != 0
    logits.masked_fill_(~allowed, float("-inf"))
