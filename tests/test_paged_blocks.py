"""The zero-copy KV store paths: entries read into and written from a paged cache's own
slices (`PagedBlocks`, `BlockStore.read_into` / `write_parts`) and the staged path,
byte-identical to the plain ones and just as strict about bad entries."""

from __future__ import annotations

import pytest
import torch
import xxhash

from kvrecover.config import KVTransferConfig
from kvrecover.kv_layout import KVCacheLayout
from kvrecover.kv_transfer.base import KVConnectorRole
from kvrecover.kv_transfer.block_store import (
    PREFIX_SIZE,
    BlockLoadError,
    BlockStore,
    payload_checksum,
)
from kvrecover.kv_transfer.paged_blocks import PagedBlocks
from kvrecover.kv_transfer.shared_storage import (
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
        for _ in range(500):  # bounded: a local load of a few blocks finishes at once
            _, done = worker.get_finished(set())
            if done:
                break
            worker._async_loads["r"].future.result(timeout=10)
    return worker.get_block_ids_with_load_errors()


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
    from kvrecover.kv_transfer.paged_blocks import MAX_FREE_STAGING

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
    assert min(buffer.shape[0] for buffer in paged._free_staging) == 3  # the smallest went


def test_async_loads_into_a_reused_buffer_stay_byte_identical(layout, tmp_path):
    source = random_caches(layout, 11)
    block_keys = keys(4)
    store = BlockStore(tmp_path, layout)
    for block_id, key in zip([1, 2, 3, 4], block_keys):
        store.write(key, block_of(source, block_id))
    target = random_caches(layout, 12)
    worker = connector(tmp_path, layout, target)
    assert not load(worker, target, [5, 6, 7, 8], block_keys, is_async=True)
    assert len(worker._paged._free_staging) == 1
    assert not load(worker, target, [3, 1], block_keys[2:], is_async=True)  # reuses it
    assert len(worker._paged._free_staging) == 1
    for saved, loaded in [(1, 5), (2, 6), (3, 3), (4, 1)]:
        assert raw_bytes(block_of(target, loaded)) == raw_bytes(block_of(source, saved))
