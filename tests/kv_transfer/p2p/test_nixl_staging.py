"""The staging pool of a consumer's NIXL READs (`p2p/staging.py`), model- and NIXL-free:
buffers are registered once and reused, a buffer whose READ was given up is not handed
out again until that READ ended, and past the bound on such READs none is handed out."""

from __future__ import annotations

import pytest

from kvrecover.kv_transfer.p2p.staging import StagingExhausted, StagingPool


class FakeAgent:
    """Registration counts, and a state per transfer handle ("PROC" until ended)."""

    def __init__(self) -> None:
        self.registered = 0
        self.deregistered = 0
        self.states: dict[str, str] = {}
        self.released: list[str] = []

    def register_memory(self, tensors):
        self.registered += 1
        return object()

    def deregister_memory(self, registration) -> None:
        self.deregistered += 1

    def check_xfer_state(self, handle: str) -> str:
        return self.states[handle]

    def release_xfer_handle(self, handle: str) -> None:
        assert self.states[handle] in ("DONE", "ERR"), "released in flight"
        self.released.append(handle)


def test_a_buffer_is_registered_once_and_reused():
    agent = FakeAgent()
    pool = StagingPool(agent, row_nbytes=64)
    first = pool.acquire(5)
    assert first.capacity == 8 and first.rows.shape == (8, 64)
    pool.give_back(first)
    assert pool.acquire(3) is first and agent.registered == 1
    assert pool.acquire(20).capacity == 32 and agent.registered == 2


def test_a_given_up_read_quarantines_its_buffer_until_it_ended():
    agent = FakeAgent()
    pool = StagingPool(agent, row_nbytes=16, max_quarantined=2)
    buffers = [pool.acquire(4) for _ in range(2)]
    for index, buffer in enumerate(buffers):
        agent.states[f"read{index}"] = "PROC"
        pool.quarantine(buffer, f"read{index}")
    with pytest.raises(StagingExhausted):  # past the bound: the pull fails at once
        pool.acquire(4)
    assert agent.released == [] and pool.num_quarantined() == 2
    agent.states["read1"] = "ERR"  # ended: nothing more of it is written
    assert pool.acquire(4) is buffers[1] and agent.released == ["read1"]
    assert pool.num_quarantined() == 1
    pool.close()  # the one still in flight is never freed
    assert agent.released == ["read1"]
