"""Token sampling: logits processors, token masks, then greedy, temperature, top-k,
top-p with per-token seeds; and the logprobs of what was sampled.

Every step samples on the device without waiting for it (`Sampler.sample_step`), so
the overlapped decode path can feed the tokens to the next step before the host
sees them; the synchronous path reads the same result (`SampledRows.to_host`).
There is one implementation for both. A step's logits pass, in order:
1. the requests' logits processors (`worker/logits_processors.py`: biases, bans,
   penalties), batched on the device;
2. the token masks in `Sampler.token_masks` (a grammar's bitmask hooks in here);
3. greedy, or temperature, min-p, top-k and top-p and a seeded draw (`Sampler.sample`).
Logprobs are taken from the raw logits, before step 1 (`worker/logprobs.py`).
Only a request with a bad word of several tokens needs the host (its last outputs):
the scheduler keeps it off chained overlapped steps (`LogitsSpec.needs_output_on_host`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, cast

import torch

from kvrecover.sampling import SamplingParams
from kvrecover.worker.logits_processors import LogitsProcessors
from kvrecover.worker.logprobs import TokenLogprobRows, token_logprobs

if TYPE_CHECKING:
    from kvrecover.step_messages import ScheduledRequest

INVALID_DISTRIBUTION = (
    "sampling failed: the distribution holds inf or nan (temperature, min-p, top-k or "
    "top-p out of range)"
)


@dataclass
class SampledRows:
    """One step's tokens, still on the device: nothing has waited for them."""

    tokens: torch.Tensor  # [B] token ids; a failed row holds its argmax, a valid id
    # [B] bool, False where the row's distribution was invalid (found on the device);
    # None when no row was randomly sampled (argmax never fails).
    valid: torch.Tensor | None = None
    errors: dict[int, str] = field(default_factory=dict)  # rows whose sampling raised
    logprobs: TokenLogprobRows | None = None  # for the rows that ask for them

    def to_host(self) -> tuple[list[int | None], dict[int, str]]:
        """Wait for the tokens: (token or None per row, row -> error message)."""
        valid = None if self.valid is None else self.valid.tolist()
        return host_results(self.tokens.tolist(), valid, self.errors)


def host_results(
    tokens: list[int], valid: list | None, errors: dict[int, str]
) -> tuple[list[int | None], dict[int, str]]:
    """Tokens and validity read back from the device -> (token or None per row, errors).
    A row that raised or whose distribution was invalid has no token."""
    errors = dict(errors)
    if valid is not None:
        for row, ok in enumerate(valid):
            if not ok:
                errors.setdefault(row, INVALID_DISTRIBUTION)
    return [None if row in errors else token for row, token in enumerate(tokens)], errors


class TokenMask(Protocol):
    """A step of the sampling pipeline after the logits processors (a grammar's token
    bitmask), called by `Sampler.sample_step` with the step's logits [B, V] and rows:
    returns its input itself when it masks no row, else new logits with the tokens
    each row may not take set to -inf (never changing its input in place: the raw
    logits give the logprobs, and an unchanged step may take the graph's argmax)."""

    def __call__(self, logits: torch.Tensor, rows: list[ScheduledRequest]) -> torch.Tensor: ...


class Sampler:
    """Picks one token per row of logits.

    Random sampling draws from a generator seeded per token (see
    `Request.next_sample_seed`), so a token resampled after a recovery or a
    preemption comes out the same, on either decode path. The draw is the
    exponential-race form of `torch.multinomial` (argmax of p / Exp(1) noise,
    what multinomial computes for one sample) minus multinomial's validity check,
    which reads the device: validity is returned on the device instead.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.processors = LogitsProcessors(device)
        self.token_masks: list[TokenMask] = []

    def sample_step(
        self, logits: torch.Tensor, rows: list[ScheduledRequest],
        greedy: torch.Tensor | None = None,
    ) -> SampledRows:
        """A step's tokens for `rows` (row i of `logits` [B, V] float32 samples
        `rows[i]`), on the device, with the logprobs the rows ask for. `greedy` (the
        argmax of `logits`, a CUDA graph's) serves a step that samples greedily and
        changes no logit."""
        processed = self.processors.apply(logits, rows)
        for mask in self.token_masks:
            processed = mask(processed, rows)
        params = [s.sampling_params for s in rows]
        if greedy is not None and processed is logits and all(p.is_greedy for p in params):
            sampled = SampledRows(greedy)
        else:
            sampled = self.sample(processed, params, [s.sample_seed for s in rows])
        self.processors.count(sampled.tokens)
        asking = [row for row, p in enumerate(params) if p.logprobs is not None]
        if asking:
            index = torch.tensor(asking, device=logits.device)
            sampled.logprobs = token_logprobs(
                logits.index_select(0, index), sampled.tokens.index_select(0, index), asking,
                [cast(int, params[row].logprobs) for row in asking])
        return sampled

    def __call__(
        self, logits: torch.Tensor, params: list[SamplingParams], seeds: list[int]
    ) -> list[int]:
        """The tokens of a batch (waits for them); raises if a row cannot be sampled."""
        tokens, errors = self.sample_isolated(logits, params, seeds)
        if errors:
            raise ValueError(f"row {min(errors)}: {errors[min(errors)]}")
        return cast(list[int], tokens)  # no errors: every row has a token

    def sample_isolated(
        self, logits: torch.Tensor, params: list[SamplingParams], seeds: list[int]
    ) -> tuple[list[int | None], dict[int, str]]:
        """Like `sample`, read back: tokens (None for a failed row), row -> error message."""
        return self.sample(logits, params, seeds).to_host()

    def sample(
        self, logits: torch.Tensor, params: list[SamplingParams], seeds: list[int]
    ) -> SampledRows:
        """Sample every row on the device, with no host sync; a row that cannot be
        sampled costs only that row. The batch is sampled at once; only when that
        raises is each row sampled alone to find the culprits (a row's token does not
        depend on the others)."""
        try:
            return self._sample_batch(logits, params, seeds)
        except Exception:
            pass
        rows = SampledRows(logits.argmax(dim=-1))
        for row, (p, seed) in enumerate(zip(params, seeds)):
            try:
                alone = self._sample_batch(logits[row : row + 1], [p], [seed])
            except Exception as error:
                rows.errors[row] = f"sampling failed: {type(error).__name__}: {error}"
                continue
            rows.tokens[row] = alone.tokens[0]
            if alone.valid is not None:
                if rows.valid is None:
                    rows.valid = torch.ones(len(params), dtype=torch.bool, device=logits.device)
                rows.valid[row] = alone.valid[0]
        return rows

    def _sample_batch(
        self, logits: torch.Tensor, params: list[SamplingParams], seeds: list[int]
    ) -> SampledRows:
        rows = SampledRows(logits.argmax(dim=-1))
        for row, (p, seed) in enumerate(zip(params, seeds)):
            if p.is_greedy:
                continue
            if rows.valid is None:
                rows.valid = torch.ones(len(params), dtype=torch.bool, device=logits.device)
            rows.tokens[row], rows.valid[row] = self._sample_row(logits[row], p, seed)
        return rows

    def _sample_row(
        self, logits: torch.Tensor, p: SamplingParams, seed: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(token, whether the distribution was valid), both 0-d tensors on the device."""
        logits = logits / p.temperature
        if p.min_p > 0.0:  # vLLM's min-p: relative to the most likely token's probability
            probs = logits.softmax(-1)
            logits = logits.masked_fill(probs < probs.max() * p.min_p, float("-inf"))
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
        probs = logits.softmax(-1)
        self.generator.manual_seed(seed)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        return (probs / noise).argmax(), torch.isfinite(probs).all()
