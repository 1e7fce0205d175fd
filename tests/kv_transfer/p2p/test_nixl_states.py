"""A hybrid's recurrent states over NIXL, model-free (`kv_transfer/p2p/states.py`): the
reference's state boundary, which checkpoint a producer copies out, its kept states'
pool (full, released, described), and the consumer's staging rows and checksum."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
import xxhash

from kvrecover.kv_transfer.p2p.params import RemoteReference, parse_reference
from kvrecover.kv_transfer.p2p.states import (
    HeldStates,
    RemoteState,
    StateCaptures,
    chunks,
    claim_end,
    parse_remote_state,
    verify,
)
from kvrecover.step_messages import SchedulerOutput

STATE_NBYTES = 300


def reference(state_block: int | None) -> RemoteReference:
    return RemoteReference("e", "r@1", ((5, 6, 7, 8),), "127.0.0.1", 5600, 1, "f" * 16,
                           state_block=state_block)


def test_the_state_boundary_round_trips_and_is_checked():
    assert parse_reference(reference(3).as_params()).state_block == 3
    assert "kv_state_block" not in reference(None).as_params()
    assert parse_reference(reference(None).as_params()).state_block is None
    for bad in (0, 5, True, "3"):
        params = reference(3).as_params() | {"kv_state_block": bad}
        with pytest.raises(ValueError, match="kv_state_block"):
            parse_reference(params)


def test_a_claim_ends_exactly_at_the_state_boundary():
    assert claim_end(5, 0, 7) == 5  # the blocks after the state are of no use
    assert claim_end(7, 0, 7) == 7
    assert claim_end(8, 0, 7) == 0  # the state lies past what the prompt loads
    assert claim_end(3, 3, 7) == 3  # already computed here
    assert claim_end(None, 2, 7) == 2


@dataclass
class Item:
    request_id: str
    save_checkpoints: list = field(default_factory=list)
    held_checkpoints: list = field(default_factory=list)


@dataclass
class View:
    request_id: str
    num_prompt_tokens: int


def test_a_producer_copies_out_the_checkpoint_of_the_last_loadable_boundary():
    captures = StateCaptures(block_size=8)
    captures.track(View("a", 61))  # last loadable boundary: 56
    captures.track(View("b", 45))  # 40
    captures.track(View("c", 5))  # none
    output = SchedulerOutput([Item("a", save_checkpoints=[(48, 1), (56, 0)]),
                              Item("b", held_checkpoints=[(40, 3)]),
                              Item("c"), Item("untracked", save_checkpoints=[(8, 2)])])
    assert captures.plan(output) == [("a", 0, 56), ("b", 3, 40)]
    assert captures.finished("a") == 56
    assert captures.finished("a") is None and captures.finished("c") is None


class FakeStates:
    bytes_per_checkpoint = STATE_NBYTES

    def read_checkpoint(self, slot: int) -> bytes:
        return bytes([slot]) * STATE_NBYTES


class FakeAgent:
    def __init__(self) -> None:
        self.registered: list[torch.Tensor] = []

    def register_memory(self, tensors: list[torch.Tensor]) -> str:
        self.registered += tensors
        return "registration"

    def deregister_memory(self, registration: str) -> None:
        self.registered.clear()


def test_kept_states_take_pool_slots_until_released():
    agent = FakeAgent()
    held = HeldStates(agent, FakeStates(), num_slots=1)  # type: ignore[arg-type]
    assert agent.registered == [held.pool]  # registered up front, before any handshake
    held.capture([("a", 4, 56), ("b", 5, 40)])
    held.hold("a@1", "a", 56)
    held.hold("b@1", "b", 40)  # the pool is full: b keeps no state
    assert len(held) == 1 and held.describe("b@1", 40) is None
    answer = held.describe("a@1", 56)
    assert answer is not None and answer["nbytes"] == STATE_NBYTES
    assert answer["address"] == held.pool.data_ptr()
    assert bytes(held.pool[0, :STATE_NBYTES].numpy()) == bytes([4]) * STATE_NBYTES
    assert held.describe("a@1", 48) is None  # a pull that ends elsewhere gets none
    held.release("a@1")
    assert len(held) == 0 and held.describe("a@1", 56) is None
    held.capture([("c", 6, 16)])
    held.hold("c@1", "c", 24)  # not the boundary it was captured at: none
    assert len(held) == 0
    held.capture([("d", 7, 16)])
    held.drop(["d"])
    held.hold("d@1", "d", 16)  # forgotten
    assert len(held) == 0
    held.close(agent)
    assert agent.registered == []


def test_a_state_is_read_into_staging_rows_and_verified():
    row_nbytes = 128
    payload = bytes(range(256)) + bytes(44)  # 300 bytes: three rows, the last one short
    held = HeldStates(FakeAgent(), FakeStates(), num_slots=2)  # type: ignore[arg-type]
    described = {"address": 1000, "nbytes": STATE_NBYTES, "position": 40,
                 "checksum": xxhash.xxh3_64_intdigest(payload)}
    state = parse_remote_state(described, 40, STATE_NBYTES)
    assert state == RemoteState(1000, STATE_NBYTES, described["checksum"])
    local, remote = chunks(state, local_base=5000, first_row=2, row_nbytes=row_nbytes)
    assert remote == [(1000, 128, 0), (1128, 128, 0), (1256, 44, 0)]
    assert local == [(5256, 128, 0), (5384, 128, 0), (5512, 44, 0)]
    rows = torch.zeros(3, row_nbytes, dtype=torch.uint8)
    rows.view(-1)[:STATE_NBYTES] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    assert verify(state, rows) == payload
    rows[1, 7] ^= 1
    assert verify(state, rows) is None
    assert held.nbytes == STATE_NBYTES


@pytest.mark.parametrize("change", [
    {"nbytes": STATE_NBYTES - 1}, {"position": 48}, {"address": -1}, {"checksum": True},
    {"address": "0x10"}])
def test_a_check_answer_of_another_state_is_no_state(change):
    answer = {"address": 1000, "nbytes": STATE_NBYTES, "position": 40, "checksum": 7} | change
    assert parse_remote_state(answer, 40, STATE_NBYTES) is None
    assert parse_remote_state(None, 40, STATE_NBYTES) is None
