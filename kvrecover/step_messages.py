"""The step messages: what the scheduler asks the worker to run each step (`SchedulerOutput`
of `ScheduledRequest`s) and what the worker reports back (`ModelRunnerOutput`).

Below both engine and worker (and read by connectors in `build_connector_meta`), so
the import arrows between them point one way: engine -> worker, both -> here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvrecover.outputs import TokenLogprob
from kvrecover.sampling import SamplingParams

if TYPE_CHECKING:
    from kvrecover.structured.state import GrammarState

# Stands in `ScheduledRequest.token_ids` for a token that the previous step is still
# sampling on the device (overlapped decode); the worker reads it from there.
PENDING_TOKEN = -1


@dataclass
class LogitsSpec:
    """What a request's logits processors need (`SamplingParams.has_logits_processors`),
    resolved against the tokenizer once when the engine adds the request; the worker
    turns it into device state the first time the request samples
    (`worker/logits_processors.py`)."""

    prompt_token_ids: list[int]  # repetition_penalty counts them
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_tokens: int
    min_tokens_banned: list[int]  # EOS (unless ignore_eos) and stop ids: banned before min_tokens
    logit_bias: dict[int, float]
    allowed_token_ids: list[int] | None
    banned_token_ids: list[int]  # bad words of one token
    bad_word_sequences: list[list[int]]  # bad words of several tokens
    # Earlier outputs ending the prompt (`SamplingParams.resumed_output_tokens`): counted
    # as output before the request's own.
    resumed_output_token_ids: list[int] = field(default_factory=list)

    @property
    def needs_output_on_host(self) -> bool:
        """Whether sampling reads the request's last outputs on the host (a bad word of
        several tokens bans its last token after the others): such a request cannot
        decode a step whose input token is still on the device."""
        return bool(self.bad_word_sequences)


@dataclass
class ScheduledRequest:
    """The slice of one request the worker computes in this step."""

    request_id: str
    token_ids: list[int]  # tokens computed in this step
    num_computed_tokens: int  # position of token_ids[0]
    block_ids: list[int]  # the request's whole block table (of KV cache group 0)
    sample: bool  # the slice reaches the end of the sequence: sample a next token
    sampling_params: SamplingParams
    sample_seed: int
    # Every KV cache group's table (`kv_groups.py`), group 0's first; empty for a model
    # of one group, whose table is `block_ids` (`tables` reads both alike).
    block_tables: list[list[int]] = field(default_factory=list)
    num_output_tokens: int = 0  # outputs before the token this step samples
    logits_spec: LogitsSpec | None = None  # None: no logits processors
    # The request's outputs so far (its own list, not a copy; in an overlapped step it
    # lacks the token still on the device). Set only with `logits_spec`.
    output_token_ids: list[int] | None = None
    # The request's prompt (its own list), set only when it asks for prompt logprobs.
    prompt_token_ids: list[int] | None = None
    # The request's grammar matcher (structured outputs), read by the runner to mask the
    # sampled row's logits; None for an unconstrained request.
    grammar: GrammarState | None = None
    # A hybrid model's recurrent-state checkpoints (`engine/state_checkpoints.py`): the
    # checkpoint slot to start from (at `num_computed_tokens`, a prefix-cache hit), and
    # (position, slot) of each block boundary inside this slice whose state to keep, and
    # of each one (its start included) whose state a checkpoint already holds (a
    # connector may store it).
    restore_checkpoint: int | None = None
    save_checkpoints: list[tuple[int, int]] = field(default_factory=list)
    held_checkpoints: list[tuple[int, int]] = field(default_factory=list)

    @property
    def tables(self) -> list[list[int]]:
        """One block table per KV cache group."""
        return self.block_tables or [self.block_ids]


@dataclass
class SchedulerOutput:
    """What to run in one step."""

    scheduled: list[ScheduledRequest]
    finished_request_ids: set[str] = field(default_factory=set)
    kv_connector_metadata: Any = None
    # Requests preempted since the last step (they restart from 0): the worker frees
    # what it holds for them besides KV blocks (a hybrid model's recurrent states).
    preempted_request_ids: set[str] = field(default_factory=set)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)


@dataclass
class ModelRunnerOutput:
    """What the worker reports back after a step."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    invalid_block_ids: set[int] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    finished_sending: set[str] = field(default_factory=set)
    kv_save_failed_blocks: int = 0
    # The connector's load report was unusable (it raised or returned garbage): every
    # load the scheduler sees end in this step counts as failed.
    kv_load_report_failed: bool = False
    kv_connector_errors: int = 0  # worker-side connector failures contained in this step
    kv_connector_stats: dict[str, int] = field(default_factory=dict)  # increments, by name
    # Requests whose part of the step failed (the sampler or the forward raised):
    # request id -> message. The scheduler ends these with an internal error, except
    # those the step's own failed loads roll back (their part read invalid KV).
    failed_requests: dict[str, str] = field(default_factory=dict)
    # The sampled token's logprobs, for requests that ask for them (`logprobs`).
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    # Prompt logprobs this step computed (`prompt_logprobs`): request id -> (index of
    # the prompt token the first entry scores, one entry per prompt token scored).
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprob]]] = field(default_factory=dict)
