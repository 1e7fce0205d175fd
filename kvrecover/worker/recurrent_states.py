"""The recurrent states of a hybrid model's linear-attention layers, one slot per request.

A request gets a slot the first time a step schedules it and gives it back when
it ends (the step's `finished_request_ids`) or is preempted
(`preempted_request_ids`). A step that starts a request at position 0 (its
first, or a recomputation from scratch after a preemption) zeroes its slot; one
with `restore_checkpoint` (a prefix-cache hit) starts from that checkpoint; any
other step must continue exactly where the slot's state stands, else the step
is refused (`RecurrentStateError`) rather than computed on a state of another
position. The pool starts with `initial_slots` slots and grows by doubling when
every slot is taken; memory per request is `bytes_per_request`. On a GPU the
model runner asks for every sequence slot up front (`max_num_seqs`), so the KV
cache is sized around the states and no step ever grows the pool.

A connector whose load failed may also leave a request a *resume state*: the stored
state at an earlier block boundary of its load (`keep_resume_state`, rule 8), which
the request's next slice starting exactly there continues from; any slice starting
there or at 0 uses it up, and it goes with the request's slot.

Checkpoints (`num_checkpoints` slots, which boundary goes where being the
scheduler's decision, `engine/state_checkpoints.py`) hold the checkpointed
states (conv and recurrent, not a partial chunk's inputs) at one block boundary
each; `bytes_per_checkpoint` each, allocated once.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

from kvrecover.models.recurrent_state import RecurrentLayerStep, RequestRows, StateSpec
from kvrecover.step_messages import ScheduledRequest

INITIAL_SLOTS = 4


def request_state_bytes(specs: dict[int, list[StateSpec]], dtype: torch.dtype) -> int:
    """Bytes of one request's states over every recurrent layer of `specs`."""
    return sum(math.prod(spec.shape) * (spec.dtype or dtype).itemsize
               for layer_specs in specs.values() for spec in layer_specs)


class RecurrentStateError(RuntimeError):
    """A step asked for a request's state at a position its slot does not hold."""


class RecurrentStates:
    """The per-request state tensors of every recurrent layer, and who holds which slot."""

    def __init__(self, specs: dict[int, list[StateSpec]], dtype: torch.dtype,
                 device: torch.device, chunk_size: int, num_checkpoints: int = 0,
                 initial_slots: int = INITIAL_SLOTS) -> None:
        if initial_slots < 1:
            raise ValueError(f"initial_slots must be >= 1, got {initial_slots}")
        self.specs = specs
        self.dtype = dtype
        self.device = device
        self.chunk_size = chunk_size
        self.tensors: dict[int, dict[str, torch.Tensor]] = {
            layer: {spec.name: self._zeros(spec, initial_slots) for spec in layer_specs}
            for layer, layer_specs in specs.items()
        }
        self.num_slots = initial_slots
        self.slots: dict[str, int] = {}
        self.free: list[int] = list(range(initial_slots - 1, -1, -1))
        self.positions: list[int] = [0] * initial_slots  # tokens each slot's state has seen
        # request id -> (position, `read_checkpoint`-form payload) to resume from.
        self.resume_states: dict[str, tuple[int, bytes]] = {}
        self.checkpoints: dict[int, dict[str, torch.Tensor]] = {
            layer: {spec.name: self._zeros(spec, num_checkpoints)
                    for spec in layer_specs if spec.checkpointed}
            for layer, layer_specs in specs.items()
        }

    @property
    def bytes_per_checkpoint(self) -> int:
        """Bytes of one checkpoint over every recurrent layer."""
        return sum(math.prod(spec.shape) * (spec.dtype or self.dtype).itemsize
                   for layer_specs in self.specs.values() for spec in layer_specs
                   if spec.checkpointed)

    @property
    def bytes_per_request(self) -> int:
        """Bytes of one request's states over every recurrent layer."""
        return request_state_bytes(self.specs, self.dtype)

    @property
    def state_signature(self) -> str:
        """The checkpointed states' layers, names, shapes and dtypes (a stored state's
        fingerprint, `kv_transfer/stores/state_entries.py`)."""
        return ";".join(f"{layer}:{spec.name}:{tuple(spec.shape)}:{spec.dtype or self.dtype}"
                        for layer, layer_specs in sorted(self.specs.items())
                        for spec in layer_specs if spec.checkpointed)

    def _checkpointed(self) -> list[tuple[int, str]]:
        return [(layer, spec.name) for layer, layer_specs in sorted(self.specs.items())
                for spec in layer_specs if spec.checkpointed]

    def read_checkpoint(self, slot: int) -> bytes:
        """Checkpoint slot `slot`'s states, layer by layer, as raw bytes (a connector
        stores them; called after the step that wrote the slot)."""
        return b"".join(self.checkpoints[layer][name][slot].contiguous().cpu()
                        .view(torch.uint8).numpy().tobytes()
                        for layer, name in self._checkpointed())

    def install(self, request_id: str, position: int, payload: bytes | None) -> None:
        """Make `payload` (`read_checkpoint`'s form; None: zeros) the request's state at
        `position`: a connector calls it for a request whose KV it loaded up to there,
        before the request's next slice runs. Takes the request's slot if it has none."""
        self._check_size(payload)
        self._write(self._slot_of(request_id), position, payload)

    def keep_resume_state(self, request_id: str, position: int, payload: bytes) -> None:
        """Keep `payload` (`read_checkpoint`'s form) as the request's state at block
        boundary `position`, for its next slice if that starts there (a connector's load
        that failed after `position` calls it; the request's slot is left as it is)."""
        self._check_size(payload)
        self.resume_states[request_id] = (position, payload)

    def _check_size(self, payload: bytes | None) -> None:
        if payload is not None and len(payload) != self.bytes_per_checkpoint:
            raise ValueError(f"a stored state of {len(payload)} bytes, not the "
                             f"{self.bytes_per_checkpoint} of this model's states")

    def _write(self, slot: int, position: int, payload: bytes | None) -> None:
        """Zero `slot`'s states, copy `payload`'s checkpointed ones in, set its position."""
        for tensors in self.tensors.values():
            for tensor in tensors.values():
                tensor[slot].zero_()
        if payload is not None:
            offset = 0
            for layer, name in self._checkpointed():
                target = self.tensors[layer][name][slot]
                size = target.nbytes
                raw = torch.frombuffer(bytearray(payload[offset : offset + size]), dtype=torch.uint8)
                target.copy_(raw.view(target.dtype).view(target.shape))
                offset += size
        self.positions[slot] = position

    def _zeros(self, spec: StateSpec, slots: int) -> torch.Tensor:
        return torch.zeros((slots, *spec.shape), dtype=spec.dtype or self.dtype,
                           device=self.device)

    def release(self, request_ids: Iterable[str]) -> None:
        """Give back the slots of requests that ended or were preempted."""
        for request_id in request_ids:
            self.resume_states.pop(request_id, None)
            slot = self.slots.pop(request_id, None)
            if slot is not None:
                self.free.append(slot)

    def _slot_of(self, request_id: str) -> int:
        slot = self.slots.get(request_id)
        if slot is None:
            if not self.free:
                self._grow()
            slot = self.slots[request_id] = self.free.pop()
        return slot

    def _grow(self) -> None:
        """Double the pool (states keep their slots)."""
        added = self.num_slots
        for layer, layer_specs in self.specs.items():
            for spec in layer_specs:
                tensors = self.tensors[layer]
                tensors[spec.name] = torch.cat((tensors[spec.name], self._zeros(spec, added)))
        self.free.extend(range(self.num_slots + added - 1, self.num_slots - 1, -1))
        self.positions.extend([0] * added)
        self.num_slots += added

    def step(self, scheduled: Sequence[ScheduledRequest]) -> dict[int, RecurrentLayerStep]:
        """Each recurrent layer's record of this step (`advance`'s rows)."""
        return self.layer_steps(self.advance(scheduled))

    def advance(self, scheduled: Sequence[ScheduledRequest]) -> list[RequestRows]:
        """The step's request rows: takes slots, zeroes or restores the states of
        requests that start at 0 or from a checkpoint, and advances every slot's position
        to the end of its request's tokens (the step computes them, or its requests end)."""
        requests: list[RequestRows] = []
        row = 0
        for item in scheduled:
            slot = self._slot_of(item.request_id)
            position, count = item.num_computed_tokens, len(item.token_ids)
            resume = self.resume_states.get(item.request_id)
            if resume is not None and position in (0, resume[0]):
                del self.resume_states[item.request_id]  # used up, or never to be
            if position == 0 or item.restore_checkpoint is not None:
                self._reset(slot, item.restore_checkpoint)
            elif self.positions[slot] != position and resume is not None and resume[0] == position:
                self._write(slot, position, resume[1])
            elif self.positions[slot] != position:
                raise RecurrentStateError(
                    f"request {item.request_id!r} continues at position {position}, but its "
                    f"recurrent state stands at {self.positions[slot]}")
            requests.append(RequestRows(row, row + count, position, slot,
                                        tuple(item.save_checkpoints)))
            self.positions[slot] = position + count
            row += count
        return requests

    def layer_steps(self, requests: Sequence[RequestRows]) -> dict[int, RecurrentLayerStep]:
        """Each recurrent layer's record of a step of `requests` (one list for all layers;
        a graphed step passes its prebuilt plan's list)."""
        return {layer: RecurrentLayerStep(tensors, requests, self.chunk_size,  # type: ignore[arg-type]
                                          self.checkpoints[layer])
                for layer, tensors in self.tensors.items()}

    def _reset(self, slot: int, checkpoint: int | None) -> None:
        """Zero `slot`'s states, then (with `checkpoint`) copy that checkpoint's in."""
        for layer, tensors in self.tensors.items():
            for name, tensor in tensors.items():
                saved = self.checkpoints[layer].get(name)
                if checkpoint is None or saved is None:
                    tensor[slot].zero_()
                else:
                    tensor[slot].copy_(saved[checkpoint])

