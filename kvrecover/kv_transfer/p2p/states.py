"""A hybrid model's recurrent states over NIXL: the state at the end of a kept prompt.

A hybrid's KV is of no use to a consumer without the linear-attention layers' state at
the boundary its claim ends at (rule 8), so the NixlConnector moves one state per kept
prompt beside its blocks, as the store connectors do (`stores/store_states.py`) but
without a store:

Producer. The scheduler role (`StateCaptures`) notes the checkpoint slot that holds each
prompt's state at its last loadable block boundary (`kv_layout.stores_state_at`: the
engine gives that boundary a slot first) in the step that writes or reaches it; the
worker copies it out after that step (`HeldStates.capture`). When the prompt is kept,
its reference says the boundary (`RemoteReference.state_block`) and the worker moves
the copy into a slot of a state pool registered with NIXL when the worker registered
(`max_held_states` slots, allocated up front on the cache's device, so that a pull
reads blocks and state from one kind of memory: memory registered after a consumer's
handshake would be unknown to it), checksummed (xxh3). A pull's check answers the
state's address, size and checksum with the blocks' checksums (`describe`); the slot is
freed with the blocks, on release or when the lease ends. A prompt whose state gets no
slot (the pool is full, or it was not captured) is not kept at all: a consumer's claim
ends at the state boundary (`claim_end`), so no block of it is of use without the state;
its blocks are freed at once (reported in `finished_sending` with the next step) and a
check of its reference is refused without a wait, so consumers recompute the prompt.

Consumer. A claim ends exactly at the reference's state boundary (none without one).
The state is READ in the same NIXL transfer as the step's blocks, into staging rows
after theirs (`chunks`), then verified (`verify`); the worker installs it where a store
connector's loaded state goes (`RecurrentStateAccess.install`) on the engine's thread:
at once for a sync pull, with `get_finished` for an async one (the state tensors may
grow, never under a running step). A state that is missing, refused or fails its
checksum is installed as zeros and the claim's last block is reported invalid, so
recovery rolls the request back to a checkpoint it holds, or 0 (the store connectors'
rule, without resume states: `keeps_resume_states` is False).

The side channel could carry the state instead (one JSON message), but a real hybrid's
state is tens of MB per prompt, past its message bound and far slower as hex; a READ of
registered memory costs one more descriptor list entry per row.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import xxhash

if TYPE_CHECKING:
    from kvrecover.kv_transfer.request_view import KVRequestView
    from kvrecover.kv_transfer.stores.state_entries import RecurrentStateAccess
    from kvrecover.step_messages import SchedulerOutput

logger = logging.getLogger(__name__)

ROW_ALIGN = 64  # each pool slot starts on a cache line


def claim_end(state_block: int | None, first: int, end: int) -> int:
    """Where a hybrid's claim of blocks [first, end) ends: at the reference's state
    boundary if it lies in (first, end], else nowhere (`first`)."""
    if state_block is None or not first < state_block <= end:
        return first
    return state_block


# ----- producer: scheduler role ---------------------------------------------------------
class StateCaptures:
    """Which checkpoint slot holds each prompt's state at its last loadable boundary."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._prompts: dict[str, int] = {}  # request id -> prompt length
        self._captured: dict[str, int] = {}  # request id -> the captured state's position

    def track(self, request: KVRequestView) -> None:
        """A new request (`update_state_after_alloc`, once per request)."""
        self._prompts[request.request_id] = request.num_prompt_tokens

    def plan(self, scheduler_output: SchedulerOutput) -> list[tuple[str, int, int]]:
        """(request id, checkpoint slot, position) of each state the step's worker copies
        out after the step: those of the prompts' last loadable boundaries it writes or
        reaches."""
        captures = []
        for item in scheduler_output.scheduled:
            num_prompt_tokens = self._prompts.get(item.request_id)
            if num_prompt_tokens is None:
                continue
            wanted = (num_prompt_tokens - 1) // self.block_size * self.block_size
            for position, slot in item.save_checkpoints + item.held_checkpoints:
                if position == wanted > 0:
                    captures.append((item.request_id, slot, position))
                    self._captured[item.request_id] = position
                    break
        return captures

    def finished(self, request_id: str) -> int | None:
        """The request ended: the position of its captured state, if one was."""
        self._prompts.pop(request_id, None)
        return self._captured.pop(request_id, None)


# ----- producer: worker role ------------------------------------------------------------
@dataclass
class _HeldState:
    slot: int
    position: int
    checksum: int


class HeldStates:
    """The producer's kept states: captured copies, and the registered pool the kept
    prompts' states are read from. Captures run on the engine's thread; `hold`,
    `release` and `describe` under the connector's lock."""

    def __init__(self, agent: Any, states: RecurrentStateAccess, num_slots: int,
                 device: torch.device | str = "cpu") -> None:
        self.states = states
        self.nbytes = states.bytes_per_checkpoint
        self.stride = math.ceil(self.nbytes / ROW_ALIGN) * ROW_ALIGN
        self.pool = torch.zeros(num_slots, self.stride, dtype=torch.uint8, device=device)
        self.registration = agent.register_memory([self.pool])
        self._free = list(range(num_slots - 1, -1, -1))
        self._pending: dict[str, tuple[int, bytes]] = {}  # request id -> (position, state)
        self._held: dict[str, _HeldState] = {}  # reference handle -> its state

    def capture(self, captures: list[tuple[str, int, int]]) -> None:
        """Copy the states these checkpoint slots hold (after the step that wrote them)."""
        for request_id, slot, position in captures:
            self._pending[request_id] = (position, self.states.read_checkpoint(slot))

    def drop(self, request_ids: list[str]) -> None:
        """These requests ended without a kept state: forget their copies."""
        for request_id in request_ids:
            self._pending.pop(request_id, None)

    def hold(self, handle: str, request_id: str, position: int) -> bool:
        """Keep the request's captured state at `position` for the reference `handle`;
        False if it was not captured there, or every slot is taken (the caller then
        keeps none of the prompt's blocks either)."""
        pending = self._pending.pop(request_id, None)
        if pending is None or pending[0] != position:
            logger.warning("request %s: no recurrent state at %d to keep; its blocks are "
                           "not kept and its pulls recompute", request_id, position)
            return False
        if not self._free:
            logger.warning("request %s: every one of max_held_states=%d state slots is "
                           "held; its blocks are not kept and its pulls recompute",
                           request_id, self.pool.shape[0])
            return False
        slot = self._free.pop()
        self.pool[slot, :self.nbytes].copy_(torch.frombuffer(bytearray(pending[1]),
                                                             dtype=torch.uint8))
        self._held[handle] = _HeldState(slot, position, xxhash.xxh3_64_intdigest(pending[1]))
        return True

    def release(self, handle: str) -> None:
        """The reference ended (released or expired): its slot is free again."""
        held = self._held.pop(handle, None)
        if held is not None:
            self._free.append(held.slot)

    def __len__(self) -> int:
        return len(self._held)

    def describe(self, handle: str, position: Any) -> dict[str, int] | None:
        """The check answer's `state` for a pull that ends at `position`: where the state
        lies, its size and checksum; None if the reference keeps none there."""
        held = self._held.get(handle)
        if held is None or held.position != position:
            return None
        return {"address": self.pool[held.slot].data_ptr(), "nbytes": self.nbytes,
                "checksum": held.checksum, "position": held.position}

    def close(self, agent: Any) -> None:
        """Deregister the pool (shutdown)."""
        try:
            agent.deregister_memory(self.registration)
        except Exception as error:  # noqa: BLE001 - a closing agent
            logger.debug("state pool deregistration failed: %r", error)


# ----- consumer: worker role ------------------------------------------------------------
@dataclass(frozen=True)
class RemoteState:
    """A check's answer about the state of a pull: in the producer's registered pool at
    `address`, `nbytes` long, of xxh3 `checksum`."""

    address: int
    nbytes: int
    checksum: int


def parse_remote_state(answer: Any, position: int, nbytes: int) -> RemoteState | None:
    """The state a check answered, if it is the one asked for and of this model's size."""
    if not isinstance(answer, dict):
        return None
    values = [answer.get(k) for k in ("address", "nbytes", "checksum", "position")]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        return None
    address, size, checksum, at = (int(v) for v in values)  # type: ignore[arg-type]
    if size != nbytes or at != position:
        return None
    return RemoteState(address, size, checksum)


def num_rows(state: RemoteState, row_nbytes: int) -> int:
    """Staging rows the state takes."""
    return math.ceil(state.nbytes / row_nbytes)


def chunks(state: RemoteState, local_base: int, first_row: int, row_nbytes: int,
           local_device: int = 0, remote_device: int = 0
           ) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """The (local, remote) READ descriptors of `state` (on `remote_device`) into staging
    rows from `first_row` on (a buffer at `local_base` on `local_device`, of rows
    `row_nbytes` long)."""
    local, remote = [], []
    for i in range(num_rows(state, row_nbytes)):
        length = min(row_nbytes, state.nbytes - i * row_nbytes)
        local.append((local_base + (first_row + i) * row_nbytes, length, local_device))
        remote.append((state.address + i * row_nbytes, length, remote_device))
    return local, remote


def verify(state: RemoteState, rows: torch.Tensor) -> bytes | None:
    """The state in its staged `rows` (read as `chunks` laid them out), None if it fails
    its checksum."""
    payload = rows.reshape(-1)[:state.nbytes].cpu().numpy().tobytes()
    return payload if xxhash.xxh3_64_intdigest(payload) == state.checksum else None
