"""Stored entries read into staging rows and hashed, a chunk per C call, off the GIL
(`csrc/entry_read.c`).

A staged load's reader threads each open, check, read, close and hash every entry of
their chunks; from Python each of those calls gives up the GIL and takes it back, and
with 8-16 threads that hand-over bounds the load, not the copying. Here one ctypes call
(which releases the GIL) does all of it for a chunk of entries; the caller checks the
headers (`BlockCodec._check_header`). The payload hash is python-xxhash's own XXH3-64
(its extension exports the C function; used only after it hashed a probe as
`xxhash.xxh3_64_intdigest` does).

Compiled at first use like the CPU kernels (`ops.cpu.native_build`); without a compiler,
with `KVRECOVER_NATIVE_KERNELS=0`, or without that export, `EntryReader.shared()` is None
and the store reads entry by entry in Python.
"""

from __future__ import annotations

import ctypes
import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import xxhash

from kvrecover.ops.cpu.native_build import load_library, native_kernels_default

SOURCE_DIR = Path(__file__).parent / "csrc"
READ, NOT_REGULAR, WRONG_SIZE, ENDED = 0, 1, 2, 3  # kvr_read_entries' statuses (< 0: -errno)

_UNSET = object()
_shared: object = _UNSET


@dataclass
class EntryReads:
    """What one call read: per entry its status, size (see READ...) and payload hash,
    the prefixes (header + header checksum) one after another, and how many entries
    were tried (the rest were not read)."""

    status: Sequence[int]
    sizes: Sequence[int]
    checksums: Sequence[int]
    prefixes: bytearray
    tried: int


def _xxh3_64() -> int | None:
    """The address of python-xxhash's C XXH3_64bits, once it hashed a probe right."""
    try:
        extension = importlib.import_module("xxhash._xxhash")  # it holds the C library
        function = ctypes.CDLL(extension.__file__).XXH3_64bits
    except (ImportError, OSError, AttributeError, TypeError):
        return None
    function.restype, function.argtypes = ctypes.c_uint64, [ctypes.c_void_p, ctypes.c_size_t]
    probe = bytes(range(256)) * 97  # past xxh3's short-input paths
    if function(probe, len(probe)) != xxhash.xxh3_64_intdigest(probe):
        return None
    return ctypes.cast(function, ctypes.c_void_p).value


class EntryReader:
    """Reads chunks of entries into rows of a host buffer; any thread may call it."""

    def __init__(self, library: ctypes.CDLL, hash_address: int) -> None:
        self._read = library.kvr_read_entries
        self._read.argtypes = [
            ctypes.POINTER(ctypes.c_char_p), ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
            ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
            ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_int32),
            ctypes.POINTER(ctypes.c_int64), ctypes.c_int32]
        self._read.restype = ctypes.c_int64
        self._hash = hash_address

    @staticmethod
    def shared() -> EntryReader | None:
        """The process's reader, or None where it cannot be used (module docstring)."""
        global _shared
        if _shared is _UNSET:
            library = load_library("entry_read", source_dir=SOURCE_DIR) \
                if native_kernels_default() else None
            hash_address = None if library is None else _xxh3_64()
            _shared = None if library is None or hash_address is None \
                else EntryReader(library, hash_address)
        return _shared  # type: ignore[return-value]

    def read(self, paths: Sequence[bytes], rows_address: int, row_stride: int,
             prefix_nbytes: int, payload_nbytes: int, every_row: bool) -> EntryReads:
        """Read entry `paths[i]` (its payload into the row at `rows_address + i *
        row_stride`, which the caller keeps alive and writable); stops after the first
        failure unless `every_row`."""
        count = len(paths)
        prefixes = bytearray(count * prefix_nbytes)
        checksums = (ctypes.c_uint64 * count)()
        status = (ctypes.c_int32 * count)()
        sizes = (ctypes.c_int64 * count)()
        tried = self._read(
            (ctypes.c_char_p * count)(*paths), count,
            (ctypes.c_char * len(prefixes)).from_buffer(prefixes), prefix_nbytes,
            rows_address, row_stride, payload_nbytes, self._hash, checksums, status, sizes,
            int(every_row))
        return EntryReads(list(status), list(sizes), list(checksums), prefixes, tried)
