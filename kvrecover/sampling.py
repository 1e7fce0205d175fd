"""Sampling parameters of one request, and the per-token sampling seeds derived from its seed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvrecover.options import option, validate
from kvrecover.structured.params import StructuredOutputsParams

# Below this, logits / temperature overflows float32 (and sampling would fail inside
# a step); any temperature this small already picks the argmax in practice.
MIN_TEMPERATURE = 1e-5
# Below this, top_p rounds to 0 in float32 and would drop every token.
MIN_TOP_P = 1e-6


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


@dataclass
class SamplingParams:
    """How to pick the next tokens of one request.

    `temperature=0` is greedy decoding. Generation stops at an EOS token (unless
    `ignore_eos`), at any of `stop_token_ids`, or after `max_tokens` new tokens.
    `seed` makes random sampling reproducible per request. `structured_outputs`
    constrains the output to a grammar (`kvrecover.structured.params`); it ends when
    the grammar is complete. A value that cannot
    work is a ValueError naming the field, here, not an error inside a step.
    """

    temperature: float = option(
        1.0, "sampling temperature; 0 is greedy", float, check=_temperature_problem,
        describe=f"0 (greedy) or a finite number >= {MIN_TEMPERATURE}")
    top_p: float = option(
        1.0, "sample from the smallest set of tokens whose probability reaches top_p", float,
        minimum=MIN_TOP_P, maximum=1)
    top_k: int = option(-1, "sample from the k most likely tokens; -1 disables", int,
                        check=_top_k_problem)
    max_tokens: int = option(16, "new tokens to generate at most", int, minimum=1)
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

    def __post_init__(self) -> None:
        if isinstance(self.stop_token_ids, tuple):
            self.stop_token_ids = list(self.stop_token_ids)
        validate(self)

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
