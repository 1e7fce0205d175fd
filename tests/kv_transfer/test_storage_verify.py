"""`kvrecover storage verify [--fix]` and the checker behind it (kv_transfer/stores/storage_check.py).

Every entry the store could read is judged: corrupt files, leftover temporary
files and anything that is not a regular file (a directory, a FIFO, a link) are
bad and `--fix` removes them. Checking never opens a FIFO in blocking mode and
never holds more than a small buffer, whatever a header claims.
"""

from __future__ import annotations

import os
import shutil
import threading
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import block_files, make_layout, random_block, rewrite_header

from kvrecover.cli import main as cli_main
from kvrecover.kv_layout import KVCacheLayout
from kvrecover.kv_transfer.stores.block_store import PREFIX_SIZE, SUFFIX, BlockStore
from kvrecover.kv_transfer.stores.storage_check import check_entry, scan_store

KEYS = [bytes([i]) * 16 for i in range(6)]
KEY_A = bytes(range(16))


@pytest.fixture
def store(tmp_path) -> BlockStore:
    """A store root with two good entries (KEYS[0], KEYS[1]) of one layout."""
    store = BlockStore(tmp_path / "store", make_layout())
    for index, key in enumerate(KEYS[:2]):
        store.write(key, random_block(store, index))
    return store


def verify(root: Path, capsys, *flags: str) -> tuple[int, list[str]]:
    capsys.readouterr()
    code = cli_main(["storage", "verify", str(root), *flags])
    return code, capsys.readouterr().out.splitlines()


def bounded(action: Callable[[], object], fifos: list[Path]) -> object:
    """Run `action` in a thread; fail (after unblocking any reader of `fifos`) if it blocks."""
    outcome: list[object] = []
    worker = threading.Thread(target=lambda: outcome.append(action()), daemon=True)
    worker.start()
    worker.join(timeout=60)
    if worker.is_alive():
        for fifo in fifos:  # a reader blocked in open() returns once a writer opens
            with open(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK), "wb"):
                pass
        worker.join(timeout=10)
        pytest.fail("verifying the store blocked on an entry")
    return outcome[0]


def test_storage_verify_counts_reports_and_fixes(tmp_path, capsys):
    layout = KVCacheLayout("verify-test", torch.float32, 4, 2, 2, 8)
    store = BlockStore(tmp_path, layout)
    generator = torch.Generator().manual_seed(0)
    for key in KEYS:
        store.write(key, torch.randn(store.block_shape, generator=generator))
    flipped, truncated, emptied = (store.path(k) for k in KEYS[:3])
    raw = bytearray(flipped.read_bytes())
    raw[PREFIX_SIZE + 5] ^= 1
    flipped.write_bytes(bytes(raw))
    os.truncate(truncated, PREFIX_SIZE + 3)
    emptied.write_bytes(b"")
    leftover = store.path(KEYS[3]).with_name(f".{KEYS[3].hex()}{SUFFIX}.99.abcd.tmp")
    leftover.write_bytes(b"partial")

    code, out = verify(tmp_path, capsys)
    assert code == 1
    assert sorted(out[:-1]) == sorted([
        f"bad: {flipped}: payload checksum mismatch",
        f"bad: {truncated}: size {PREFIX_SIZE + 3} bytes, header says "
        f"{PREFIX_SIZE + layout.block_nbytes}",
        f"bad: {emptied}: truncated: 0 bytes",
        f"bad: {leftover}: leftover temporary file of an interrupted write",
    ])
    assert out[-1] == f"3 good, 4 bad entries under {tmp_path}"

    code, out = verify(tmp_path, capsys, "--fix")
    assert code == 0
    assert sum(line.startswith("removed: ") for line in out) == 4
    assert block_files(tmp_path) == sorted(store.path(k) for k in KEYS[3:])
    assert not leftover.exists()

    assert verify(tmp_path, capsys) == (0, [f"3 good, 0 bad entries under {tmp_path}"])
    assert all(store.read(k).tensor.shape == store.block_shape for k in KEYS[3:])


def test_storage_verify_of_a_missing_folder_is_a_usage_error(tmp_path, capsys):
    assert cli_main(["storage", "verify", str(tmp_path / "nope")]) == 2
    assert "is not a folder" in capsys.readouterr().err
    assert verify(tmp_path, capsys) == (0, [f"0 good, 0 bad entries under {tmp_path}"])


# ----- entries that are not regular files ------------------------------------------------
def plant(store: BlockStore, kind: str) -> tuple[Path, str, Path | None]:
    """Put a non-regular entry where the store would read; returns (its path, the expected
    verdict, a path that must survive --fix or None)."""
    entry = store.path(KEYS[2])
    entry.parent.mkdir(parents=True, exist_ok=True)
    outside = store.root.parent / "outside"
    if kind == "directory":
        entry.mkdir()
        (entry / "inside").write_bytes(b"x")
        return entry, "a directory, not a block file", None
    if kind == "fifo":
        os.mkfifo(entry)
        return entry, "a FIFO, not a block file", None
    if kind == "temporary-fifo":
        entry = entry.with_name(f".{entry.name}.1.ab.tmp")
        os.mkfifo(entry)
        return entry, "a FIFO, not a block file", None
    if kind == "link-to-a-good-entry":  # the target verifies; the link is still not an entry
        outside.mkdir()
        target = outside / entry.name
        shutil.copy(store.path(KEYS[0]), target)
        entry.symlink_to(target)
        return entry, "a symbolic link, not a block file", target
    if kind == "link-to-dev-zero":
        entry.symlink_to("/dev/zero")
        return entry, "a symbolic link, not a block file", Path("/dev/zero")
    if kind == "dangling-link":
        entry.symlink_to(store.root / "nowhere")
        return entry, "a symbolic link, not a block file", None
    assert kind == "linked-layout-folder"  # a whole layout folder redirected elsewhere
    outside.mkdir()
    (outside / "01").mkdir()
    (outside / "01" / "keep").write_bytes(b"x")
    folder = store.root / ("f" * 16)
    folder.symlink_to(outside, target_is_directory=True)
    return folder, "a symbolic link, not a block file", outside / "01" / "keep"


NON_REGULAR = ["directory", "fifo", "temporary-fifo", "link-to-a-good-entry", "link-to-dev-zero",
               "dangling-link", "linked-layout-folder"]


@pytest.mark.parametrize("kind", NON_REGULAR)
def test_a_non_regular_entry_is_bad_and_fix_removes_it(store, capsys, kind):
    entry, verdict, survivor = plant(store, kind)
    fifos = [entry] if "fifo" in kind else []
    assert bounded(lambda: check_entry(entry), fifos) == verdict
    code, out = bounded(lambda: verify(store.root, capsys), fifos)
    assert (code, out) == (1, [f"bad: {entry}: {verdict}",
                               f"2 good, 1 bad entries under {store.root}"])
    code, out = bounded(lambda: verify(store.root, capsys, "--fix"), fifos)
    assert code == 0 and out[0] == f"removed: {entry}: {verdict}"
    assert not os.path.lexists(entry)
    if survivor is not None:  # a link is removed, never what it points to
        assert survivor.exists()
    assert verify(store.root, capsys) == (0, [f"2 good, 0 bad entries under {store.root}"])
    assert [key for key, _ in store.entries()] == KEYS[:2]


def test_other_files_in_the_store_are_left_alone(store, capsys):
    (store.root / "README").write_text("notes")
    os.mkfifo(store.root / "a-fifo")  # not named like an entry: never read by the store
    assert verify(store.root, capsys, "--fix") == (0, [f"2 good, 0 bad entries under {store.root}"])
    assert (store.root / "README").exists() and (store.root / "a-fifo").exists()


# ----- forged headers: bounded memory ---------------------------------------------------
def peak_allocation(action: Callable[[], object]) -> tuple[object, int]:
    tracemalloc.start()
    try:
        result = action()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_forged_header_claiming_1_gib_is_checked_in_bounded_memory(store):
    """A self-consistent header for a 1 GiB block over a sparse 1 GiB file: the payload is
    streamed through the checksum, never held whole."""
    path = store.path(KEYS[0])
    layers = (1 << 30) // (2 * 4 * 2 * 8 * 4)  # [layers, K/V, block 4, 2 heads, dim 8] float32
    rewrite_header(path, num_layers=layers, payload_nbytes=1 << 30)
    os.truncate(path, PREFIX_SIZE + (1 << 30))
    verdict, peak = peak_allocation(lambda: check_entry(path))
    assert verdict == "payload checksum mismatch"
    assert peak < 8 << 20, f"peak allocation {peak} bytes"
    path.unlink()


def test_a_header_beyond_the_block_size_limit_is_rejected_before_reading(store):
    path = store.path(KEYS[0])
    layers = (1 << 31) // (2 * 4 * 2 * 8 * 4)  # 2 GiB: self-consistent, but no sane block
    rewrite_header(path, num_layers=layers, payload_nbytes=1 << 31)
    os.truncate(path, PREFIX_SIZE + (1 << 31))
    verdict, peak = peak_allocation(lambda: check_entry(path))
    assert verdict == "header sizes are inconsistent"  # decided before the payload checksum
    assert peak < 1 << 20
    path.unlink()


def test_scan_store_reports_every_bad_entry_and_leftover_temporary_file(tmp_path):
    float_store = BlockStore(tmp_path, make_layout())
    half_store = BlockStore(tmp_path, make_layout(torch.bfloat16))
    for index in range(3):
        float_store.write(bytes([index]) * 16, random_block(float_store, index))
        half_store.write(bytes([index]) * 16, random_block(half_store, index))
    raw = bytearray(half_store.path(bytes([1]) * 16).read_bytes())
    raw[-1] ^= 0xFF
    half_store.path(bytes([1]) * 16).write_bytes(bytes(raw))
    moved = tmp_path / ("0" * 16) / "02"
    moved.mkdir(parents=True)
    shutil.move(float_store.path(bytes([2]) * 16), moved / f"{(bytes([2]) * 16).hex()}{SUFFIX}")
    leftover = float_store.path(KEY_A).parent / f".{KEY_A.hex()}{SUFFIX}.123.abc.tmp"
    leftover.parent.mkdir(parents=True, exist_ok=True)
    leftover.write_bytes(b"half a block")
    (tmp_path / "README").write_text("not an entry")  # other files are ignored
    reports = list(scan_store(tmp_path))
    assert [r.path for r in reports] == sorted(r.path for r in reports)
    problems = {report.path: report.problem for report in reports}
    assert len(problems) == 7
    assert sorted(p for p in problems.values() if p) == [
        "folder does not match the layout fingerprint in its header",
        "leftover temporary file of an interrupted write",
        "payload checksum mismatch",
    ]
