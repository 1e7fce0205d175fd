"""OpenAI's completion and chat-completion answers, as strict pydantic models.

One place for the response shapes (with kvrecover's and vLLM's `token_ids` /
`prompt_token_ids`): the proxy validates every upstream answer, stream event and
error body with them before anything of it reaches a client. Types are strict (a
token id is an int, not `"7"`, `7.0` or `true`); unknown extra fields are
ignored, as OpenAI adds fields over time. `load_json` parses untrusted JSON with
every way it can fail (syntax, NaN, 5,000-digit numbers, deep nesting) as one
`ShapeError`.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

FinishReason = Literal["stop", "length", "content_filter", "tool_calls", "function_call"]
Count = Annotated[int, Field(ge=0)]
TokenIds = list[Count]


class ShapeError(ValueError):
    """A JSON value that is not the OpenAI answer it should be."""


class _Shape(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


class Usage(_Shape):
    """`usage`: token counts of the answer."""

    prompt_tokens: Count
    completion_tokens: Count
    total_tokens: Count

    @model_validator(mode="after")
    def _total_is_the_sum(self) -> Usage:
        if self.total_tokens != self.prompt_tokens + self.completion_tokens:
            raise ValueError("total_tokens must be prompt_tokens + completion_tokens")
        return self


class _Choice(_Shape):
    """What every choice carries, whatever holds its text."""

    index: Count
    finish_reason: FinishReason | None
    logprobs: Any = None
    token_ids: TokenIds | None = None


class CompletionChoice(_Choice):
    """One choice of a completion, streamed (the new text) or whole."""

    text: str
    prompt_token_ids: TokenIds | None = None
    prompt_logprobs: list[Any] | None = None  # vLLM's


class ChatDelta(_Shape):
    """What one chat chunk adds to the assistant's message."""

    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatStreamChoice(_Choice):
    """One choice of a chat chunk."""

    delta: ChatDelta


class ChatMessage(_Shape):
    """The assistant's message of a whole chat answer."""

    role: Literal["assistant"]
    content: str | None


class ChatChoice(_Choice):
    """One choice of a whole chat answer."""

    message: ChatMessage


class _Answer(_Shape):
    id: str
    created: Count
    model: str
    usage: Usage | None = None


class Completion(_Answer):
    """`/v1/completions`: a whole answer or one streamed chunk (same object name)."""

    object: Literal["text_completion"]
    choices: list[CompletionChoice]


class ChatCompletionChunk(_Answer):
    """One streamed chunk of `/v1/chat/completions`."""

    object: Literal["chat.completion.chunk"]
    choices: list[ChatStreamChoice]
    prompt_token_ids: TokenIds | None = None
    prompt_logprobs: list[Any] | None = None  # vLLM's


class ChatCompletion(_Answer):
    """A whole answer of `/v1/chat/completions`."""

    object: Literal["chat.completion"]
    choices: list[ChatChoice]
    prompt_token_ids: TokenIds | None = None
    prompt_logprobs: list[Any] | None = None  # vLLM's


class ErrorDetail(_Shape):
    """The `error` object of an OpenAI error answer."""

    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorAnswer(_Shape):
    """`{"error": {"message", "type", "param", "code"}}`."""

    error: ErrorDetail


class ModelCard(_Shape):
    """One entry of `/v1/models`."""

    id: str
    object: Literal["model"]


class ModelList(_Shape):
    """`/v1/models`."""

    object: Literal["list"]
    data: list[ModelCard]


Shape = TypeVar("Shape", bound=BaseModel)


def load_json(text: str | bytes) -> Any:
    """Parse untrusted JSON; a ShapeError for anything that is not plain JSON."""
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as error:  # JSONDecodeError, digit limit, NaN
        raise ShapeError(f"not valid JSON: {error}"[:300]) from None


def parse_shape(shape: type[Shape], value: Any) -> Shape:
    """`value` as `shape`; a ShapeError naming the first wrong field otherwise."""
    try:
        return shape.model_validate(value)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "the value"
        raise ShapeError(f"not a {shape.__name__}: {where}: {first['msg']}") from None
    except RecursionError:
        raise ShapeError(f"not a {shape.__name__}: nested too deeply") from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")
