"""What callers hand the engine, checked and turned into engine inputs.

Prompts become token ids (never coerced: 5.7, "123" and True are errors; text with a
lone surrogate or a NUL is an error naming the prompt), a
request is checked against the model and the KV cache before it is queued, and
the `device` / `dtype` options resolve to torch objects. Everything here raises
a ValueError that says what to change.
"""

from __future__ import annotations

from typing import Any

import torch

from kvrecover.kv_layout import blocks_needed
from kvrecover.models.config import ModelConfig
from kvrecover.sampling import SamplingParams
from kvrecover.tokenizer import check_text

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def prompt_tokens(prompt: Any, tokenizer) -> tuple[str | None, list[int]]:
    """(text or None, token ids) of a string, `{"prompt_token_ids": [...]}` or id list."""
    if isinstance(prompt, str):
        return prompt, tokenizer.encode(prompt, "prompt")
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        text = prompt.get("prompt")
        if text is not None and not isinstance(text, str):
            raise ValueError(f"prompt must be a string (or absent), got {text!r}")
        if text is not None:
            check_text(text, "prompt")
        return text, _token_ids(prompt["prompt_token_ids"])
    if isinstance(prompt, list):
        return None, _token_ids(prompt)
    raise ValueError(
        "a prompt must be a string or {'prompt_token_ids': [...]}, "
        f"got {type(prompt).__name__}"
    )


def _token_ids(values: object) -> list[int]:
    if not isinstance(values, (list, tuple)) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in values
    ):
        shown = repr(values) if len(repr(values)) < 80 else repr(values)[:77] + "..."
        raise ValueError(f"prompt_token_ids must be a list of integers, got {shown}")
    return list(values)


def check_request(
    request_id: str, token_ids: list[int], params: SamplingParams, *, max_model_len: int,
    vocab_size: int, block_size: int, num_blocks: int,
) -> None:
    """A ValueError unless the request can run: a non-empty prompt that leaves room for
    one new token, ids in the vocabulary, and a KV cache large enough for it alone."""
    if not token_ids:
        raise ValueError(f"request {request_id!r}: the prompt has no tokens")
    if len(token_ids) >= max_model_len:
        raise ValueError(
            f"request {request_id!r}: prompt of {len(token_ids)} tokens does not fit "
            f"max_model_len={max_model_len} (at least one new token must fit)"
        )
    if min(token_ids) < 0 or max(token_ids) >= vocab_size:
        raise ValueError(f"request {request_id!r}: token ids must be in [0, {vocab_size})")
    stop_ids = params.stop_token_ids or ()
    if any(t >= vocab_size for t in stop_ids):
        raise ValueError(
            f"request {request_id!r}: stop_token_ids must be token ids in [0, {vocab_size}), "
            f"got {stop_ids!r}"
        )
    longest = min(len(token_ids) + params.max_tokens, max_model_len)
    if blocks_needed(longest, block_size) > num_blocks - 1:
        raise ValueError(
            f"request {request_id!r} needs {blocks_needed(longest, block_size)} "
            f"KV blocks but the cache has {num_blocks - 1}; raise num_kv_blocks or "
            "kv_cache_memory_gb, or shorten the request"
        )


def or_default(value: int | None, default: int) -> int:
    """`value`, or `default` when it is None (0 is a value, not a default)."""
    return default if value is None else value


def resolve_device(device: str) -> torch.device:
    """The torch device of the `device` option ("auto" picks CUDA when there is one)."""
    if device == "auto":
        return resolve_device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}") from error
    if resolved.type not in ("cpu", "cuda"):  # torch knows more types than we run on
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}")
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device='cuda' was asked for but CUDA is not available")
        if resolved.index is None:  # torch.cuda.set_device needs an index
            resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


def resolve_dtype(dtype: str, device: torch.device, config: ModelConfig) -> torch.dtype:
    """The torch dtype of the `dtype` option ("auto": float32 on the CPU, the
    checkpoint's fp16 or else bf16 on a GPU)."""
    if dtype != "auto":
        return DTYPES[dtype]
    if device.type != "cuda":
        return torch.float32
    return torch.float16 if config.checkpoint_dtype == torch.float16 else torch.bfloat16
