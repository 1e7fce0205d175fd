"""What `LLM.generate` and `Engine.step` return."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """The generated continuation of one prompt."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "error" or None while running


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
