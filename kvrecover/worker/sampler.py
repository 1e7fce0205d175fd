"""Token sampling: greedy, temperature, top-k, top-p, with per-token seeds."""

from __future__ import annotations

import torch

from kvrecover.sampling import SamplingParams


class Sampler:
    """Picks one token per row of logits.

    Random sampling draws from a generator seeded per token (see
    `Request.next_sample_seed`), so a token resampled after a recovery or a
    preemption comes out the same.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)

    def __call__(
        self, logits: torch.Tensor, params: list[SamplingParams], seeds: list[int]
    ) -> list[int]:
        tokens = logits.argmax(dim=-1)
        for row, (p, seed) in enumerate(zip(params, seeds)):
            if not p.is_greedy:
                tokens[row] = self._sample_row(logits[row], p, seed)
        return tokens.tolist()

    def sample_isolated(
        self, logits: torch.Tensor, params: list[SamplingParams], seeds: list[int]
    ) -> tuple[list[int | None], dict[int, str]]:
        """Like calling the sampler, but a row that cannot be sampled costs only that
        row: returns the tokens (None for a failed row) and row -> error message.

        The batch is sampled at once; only when that raises is each row re-sampled
        alone to find the culprits (a row's token does not depend on the others).
        """
        try:
            return self(logits, params, seeds), {}
        except Exception:
            pass
        tokens: list[int | None] = []
        errors: dict[int, str] = {}
        for row, (p, seed) in enumerate(zip(params, seeds)):
            try:
                tokens.append(self(logits[row : row + 1], [p], [seed])[0])
            except Exception as error:
                tokens.append(None)
                errors[row] = f"sampling failed: {type(error).__name__}: {error}"
        return tokens, errors

    def _sample_row(self, logits: torch.Tensor, p: SamplingParams, seed: int) -> torch.Tensor:
        logits = logits / p.temperature
        if p.top_k > 0 and p.top_k < logits.shape[-1]:
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True)
            cumulative = sorted_logits.softmax(-1).cumsum(-1)
            # Drop a token when the tokens before it already reach top_p.
            drop = cumulative - sorted_logits.softmax(-1) >= p.top_p
            drop[0] = False  # the most likely token always stays
            logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
        self.generator.manual_seed(seed)
        return torch.multinomial(logits.softmax(-1), 1, generator=self.generator)[0]
