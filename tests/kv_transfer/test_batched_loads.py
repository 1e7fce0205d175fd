"""A step's sync folder loads read as ONE staged batch (issue 28 goal 4): every request's
blocks on one reader and one set of I/O threads, one install for them all, while each
request keeps its own failures (a bad block cuts its own request only) and a deadline
that gives up mid-batch keeps what had finished and never writes the cache later."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import xxhash

from kvrecover.config import KVTransferConfig
from kvrecover.kv_layout import KVCacheLayout
from kvrecover.kv_transfer.base import KVConnectorRole
from kvrecover.kv_transfer.stores import paged_blocks, staged_io
from kvrecover.kv_transfer.stores.block_store import PREFIX_SIZE, BlockLoadError, BlockStore
from kvrecover.kv_transfer.stores.paged_blocks import PagedBlocks
from kvrecover.kv_transfer.stores.reader_threads import ReadCancel, ReaderThreads, ReadTimedOut
from kvrecover.kv_transfer.stores.shared_storage import (
    BlockTransfer,
    SharedStorageConnector,
    StorageConnectorMetadata,
)

REQUESTS, PER_REQUEST = 3, 4
NUM_BLOCKS = 1 + REQUESTS * PER_REQUEST  # block 0 is the null block
# "cpu": a sync load copies into the cache itself; "cpu-strided" and "cuda": staged rows.
DEVICES = ["cpu", "cpu-strided", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the pinned staging path needs a GPU")])]


@pytest.fixture
def layout() -> KVCacheLayout:
    return KVCacheLayout("batched-test", torch.bfloat16, 4, 3, 2, 8)


def random_caches(layout: KVCacheLayout, seed: int, device: str = "cpu") -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shape = (2, NUM_BLOCKS, layout.block_size, layout.num_kv_heads, layout.head_dim)
    if device == "cpu-strided":  # block-major storage seen through a view: not direct
        return [torch.randn(shape, generator=generator).to(layout.dtype).transpose(0, 1)
                .contiguous().transpose(0, 1) for _ in range(layout.num_layers)]
    return [torch.randn(shape, generator=generator).to(layout.dtype).to(device)
            for _ in range(layout.num_layers)]


def block_bytes(caches: list[torch.Tensor], block_id: int) -> bytes:
    block = torch.stack([cache[:, block_id] for cache in caches]).cpu().contiguous()
    return block.view(torch.uint8).numpy().tobytes()


def request_keys(request: int) -> list[bytes]:
    return [xxhash.xxh3_128_digest(bytes([request, position])) for position in range(PER_REQUEST)]


def request_blocks(request: int) -> list[int]:
    # Not in storage order: each request's blocks land in another request's ids.
    return [1 + ((request + 1) % REQUESTS) * PER_REQUEST + p for p in range(PER_REQUEST)]


def store_requests(tmp_path, layout, source: list[torch.Tensor]) -> BlockStore:
    """Request r's blocks are source blocks 1 + r * PER_REQUEST ..., under request_keys(r)."""
    store = BlockStore(tmp_path, layout)
    for request in range(REQUESTS):
        for position, key in enumerate(request_keys(request)):
            block_id = 1 + request * PER_REQUEST + position
            store.write(key, torch.stack([cache[:, block_id] for cache in source]).cpu())
    return store


def flip_a_payload_bit(store: BlockStore, key: str) -> None:
    """Corrupt the stored block `key` (one bit of its payload): its checksum fails."""
    path = store.path(key)
    raw = bytearray(path.read_bytes())
    raw[PREFIX_SIZE + 5] ^= 0x08
    path.write_bytes(bytes(raw))


def make_worker(tmp_path, layout, caches, **extra) -> SharedStorageConnector:
    config = KVTransferConfig("SharedStorageConnector", "kv_consumer",
                              {"shared_storage_path": str(tmp_path), **extra})
    worker = SharedStorageConnector(config, KVConnectorRole.WORKER, layout)
    worker.register_kv_caches(caches)
    return worker


class Counted:
    """Counts the readers a connector starts and the batches its cache loads and installs."""

    def __init__(self, monkeypatch) -> None:
        self.readers = 0
        self.batches: list[int] = []  # rows per load_direct / stage call
        self.installs: list[int] = []  # blocks per install call (of every group in it)
        start, load_direct = ReaderThreads.start, PagedBlocks.load_direct
        stage = PagedBlocks.stage
        install_groups = PagedBlocks.install_groups

        def counted_start(readers, name, read):
            self.readers += 1
            return start(readers, name, read)

        def counted_load_direct(paged, block_ids, *args, **kwargs):
            self.batches.append(len(block_ids))
            return load_direct(paged, block_ids, *args, **kwargs)

        def counted_stage(paged, count, *args, **kwargs):
            self.batches.append(count)
            return stage(paged, count, *args, **kwargs)

        def counted_install(paged, groups):
            self.installs.append(sum(len(group.block_ids) for group in groups))
            return install_groups(paged, groups)

        monkeypatch.setattr(ReaderThreads, "start", counted_start)
        monkeypatch.setattr(PagedBlocks, "load_direct", counted_load_direct)
        monkeypatch.setattr(PagedBlocks, "stage", counted_stage)
        monkeypatch.setattr(PagedBlocks, "install_groups", counted_install)


def load_step(worker, caches) -> set[int]:
    """One step whose sync loads are every request's blocks; the invalid block ids."""
    worker.bind_connector_metadata(StorageConnectorMetadata(loads=[
        BlockTransfer(f"r{request}", request_blocks(request), request_keys(request))
        for request in range(REQUESTS)]))
    worker.start_load_kv(caches)
    worker.clear_connector_metadata()
    if caches[0].is_cuda:
        torch.cuda.synchronize()
    return worker.get_block_ids_with_load_errors()


@pytest.mark.parametrize("device", DEVICES)
def test_a_steps_sync_loads_read_and_install_as_one_batch(layout, tmp_path, monkeypatch, device):
    source = random_caches(layout, 1)
    store_requests(tmp_path, layout, source)
    target = random_caches(layout, 2, device)
    worker = make_worker(tmp_path, layout, target, io_threads=2)
    counted = Counted(monkeypatch)
    assert not load_step(worker, target)
    assert counted.readers == 1  # one reader thread for the step, not one per request
    assert counted.batches == [REQUESTS * PER_REQUEST]
    assert counted.installs == ([] if worker._paged.direct else [REQUESTS * PER_REQUEST])
    for request in range(REQUESTS):
        for position, block_id in enumerate(request_blocks(request)):
            saved = 1 + request * PER_REQUEST + position
            assert block_bytes(target, block_id) == block_bytes(source, saved)
    worker.shutdown()


@pytest.mark.parametrize("device", DEVICES)
def test_a_bad_block_in_a_batch_fails_only_its_own_requests_blocks(layout, tmp_path, monkeypatch,
                                                                   device):
    monkeypatch.setattr(staged_io, "CHUNK_BYTES", 2 * layout.block_nbytes)  # chunks of 2 rows
    monkeypatch.setattr(paged_blocks, "DIRECT_CHUNK_BYTES", 2 * layout.block_nbytes)
    source = random_caches(layout, 3)
    store = store_requests(tmp_path, layout, source)
    flip_a_payload_bit(store, request_keys(1)[1])  # request 1's second block
    target = random_caches(layout, 4, device)
    worker = make_worker(tmp_path, layout, target, io_threads=2)
    counted = Counted(monkeypatch)
    assert load_step(worker, target) == set(request_blocks(1)[1:])
    assert counted.readers == 1 and counted.batches == [REQUESTS * PER_REQUEST]
    for request, good in [(0, PER_REQUEST), (1, 1), (2, PER_REQUEST)]:
        for position, block_id in enumerate(request_blocks(request)[:good]):
            saved = 1 + request * PER_REQUEST + position
            assert block_bytes(target, block_id) == block_bytes(source, saved)
    assert request_keys(1)[1] in worker._suspect_keys
    worker.shutdown()


def test_read_rows_a_failure_cuts_its_own_run_only():
    read = []

    def read_row(position: int) -> int:
        read.append(position)
        if position == 1:
            raise BlockLoadError("bad")
        return position

    results = staged_io.read_rows(7, read_row, threading.Event(), threads=1, rows_per_chunk=1,
                                  segments=[3, 5, 7])
    assert results[0] == 0 and isinstance(results[1], BlockLoadError)
    assert results[2:] == [None, 3, 4, 5, 6]  # the first run stops; the others are whole
    assert read == [0, 1, 3, 4, 5, 6]
    with pytest.raises(ValueError, match="segments"):
        staged_io.read_rows(4, read_row, threading.Event(), 1, 1, segments=[3])


def test_a_deadline_mid_batch_keeps_what_finished_and_never_writes_later(layout, tmp_path,
                                                                         monkeypatch):
    """Request 0's second read hangs (a stuck NFS read) while the other I/O thread reads
    the rest of the batch: at the deadline request 0's blocks from the hung one on are
    invalid, everything that finished is kept, and once the read comes unstuck it copies
    nothing into the blocks that the engine has since filled (here with NaN)."""
    monkeypatch.setattr(paged_blocks, "DIRECT_CHUNK_BYTES", layout.block_nbytes)  # 1-row claims
    source = random_caches(layout, 5)
    store_requests(tmp_path, layout, source)
    target = random_caches(layout, 6)
    hung_key, release, stuck = request_keys(0)[1], threading.Event(), threading.Event()
    open_entry = BlockStore._open_entry

    def hanging_open_entry(store, key):
        if key == hung_key:
            stuck.set()
            release.wait(30)
        return open_entry(store, key)

    monkeypatch.setattr(BlockStore, "_open_entry", hanging_open_entry)
    refused = []  # copies into the cache that the closed fence turned down
    write_unless_set = ReadCancel.write_unless_set

    def spied(cancel, write):
        try:
            return write_unless_set(cancel, write)
        except ReadTimedOut:
            refused.append(cancel)
            raise

    monkeypatch.setattr(ReadCancel, "write_unless_set", spied)
    worker = make_worker(tmp_path, layout, target, io_threads=2, load_timeout_s=1.0)
    assert worker._paged.direct
    counted = Counted(monkeypatch)
    try:
        started = time.monotonic()
        invalid = load_step(worker, target)
        assert time.monotonic() - started < 10
        assert stuck.is_set() and counted.readers == 1
        hung = request_blocks(0)[1:]
        assert invalid == set(hung)  # request 0's first block and requests 1, 2 were kept
        for request, good in [(0, 1), (1, PER_REQUEST), (2, PER_REQUEST)]:
            for position, block_id in enumerate(request_blocks(request)[:good]):
                saved = 1 + request * PER_REQUEST + position
                assert block_bytes(target, block_id) == block_bytes(source, saved)
        for cache in target:
            for block_id in hung:
                cache[:, block_id].fill_(float("nan"))
        release.set()
        give_up = time.monotonic() + 10
        while not refused and time.monotonic() < give_up:
            time.sleep(0.01)
        assert refused  # the read came unstuck and tried to copy its block in
    finally:
        release.set()
        worker.shutdown()
    assert all(cache[:, block_id].isnan().all() for cache in target for block_id in hung)
