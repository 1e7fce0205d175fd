"""The staging pool of a consumer's NIXL READs (`p2p/staging.py`), model- and NIXL-free:
buffers are registered once and reused, a buffer whose READ was given up is not handed
out again until that READ ended, and past the bound on such READs none is handed out;
the staging layout: a run of consecutive block ids is one descriptor per (side, cache
tensor), and a staged block checksums as the producer's block-major bytes, by either
algorithm (`p2p/checksums.py`)."""

from __future__ import annotations

import pytest
import torch
import xxhash

from kvrecover.kv_transfer.p2p.checksums import checksum_blocks, fold64_reference
from kvrecover.kv_transfer.p2p.pull_reads import InstallPlan
from kvrecover.kv_transfer.p2p.staging import (
    StagingExhausted,
    StagingLayout,
    StagingPool,
    block_descriptors,
    block_runs,
    max_gap_blocks,
    memory_of,
    rounded_rows,
    staged_blocks,
)


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
    assert pool.acquire(20).capacity == 20 and agent.registered == 2


def test_a_free_buffer_is_taken_whatever_its_place_in_the_free_list():
    """Free buffers are told apart by identity: taking one that is not first in the free
    list once compared their tensors (a dataclass's field equality) and raised, failing
    every pull of that step and leaving their references unreleased until their leases
    ended."""
    agent = FakeAgent()
    pool = StagingPool(agent, row_nbytes=16)
    small, large = pool.acquire(8), pool.acquire(20)
    pool.give_back(small)
    pool.give_back(large)
    assert pool.acquire(20) is large  # the second free buffer
    assert pool.acquire(5) is small
    assert agent.registered == 2


def test_a_new_buffer_is_at_most_an_eighth_larger_than_asked():
    assert [rounded_rows(n) for n in (1, 8, 9, 17, 1000, 1030, 4097)] == \
        [8, 8, 9, 18, 1024, 1152, 4608]
    for rows in range(1, 3000, 7):
        assert rows <= rounded_rows(rows) <= max(8, rows + rows // 8 + 1)


def test_descriptors_name_each_sides_device():
    local, remote = block_descriptors([3, 4], [(0, 100)], 8, local_base=1000, first_row=0,
                                      num_blocks=2, local_device=1, remote_device=2)
    assert {d[2] for d in local} == {1} and {d[2] for d in remote} == {2}
    assert memory_of(torch.zeros(1)) == ("DRAM", 0)


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


class nixlRemoteDisconnectError(Exception):  # noqa: N801 - NIXL's bindings' name
    """What NIXL's bindings raise for a transfer whose peer died."""


def test_a_read_that_nixl_reports_failed_by_raising_frees_its_buffer():
    """NIXL's bindings report an error status by raising, never as "ERR": a READ whose
    producer died (SIGKILL mid-READ) once stayed quarantined for good, and after four
    such deaths the consumer refused every pull for its lifetime."""
    agent = FakeAgent()

    def check_xfer_state(handle: str) -> str:
        if agent.states[handle] == "ERR":
            raise nixlRemoteDisconnectError("NIXL_ERR_REMOTE_DISCONNECT")
        return agent.states[handle]

    agent.check_xfer_state = check_xfer_state
    pool = StagingPool(agent, row_nbytes=16, max_quarantined=1)
    buffer = pool.acquire(4)
    agent.states["read"] = "PROC"
    pool.quarantine(buffer, "read")
    with pytest.raises(StagingExhausted):
        pool.acquire(4)
    agent.states["read"] = "ERR"  # the producer died: the READ ended with an error
    assert pool.acquire(4) is buffer and agent.released == ["read"]
    assert pool.num_quarantined() == 0


def test_consecutive_block_ids_make_one_run_and_others_split():
    assert block_runs([5, 6, 7, 9, 10, 3]) == [(0, 5, 3), (3, 9, 2), (5, 3, 1)]
    assert block_runs([4, 4, 3]) == [(0, 4, 1), (1, 4, 1), (2, 3, 1)]
    assert block_runs([]) == []


def test_the_staging_layout_reads_each_producer_block_once_in_ascending_id():
    layout = StagingLayout.of([9, 8, 7, 3, 3, 4])  # a used producer's descending runs
    assert layout.remote_ids == [3, 4, 7, 8, 9]
    assert layout.rows == [4, 3, 2, 0, 0, 1]  # the shared block 3 staged once
    assert len(block_runs(layout.remote_ids)) == 2
    assert StagingLayout.of([]) == StagingLayout([], [])


def test_short_gaps_between_runs_are_read_to_join_them():
    joined = StagingLayout.of([9, 8, 7, 3, 3, 4], max_gap=2)  # 5 and 6 read, unused
    assert joined.remote_ids == [3, 4, 5, 6, 7, 8, 9]
    assert joined.rows == [6, 5, 4, 0, 0, 1] and len(block_runs(joined.remote_ids)) == 1
    assert StagingLayout.of([9, 8, 7, 3, 4], max_gap=1).remote_ids == [3, 4, 7, 8, 9]
    # Gap rows never outnumber the pulled blocks: 8 unpulled blocks for 2 pulled are not read.
    assert StagingLayout.of([10, 1], max_gap=100).remote_ids == [1, 10]
    assert StagingLayout.of([1, 4, 10], max_gap=100).remote_ids == [1, 2, 3, 4, 10]


def test_an_install_plan_copies_runs_of_rows_and_repeats_a_shared_row():
    # (staged row, cache block): rows 0-2 and 5 (3 and 4 a gap or a failed block), row 1
    # also into block 40 (a producer block two pulls share).
    plan = InstallPlan.of([(5, 9), (1, 31), (0, 30), (2, 7), (1, 40)])
    assert plan.segments == [(0, 3), (5, 1)]
    assert plan.targets == [30, 31, 7, 9]
    assert plan.repeats == [(1, 40)]
    assert InstallPlan.of([]) == InstallPlan([], [], [])
    assert plan.copies(gather=False) == [(slice(0, 3), [30, 31, 7]), (slice(5, 6), [9]),
                                         ([1], [40])]
    assert plan.copies(gather=True) == [([0, 1, 2, 5, 1], [30, 31, 7, 9, 40])]
    whole = InstallPlan.of([(1, 8), (0, 3)])  # every row in order: a slice either way
    assert whole.copies(gather=True) == whole.copies(gather=False) == [(slice(0, 2), [3, 8])]


def test_a_gap_is_read_where_it_costs_less_than_the_descriptors_it_saves():
    # An 8B model's block side (32 KiB): 128 blocks on a GPU; a small CPU model's
    # (12 KiB): one block, the partial block between two prompts' runs.
    assert max_gap_blocks(32 << 10, "cuda") == 128
    assert max_gap_blocks(12 << 10, "cpu") == 1
    assert max_gap_blocks(64 << 10, "cpu") == 0


def test_a_run_is_one_descriptor_per_side_and_cache_tensor():
    half, regions = 8, [(1000, 2000), (3000, 4000)]  # two cache tensors' (K, V) bases
    local, remote = block_descriptors([5, 6, 7, 2], regions, half, local_base=0,
                                      first_row=1, num_blocks=6)
    assert len(local) == len(remote) == 2 * 2 * 2  # two runs x (side, cache tensor)
    # The run [5, 6, 7] of rows 1..3: K of cache 0, then of cache 1, then V of each.
    assert remote[:4] == [(1000 + 5 * half, 3 * half, 0), (3000 + 5 * half, 3 * half, 0),
                          (2000 + 5 * half, 3 * half, 0), (4000 + 5 * half, 3 * half, 0)]
    assert local[:4] == [((c * 6 + 1) * half, 3 * half, 0) for c in range(4)]
    assert remote[4] == (1000 + 2 * half, half, 0) and local[4] == (4 * half, half, 0)


@pytest.mark.parametrize("algorithm", ["xxh3", "fold64"])
def test_staged_blocks_checksum_as_the_producers_block_major_bytes(algorithm):
    """A READ simulated from the descriptors: each staged block hashes as the old layout
    (one row per block: K of every cache tensor, then V) and as the producer's cache."""
    generator = torch.Generator().manual_seed(0)
    num_caches, cache_blocks, half = 3, 10, 16
    caches = [torch.randint(0, 256, (2, cache_blocks, half), generator=generator,
                            dtype=torch.uint8) for _ in range(num_caches)]
    memory = torch.cat([c.reshape(-1) for c in caches])  # a fake producer address space
    regions = [(c * 2 * cache_blocks * half, (c * 2 + 1) * cache_blocks * half)
               for c in range(num_caches)]
    remote_ids = [7, 8, 9, 1, 2, 4]
    rows = torch.zeros(8, 2 * num_caches * half, dtype=torch.uint8)
    flat = rows.view(-1)
    for (at, length, _), (source, _, _) in zip(*block_descriptors(
            remote_ids, regions, half, local_base=0, first_row=0, num_blocks=6)):
        flat[at:at + length] = memory[source:source + length]
    staged = staged_blocks(rows, 6, num_caches)
    assert staged.shape == (2, num_caches, 6, half)
    old_rows = [torch.cat([caches[c][side, b] for side in range(2)
                           for c in range(num_caches)]).numpy().tobytes()
                for b in remote_ids]
    expected = [xxhash.xxh3_64_intdigest(row) if algorithm == "xxh3"
                else fold64_reference(row, half) for row in old_rows]
    assert checksum_blocks(algorithm, [staged[:, c] for c in range(num_caches)],
                           range(6)) == expected
    assert checksum_blocks(algorithm, caches, remote_ids) == expected
    for index, block_id in enumerate(remote_ids):
        for c in range(num_caches):
            assert torch.equal(staged[:, c, index], caches[c][:, block_id])


@pytest.mark.parametrize("gpu", [False, True])
@pytest.mark.parametrize("user_value", [None, "n"])
def test_a_gpu_agent_starts_with_cuda_ipc_get_on_unless_the_user_says_otherwise(
        monkeypatch, gpu, user_value):
    """A GPU consumer's READ is a GET: UCX's `auto` turns cuda_ipc's GET off without
    NVLink (READs fall back to TCP emulation), so a GPU agent starts with it on; the
    environment UCX reads is set before the agent (and its backend) is created."""
    from types import SimpleNamespace

    from kvrecover.kv_transfer.p2p import nixl_connector

    variable = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"
    monkeypatch.setenv(variable, "recorded")  # undone after the test, whatever it set
    if user_value is None:
        monkeypatch.delenv(variable)
    else:
        monkeypatch.setenv(variable, user_value)
    seen: list[str | None] = []

    def agent(name, config):
        import os

        seen.append(os.environ.get(variable))
        return name

    api = SimpleNamespace(nixl_agent=agent, nixl_agent_config=lambda **kwargs: kwargs,
                          nixl_thread_sync_t=SimpleNamespace(NIXL_THREAD_SYNC_STRICT=2))
    monkeypatch.setattr(nixl_connector, "_nixl_api", lambda: api)
    assert nixl_connector._nixl_agent("probe", gpu=gpu) == "probe"
    assert seen == [user_value if user_value is not None else ("y" if gpu else None)]


def test_a_steps_pulls_are_described_together_so_runs_span_prompts(monkeypatch):
    """Two prompts whose producer blocks are adjacent are one run (one descriptor per
    side and cache tensor, not one per prompt); a gap longer than the blocks pulled
    starts another run (shorter ones are read: `StagingLayout`)."""
    from types import SimpleNamespace

    from kvrecover.kv_transfer.p2p.consumer import NixlConsumer
    from kvrecover.kv_transfer.p2p.metadata import Pull
    from kvrecover.kv_transfer.p2p.peers import Peer

    num_caches, block_shape = 3, (4, 8)  # a block's side: 4 x 8 float32 = 128 bytes
    half = 4 * 8 * 4
    consumer = NixlConsumer(SimpleNamespace(tensor_parallel_rank=0), load_timeout_s=1.0)
    consumer.register([torch.zeros(2, 16, *block_shape) for _ in range(num_caches)],
                      FakeAgent())
    posted: list[tuple[list, list]] = []
    monkeypatch.setattr(StagingPool, "read",
                        lambda self, buffer, local, remote, *rest: posted.append((local, remote))
                        or True)
    regions = [(10_000 * (c + 1), 10_000 * (c + 1) + 5_000) for c in range(num_caches)]
    peer = Peer("producer", 64, half, regions, "DRAM", 0, "xxh3")

    def pull(request_id: str, local_ids: list[int], remote_ids: list[int]) -> Pull:
        return Pull(request_id, local_ids, remote_ids, [(0, i) for i in range(len(local_ids))],
                    [], None, 0, "", False)  # type: ignore[arg-type]

    pulls = [pull("a", [1, 2, 3], [10, 11, 12]), pull("b", [7, 8], [13, 14]),
             pull("c", [9], [40])]
    assert consumer.reader.read("producer", [(p, peer, []) for p in pulls], deadline=0.0) is not None
    local, remote = posted[0]
    assert len(local) == len(remote) == 2 * 2 * num_caches  # runs 10..14 and 40
    assert remote[0] == (regions[0][0] + 10 * half, 5 * half, 0)
    assert local[0][1] == 5 * half and remote[2 * num_caches] == (regions[0][0] + 40 * half,
                                                                  half, 0)
