"""What `LLM.generate` and `Engine.step` return."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class TokenLogprob:
    """The model's log-probability of one token (float32 `log_softmax` of the raw
    logits, before penalties, biases and temperature) and the most likely tokens there."""

    token_id: int
    logprob: float
    rank: int  # 1 for the most likely token (1 + how many are strictly more likely)
    top: list[tuple[int, float]]  # the top-k (token id, logprob), most likely first


@dataclass
class CompletionOutput:
    """The generated continuation of one prompt (choice `index` of `n`)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "error" or None while running
    logprobs: list[TokenLogprob] | None = None  # one per token, with `logprobs` set


@dataclass
class RequestOutput:
    """The state of one request: its prompt and (so far) generated output."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    error: str | None = None  # a message when finish_reason is "error"
    error_type: str | None = None  # "kv_load_failed" or "internal_error" with an error
    # With `prompt_logprobs`: one per prompt token, None for the first (nothing precedes it).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # A producer's P2P connector: the reference a consumer pulls this prompt's KV with
    # (vLLM's `kv_transfer_params`), set once the request finished.
    kv_transfer_params: dict[str, Any] | None = None


def choice_request_id(request_id: str, index: int, n: int) -> str:
    """The engine's id of choice `index` of a request of `n` choices: the request's own
    id when n is 1, else `<id>#<index>` (what `Engine.step` reports it under)."""
    return request_id if n == 1 else f"{request_id}#{index}"
