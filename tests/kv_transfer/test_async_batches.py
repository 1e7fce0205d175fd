"""A step's async folder loads read as ONE staged batch and land in ONE install per poll
(issue 28 goal 4): one reader thread for the step, each request's result ready as soon
as its own rows are read, every load that finished by a `get_finished` installed by one
`PagedBlocks.install_groups` call (on a GPU one check with one host sync), while each
request keeps its own failures and an aborted request leaves the others' read alone.
The loads of a batch land together, unless one of them is slow: the others then go on
after a quarter of their deadline window."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from test_batched_loads import (
    PER_REQUEST,
    REQUESTS,
    block_bytes,
    flip_a_payload_bit,
    make_worker,
    random_caches,
    request_blocks,
    request_keys,
    store_requests,
)

from kvrecover.kv_layout import KVCacheLayout
from kvrecover.kv_transfer.stores.block_store import BlockStore
from kvrecover.kv_transfer.stores.paged_blocks import PagedBlocks
from kvrecover.kv_transfer.stores.reader_threads import ReaderThreads
from kvrecover.kv_transfer.stores.shared_storage import BlockTransfer, StorageConnectorMetadata


@pytest.fixture
def layout() -> KVCacheLayout:
    return KVCacheLayout("async-batch-test", torch.bfloat16, 4, 3, 2, 8)


# "cpu": a contiguous cache, read into through bounce rows (no install); "cpu-strided":
# staged rows and the host scatter; "cuda": pinned rows, the device scatter and check.
DEVICES = ["cpu", "cpu-strided", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the pinned staging path needs a GPU")])]


class Spied:
    """Counts reader threads, staged batches, install calls and (GPU) host syncs."""

    def __init__(self, monkeypatch) -> None:
        self.readers = 0
        self.batches: list[int] = []
        self.installs: list[int] = []  # blocks per install call
        self.host_syncs = 0
        self.direct: list[int] = []  # rows per load_direct call (a contiguous CPU cache)
        start, stage, load_direct = ReaderThreads.start, PagedBlocks.stage, PagedBlocks.load_direct
        # (Before batched installs there was one install_rows call per load.)
        name = "install_groups" if hasattr(PagedBlocks, "install_groups") else "install_rows"
        install = getattr(PagedBlocks, name)
        tolist = torch.Tensor.tolist

        def counted_start(readers, thread_name, read):
            self.readers += 1
            return start(readers, thread_name, read)

        def counted_stage(paged, count, *args, **kwargs):
            self.batches.append(count)
            return stage(paged, count, *args, **kwargs)

        def counted_install(paged, first, *args, **kwargs):
            blocks = (sum(len(g.block_ids) for g in first) if name == "install_groups"
                      else len(first))
            self.installs.append(blocks)
            return install(paged, first, *args, **kwargs)

        def counted_load_direct(paged, block_ids, *args, **kwargs):
            self.direct.append(len(block_ids))
            return load_direct(paged, block_ids, *args, **kwargs)

        def counted_tolist(tensor):
            if tensor.is_cuda:
                self.host_syncs += 1
            return tolist(tensor)

        monkeypatch.setattr(ReaderThreads, "start", counted_start)
        monkeypatch.setattr(PagedBlocks, "stage", counted_stage)
        monkeypatch.setattr(PagedBlocks, "load_direct", counted_load_direct)
        monkeypatch.setattr(PagedBlocks, name, counted_install)
        monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)


def installs(device: str, blocks: int) -> list[int]:
    """Blocks per install call of one landing: none on a contiguous CPU cache (the
    loads read into it, checked there), else one call for every load."""
    return [] if device == "cpu" else [blocks]


def start_async_step(worker, caches, requests=range(REQUESTS)) -> dict[str, threading.Thread]:
    """Start one step whose loads are the given requests, all async; their reader threads."""
    worker.bind_connector_metadata(StorageConnectorMetadata(loads=[
        BlockTransfer(f"r{request}", request_blocks(request), request_keys(request),
                      is_async=True) for request in requests]))
    worker.start_load_kv(caches)
    worker.clear_connector_metadata()
    return {rid: load.thread for rid, load in worker._async_loads.items()}


def wait_read(worker) -> None:
    """Until every async load in flight has its result (bounded)."""
    for load in list(worker._async_loads.values()):
        load.future.result(timeout=10)


def assert_loaded(target, source, requests) -> None:
    for request, good in requests:
        for position, block_id in enumerate(request_blocks(request)[:good]):
            saved = 1 + request * PER_REQUEST + position
            assert block_bytes(target, block_id) == block_bytes(source, saved)


@pytest.mark.parametrize("device", DEVICES)
def test_async_loads_finished_by_one_poll_install_in_one_call(layout, tmp_path, monkeypatch,
                                                              device):
    source = random_caches(layout, 1)
    store_requests(tmp_path, layout, source)
    target = random_caches(layout, 2, device)
    worker = make_worker(tmp_path, layout, target, io_threads=2, async_load=True)
    spied = Spied(monkeypatch)
    readers = start_async_step(worker, target)
    wait_read(worker)
    _, done = worker.get_finished(set())
    assert done == {f"r{request}" for request in range(REQUESTS)}
    assert spied.installs == installs(device, REQUESTS * PER_REQUEST)  # one for the 3 loads
    if device == "cuda":
        torch.cuda.synchronize()
        assert spied.host_syncs == 1  # one check for all of them
    assert not worker.get_block_ids_with_load_errors()
    assert_loaded(target, source, [(request, PER_REQUEST) for request in range(REQUESTS)])
    assert spied.readers == 1  # one batch:
    assert (spied.direct if device == "cpu" else spied.batches) == [REQUESTS * PER_REQUEST]
    for reader in set(readers.values()):
        reader.join(timeout=10)
    # Its buffer went back to the pool (a contiguous CPU cache stages nothing).
    assert len(worker._paged._free_staging) == (device != "cpu")
    worker.shutdown()


@pytest.mark.parametrize("device", DEVICES)
def test_a_bad_block_in_a_batched_async_install_fails_only_its_own_requests_blocks(
        layout, tmp_path, monkeypatch, device):
    source = random_caches(layout, 3)
    store = store_requests(tmp_path, layout, source)
    flip_a_payload_bit(store, request_keys(1)[1])  # request 1's second block
    target = random_caches(layout, 4, device)
    worker = make_worker(tmp_path, layout, target, io_threads=2, async_load=True)
    spied = Spied(monkeypatch)
    start_async_step(worker, target)
    wait_read(worker)
    assert worker.get_finished(set())[1] == {f"r{request}" for request in range(REQUESTS)}
    assert spied.installs == installs(device, REQUESTS * PER_REQUEST - (PER_REQUEST - 1))
    assert worker.get_block_ids_with_load_errors() == set(request_blocks(1)[1:])
    assert_loaded(target, source, [(0, PER_REQUEST), (1, 1), (2, PER_REQUEST)])
    worker.shutdown()


def test_a_garbled_install_fails_only_its_own_requests_blocks(layout, tmp_path, monkeypatch):
    # The check after the batched install: one request's block is overwritten after its
    # copy (a garbled scatter); only that request loses blocks, from that one on.
    source = random_caches(layout, 5)
    store_requests(tmp_path, layout, source)
    target = random_caches(layout, 6, "cpu-strided")
    worker = make_worker(tmp_path, layout, target, io_threads=2, async_load=True)
    garbled = request_blocks(2)[2]
    scatter_host = PagedBlocks._scatter_host

    def garbling(paged, block_ids, staging):
        scatter_host(paged, block_ids, staging)
        for cache in paged.caches:
            cache[:, garbled].zero_()

    monkeypatch.setattr(PagedBlocks, "_scatter_host", garbling)
    start_async_step(worker, target)
    wait_read(worker)
    assert worker.get_finished(set())[1] == {f"r{request}" for request in range(REQUESTS)}
    assert worker.get_block_ids_with_load_errors() == set(request_blocks(2)[2:])
    worker.shutdown()


def hold_request(store: BlockStore, monkeypatch, *requests: int) -> threading.Event:
    """Reads of these requests' entries wait for the returned event (10 s at most)."""
    release = threading.Event()
    held = {key for request in requests for key in request_keys(request)}
    read = BlockStore.read_into

    def holding(self, key, parts):
        if key in held:
            release.wait(timeout=10)
        return read(self, key, parts)

    read_unchecked = BlockStore.read_unchecked_into

    def holding_unchecked(self, key, parts):  # (a direct cache's reads)
        if key in held:
            release.wait(timeout=10)
        return read_unchecked(self, key, parts)

    read_entries = BlockStore.read_entries_into

    def holding_entries(self, keys, *args, **kwargs):  # (a staged load's chunks)
        if held.intersection(keys):
            release.wait(timeout=10)
        return read_entries(self, keys, *args, **kwargs)

    monkeypatch.setattr(BlockStore, "read_entries_into", holding_entries)
    monkeypatch.setattr(BlockStore, "read_into", holding)
    monkeypatch.setattr(BlockStore, "read_unchecked_into", holding_unchecked)
    return release


@pytest.mark.parametrize("device", ["cpu", "cpu-strided"])
def test_a_steps_async_loads_land_together_in_one_install(layout, tmp_path, monkeypatch, device):
    # r0 and r1 are read while r2's reads are held: they wait for r2 (as a sync step
    # would), then all three land in one install.
    source = random_caches(layout, 7)
    store = store_requests(tmp_path, layout, source)
    target = random_caches(layout, 8, device)
    worker = make_worker(tmp_path, layout, target, io_threads=2, async_load=True)
    release = hold_request(store, monkeypatch, 2)
    spied = Spied(monkeypatch)
    try:
        start_async_step(worker, target)
        for request in (0, 1):
            worker._async_loads[f"r{request}"].future.result(timeout=10)
        assert worker.get_finished(set())[1] is None  # r2 is still being read
    finally:
        release.set()
    wait_read(worker)
    assert worker.get_finished(set())[1] == {"r0", "r1", "r2"}
    assert spied.installs == installs(device, REQUESTS * PER_REQUEST)
    assert not worker.get_block_ids_with_load_errors()
    assert_loaded(target, source, [(request, PER_REQUEST) for request in range(REQUESTS)])
    worker.shutdown()


@pytest.mark.parametrize("device", ["cpu", "cpu-strided"])
def test_a_slow_member_holds_its_batch_for_a_quarter_of_the_deadline_at_most(
        layout, tmp_path, monkeypatch, device):
    source = random_caches(layout, 11)
    store = store_requests(tmp_path, layout, source)
    target = random_caches(layout, 12, device)
    worker = make_worker(tmp_path, layout, target, io_threads=2, async_load=True,
                         load_timeout_s=4.0)
    release = hold_request(store, monkeypatch, 2)
    try:
        start_async_step(worker, target)
        held_until = worker._async_loads["r0"].deadline - 0.75 * worker.load_timeout_s
        for request in (0, 1):
            worker._async_loads[f"r{request}"].future.result(timeout=10)
        if time.monotonic() < held_until - 0.1:  # (a slow machine may be past it already)
            assert worker.get_finished(set())[1] is None
        time.sleep(max(0.0, held_until - time.monotonic()) + 0.01)
        assert worker.get_finished(set())[1] == {"r0", "r1"}  # r2 still hangs: they go on
        assert_loaded(target, source, [(0, PER_REQUEST), (1, PER_REQUEST)])
    finally:
        release.set()
    wait_read(worker)
    assert worker.get_finished(set())[1] == {"r2"}
    assert not worker.get_block_ids_with_load_errors()
    assert_loaded(target, source, [(2, PER_REQUEST)])
    worker.shutdown()


@pytest.mark.parametrize("device", ["cpu", "cpu-strided"])
def test_an_aborted_request_leaves_its_batchs_read_to_the_others(layout, tmp_path, monkeypatch,
                                                                 device):
    # On a contiguous CPU cache the loads read into the cache itself: from its abort on,
    # nothing of r0 is written there (its blocks may be someone else's by then).
    source = random_caches(layout, 9)
    store = store_requests(tmp_path, layout, source)
    target = random_caches(layout, 10, device)
    before = [block_bytes(target, block_id) for block_id in request_blocks(0)]
    worker = make_worker(tmp_path, layout, target, io_threads=2, async_load=True)
    release = hold_request(store, monkeypatch, 0, 2)
    try:
        readers = start_async_step(worker, target)
        assert worker.get_finished({"r0"})[1] == {"r0"}  # aborted: reported at once
        assert not worker._async_loads["r2"].future.done()  # (held)
        assert not worker._async_loads["r2"].cancelled.is_set()  # r2 still needs the read
    finally:
        release.set()
    wait_read(worker)
    assert worker.get_finished(set())[1] == {"r1", "r2"}
    assert not worker.get_block_ids_with_load_errors()
    assert_loaded(target, source, [(1, PER_REQUEST), (2, PER_REQUEST)])
    readers["r1"].join(timeout=10)
    assert [block_bytes(target, block_id) for block_id in request_blocks(0)] == before
    # The aborted request let go of its share of the staging buffer (if staged).
    assert len(worker._paged._free_staging) == (device != "cpu")
    worker.shutdown()
