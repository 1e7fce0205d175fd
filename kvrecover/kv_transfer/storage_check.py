"""Offline verification of a block store folder (`kvrecover storage verify`)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import xxhash

from kvrecover.kv_transfer.block_store import (
    HEADER,
    HEADER_CHECKSUM,
    MAGIC,
    PREFIX_SIZE,
    SUFFIX,
    VERSION,
)

_ITEM_SIZES = {b"float32": 4, b"bfloat16": 2, b"float16": 2}
MAX_BLOCK_BYTES = 1 << 30  # no sane block is larger; bigger headers are bogus


@dataclass
class EntryReport:
    """The verdict on one stored file."""

    path: Path
    problem: str | None  # None when the entry verifies


def check_entry(path: Path) -> str | None:
    """Why a stored block file is bad, or None if it verifies (header, size, checksums)."""
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if size < PREFIX_SIZE:
                return f"truncated: {size} bytes"
            prefix = handle.read(PREFIX_SIZE)
            header = prefix[: HEADER.size]
            (header_sum,) = HEADER_CHECKSUM.unpack_from(prefix, HEADER.size)
            if xxhash.xxh3_64_intdigest(header) != header_sum:
                return "header checksum mismatch"
            (magic, version, _flags, fingerprint, key, layers, block_size, heads, head_dim,
             dtype_name, nbytes, payload_sum) = HEADER.unpack(header)
            if magic != MAGIC or version != VERSION:
                return "not a kvrecover block file"
            item = _ITEM_SIZES.get(dtype_name.rstrip(b"\0"))
            if item is None:
                return f"unknown dtype {dtype_name!r}"
            expected = layers * 2 * block_size * heads * head_dim * item
            if expected != nbytes or nbytes > MAX_BLOCK_BYTES:
                return "header sizes are inconsistent"
            if size != PREFIX_SIZE + nbytes:
                return f"size {size} bytes, header says {PREFIX_SIZE + nbytes}"
            if path.name != f"{key.hex()}{SUFFIX}":
                return "file name does not match the key in its header"
            if path.parent.parent.name != fingerprint.decode(errors="replace"):
                return "folder does not match the layout fingerprint in its header"
            if xxhash.xxh3_64_intdigest(handle.read(nbytes)) != payload_sum:
                return "payload checksum mismatch"
    except OSError as error:
        return f"unreadable: {error}"
    return None


def scan_store(root: Path) -> Iterator[EntryReport]:
    """Verify every block file under a store root (all layouts); stray temp files are bad too."""
    for path in sorted(root.rglob("*")):
        if path.is_file() and (path.name.endswith(SUFFIX) or path.name.endswith(".tmp")):
            if path.name.endswith(".tmp"):
                yield EntryReport(path, "leftover temporary file of an interrupted write")
            else:
                yield EntryReport(path, check_entry(path))
