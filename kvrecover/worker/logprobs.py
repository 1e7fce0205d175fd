"""Logprobs on the device: the chosen token's log-probability, its rank, the top-k.

Computed from the raw float32 logits (before penalties, biases and temperature, as
vLLM reports them by default) in one batch for the rows that ask, with no host
sync: `TokenLogprobRows` holds device tensors until the step's result is read
(`to_host`, after the step's one wait for its tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrecover.outputs import TokenLogprob


@dataclass
class TokenLogprobRows:
    """The logprobs of some rows of a step, still on the device."""

    rows: list[int]  # the rows (of the step's batch) they belong to
    num_top: list[int]  # top-k asked for, per row
    token_ids: torch.Tensor  # [R] the scored tokens
    logprobs: torch.Tensor  # [R] float32
    ranks: torch.Tensor  # [R]
    top_ids: torch.Tensor  # [R, K] with K = max(num_top)
    top_logprobs: torch.Tensor  # [R, K]

    def to_host(self) -> list[TokenLogprob]:
        """One record per row (reads the device: call once the step is done)."""
        token_ids = self.token_ids.tolist()
        logprobs = self.logprobs.tolist()
        ranks = self.ranks.tolist()
        top_ids = self.top_ids.tolist()
        top_logprobs = self.top_logprobs.tolist()
        return [
            TokenLogprob(token_ids[i], logprobs[i], ranks[i],
                         list(zip(top_ids[i][:k], top_logprobs[i][:k])))
            for i, k in enumerate(self.num_top)
        ]


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, rows: list[int],
                   num_top: list[int]) -> TokenLogprobRows:
    """Logprobs of `token_ids[j]` under `logits[j]` [R, V] (float32), with the top
    `num_top[j]` tokens; `rows` names each one's row in the step. Ties in the top-k
    keep torch.topk's order."""
    logprobs = logits.float().log_softmax(-1)
    token_ids = token_ids.long()
    chosen = logprobs.gather(1, token_ids[:, None])[:, 0]
    ranks = (logprobs > chosen[:, None]).sum(-1) + 1
    k = max(num_top, default=0)
    top = logprobs.topk(k, dim=-1) if k else None
    empty = logprobs.new_zeros((len(rows), 0))
    return TokenLogprobRows(
        rows, num_top, token_ids, chosen, ranks,
        top.indices if top is not None else empty.long(),
        top.values if top is not None else empty,
    )
