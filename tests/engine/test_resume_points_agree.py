"""Rule 8's resume point of a failed hybrid load, seen from both sides: the state the
connector's worker role keeps (`StoreStates.plan_load` then `keep_resume_state`, with
some of its state reads failing) is the one the scheduler's `StateCheckpoints` expects
from the first invalid block the worker reports, over a grid of loads, failures and K."""

from __future__ import annotations

from itertools import combinations

from test_recovery_unit import make_request

from kvrecover.engine.state_checkpoints import StateCheckpoints
from kvrecover.kv_transfer.request_view import KVRequestView
from kvrecover.kv_transfer.stores.store_states import StoreStates
from kvrecover.kv_transfer.stores.transfers import BlockTransfer
from kvrecover.sampling import SamplingParams

BLOCK = 4
MAX_BLOCKS = 16
HASHES = tuple(b"h%02d" % b for b in range(MAX_BLOCKS))
BLOCK_IDS = tuple(range(100, 100 + MAX_BLOCKS))  # block position p has id 100 + p


class KeptStates:
    """The worker's recurrent states: records the resume state kept."""

    bytes_per_checkpoint = 8
    state_signature = "test"

    def __init__(self) -> None:
        self.kept: int | None = None

    def keep_resume_state(self, request_id: str, position: int, payload: bytes) -> None:
        self.kept = position


def worker_keeps(first: int, last: int, interval: int, first_failed: int,
                 failing: set[int]) -> tuple[int | None, int]:
    """(position of the state the worker keeps, first invalid block it reports) after a
    load of blocks [first, last) whose blocks from `first_failed` on failed and whose
    stored states at `failing` (positions) fail to read."""
    view = KVRequestView("r", tuple(range(MAX_BLOCKS * BLOCK)), HASHES, first * BLOCK,
                         SamplingParams(), (BLOCK_IDS,))
    load = BlockTransfer("r", list(BLOCK_IDS[first:last]), list(HASHES[first:last]))
    states = StoreStates(store=None, block_size=BLOCK, interval=interval)
    kept = KeptStates()
    states.register(kept)  # type: ignore[arg-type]
    states.plan_load(load, view, first, last)
    invalid = set(BLOCK_IDS[first_failed:last])

    def read(transfer: BlockTransfer) -> bytes | None:
        return None if transfer.state_position in failing else b"state"

    invalid |= states.keep_resume_state(load, invalid, read)
    return kept.kept, min(invalid) - BLOCK_IDS[0]


def scheduler_expects(first: int, last: int, interval: int, first_invalid: int) -> set[int]:
    """The block boundaries inside the load at which the scheduler holds the request's
    state to be had (`can_resume`, no checkpoints kept) after a failure from block
    `first_invalid` on."""
    checkpoints = StateCheckpoints(num_slots=0, block_size=BLOCK, load_interval=interval)
    request = make_request("r", MAX_BLOCKS * BLOCK, list(BLOCK_IDS), last * BLOCK)
    request.pending_external = (first * BLOCK, last * BLOCK)
    return {position for position in range(BLOCK, last * BLOCK, BLOCK)
            if checkpoints.can_resume(request, position, first_invalid * BLOCK)}


def test_the_worker_keeps_the_state_the_scheduler_resumes_from():
    cases = disagreements = 0
    examples = []
    for interval in range(1, 7):
        for first in range(0, 6):
            for last in range(first + 1, min(first + 11, MAX_BLOCKS) + 1):
                points = [b * BLOCK for b in range(first + 1, last) if b % interval == 0]
                # Every set of failing state reads among the latest three points.
                failing_sets = [set(c) for n in range(4) for c in combinations(points[-3:], n)]
                for first_failed in range(first, last):
                    for failing in failing_sets:
                        cases += 1
                        kept, first_invalid = worker_keeps(first, last, interval,
                                                           first_failed, failing)
                        expected = scheduler_expects(first, last, interval, first_invalid)
                        if expected != ({kept} if kept is not None else set()):
                            disagreements += 1
                            examples.append((interval, first, last, first_failed,
                                             sorted(failing), kept, sorted(expected)))
    assert cases > 5000
    assert disagreements == 0, (
        f"{disagreements} of {cases} cases disagree (K, first, last, first failed, failing "
        f"reads, worker kept, scheduler expects): {examples[:5]}")


def test_the_grid_reaches_every_outcome():
    """The grid above is not vacuous: a point kept at once, one kept after a failed read,
    and none (before the first point, or out of reads)."""
    assert worker_keeps(0, 10, 2, 7, set()) == (24, 7)
    assert worker_keeps(0, 10, 2, 7, {24}) == (16, 5)
    assert worker_keeps(0, 10, 2, 1, set()) == (None, 1)
    assert worker_keeps(0, 10, 2, 9, {32, 24}) == (None, 1)
    assert scheduler_expects(0, 10, 2, 7) == {24}
    assert scheduler_expects(0, 10, 2, 5) == {16}
    assert scheduler_expects(0, 10, 2, 1) == set()
