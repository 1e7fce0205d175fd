"""Per-request logits processors on the device: penalties, biases and bans.

Every request with a `LogitsSpec` holds a slot of device state, made the first time
it samples: its output token counts, which tokens its prompt holds, a dense bias row
(`logit_bias`, -inf outside `allowed_token_ids` and on bad words of one token), the
ids `min_tokens` bans, and its three penalties. `apply` processes a step's rows in
one batch of tensor ops (vLLM's order: biases and bans, then repetition, frequency
and presence penalties); `count` adds the step's sampled tokens to the counts on the
device, so an overlapped step needs nothing from the host. The counts stay exact
across recovery and preemption: a slot knows how many outputs it counted, and a
request that samples at another output index (its last token was discarded) has
its counts rebuilt from its outputs on the host. A slot is freed when its request
finishes (`release`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrecover.step_messages import LogitsSpec, ScheduledRequest

INITIAL_SLOTS = 8


@dataclass
class _Slot:
    index: int
    num_counted: int  # outputs whose tokens `counts` holds


class LogitsProcessors:
    """The device state of every request with logits processors, and the batched ops."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.vocab_size = 0
        self.capacity = 0
        self.slots: dict[str, _Slot] = {}
        self._free: list[int] = []
        empty = torch.empty(0, 0, device=device)
        self.counts = empty.int()  # [slots, V] how often each output holds each token
        self.in_prompt = empty.bool()  # [slots, V] whether the prompt holds it
        self.bias = empty  # [slots, V] logit_bias, -inf where banned or not allowed
        self.min_tokens_banned = empty.bool()  # [slots, V] banned before min_tokens
        self.penalties = empty  # [slots, 3] presence, frequency, repetition
        # The rows and slots of the last `apply`, which `count` updates.
        self._applied: tuple[torch.Tensor, torch.Tensor, list[_Slot]] | None = None

    def apply(self, logits: torch.Tensor, rows: list[ScheduledRequest]) -> torch.Tensor:
        """`logits` [B, V] (row i sampled for `rows[i]`) with every row's processors
        applied; the input is left as it is (its raw values give the logprobs)."""
        self._applied = None
        active = [(row, s) for row, s in enumerate(rows) if s.logits_spec is not None]
        if not active:
            return logits
        if self.vocab_size != logits.shape[-1]:
            self._reset(logits.shape[-1])
        slots = [self._slot_for(s) for _, s in active]
        row_index = torch.tensor([row for row, _ in active], device=self.device)
        slot_index = torch.tensor([slot.index for slot in slots], device=self.device)
        before_min = torch.tensor([_before_min_tokens(s) for _, s in active], device=self.device)
        x = logits.index_select(0, row_index) + self.bias.index_select(0, slot_index)
        banned = self.min_tokens_banned.index_select(0, slot_index) & before_min[:, None]
        x = x.masked_fill(banned, float("-inf"))
        bad = _bad_word_bans([s for _, s in active])
        if bad is not None:
            x[torch.tensor(bad[0], device=self.device),
              torch.tensor(bad[1], device=self.device)] = float("-inf")
        counts = self.counts.index_select(0, slot_index)
        penalties = self.penalties.index_select(0, slot_index)
        in_output = counts > 0
        seen = in_output | self.in_prompt.index_select(0, slot_index)
        repetition = penalties[:, 2:3]
        x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
        x = x - penalties[:, 1:2] * counts - penalties[:, 0:1] * in_output
        self._applied = (row_index, slot_index, slots)
        return logits.index_copy(0, row_index, x)

    def count(self, tokens: torch.Tensor) -> None:
        """Add the tokens sampled from the last `apply`'s logits ([B], on the device)
        to their requests' counts."""
        if self._applied is None:
            return
        row_index, slot_index, slots = self._applied
        self._applied = None
        sampled = tokens.index_select(0, row_index).long()
        self.counts.index_put_((slot_index, sampled),
                               torch.ones_like(sampled, dtype=self.counts.dtype),
                               accumulate=True)
        for slot in slots:
            slot.num_counted += 1

    def release(self, request_ids: set[str]) -> None:
        """Free the slots of finished requests."""
        for request_id in request_ids:
            slot = self.slots.pop(request_id, None)
            if slot is not None:
                self._free.append(slot.index)

    # ----- state ----------------------------------------------------------------------
    def _reset(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.slots.clear()
        self._free = []
        self.capacity = 0
        self._grow(INITIAL_SLOTS)

    def _grow(self, capacity: int) -> None:
        vocab, device, old = self.vocab_size, self.device, self.capacity
        grown = {
            "counts": torch.zeros((capacity, vocab), dtype=torch.int32, device=device),
            "in_prompt": torch.zeros((capacity, vocab), dtype=torch.bool, device=device),
            "bias": torch.zeros((capacity, vocab), dtype=torch.float32, device=device),
            "min_tokens_banned": torch.zeros((capacity, vocab), dtype=torch.bool,
                                             device=device),
            "penalties": torch.zeros((capacity, 3), dtype=torch.float32, device=device),
        }
        for name, tensor in grown.items():
            if old:
                tensor[:old] = getattr(self, name)
            setattr(self, name, tensor)
        self._free.extend(range(capacity - 1, old - 1, -1))
        self.capacity = capacity

    def _slot_for(self, item: ScheduledRequest) -> _Slot:
        slot = self.slots.get(item.request_id)
        if slot is None:
            if not self._free:
                self._grow(self.capacity * 2)
            slot = self.slots[item.request_id] = _Slot(self._free.pop(), -1)
            self._write_static(slot.index, item.logits_spec)  # type: ignore[arg-type]
        if slot.num_counted != item.num_output_tokens:
            outputs = item.output_token_ids
            if outputs is None or len(outputs) < item.num_output_tokens:
                raise RuntimeError(f"request {item.request_id}: its output tokens are not on "
                                   "the host to rebuild its penalty counts")
            resumed = item.logits_spec.resumed_output_token_ids  # type: ignore[union-attr]
            counted = torch.tensor(resumed + outputs[: item.num_output_tokens], dtype=torch.long)
            self.counts[slot.index] = torch.bincount(counted, minlength=self.vocab_size)[
                : self.vocab_size].to(self.device, torch.int32)
            slot.num_counted = item.num_output_tokens
        return slot

    def _write_static(self, index: int, spec: LogitsSpec) -> None:
        vocab = self.vocab_size
        bias = torch.zeros(vocab, dtype=torch.float32)
        if spec.logit_bias:
            ids = torch.tensor(list(spec.logit_bias), dtype=torch.long)
            bias[ids] = torch.tensor(list(spec.logit_bias.values()), dtype=torch.float32)
        if spec.allowed_token_ids is not None:
            allowed = torch.zeros(vocab, dtype=torch.bool)
            allowed[torch.tensor(spec.allowed_token_ids, dtype=torch.long)] = True
            bias = bias.masked_fill(~allowed, float("-inf"))
        if spec.banned_token_ids:
            bias[torch.tensor(spec.banned_token_ids, dtype=torch.long)] = float("-inf")
        self.bias[index] = bias.to(self.device)
        self.in_prompt[index] = _id_mask(spec.prompt_token_ids, vocab).to(self.device)
        self.min_tokens_banned[index] = _id_mask(spec.min_tokens_banned, vocab).to(self.device)
        self.penalties[index] = torch.tensor(
            [spec.presence_penalty, spec.frequency_penalty, spec.repetition_penalty])
        self.counts[index] = 0


def _before_min_tokens(item: ScheduledRequest) -> bool:
    spec = item.logits_spec
    if spec is None:
        return False
    return len(spec.resumed_output_token_ids) + item.num_output_tokens < spec.min_tokens


def _id_mask(token_ids: list[int], vocab_size: int) -> torch.Tensor:
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    if token_ids:
        mask[torch.tensor(token_ids, dtype=torch.long)] = True
    return mask


def _bad_word_bans(items: list[ScheduledRequest]) -> tuple[list[int], list[int]] | None:
    """(rows, token ids) banned because the outputs end with all but the last token of
    a bad word of several tokens (vLLM's rule); None when nothing is banned."""
    rows: list[int] = []
    tokens: list[int] = []
    for row, item in enumerate(items):
        spec = item.logits_spec
        if spec is None or not spec.bad_word_sequences:
            continue
        own = item.output_token_ids or []
        if len(own) != item.num_output_tokens:
            raise RuntimeError(f"request {item.request_id}: bad words need its outputs on "
                               "the host")
        outputs = spec.resumed_output_token_ids + own
        for sequence in spec.bad_word_sequences:
            prefix = sequence[:-1]
            if len(outputs) >= len(prefix) and outputs[len(outputs) - len(prefix):] == prefix:
                rows.append(row)
                tokens.append(sequence[-1])
    return (rows, tokens) if rows else None
