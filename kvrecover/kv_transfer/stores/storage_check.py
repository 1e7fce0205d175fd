"""Offline verification of a block store folder (`kvrecover storage verify`).

Judged under the root: every entry named like a block (`*.kvblock`) or a
leftover temporary file (`*.tmp`), whatever its type, and every symbolic link
(the store never makes links; one in place of a folder would redirect reads).
Other files are left alone. A non-regular entry is flagged from `lstat` alone,
never opened (opening a FIFO can block). A regular file is opened without
following links and without blocking, its header decoded by the store's own
decoder (`BlockHeader.unpack`) and its sizes checked against the file size
before the payload is streamed through the checksum in 1 MiB chunks: memory
stays bounded whatever a header claims.
"""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import xxhash

from kvrecover.kv_transfer.stores.block_store import (
    MAGIC,
    PREFIX_SIZE,
    SUFFIX,
    VERSION,
    BlockHeader,
    BlockLoadError,
)

TEMPORARY_SUFFIX = ".tmp"
MAX_BLOCK_BYTES = 1 << 30  # no sane block is larger; bigger headers are bogus
CHUNK_BYTES = 1 << 20
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0)


@dataclass
class EntryReport:
    """The verdict on one stored file."""

    path: Path
    problem: str | None  # None when the entry verifies


def _non_regular_kind(mode: int) -> str | None:
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a device"


def check_entry(path: Path) -> str | None:
    """Why a stored block file is bad, or None if it verifies (type, header, size,
    name, checksums)."""
    try:
        kind = _non_regular_kind(os.lstat(path).st_mode)
        if kind is not None:
            return f"{kind}, not a block file"
        with open(os.open(path, _OPEN_FLAGS), "rb", buffering=0) as handle:
            info = os.fstat(handle.fileno())
            kind = _non_regular_kind(info.st_mode)  # replaced since the lstat
            if kind is not None:
                return f"{kind}, not a block file"
            return _check_contents(path, handle, info.st_size)
    except OSError as error:
        return f"unreadable: {error}"


def _check_contents(path: Path, handle, size: int) -> str | None:
    if size < PREFIX_SIZE:
        return f"truncated: {size} bytes"
    try:
        header = BlockHeader.unpack(handle.read(PREFIX_SIZE))
    except BlockLoadError as error:
        return str(error)
    if header.magic != MAGIC or header.version != VERSION:
        return "not a kvrecover block file"
    nbytes = header.shape_nbytes()
    if nbytes is None:
        return f"unknown dtype {header.dtype_name!r}"
    if nbytes != header.payload_nbytes or nbytes > MAX_BLOCK_BYTES:
        return "header sizes are inconsistent"
    if size != PREFIX_SIZE + nbytes:
        return f"size {size} bytes, header says {PREFIX_SIZE + nbytes}"
    if path.name != f"{header.key.hex()}{SUFFIX}":
        return "file name does not match the key in its header"
    if path.parent.parent.name != header.fingerprint.decode(errors="replace"):
        return "folder does not match the layout fingerprint in its header"
    if _streamed_checksum(handle, nbytes) != header.payload_xxh3:
        return "payload checksum mismatch"
    return None


def _streamed_checksum(handle, nbytes: int) -> int | None:
    """xxh3-64 of the next `nbytes` bytes, read through one small reused buffer; None if
    the file ends early (it shrank while being read)."""
    digest = xxhash.xxh3_64()
    buffer = bytearray(min(CHUNK_BYTES, max(nbytes, 1)))
    view = memoryview(buffer)
    remaining = nbytes
    while remaining:
        count = handle.readinto(view[: min(remaining, len(buffer))])
        if not count:
            return None
        digest.update(view[:count])
        remaining -= count
    return digest.intdigest()


def _judged(name: str, mode: int) -> bool:
    return name.endswith((SUFFIX, TEMPORARY_SUFFIX)) or stat.S_ISLNK(mode)


def scan_store(root: Path) -> Iterator[EntryReport]:
    """Verify every entry under a store root (all layouts), in path order; stray
    temporary files, links and non-regular entries are bad too."""
    reports = []
    for folder, subfolders, files in os.walk(root):  # never follows links
        for name in sorted(subfolders + files):
            path = Path(folder) / name
            try:
                mode = os.lstat(path).st_mode
            except OSError:
                continue  # removed meanwhile
            if not _judged(name, mode):
                continue
            if name in subfolders:
                subfolders.remove(name)  # judged as a whole, not descended into
            if name.endswith(TEMPORARY_SUFFIX) and stat.S_ISREG(mode):
                reports.append(EntryReport(path, "leftover temporary file of an interrupted write"))
            else:
                reports.append(EntryReport(path, check_entry(path)))
    yield from sorted(reports, key=lambda report: report.path)


def remove_entry(path: Path) -> None:
    """Delete a bad entry: a link itself (never its target), a directory with its contents."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
