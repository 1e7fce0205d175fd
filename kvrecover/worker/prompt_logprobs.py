"""Logprobs into the step's output: the sampled tokens', and the prompt tokens'.

A request that asks for prompt logprobs has the logits of its prompt rows computed
(only those rows: the LM head runs on them alone), so each prompt token is scored
by the position before it; the first prompt token has none. A slice scores the
prompt tokens after its positions, up to the prompt's last token (the position of
that one samples the first output instead).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvrecover.step_messages import ModelRunnerOutput, ScheduledRequest
from kvrecover.worker.logprobs import TokenLogprobRows, token_logprobs
from kvrecover.worker.sampler import SampledRows


def add_logprobs(output: ModelRunnerOutput, sampled: SampledRows,
                 request_ids: list[str]) -> None:
    """Put the sampled tokens' logprobs (rows of `request_ids`) into `output`; reads
    the device, so call it once the step's tokens were read."""
    if sampled.logprobs is None:
        return
    for row, record in zip(sampled.logprobs.rows, sampled.logprobs.to_host()):
        if row not in sampled.errors:
            output.logprobs[request_ids[row]] = record


def num_prompt_rows(item: ScheduledRequest) -> int:
    """How many leading rows of the slice score a prompt token (each the next one)."""
    prompt = item.prompt_token_ids
    if prompt is None:
        return 0
    return max(0, min(len(item.token_ids), len(prompt) - 1 - item.num_computed_tokens))


@dataclass
class PendingPromptLogprobs:
    """A step's prompt logprobs, still on the device."""

    rows: TokenLogprobRows
    spans: list[tuple[str, int, int]]  # request id, first prompt index scored, count

    def add_to(self, output: ModelRunnerOutput) -> None:
        """Read them (once the step's tokens were read) into `output`."""
        records = self.rows.to_host()
        at = 0
        for request_id, first_index, count in self.spans:
            output.prompt_logprobs[request_id] = (first_index, records[at : at + count])
            at += count


def score_prompt_tokens(
    scheduled: list[ScheduledRequest], hidden: torch.Tensor,
    logits_of: Callable[[torch.Tensor], torch.Tensor | None],
) -> PendingPromptLogprobs | None:
    """Score the prompt tokens of this step's slices that ask for prompt logprobs:
    `hidden` holds the step's flat rows in `scheduled` order, `logits_of` is the LM
    head (a collective under tensor parallelism: every rank calls it, rank 0 gets the
    logits); None when no slice asks, or off rank 0."""
    rows: list[int] = []
    targets: list[int] = []
    num_top: list[int] = []
    spans: list[tuple[str, int, int]] = []
    offset = 0
    for item in scheduled:
        count = num_prompt_rows(item)
        if count and item.prompt_token_ids is not None:
            start = item.num_computed_tokens
            rows.extend(range(offset, offset + count))
            targets.extend(item.prompt_token_ids[start + 1 : start + 1 + count])
            num_top.extend([item.sampling_params.prompt_logprobs or 0] * count)
            spans.append((item.request_id, start + 1, count))
        offset += len(item.token_ids)
    if not rows:
        return None
    device = hidden.device
    logits = logits_of(hidden[torch.tensor(rows, device=device)])
    if logits is None:
        return None  # a tensor-parallel rank other than 0: rank 0 scores them
    scored = token_logprobs(logits, torch.tensor(targets, device=device),
                            list(range(len(rows))), num_top)
    return PendingPromptLogprobs(scored, spans)
