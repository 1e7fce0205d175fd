"""What callers hand the engine, checked and turned into engine inputs.

Prompts become token ids (never coerced: 5.7, "123" and True are errors; text with a
lone surrogate or a NUL is an error naming the prompt), a request is checked against
the model and the KV cache before it is queued. Everything here raises a ValueError
that says what to change (the engine's options are resolved in `engine/resolve.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvrecover.kv_layout import blocks_needed
from kvrecover.sampling import SamplingParams
from kvrecover.tokenizer import check_text


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
    blocks_for: Callable[[int], int] | None = None,
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
    # `blocks_for`: the blocks of all KV cache groups for that many tokens.
    needed = blocks_needed(longest, block_size) if blocks_for is None else blocks_for(longest)
    if needed > num_blocks - 1:
        raise ValueError(
            f"request {request_id!r} needs {needed} "
            f"KV blocks but the cache has {num_blocks - 1}; raise num_kv_blocks or "
            "kv_cache_memory_gb, or shorten the request"
        )
