"""Sampling parameters of one request."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How to pick the next tokens of one request.

    `temperature=0` is greedy decoding. Generation stops at an EOS token (unless
    `ignore_eos`), at any of `stop_token_ids`, or after `max_tokens` new tokens.
    `seed` makes random sampling reproducible per request.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = field(default=True, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not 0 <= self.temperature < float("inf"):  # also rejects NaN
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k != -1):
            raise ValueError(f"top_k must be -1 (disabled) or an integer >= 1, got {self.top_k!r}")
        if self.stop_token_ids is not None:
            self.stop_token_ids = [int(t) for t in self.stop_token_ids]

    @property
    def is_greedy(self) -> bool:
        """True when the next token is always the argmax."""
        return self.temperature == 0 or self.top_k == 1
