"""`kv_transfer/stores/store_states.py` on its own (no engine, no store): which stored state a
failed hybrid load keeps to resume from, and how a failing one degrades (rule 8)."""

from __future__ import annotations

import pytest

from kvrecover.kv_transfer.stores.store_states import MAX_RESUME_READS, StoreStates
from kvrecover.kv_transfer.stores.transfers import BlockTransfer

BLOCK = 4


class KeptStates:
    """The worker's side: records the resume states kept."""

    bytes_per_checkpoint = 8
    state_signature = "test"

    def __init__(self) -> None:
        self.kept: dict[str, tuple[int, bytes]] = {}

    def keep_resume_state(self, request_id: str, position: int, payload: bytes) -> None:
        self.kept[request_id] = (position, payload)


def load_of_ten_blocks() -> BlockTransfer:
    """Blocks 0-9 (ids 100-109) of a load of [0, 40), resume points every 2 blocks."""
    return BlockTransfer("r", list(range(100, 110)), [b"k%d" % i for i in range(10)],
                         block_positions=list(range(10)),
                         resume_points=[(p, b"h%d" % p) for p in (8, 16, 24, 32)])


def keep(invalid: set[int], failing: set[int]) -> tuple[int | None, set[int], list[int]]:
    """(position kept, blocks to report invalid too, positions read)."""
    states = StoreStates(store=None, block_size=BLOCK, interval=2)
    kept = KeptStates()
    states.register(kept)  # type: ignore[arg-type]
    reads: list[int] = []

    def read(transfer: BlockTransfer) -> bytes | None:
        reads.append(transfer.state_position)
        return None if transfer.state_position in failing else b"state%03d" % transfer.state_position

    marked = states.keep_resume_state(load_of_ten_blocks(), invalid, read)
    position = kept.kept["r"][0] if "r" in kept.kept else None
    return position, marked, reads


def test_the_latest_resume_point_at_or_before_the_first_failed_block_is_kept():
    assert keep({107, 109}, set()) == (24, set(), [24])  # block 7 (28) -> 24
    assert keep({106}, set()) == (24, set(), [24])  # block 6 starts at 24
    assert keep({109}, set()) == (32, set(), [32])  # the last block (or the end state)


def test_nothing_is_read_without_a_failure_or_a_resume_point_before_it():
    assert keep(set(), set()) == (None, set(), [])
    assert keep({101}, set()) == (None, set(), [])  # block 1 < the first point (8)
    assert keep({999}, set()) == (None, set(), [])  # another load's block


def test_a_failed_state_reports_the_block_ending_there_and_tries_the_one_before():
    # 24 fails: block 5 (ending at 24) is reported too, so the scheduler's first invalid
    # block is 5, whose latest point is 16: what is kept.
    assert keep({107}, {24}) == (16, {105}, [24, 16])


def test_after_the_last_read_no_point_of_the_load_is_left():
    assert MAX_RESUME_READS == 2
    # 32 and 24 fail: blocks 7 and 5, then block 1 (ending at the earliest point, 8):
    # the first invalid block is 1, before every point.
    assert keep({109}, {32, 24}) == (None, {107, 105, 101}, [32, 24])
    assert keep({103}, {8}) == (None, {101}, [8])


@pytest.mark.parametrize("interval", [1, 3])
def test_a_load_carries_the_stored_boundaries_inside_it(interval):
    from kvrecover.kv_transfer.request_view import KVRequestView
    from kvrecover.sampling import SamplingParams

    hashes = tuple(b"h%d" % i for i in range(12))
    request = KVRequestView("r", tuple(range(45)), hashes, 8, SamplingParams(),
                            (tuple(range(100, 112)),))
    load = BlockTransfer("r", list(range(102, 110)), hashes[2:10])
    StoreStates(store=None, block_size=BLOCK, interval=interval).plan_load(load, request, 2, 10)
    assert (load.state_hash, load.state_position) == (hashes[9], 40)
    assert load.block_positions == list(range(2, 10))
    inside = [b for b in range(3, 10) if b % interval == 0]
    assert load.resume_points == [(b * BLOCK, hashes[b - 1]) for b in inside]
