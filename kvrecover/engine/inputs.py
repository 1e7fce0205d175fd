"""What callers hand the engine, checked and turned into engine inputs.

Prompts become token ids (never coerced: 5.7, "123" and True are errors; text with a
lone surrogate or a NUL is an error naming the prompt), a request is checked against
the model and the KV cache before it is queued. Everything here raises a ValueError
that says what to change (the engine's options are resolved in `engine/resolve.py`).
"""

from __future__ import annotations

from typing import Any

from kvrecover.kv_layout import blocks_needed
from kvrecover.sampling import SamplingParams
from kvrecover.step_messages import LogitsSpec
from kvrecover.tokenizer import Tokenizer, check_text


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
    for name, ids in (("stop_token_ids", params.stop_token_ids),
                      ("allowed_token_ids", params.allowed_token_ids),
                      ("logit_bias", list(params.logit_bias or ()))):
        if any(t >= vocab_size for t in ids or ()):
            raise ValueError(
                f"request {request_id!r}: {name} must be token ids in [0, {vocab_size}), "
                f"got {ids!r:.200}"
            )
    if params.resumed_output_tokens >= len(token_ids):
        raise ValueError(f"request {request_id!r}: resumed_output_tokens must be shorter than "
                         f"the prompt ({len(token_ids)} tokens), got {params.resumed_output_tokens}")
    if params.max_tokens == 0 and params.prompt_logprobs is None:
        raise ValueError(f"request {request_id!r}: max_tokens must be >= 1 unless "
                         "prompt_logprobs is set (0 scores the prompt alone)")
    longest = min(len(token_ids) + params.max_tokens, max_model_len)
    if blocks_needed(longest, block_size) > num_blocks - 1:
        raise ValueError(
            f"request {request_id!r} needs {blocks_needed(longest, block_size)} "
            f"KV blocks but the cache has {num_blocks - 1}; raise num_kv_blocks or "
            "kv_cache_memory_gb, or shorten the request"
        )


def logits_spec(params: SamplingParams, prompt_token_ids: list[int],
                eos_token_ids: frozenset[int], tokenizer: Tokenizer) -> LogitsSpec | None:
    """The logits processors of a request (None when it has none): `min_tokens` bans
    EOS (unless `ignore_eos`) and the stop ids; each bad word is banned as its token
    sequence with and without a leading space (vLLM's rule: the spaced form only when
    it tokenizes to as many tokens and starts differently)."""
    if not params.has_logits_processors:
        return None
    banned: list[int] = []
    sequences: list[list[int]] = []
    for word in params.bad_words or ():
        plain = tokenizer.encode(word.lstrip(), "bad_words", add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), "bad_words", add_special_tokens=False)
        forms = [plain]
        if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
            forms.append(spaced)
        for form in forms:
            if len(form) == 1:
                banned.append(form[0])
            elif form:
                sequences.append(form)
    stop_ids = set(params.stop_token_ids or ())
    if not params.ignore_eos:
        stop_ids |= eos_token_ids
    resumed = params.resumed_output_tokens
    return LogitsSpec(
        prompt_token_ids=list(prompt_token_ids),
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        min_tokens=params.min_tokens,
        min_tokens_banned=sorted(stop_ids) if params.min_tokens else [],
        logit_bias=dict(params.logit_bias or {}),
        allowed_token_ids=None if params.allowed_token_ids is None
        else list(params.allowed_token_ids),
        banned_token_ids=banned,
        bad_word_sequences=sequences,
        resumed_output_token_ids=list(prompt_token_ids[len(prompt_token_ids) - resumed:])
        if resumed else [],
    )
