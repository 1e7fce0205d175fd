"""Sampling parameters of one request, and the per-token sampling seeds derived from its seed."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvrecover.options import option, validate
from kvrecover.structured.params import StructuredOutputsParams

# Below this, logits / temperature overflows float32 (and sampling would fail inside
# a step); any temperature this small already picks the argmax in practice.
MIN_TEMPERATURE = 1e-5
# Below this, top_p rounds to 0 in float32 and would drop every token.
MIN_TOP_P = 1e-6
MAX_N = 16  # completions per prompt (`n`): each one holds its own KV blocks
MAX_LOGPROBS = 20  # top logprobs per token, as OpenAI's chat `top_logprobs` allows
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a `logit_bias` value: [-100, 100]


def _temperature_problem(value: float) -> str | None:
    return None if value == 0 or value >= MIN_TEMPERATURE else "too small"


def _top_k_problem(value: int) -> str | None:
    return None if value == -1 or value >= 1 else "-1 (disabled) or an integer >= 1"


def _structured_outputs(value: Any) -> Any:
    """A dict of `StructuredOutputsParams` fields (JSON) becomes the record."""
    if isinstance(value, dict):
        unknown = sorted(set(value) - set(StructuredOutputsParams.__dataclass_fields__))
        if unknown:
            raise ValueError(f"structured_outputs: unknown field {unknown[0]!r}; the fields "
                             f"are {', '.join(StructuredOutputsParams.__dataclass_fields__)}")
        return StructuredOutputsParams(**value)
    return value


def _token_ids_problem(value: Any) -> str | None:
    ok = isinstance(value, (list, tuple)) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value
    )
    return None if ok else "a list of token ids (integers >= 0)"


def _logit_bias_problem(value: Any) -> str | None:
    ok = isinstance(value, dict) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0
        and isinstance(b, (int, float)) and not isinstance(b, bool)
        and math.isfinite(b) and abs(b) <= MAX_LOGIT_BIAS
        for t, b in value.items()
    )
    return None if ok else (f"a dict of token id (integer >= 0) -> bias in "
                            f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")


def _allowed_token_ids_problem(value: Any) -> str | None:
    if _token_ids_problem(value) is not None or not value:
        return "a non-empty list of token ids (integers >= 0)"
    return None


def _bad_words_problem(value: Any) -> str | None:
    ok = isinstance(value, (list, tuple)) and all(isinstance(w, str) and w for w in value)
    return None if ok else "a list of non-empty strings"


@dataclass
class SamplingParams:
    """How to pick the next tokens of one request.

    `temperature=0` is greedy decoding. Generation stops at an EOS token (unless
    `ignore_eos`), at any of `stop_token_ids`, or after `max_tokens` new tokens.
    `seed` makes random sampling reproducible per request. `structured_outputs`
    constrains the output to a grammar (`kvrecover.structured.params`); it ends when
    the grammar is complete. A value that cannot
    work is a ValueError naming the field, here, not an error inside a step.

    The logits a token is drawn from pass, in this order: `logit_bias`,
    `allowed_token_ids`, `bad_words`, the `min_tokens` ban of EOS and stop ids,
    `repetition_penalty` (over prompt and output: positive logits divided, negative
    multiplied, as in Hugging Face and vLLM), `presence_penalty` and
    `frequency_penalty` (over the output, as in OpenAI); then a grammar mask (when
    one is set); then temperature, min-p (as vLLM: after temperature, before top-k),
    top-k, top-p. `logprobs` and `prompt_logprobs`
    report the model's own distribution (float32 `log_softmax` of the raw logits,
    before any of those steps), as vLLM does by default. `n` completions share the
    prompt's full KV blocks through the prefix cache; choice i draws from
    `choice_seed(seed, i)`.
    """

    temperature: float = option(
        1.0, "sampling temperature; 0 is greedy", float, check=_temperature_problem,
        describe=f"0 (greedy) or a finite number >= {MIN_TEMPERATURE}")
    top_p: float = option(
        1.0, "sample from the smallest set of tokens whose probability reaches top_p", float,
        minimum=MIN_TOP_P, maximum=1)
    top_k: int = option(-1, "sample from the k most likely tokens; -1 disables", int,
                        check=_top_k_problem)
    max_tokens: int = option(16, "new tokens to generate at most (0 only with "
                             "prompt_logprobs: score the prompt alone)", int, minimum=0)
    seed: int | None = option(None, "sampling seed of the request", int, nullable=True)
    stop_token_ids: list[int] | None = option(
        None, "token ids that end the request", list, nullable=True, check=_token_ids_problem,
        flag=False)
    ignore_eos: bool = option(False, "keep generating after an EOS token", bool)
    structured_outputs: StructuredOutputsParams | None = option(
        None, "the grammar the output follows (JSON schema, regex, choice, EBNF)",
        StructuredOutputsParams, nullable=True, flag=False, convert=_structured_outputs)
    skip_special_tokens: bool = option(
        True, "leave special tokens out of the output text", bool, repr=False, flag=False)
    n: int = option(1, "completions to generate for the prompt", int, minimum=1,
                    maximum=MAX_N, flag=False)
    logprobs: int | None = option(
        None, "top logprobs to return per output token (plus the chosen token's)", int,
        nullable=True, minimum=0, maximum=MAX_LOGPROBS, flag=False)
    prompt_logprobs: int | None = option(
        None, "top logprobs to return per prompt token (plus the prompt token's)", int,
        nullable=True, minimum=0, maximum=MAX_LOGPROBS, flag=False)
    presence_penalty: float = option(
        0.0, "subtracted from the logit of every token the output already holds", float,
        minimum=-2, maximum=2, flag=False)
    frequency_penalty: float = option(
        0.0, "subtracted from a token's logit once per time the output holds it", float,
        minimum=-2, maximum=2, flag=False)
    repetition_penalty: float = option(
        1.0, "divides positive (multiplies negative) logits of prompt and output tokens",
        float, above=0, flag=False)
    min_tokens: int = option(0, "new tokens before EOS or a stop token id may end it", int,
                             minimum=0, flag=False)
    logit_bias: dict[int, float] | None = option(
        None, "token id -> bias added to its logit", dict, nullable=True,
        check=_logit_bias_problem, flag=False)
    allowed_token_ids: list[int] | None = option(
        None, "sample only these token ids", list, nullable=True,
        check=_allowed_token_ids_problem, flag=False)
    bad_words: list[str] | None = option(
        None, "words never generated (as vLLM: each word's token sequence, with and "
        "without a leading space)", list, nullable=True, check=_bad_words_problem, flag=False)
    min_p: float = option(
        0.0, "drop the tokens less likely than min_p times the most likely one (after "
        "temperature); 0 disables", float, minimum=0, maximum=1, flag=False)

    kv_transfer_params: dict[str, Any] | None = option(
        None, "a P2P KV reference (vLLM's field names): a consumer's connector pulls the "
        "prompt's KV from the producer it names (`kv_transfer/p2p/`)", dict, nullable=True,
        flag=False, repr=False)

    resumed_output_tokens: int = option(
        0, "the prompt's last tokens that are earlier output of this request (one a proxy "
        "migrated): penalties, min_tokens and bad words count them as output", int,
        minimum=0, flag=False)

    def __post_init__(self) -> None:
        for name in ("stop_token_ids", "allowed_token_ids", "bad_words"):
            if isinstance(getattr(self, name), tuple):
                setattr(self, name, list(getattr(self, name)))
        validate(self)
        if self.max_tokens == 0 and self.prompt_logprobs is None:
            raise ValueError("max_tokens must be >= 1, got 0 (0 is only for scoring a prompt: "
                             "set prompt_logprobs)")
        if self.logit_bias is not None:
            self.logit_bias = {t: float(b) for t, b in self.logit_bias.items()}

    @property
    def has_logits_processors(self) -> bool:
        """True when some option changes the logits before temperature, top-k and top-p."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
            or self.min_tokens or self.logit_bias or self.allowed_token_ids or self.bad_words
        )

    @property
    def is_greedy(self) -> bool:
        """True when the next token is always the argmax."""
        return self.temperature == 0 or self.top_k == 1


_SEED_STRIDE = 0x9E3779B97F4A7C15  # odd, hence invertible modulo 2**63
_SEED_MODULUS = 1 << 63


def sample_seed(request_seed: int, output_index: int) -> int:
    """The sampler's seed for output token `output_index` of a request seeded
    `request_seed`: a pure function of the two (see `engine.request.Request.next_sample_seed`)."""
    return (request_seed * _SEED_STRIDE + output_index) % _SEED_MODULUS


def resumed_request_seed(request_seed: int, num_output_tokens: int) -> int:
    """The seed of a continuation whose prompt ends with the first
    `num_output_tokens` outputs of a request seeded `request_seed`: the
    continuation's output j draws from the seed of the original's output
    `num_output_tokens + j`, so a migrated seeded request samples what the
    undisturbed one would have (given the same logits)."""
    inverse = pow(_SEED_STRIDE, -1, _SEED_MODULUS)
    return (request_seed + num_output_tokens * inverse) % _SEED_MODULUS


def choice_seed(request_seed: int, choice_index: int) -> int:
    """The request seed of choice `choice_index` of an `n`-choice request seeded
    `request_seed`: choice 0 keeps it (so n=1 samples as before), the others get
    distinct, reproducible seeds."""
    if choice_index == 0:
        return request_seed
    return (request_seed * _CHOICE_STRIDE + choice_index) % _SEED_MODULUS


_CHOICE_STRIDE = 0xD1B54A32D192ED03  # odd, and not _SEED_STRIDE
