"""One generation request and its lifecycle states."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from kvrecover.outputs import TokenLogprob
from kvrecover.sampling import SamplingParams, sample_seed
from kvrecover.step_messages import LogitsSpec

if TYPE_CHECKING:
    from kvrecover.structured.state import GrammarState


class RequestStatus(enum.Enum):
    """Where a request is in its life."""

    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"  # an async KV load is in flight
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def is_finished(self) -> bool:
        """True for every terminal state."""
        # A tuple: `in` compares members by identity in C (the scheduler asks this of
        # every request several times a step; `name` is a Python descriptor).
        return self in _TERMINAL_STATES

    @property
    def finish_reason(self) -> str | None:
        """The user-facing finish reason of a terminal state."""
        return _FINISH_REASONS.get(self)


_TERMINAL_STATES = tuple(status for status in RequestStatus if status.name.startswith("FINISHED"))
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """A prompt being generated: its tokens, its blocks and its KV-transfer state.

    `num_computed_tokens` counts the leading tokens whose KV is in the request's
    blocks (computed here, hit in the prefix cache, or loaded by a connector).
    """

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: frozenset[int],
        sampling_seed: int,
        max_model_len: int,
        num_kv_groups: int = 1,
        choice_index: int = 0,
        logits_spec: LogitsSpec | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = frozenset() if sampling_params.ignore_eos else eos_token_ids
        self.stop_token_ids = frozenset(sampling_params.stop_token_ids or ())
        self.sampling_seed = sampling_seed
        self.max_model_len = max_model_len
        self.token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        # One block table per KV cache group (`kv_groups.py`); group 0's is `block_ids`.
        self.block_tables: list[list[int]] = [[] for _ in range(num_kv_groups)]
        self.block_hashes: list[bytes] = []  # chain hash of each full block of token_ids
        self.num_cached_blocks = 0  # leading blocks registered in the prefix cache
        self.num_preemptions = 0
        # KV transfer bookkeeping.
        self.connector_consulted = False  # asked the connector since (re)start
        self.num_kv_load_failures = 0
        self.pending_external: tuple[int, int] | None = None  # token range being loaded
        # What the connector returned for the request when it ended (a P2P reference).
        self.kv_transfer_params: dict | None = None
        # Valid loaded token ranges above num_computed_tokens that recovery kept after a
        # hole (scope "blocks", `recompute_gaps.py`): skipped, not computed, when reached.
        self.kept_ranges: list[tuple[int, int]] = []
        self.error: str | None = None
        self.error_type: str | None = None  # see RequestOutput.error_type
        # Sampling beyond the token: processors, logprobs, the choices of `n`.
        self.choice_index = choice_index
        self.logits_spec = logits_spec
        self.output_logprobs: list[TokenLogprob] | None = (
            None if sampling_params.logprobs is None else [])
        # Only choice 0 scores the prompt (so the other choices may share its blocks).
        self.prompt_logprobs: list[TokenLogprob | None] | None = (
            None if sampling_params.prompt_logprobs is None or choice_index
            else [None] * len(prompt_token_ids))
        # A choice of `n` waits for this sibling's prompt KV (then finds it in the prefix
        # cache) instead of computing the same prompt beside it; cleared once admitted.
        self.prefill_after: Request | None = None
        # Structured outputs: the matcher, advanced by every appended token (the engine
        # sets it when the request has `sampling_params.structured_outputs`).
        self.grammar: GrammarState | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def needs_every_prompt_position(self) -> bool:
        """True when every prompt position must be computed here (its logits score the
        next prompt token): no prefix-cache hits and no connector loads for it."""
        return self.prompt_logprobs is not None

    @property
    def waits_for_sibling(self) -> bool:
        """True while the sibling choice it follows is still computing the prompt."""
        sibling = self.prefill_after
        return sibling is not None and not sibling.is_finished and \
            sibling.num_computed_tokens < sibling.num_prompt_tokens

    @property
    def block_ids(self) -> list[int]:
        """Group 0's block table (a model without windows has only that one)."""
        return self.block_tables[0]

    @block_ids.setter
    def block_ids(self, block_ids: list[int]) -> None:
        self.block_tables[0] = block_ids

    @property
    def holds_blocks(self) -> bool:
        """Whether any group's block table is non-empty."""
        return any(self.block_tables)

    @property
    def pending_range(self) -> tuple[int, int]:
        """The token range of the KV load in flight; only for a request with one."""
        if self.pending_external is None:
            raise RuntimeError(f"request {self.request_id} has no KV load in flight")
        return self.pending_external

    def restart(self) -> None:
        """Start over once the scheduler released all the request's blocks (preemption,
        or making room for another request): nothing is computed any more and the
        connector may be asked for the KV again (within the retry bound)."""
        if self.holds_blocks:
            raise RuntimeError(f"request {self.request_id} restarts while holding blocks")
        self.num_computed_tokens = 0
        self.num_cached_blocks = 0
        self.pending_external = None
        self.kept_ranges = []
        self.connector_consulted = False

    def append_output_token(self, token_id: int, logprob: TokenLogprob | None = None) -> None:
        """Record a sampled token (and its logprobs, when the request asks for them) and
        set a finished status if it ends the request."""
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)
        if self.output_logprobs is not None and logprob is not None:
            self.output_logprobs.append(logprob)
        if self.grammar is not None and self._grammar_ends(token_id):
            return
        if token_id in self.eos_token_ids or token_id in self.stop_token_ids:
            self.status = RequestStatus.FINISHED_STOPPED
        elif len(self.output_token_ids) >= self.sampling_params.max_tokens:
            self.status = RequestStatus.FINISHED_LENGTH
        elif self.num_tokens >= self.max_model_len:
            self.status = RequestStatus.FINISHED_LENGTH

    def _grammar_ends(self, token_id: int) -> bool:
        """Advance the grammar past `token_id`; True when that ends the request: the
        grammar is complete (stopped), or it forbids the token (an error: the sampler
        masks what the grammar forbids, so only a bug gets here)."""
        grammar = self.grammar
        if grammar is None:
            return False
        if not grammar.accept(token_id):
            self.status = RequestStatus.FINISHED_ERROR
            self.error = f"sampled token {token_id}, which the request's grammar forbids"
            self.error_type = "internal_error"
            return True
        if grammar.is_terminated:
            self.status = RequestStatus.FINISHED_STOPPED
            return True
        return False

    def next_sample_seed(self, output_index: int | None = None) -> int:
        """Seed for the token at `output_index` (default: the next one): a pure
        function of the request seed and the output position, so a token
        recomputed after a failure is resampled identically."""
        if output_index is None:
            output_index = len(self.output_token_ids)
        return sample_seed(self.sampling_seed, output_index)
