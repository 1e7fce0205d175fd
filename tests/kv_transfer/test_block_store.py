"""BlockStore: the on-disk format of one KV block, and what `read` rejects.

Stored KV is untrusted input (DESIGN.md, Trust): whatever is on disk, `read`
returns the exact block that was written or raises BlockLoadError, nothing else.
"""

from __future__ import annotations

import os
import random
import shutil
import threading

import pytest
import torch
from conftest import make_layout, random_block, rewrite_header, simulate_full_disk

from kvrecover.kv_transfer.stores import entry_read
from kvrecover.kv_transfer.stores.block_store import (
    MAGIC,
    PREFIX_SIZE,
    SUFFIX,
    VERSION,
    BlockHeader,
    BlockLoadError,
    BlockStore,
)
from kvrecover.kv_transfer.stores.storage_check import check_entry

KEY_A = bytes(range(16))
KEY_B = bytes(range(16, 32))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


@pytest.fixture
def store(tmp_path) -> BlockStore:
    return BlockStore(tmp_path / "store", make_layout())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_is_bit_exact(tmp_path, dtype):
    store = BlockStore(tmp_path, make_layout(dtype))
    block = random_block(store, seed=1)
    block[0, 0, 0, 0, :2] = torch.tensor([float("inf"), -0.0])  # odd values survive too
    store.write(KEY_A, block)
    path = store.path(KEY_A)
    assert path == tmp_path / store.layout.fingerprint / KEY_A.hex()[:2] / f"{KEY_A.hex()}{SUFFIX}"
    assert path.stat().st_size == PREFIX_SIZE + store.layout.block_nbytes
    stored = store.read(KEY_A)
    assert same_bits(stored.tensor, block)
    assert stored.tensor.shape == (2, 2, 4, 2, 8)
    assert store.exists(KEY_A) and not store.exists(KEY_B)
    assert [key for key, _ in store.entries()] == [KEY_A]
    assert check_entry(path) is None
    # Only the finished entry is left: no temporary files.
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == [path.name]


def test_the_header_decoder_reads_back_what_write_stored(tmp_path):
    """BlockHeader.unpack is the one decoder (reads and `storage verify` use it)."""
    layout = make_layout(torch.bfloat16)
    store = BlockStore(tmp_path, layout)
    store.write(KEY_A, random_block(store, seed=4))
    raw = store.path(KEY_A).read_bytes()
    header = BlockHeader.unpack(raw[:PREFIX_SIZE])
    assert (header.magic, header.version, header.key, header.num_layers, header.dtype_name) == (
        MAGIC, VERSION, KEY_A, 2, b"bfloat16")
    assert header.fingerprint == layout.fingerprint.encode()
    assert header.shape_nbytes() == header.payload_nbytes == layout.block_nbytes
    assert header.pack() == raw[:PREFIX_SIZE]
    with pytest.raises(BlockLoadError, match="truncated"):
        BlockHeader.unpack(raw[: PREFIX_SIZE - 1])
    flipped = bytearray(raw[:PREFIX_SIZE])
    flipped[20] ^= 1
    with pytest.raises(BlockLoadError, match="header checksum mismatch"):
        BlockHeader.unpack(flipped)


def test_write_replaces_an_entry_atomically_and_remove_deletes_it(store):
    store.write(KEY_A, random_block(store, 1))
    second = random_block(store, 2)
    store.write(KEY_A, second)
    assert same_bits(store.read(KEY_A).tensor, second)
    store.remove(KEY_A)
    assert not store.exists(KEY_A)
    with pytest.raises(BlockLoadError, match="cannot read"):
        store.read(KEY_A)
    store.remove(KEY_A)  # removing a missing entry is fine


def test_write_rejects_a_block_of_another_shape_or_dtype(store):
    with pytest.raises(ValueError, match="does not match the layout"):
        store.write(KEY_A, torch.zeros(2, 2, 4, 2, 7))
    with pytest.raises(ValueError, match="does not match the layout"):
        store.write(KEY_A, torch.zeros(store.block_shape, dtype=torch.float16))
    assert not store.exists(KEY_A)


def test_a_write_that_fails_midway_leaves_no_file(store, monkeypatch):
    import kvrecover.kv_transfer.stores.block_store as block_store_module

    simulate_full_disk(monkeypatch, block_store_module, bytes_before_failure=10)
    with pytest.raises(OSError, match="No space"):
        store.write(KEY_A, random_block(store, 1))
    assert [p for p in store.root.rglob("*") if p.is_file()] == []


# ----- what read rejects ---------------------------------------------------------------
def test_wrong_magic_or_version_is_rejected(store):
    store.write(KEY_A, random_block(store, 1))
    path = store.path(KEY_A)
    pristine = path.read_bytes()
    for change in ({"magic": b"XXXX"}, {"version": VERSION + 1}):
        path.write_bytes(pristine)
        rewrite_header(path, **change)
        with pytest.raises(BlockLoadError, match="header does not match"):
            store.read(KEY_A)
        assert check_entry(path) == "not a kvrecover block file"
    # Without re-sealing, a changed magic already fails the header checksum.
    raw = bytearray(pristine)
    raw[0:4] = b"KVRX"
    path.write_bytes(bytes(raw))
    with pytest.raises(BlockLoadError, match="header checksum"):
        store.read(KEY_A)
    assert MAGIC == b"KVRB"


@pytest.mark.parametrize(
    "field, value",
    [
        ("fingerprint", b"0" * 16),
        ("num_layers", 3),
        ("block_size", 8),
        ("num_kv_heads", 1),
        ("head_dim", 4),
        ("dtype_name", b"float16\0"),
        ("payload_nbytes", 1 << 40),  # a forged size never becomes an allocation
    ],
)
def test_a_self_consistent_header_for_another_layout_is_rejected(store, field, value):
    store.write(KEY_A, random_block(store, 1))
    rewrite_header(store.path(KEY_A), **{field: value})
    assert check_entry(store.path(KEY_A)) is not None
    with pytest.raises(BlockLoadError, match="header does not match"):
        store.read(KEY_A)


@pytest.mark.parametrize(
    "other",
    [
        make_layout(model_identity="another-model"),  # same sizes, other model
        make_layout(torch.float16),  # float16 vs bfloat16: same sizes, other dtype
        make_layout(block_size=8),
        make_layout(num_layers=4),
    ],
)
def test_a_file_of_another_layout_copied_into_this_layout_is_rejected(tmp_path, other):
    mine = BlockStore(tmp_path, make_layout(torch.bfloat16))
    theirs = BlockStore(tmp_path, other)
    assert mine.folder != theirs.folder
    theirs.write(KEY_A, random_block(theirs, 1))
    assert not mine.exists(KEY_A)  # another layout's KV is simply a miss ...
    mine.path(KEY_A).parent.mkdir(parents=True)
    shutil.copy(theirs.path(KEY_A), mine.path(KEY_A))
    with pytest.raises(BlockLoadError):  # ... and never loads even when copied over
        mine.read(KEY_A)


def test_a_file_swapped_with_another_key_is_rejected(store):
    store.write(KEY_A, random_block(store, 1))
    store.write(KEY_B, random_block(store, 2))
    path_a, path_b = store.path(KEY_A), store.path(KEY_B)
    raw_a, raw_b = path_a.read_bytes(), path_b.read_bytes()
    path_a.write_bytes(raw_b)
    path_b.write_bytes(raw_a)
    for key in (KEY_A, KEY_B):
        with pytest.raises(BlockLoadError, match="header does not match"):
            store.read(key)
    assert check_entry(path_a) == "file name does not match the key in its header"


@pytest.mark.parametrize("size", [0, 1, PREFIX_SIZE - 1, PREFIX_SIZE, PREFIX_SIZE + 5, -1])
def test_truncated_files_are_rejected(store, size):
    store.write(KEY_A, random_block(store, 1))
    path = store.path(KEY_A)
    full = path.stat().st_size
    os.truncate(path, full + size if size < 0 else size)
    with pytest.raises(BlockLoadError, match="bytes"):
        store.read(KEY_A)
    assert check_entry(path) is not None


def test_a_longer_file_is_rejected_without_reading_it(store):
    store.write(KEY_A, random_block(store, 1))
    path = store.path(KEY_A)
    os.truncate(path, 1 << 40)  # sparse: a terabyte that must not be read
    with pytest.raises(BlockLoadError, match="bytes"):
        store.read(KEY_A)
    assert check_entry(path) is not None
    path.unlink()


def test_every_header_bit_flip_is_rejected(store):
    store.write(KEY_A, random_block(store, 1))
    path = store.path(KEY_A)
    pristine = path.read_bytes()
    for offset in range(PREFIX_SIZE):
        for bit in (0, 7):
            raw = bytearray(pristine)
            raw[offset] ^= 1 << bit
            with pytest.raises(BlockLoadError):
                store.parse(KEY_A, bytes(raw))
    path.write_bytes(pristine)
    store.read(KEY_A)


def test_payload_bit_flips_are_rejected(store):
    store.write(KEY_A, random_block(store, 1))
    path = store.path(KEY_A)
    pristine = path.read_bytes()
    rng = random.Random(7)
    offsets = [PREFIX_SIZE, len(pristine) - 1] + [
        rng.randrange(PREFIX_SIZE, len(pristine)) for _ in range(30)
    ]
    for offset in offsets:
        raw = bytearray(pristine)
        raw[offset] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(raw))
        with pytest.raises(BlockLoadError, match="payload checksum"):
            store.read(KEY_A)
        assert check_entry(path) == "payload checksum mismatch"


def test_a_directory_or_a_fifo_under_the_entry_name_is_rejected_without_blocking(store):
    store.path(KEY_A).mkdir(parents=True)
    with pytest.raises(BlockLoadError):
        store.read(KEY_A)
    assert not store.exists(KEY_A)
    fifo = store.path(KEY_B)
    fifo.parent.mkdir(parents=True)
    os.mkfifo(fifo)
    outcome: list[BaseException] = []

    def read() -> None:
        try:
            store.read(KEY_B)
        except BaseException as error:  # noqa: BLE001 - recorded and checked below
            outcome.append(error)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout=5)
    if reader.is_alive():  # unblock the reader so the test process can exit
        with open(fifo, "wb"):
            pass
        pytest.fail("reading a FIFO entry blocked")
    assert len(outcome) == 1 and isinstance(outcome[0], BlockLoadError)


def test_read_raises_only_block_load_error_on_random_damage(store):
    """Seeded fuzz: any damage yields BlockLoadError; intact bytes yield the exact block."""
    block = random_block(store, 3)
    store.write(KEY_A, block)
    path = store.path(KEY_A)
    pristine = path.read_bytes()
    rng = random.Random(1234)
    for _ in range(200):
        raw = bytearray(pristine)
        action = rng.choice(["flip", "truncate", "extend", "garbage", "zero_run"])
        if action == "flip":
            for _ in range(rng.randint(1, 4)):
                raw[rng.randrange(len(raw))] ^= rng.randint(1, 255)
        elif action == "truncate":
            del raw[rng.randrange(len(raw)) :]
        elif action == "extend":
            raw += bytes(rng.randint(1, 64))
        elif action == "garbage":
            raw = bytearray(rng.randbytes(len(raw)))
        else:
            start, length = rng.randrange(len(raw)), rng.randint(1, 32)
            raw[start : start + length] = bytes(len(raw[start : start + length]))
        path.write_bytes(bytes(raw))
        if bytes(raw) == pristine:
            assert same_bits(store.read(KEY_A).tensor, block)
            continue
        with pytest.raises(BlockLoadError):
            store.read(KEY_A)


def damaged_entries(store: BlockStore) -> dict[str, bytes]:
    """One entry per way an entry can be bad (and one good), by name: their keys."""
    keys = {name: bytes([index]) * 16 for index, name in enumerate(
        ["good", "missing", "directory", "fifo", "short", "long", "header", "payload",
         "other key"])}
    for name, key in keys.items():
        if name not in ("missing", "directory", "fifo"):
            store.write(key, random_block(store, len(name)))
    store.path(keys["directory"]).mkdir(parents=True, exist_ok=True)
    store.path(keys["fifo"]).parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(store.path(keys["fifo"]))
    os.truncate(store.path(keys["short"]), PREFIX_SIZE + 3)
    os.truncate(store.path(keys["long"]), 1 << 40)
    for name, offset in (("header", 5), ("payload", PREFIX_SIZE + 7)):
        raw = bytearray(store.path(keys[name]).read_bytes())
        raw[offset] ^= 0x40
        store.path(keys[name]).write_bytes(bytes(raw))
    shutil.copy(store.path(keys["good"]), store.path(keys["other key"]))
    return keys


def test_entries_read_in_one_c_call_fail_and_pass_as_read_into_does(store):
    """`read_entries_into` (a staged load's chunks, off the GIL) gives each entry the
    outcome `read_into` gives it, and the same bytes."""
    if entry_read.EntryReader.shared() is None:
        pytest.skip("the native entry reader is off here (no C compiler, or "
                    "KVRECOVER_NATIVE_KERNELS=0)")
    keys = damaged_entries(store)
    nbytes = store.payload_nbytes
    rows = torch.zeros((len(keys), nbytes), dtype=torch.uint8)
    results = store.read_entries_into(list(keys.values()), rows.data_ptr(), nbytes,
                                      every_row=True)
    for index, (name, key) in enumerate(keys.items()):
        row = torch.zeros(nbytes, dtype=torch.uint8)
        try:
            expected: int | str = store.read_into(key, [row.numpy().data.cast("B")])
        except BlockLoadError as error:
            expected = str(error).split(":")[0]
        got = results[index]
        assert (got if isinstance(got, int) else str(got).split(":")[0]) == expected, name
        if name == "good":
            assert torch.equal(rows[index], row)
    assert isinstance(results[0], int) and all(isinstance(r, BlockLoadError) for r in results[1:])


def test_entries_read_in_one_c_call_stop_at_the_first_failure(store):
    if entry_read.EntryReader.shared() is None:
        pytest.skip("the native entry reader is off here")
    keys = [bytes([index]) * 16 for index in range(4)]
    for key in keys[:2] + keys[3:]:
        store.write(key, random_block(store, key[0]))
    nbytes = store.payload_nbytes
    rows = torch.zeros((4, nbytes), dtype=torch.uint8)
    results = store.read_entries_into(keys, rows.data_ptr(), nbytes)
    assert isinstance(results[0], int) and isinstance(results[1], int)
    assert isinstance(results[2], BlockLoadError) and results[3] is None  # never read
    assert not rows[3].any()
