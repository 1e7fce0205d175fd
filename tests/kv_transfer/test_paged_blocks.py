"""The zero-copy KV store paths: entries read into and written from a paged cache's own
slices (`PagedBlocks`, `BlockStore.read_into` / `write_parts`) and the staged path
(several reader threads, pinned rows and a side-stream upload on a GPU),
byte-identical to the plain ones and just as strict about bad entries."""

from __future__ import annotations

import threading

import pytest
import torch
import xxhash
from conftest import (
    KV_BLOCK,
    KV_LOADABLE,
    KV_PROMPTS,
    block_files,
    kv_generate,
    make_kv_llm,
    storage_transfer,
)

from kvrecover import LLM
from kvrecover.config import KVTransferConfig
from kvrecover.kv_layout import KVCacheLayout
from kvrecover.kv_transfer.base import KVConnectorRole
from kvrecover.kv_transfer.stores import entry_read, native_copy, paged_blocks, staged_io
from kvrecover.kv_transfer.stores.block_store import (
    PREFIX_SIZE,
    BlockLoadError,
    BlockStore,
    payload_checksum,
)
from kvrecover.kv_transfer.stores.paged_blocks import PagedBlocks, StagedRows
from kvrecover.kv_transfer.stores.shared_storage import (
    BlockTransfer,
    SharedStorageConnector,
    StorageConnectorMetadata,
)

NUM_BLOCKS = 9  # block 0 is the null block
# "cpu-strided": non-contiguous CPU caches take the staged path a GPU takes (bar pinning).
DEVICES = ["cpu", "cpu-strided", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the pinned staging path needs a GPU")])]


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def layout(request) -> KVCacheLayout:
    return KVCacheLayout("paged-test", request.param, 4, 3, 2, 8)


def random_caches(layout: KVCacheLayout, seed: int, device: str = "cpu") -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shape = (2, NUM_BLOCKS, layout.block_size, layout.num_kv_heads, layout.head_dim)
    if device == "cpu-strided":  # the same values, stored block-major: a strided view
        return [torch.randn(shape, generator=generator).to(layout.dtype).transpose(0, 1)
                .contiguous().transpose(0, 1) for _ in range(layout.num_layers)]
    return [torch.randn(shape, generator=generator).to(layout.dtype).to(device)
            for _ in range(layout.num_layers)]


def block_of(caches: list[torch.Tensor], block_id: int) -> torch.Tensor:
    return torch.stack([cache[:, block_id] for cache in caches]).cpu().contiguous()


def raw_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()


def keys(count: int) -> list[bytes]:
    return [xxhash.xxh3_128_digest(i.to_bytes(4, "little")) for i in range(count)]


def test_parts_are_the_block_in_file_order(layout):
    caches = random_caches(layout, 0)
    paged = PagedBlocks(caches)
    assert paged.direct
    for block_id in (0, 3, NUM_BLOCKS - 1):
        assert b"".join(bytes(part) for part in paged.parts(block_id)) == raw_bytes(
            block_of(caches, block_id))
        assert paged.checksums([block_id]) == [payload_checksum(block_of(caches, block_id))]


def test_write_parts_writes_the_same_file_as_write(layout, tmp_path):
    caches = random_caches(layout, 1)
    from_parts, whole = BlockStore(tmp_path / "parts", layout), BlockStore(tmp_path / "whole", layout)
    key = keys(1)[0]
    from_parts.write_parts(key, PagedBlocks(caches).parts(5))
    whole.write(key, block_of(caches, 5))
    assert from_parts.path(key).read_bytes() == whole.path(key).read_bytes()
    with pytest.raises(ValueError, match="parts hold"):
        from_parts.write_parts(key, PagedBlocks(caches).parts(5)[:-1])


def test_read_into_fills_the_cache_slices_exactly(layout, tmp_path):
    source, target = random_caches(layout, 2), random_caches(layout, 3)
    store = BlockStore(tmp_path, layout)
    key = keys(1)[0]
    store.write(key, block_of(source, 2))
    checksum = store.read_into(key, PagedBlocks(target).parts(7))
    assert raw_bytes(block_of(target, 7)) == raw_bytes(block_of(source, 2))
    assert checksum == payload_checksum(block_of(source, 2))
    untouched = random_caches(layout, 3)
    for block_id in set(range(NUM_BLOCKS)) - {7}:
        assert raw_bytes(block_of(target, block_id)) == raw_bytes(block_of(untouched, block_id))


@pytest.mark.parametrize("where", ["header", "payload", "last byte"])
def test_read_into_rejects_a_flipped_byte(layout, tmp_path, where):
    caches = random_caches(layout, 4)
    store = BlockStore(tmp_path, layout)
    key = keys(1)[0]
    store.write(key, block_of(caches, 1))
    path = store.path(key)
    raw = bytearray(path.read_bytes())
    offset = {"header": 40, "payload": PREFIX_SIZE + 5, "last byte": len(raw) - 1}[where]
    raw[offset] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(BlockLoadError, match="checksum mismatch"):
        store.read_into(key, PagedBlocks(random_caches(layout, 5)).parts(2))
    path.write_bytes(bytes(raw[:-3]))  # a short file is refused before it is read
    with pytest.raises(BlockLoadError, match="bytes, expected"):
        store.read_into(key, PagedBlocks(random_caches(layout, 5)).parts(2))


def connector(tmp_path, layout, caches, **extra) -> SharedStorageConnector:
    config = KVTransferConfig("SharedStorageConnector", "kv_both",
                              {"shared_storage_path": str(tmp_path), **extra})
    worker = SharedStorageConnector(config, KVConnectorRole.WORKER, layout)
    worker.register_kv_caches(caches)
    return worker


def load(worker: SharedStorageConnector, caches, block_ids, block_keys, is_async: bool) -> set[int]:
    worker.bind_connector_metadata(StorageConnectorMetadata(
        loads=[BlockTransfer("r", block_ids, block_keys, is_async=is_async)]))
    worker.start_load_kv(caches)
    worker.clear_connector_metadata()
    if is_async:
        reader = worker._async_loads["r"].thread
        for _ in range(500):  # bounded: a local load of a few blocks finishes at once
            _, done = worker.get_finished(set())
            if done:
                break
            worker._async_loads["r"].future.result(timeout=10)
        # A load lands as soon as its rows are read; its staging buffer goes back to the
        # pool once the batch's reader has ended too.
        reader.join(timeout=10)
    return worker.get_block_ids_with_load_errors()


def hold_reads_until_two_threads_read(store, method: str) -> tuple[set, threading.Event]:
    """Spy on `store.<method>(key, parts)`: each call waits (5 s at most) until a second
    thread has read too. Returns the reading threads' names and the 'second reader' event."""
    readers: set[str] = set()
    second_reader = threading.Event()
    read = getattr(store, method)

    def spied(*args, **kwargs):
        readers.add(threading.current_thread().name)
        if len(readers) >= 2:
            second_reader.set()
        second_reader.wait(timeout=5)
        return read(*args, **kwargs)

    setattr(store, method, spied)
    return readers, second_reader


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_connector_round_trip_is_byte_identical(layout, tmp_path, is_async, device):
    source = random_caches(layout, 6, device)
    saved_ids, block_keys = [1, 2, 3, 6, 8], keys(5)
    saver = connector(tmp_path, layout, source)
    saver.bind_connector_metadata(StorageConnectorMetadata(
        saves=[BlockTransfer("r", saved_ids, block_keys)]))
    saver.wait_for_save()
    assert saver.get_save_failures() == 0
    target = random_caches(layout, 7, device)
    loaded_ids = [4, 5, 1, 7, 8]  # runs and gaps, in another order than saved
    worker = connector(tmp_path, layout, target)
    assert worker._paged.direct == (device == "cpu")  # in place if it can, else staged
    assert not load(worker, target, loaded_ids, block_keys, is_async)
    for saved, loaded in zip(saved_ids, loaded_ids):
        assert raw_bytes(block_of(target, loaded)) == raw_bytes(block_of(source, saved))
    assert raw_bytes(block_of(target, 2)) == raw_bytes(block_of(random_caches(layout, 7), 2))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_connector_reports_a_corrupt_entry_and_everything_after_it(layout, tmp_path, is_async,
                                                                    device):
    source = random_caches(layout, 8)
    block_keys = keys(4)
    store = BlockStore(tmp_path, layout)
    for block_id, key in zip([1, 2, 3, 4], block_keys):
        store.write(key, block_of(source, block_id))
    path = store.path(block_keys[2])
    raw = bytearray(path.read_bytes())
    raw[PREFIX_SIZE + 17] ^= 0x40
    path.write_bytes(bytes(raw))
    target = random_caches(layout, 9, device)
    invalid = load(connector(tmp_path, layout, target), target, [5, 6, 7, 8], block_keys, is_async)
    assert invalid == {7, 8}
    for saved, loaded in [(1, 5), (2, 6)]:
        assert raw_bytes(block_of(target, loaded)) == raw_bytes(block_of(source, saved))


def test_staging_buffers_are_reused_smallest_fit_first(layout):
    from kvrecover.kv_transfer.stores.paged_blocks import MAX_FREE_STAGING

    paged = PagedBlocks(random_caches(layout, 10))
    small, large = paged.staging(2), paged.staging(5)
    assert small.shape == (2, layout.block_nbytes) and large.shape == (5, layout.block_nbytes)
    paged.release(large)
    paged.release(small)
    assert paged.staging(2) is small  # the smallest buffer that fits
    assert paged.staging(2) is large
    assert paged.staging(1) is not small  # the pool is empty again: a fresh buffer
    for count in range(1, MAX_FREE_STAGING + 3):
        paged.release(paged.staging(count) if count > MAX_FREE_STAGING else torch.empty(
            (count, layout.block_nbytes), dtype=torch.uint8))
    assert len(paged._free_staging) == MAX_FREE_STAGING
    assert min(buffer.shape[0] for buffer, _ in paged._free_staging) == 3  # the smallest went


def test_async_loads_into_a_reused_buffer_stay_byte_identical(layout, tmp_path):
    source = random_caches(layout, 11)
    block_keys = keys(4)
    store = BlockStore(tmp_path, layout)
    for block_id, key in zip([1, 2, 3, 4], block_keys):
        store.write(key, block_of(source, block_id))
    target = random_caches(layout, 12, "cpu-strided")  # staged (a direct cache reads in)
    worker = connector(tmp_path, layout, target)
    assert not load(worker, target, [5, 6, 7, 8], block_keys, is_async=True)
    assert len(worker._paged._free_staging) == 1
    assert not load(worker, target, [3, 1], block_keys[2:], is_async=True)  # reuses it
    assert len(worker._paged._free_staging) == 1
    for saved, loaded in [(1, 5), (2, 6), (3, 3), (4, 1)]:
        assert raw_bytes(block_of(target, loaded)) == raw_bytes(block_of(source, saved))


@pytest.fixture
def small_chunks(monkeypatch, layout):
    """Chunks of two rows, so that a load of a few blocks spreads over several threads."""
    monkeypatch.setattr(staged_io, "CHUNK_BYTES", 2 * layout.block_nbytes)


STAGED = ["cpu-strided", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the pinned staging path needs a GPU")])]


def stored(tmp_path, layout, count: int, seed: int) -> tuple[list[torch.Tensor], list[bytes]]:
    """`count` blocks (ids 1..count of seeded caches) saved under tmp_path, and their keys."""
    source = random_caches(layout, seed)
    store = BlockStore(tmp_path, layout)
    for block_id, key in zip(range(1, count + 1), keys(count)):
        store.write(key, block_of(source, block_id))
    return source, keys(count)


@pytest.mark.parametrize("device", STAGED)
@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("verify", [False, True], ids=["plain", "verified"])
def test_threaded_staged_loads_are_byte_identical(layout, tmp_path, small_chunks, is_async,
                                                  device, verify, entry_reads):
    source, block_keys = stored(tmp_path, layout, 7, seed=20)
    target = random_caches(layout, 21, device)
    worker = connector(tmp_path, layout, target, io_threads=3, verify_after_load=verify)
    assert not worker._paged.direct and worker.io_threads == 3
    readers, second_reader = hold_reads_until_two_threads_read(
        worker.store, "read_entries_into" if entry_reads == "native" else "read_into")
    loaded_ids = [8, 2, 3, 4, 6, 5, 1]
    assert not load(worker, target, loaded_ids, block_keys, is_async)
    assert len(readers) >= 2 and second_reader.is_set()  # 4 chunks of 2 rows, 3 threads
    for saved, loaded in zip(range(1, 8), loaded_ids):
        assert raw_bytes(block_of(target, loaded)) == raw_bytes(block_of(source, saved))
    assert raw_bytes(block_of(target, 7)) == raw_bytes(block_of(random_caches(layout, 21), 7))


@pytest.mark.parametrize("device", STAGED)
@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_threaded_staged_load_stops_at_the_first_corrupt_entry(layout, tmp_path, small_chunks,
                                                               is_async, device, entry_reads):
    source, block_keys = stored(tmp_path, layout, 7, seed=22)
    path = BlockStore(tmp_path, layout).path(block_keys[3])  # the second row of chunk 1
    raw = bytearray(path.read_bytes())
    raw[PREFIX_SIZE + 3] ^= 0x10
    path.write_bytes(bytes(raw))
    target = random_caches(layout, 23, device)
    worker = connector(tmp_path, layout, target, io_threads=4)
    loaded_ids = [1, 2, 3, 4, 5, 6, 7]
    assert load(worker, target, loaded_ids, block_keys, is_async) == {4, 5, 6, 7}
    assert block_keys[3] in worker._suspect_keys
    for block_id in (1, 2, 3):
        assert raw_bytes(block_of(target, block_id)) == raw_bytes(block_of(source, block_id))


@pytest.mark.parametrize("verify", [False, True], ids=["plain", "verified"])
def test_direct_loads_on_several_threads_are_byte_identical(layout, tmp_path, monkeypatch, verify,
                                                            row_copies):
    """A sync load into a CPU cache goes through bounce rows, two blocks per thread claim."""
    monkeypatch.setattr(paged_blocks, "DIRECT_CHUNK_BYTES", 2 * layout.block_nbytes)
    source, block_keys = stored(tmp_path, layout, 7, seed=30)
    target = random_caches(layout, 31)
    worker = connector(tmp_path, layout, target, io_threads=3, verify_after_load=verify)
    assert worker._paged.direct
    readers, second_reader = hold_reads_until_two_threads_read(worker.store,
                                                               "read_unchecked_into")
    loaded_ids = [8, 2, 3, 4, 6, 5, 1]
    assert not load(worker, target, loaded_ids, block_keys, is_async=False)
    assert len(readers) >= 2 and second_reader.is_set()
    for saved, loaded in zip(range(1, 8), loaded_ids):
        assert raw_bytes(block_of(target, loaded)) == raw_bytes(block_of(source, saved))
    assert raw_bytes(block_of(target, 7)) == raw_bytes(block_of(random_caches(layout, 31), 7))
    assert len(worker._paged._free_bounce_rows) >= 2  # each thread's row, back for reuse


@pytest.fixture(params=["native", "python"])
def entry_reads(request, monkeypatch) -> str:
    """A staged load reads each chunk of entries in one C call (`entry_read`, off the GIL)
    or entry by entry in Python (where no C compiler is found)."""
    if request.param == "python":
        monkeypatch.setattr(entry_read.EntryReader, "shared", staticmethod(lambda: None))
    elif entry_read.EntryReader.shared() is None:
        pytest.skip("the native entry reader is off here (no C compiler, or "
                    "KVRECOVER_NATIVE_KERNELS=0)")
    return request.param


@pytest.fixture(params=["native", "python"])
def row_copies(request, monkeypatch) -> str:
    """Rows go into a direct (CPU) cache through `native_copy` (one C call, off the GIL)
    or through Python's per-part copies (where no C compiler is found)."""
    if request.param == "python":
        monkeypatch.setattr(native_copy, "_library", lambda: None)
    elif native_copy._library() is None:
        pytest.skip("the native row installer is off here (no C compiler, or KVRECOVER_NATIVE_KERNELS=0)")
    return request.param


def copies_write_nothing(monkeypatch, row_copies: str) -> None:
    """Every copy of a row into a direct cache writes nothing (its check still runs)."""
    if row_copies == "python":
        monkeypatch.setattr(PagedBlocks, "_copy_row", staticmethod(lambda row, parts: None))
        return
    install = native_copy.RowInstaller.install
    monkeypatch.setattr(native_copy.RowInstaller, "install",
                        lambda self, rows, positions, block_ids, check, copy=True: install(
                            self, rows, positions, block_ids, check, copy=False))
    monkeypatch.setattr(native_copy.RowInstaller, "install_one",  # a direct load's copies
                        lambda self, row, block_id: install(self, row, [0], [block_id],
                                                            check=True, copy=False)[0])


@pytest.mark.parametrize("verify", [False, True], ids=["plain", "verified"])
def test_a_direct_load_checks_the_bytes_that_reached_the_cache(layout, tmp_path, monkeypatch,
                                                               caplog, verify, row_copies):
    """The copy into the cache is checked there, whatever `verify_after_load` says
    (the payload hashed in the cache, or compared there with its hashed row): a copy
    that wrote nothing is a failed block, never a loaded one."""
    _, block_keys = stored(tmp_path, layout, 3, seed=32)
    target = random_caches(layout, 33)
    worker = connector(tmp_path, layout, target, verify_after_load=verify)
    assert (worker._paged._installer is None) == (row_copies == "python")
    copies_write_nothing(monkeypatch, row_copies)
    with caplog.at_level("WARNING"):
        assert load(worker, target, [4, 5, 6], block_keys, is_async=False) == {4, 5, 6}
    assert ("payload checksum mismatch" if row_copies == "python"
            else "differs from its verified row") in caplog.text
    assert block_keys[0] in worker._suspect_keys  # a later save may replace it


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_a_corrupt_entry_fails_through_either_row_copy(layout, tmp_path, row_copies, is_async):
    """A flipped payload bit through the native or the Python copies: that block and the
    ones after it fail, the ones before it are loaded byte for byte."""
    source, block_keys = stored(tmp_path, layout, 5, seed=36)
    path = BlockStore(tmp_path, layout).path(block_keys[2])
    raw = bytearray(path.read_bytes())
    raw[PREFIX_SIZE + len(raw) // 3] ^= 0x10
    path.write_bytes(bytes(raw))
    target = random_caches(layout, 37)
    worker = connector(tmp_path, layout, target)
    assert load(worker, target, [3, 4, 5, 6, 7], block_keys, is_async) == {5, 6, 7}
    for saved, loaded in zip(range(1, 3), [3, 4]):
        assert raw_bytes(block_of(target, loaded)) == raw_bytes(block_of(source, saved))


def test_a_native_sync_load_never_copies_a_corrupt_row_into_the_cache(layout, tmp_path):
    """Through `native_copy` a sync load hashes the row before the copy: a corrupt
    entry's block keeps what it held (the Python copies write it, then fail it)."""
    if native_copy._library() is None:
        pytest.skip("the native row installer is off here (no C compiler, or KVRECOVER_NATIVE_KERNELS=0)")
    _, block_keys = stored(tmp_path, layout, 2, seed=38)
    path = BlockStore(tmp_path, layout).path(block_keys[0])
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0x01
    path.write_bytes(bytes(raw))
    target = random_caches(layout, 39)
    before = raw_bytes(block_of(target, 4))
    worker = connector(tmp_path, layout, target)
    assert load(worker, target, [4, 5], block_keys, is_async=False) == {4, 5}
    assert raw_bytes(block_of(target, 4)) == before


def staged_rows(layout, source, block_ids: list[int]) -> tuple[StagedRows, list[int]]:
    """The given blocks of `source` as host rows to install, and their payload checksums."""
    host = torch.stack([block_of(source, block_id).view(torch.uint8).reshape(-1)
                        for block_id in block_ids])
    return StagedRows(host), [payload_checksum(row) for row in host]


def test_a_row_changed_after_its_read_check_fails_the_native_install(layout, monkeypatch):
    """An install of staged rows into a CPU cache compares the cache with the row and
    hashes the row again: a row that changed after its read's check (and was copied
    faithfully) still fails its block."""
    if native_copy._library() is None:
        pytest.skip("the native row installer is off here (no C compiler, or KVRECOVER_NATIVE_KERNELS=0)")
    source, target = random_caches(layout, 40), random_caches(layout, 41)
    paged = PagedBlocks(target)
    staged, checksums = staged_rows(layout, source, [1, 2, 3])
    install = native_copy.RowInstaller.install

    def changing(self, rows, positions, block_ids, check, copy=True):
        rows.view(-1)[positions[1] * self.row_nbytes + 7] ^= 0x04  # the second row
        return install(self, rows, positions, block_ids, check, copy)

    monkeypatch.setattr(native_copy.RowInstaller, "install", changing)
    assert paged.install_rows([4, 5, 6], [0, 1, 2], staged, checksums) == [True, False, True]
    assert raw_bytes(block_of(target, 4)) == raw_bytes(block_of(source, 1))


def test_the_native_installer_refuses_a_block_outside_the_cache(layout):
    caches = random_caches(layout, 42)
    installer = native_copy.RowInstaller.for_caches(caches)
    if installer is None:
        pytest.skip("the native row installer is off here (no C compiler, or KVRECOVER_NATIVE_KERNELS=0)")
    before = [cache.clone() for cache in caches]
    rows = torch.zeros((2, installer.row_nbytes), dtype=torch.uint8)
    with pytest.raises(ValueError, match="outside the cache"):
        installer.install(rows, [0, 1], [1, NUM_BLOCKS], check=True)
    with pytest.raises(ValueError, match="row positions"):
        installer.install(rows, [0, 2], [1, 2], check=True)
    assert all(torch.equal(cache, old) for cache, old in zip(caches, before))
    assert installer.install(rows, [1], [3], check=True) == [True]
    assert raw_bytes(block_of(caches, 3)) == bytes(installer.row_nbytes)
    with pytest.raises(ValueError, match="outside the cache"):
        installer.install_one(rows[0], NUM_BLOCKS)
    row = torch.arange(installer.row_nbytes, dtype=torch.int64).to(torch.uint8)
    assert installer.install_one(row, 2)
    assert raw_bytes(block_of(caches, 2)) == raw_bytes(row)


def test_an_install_into_a_cpu_cache_checks_the_copy_when_asked(layout, monkeypatch, row_copies):
    """Staged rows copied into a CPU cache (`PagedBlocks.install_rows`): with checksums,
    a copy that wrote nothing is caught in the cache; without, it is taken on trust."""
    source, target = random_caches(layout, 34), random_caches(layout, 35)
    paged = PagedBlocks(target)
    copies_write_nothing(monkeypatch, row_copies)
    staged, checksums = staged_rows(layout, source, [1, 2, 3])
    assert paged.install_rows([4, 5, 6], [0, 1, 2], staged, checksums) == [False] * 3
    staged, _ = staged_rows(layout, source, [1, 2, 3])
    assert paged.install_rows([4, 5, 6], [0, 1, 2], staged, None) == [True] * 3


def test_an_async_load_into_a_cpu_cache_writes_it_during_the_read(layout, tmp_path, row_copies):
    """An async load into a contiguous CPU cache reads through bounce rows into the
    cache, as a sync one does (no staging buffer), checked there."""
    source, block_keys = stored(tmp_path, layout, 4, seed=43)
    target = random_caches(layout, 44)
    worker = connector(tmp_path, layout, target)
    assert not load(worker, target, [5, 6, 7, 8], block_keys, is_async=True)
    assert not worker._paged._free_staging  # nothing was staged
    for saved, loaded in zip(range(1, 5), [5, 6, 7, 8]):
        assert raw_bytes(block_of(target, loaded)) == raw_bytes(block_of(source, saved))


@pytest.mark.parametrize("device", STAGED)
def test_verify_after_load_catches_a_garbled_scatter(layout, tmp_path, device, monkeypatch):
    _, block_keys = stored(tmp_path, layout, 4, seed=24)
    target = random_caches(layout, 25, device)
    worker = connector(tmp_path, layout, target)
    scatter = worker._paged._scatter

    def swapped(block_ids, positions, staged):  # rows 2 and 3 land in each other's blocks
        return scatter([*block_ids[:2], block_ids[3], block_ids[2]], positions, staged)

    monkeypatch.setattr(worker._paged, "_scatter", swapped)
    assert load(worker, target, [5, 6, 7, 8], block_keys, is_async=False) == {7, 8}
    worker.verify_after_load = False  # the same garbling goes unseen without the check
    assert not load(worker, target, [5, 6, 7, 8], block_keys, is_async=False)


@pytest.mark.parametrize("device", STAGED)
def test_staged_saves_with_threads_write_the_same_files(layout, tmp_path, device):
    source = random_caches(layout, 26, device)
    block_keys, saved_ids = keys(6), [3, 1, 2, 8, 7, 5]
    worker = connector(tmp_path / "threads", layout, source, io_threads=4)
    worker.bind_connector_metadata(StorageConnectorMetadata(
        saves=[BlockTransfer("a", saved_ids[:4], block_keys[:4]),
               BlockTransfer("b", saved_ids[2:], block_keys[2:])]))  # shares two blocks
    worker.wait_for_save()
    assert worker.get_save_failures() == 0
    plain = BlockStore(tmp_path / "plain", layout)
    for block_id, key in zip(saved_ids, block_keys):
        plain.write(key, block_of(source, block_id))
        assert worker.store.path(key).read_bytes() == plain.path(key).read_bytes()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_loads_reuse_one_pinned_staging_buffer(layout, tmp_path):
    _, block_keys = stored(tmp_path, layout, 4, seed=27)
    target = random_caches(layout, 28, "cuda")
    worker = connector(tmp_path, layout, target)
    assert not load(worker, target, [1, 2, 3, 4], block_keys, is_async=False)
    (buffer, _), = worker._paged._free_staging
    assert buffer.is_pinned()
    assert not load(worker, target, [5, 6], block_keys[:2], is_async=True)
    (again, _), = worker._paged._free_staging
    assert again.data_ptr() == buffer.data_ptr()


def test_read_rows_stops_after_a_failure_and_uploads_what_was_read():
    read, uploaded = [], []

    def read_row(position: int) -> int:
        read.append(position)
        if position == 5:
            raise BlockLoadError("bad")
        return 100 + position

    results = staged_io.read_rows(9, read_row, threading.Event(), threads=1, rows_per_chunk=3,
                                  after_chunk=lambda start, end: uploaded.append((start, end)))
    assert results[:5] == [100, 101, 102, 103, 104]
    assert isinstance(results[5], BlockLoadError) and results[6:] == [None] * 3
    assert read == [0, 1, 2, 3, 4, 5] and uploaded == [(0, 3), (3, 5)]


def test_read_rows_reports_a_failed_upload_and_honours_cancellation():
    cancelled = threading.Event()

    def failing_upload(start: int, end: int) -> None:
        if start == 2:
            raise RuntimeError("upload failed")

    results = staged_io.read_rows(6, lambda position: position, cancelled, threads=3,
                                  rows_per_chunk=2, after_chunk=failing_upload)
    assert results[:2] == [0, 1] and isinstance(results[2], RuntimeError)
    cancelled.set()
    assert staged_io.read_rows(4, lambda position: position, cancelled, 2, 1) == [None] * 4


def test_write_rows_attempts_every_row_and_counts_failures():
    written = []
    lock = threading.Lock()

    def write_row(position: int) -> None:
        with lock:
            written.append(position)
        if position % 3 == 0:
            raise OSError("disk full")

    assert staged_io.write_rows(10, write_row, threads=4) == 4
    assert sorted(written) == list(range(10))


def test_io_threads_must_be_a_small_whole_number(layout, tmp_path):
    for bad in (0, 65, 2.5, True, "4"):
        with pytest.raises(ValueError, match="io_threads"):
            connector(tmp_path, layout, random_caches(layout, 0), io_threads=bad)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU")])])
@pytest.mark.parametrize("async_load", [False, True], ids=["sync", "async"])
def test_engine_decodes_loaded_kv_to_the_same_tokens(tiny_llama, tmp_path, monkeypatch, device,
                                                     async_load):
    """End to end through the engine: a producer stores the prompts' KV, a consumer
    loads it (staged loads: three threads, one block per chunk) and decodes the same ids; with
    one stored entry corrupted, recovery recomputes it and the ids still match."""
    monkeypatch.setattr(staged_io, "CHUNK_BYTES", 1)  # one block per chunk: every thread works
    prompts = KV_PROMPTS
    producer = make_kv_llm(tiny_llama, storage_transfer(tmp_path, "kv_producer"), device=device)
    expected = kv_generate(producer, prompts)
    del producer

    def consumer() -> LLM:
        return make_kv_llm(tiny_llama, storage_transfer(
            tmp_path, "kv_consumer", async_load=async_load, io_threads=3), device=device)

    loaded = consumer()
    assert kv_generate(loaded, prompts) == expected
    assert loaded.stats["prompt_tokens_external"] == KV_BLOCK * sum(KV_LOADABLE)
    assert loaded.stats["kv_load_failed_blocks"] == 0
    del loaded
    files = block_files(tmp_path)
    raw = bytearray(files[len(files) // 2].read_bytes())
    raw[PREFIX_SIZE + 7] ^= 0x01
    files[len(files) // 2].write_bytes(bytes(raw))
    recovered = consumer()
    assert kv_generate(recovered, prompts) == expected
    assert recovered.stats["kv_load_failed_blocks"] >= 1
    assert recovered.stats["kv_load_recovered_requests"] >= 1
