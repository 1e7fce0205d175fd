"""On-disk store of KV cache blocks: one verified file per block.

Layout: `<root>/<layout fingerprint>/<first 2 hex of key>/<key hex>.kvblock`, where
the key is the block's prefix-chain hash (`kv_layout.hash_block_tokens`)
and the fingerprint digests model identity, dtype, block size, layers, KV heads
and head dim: KV of another model or layout sits under another folder and is
simply a miss.

File format (little endian), never unpickled:

    header  (HEADER.size bytes)
        magic "KVRB", version u16, flags u16,
        layout fingerprint (16 ascii), block key (16 bytes),
        num_layers u32, block_size u32, num_kv_heads u32, head_dim u32,
        dtype name (8 ascii, NUL padded), payload_nbytes u64, payload_xxh3 u64
    header_xxh3 u64  (of the header bytes above)
    payload  [num_layers, 2 (K, V), block_size, kv_heads, head_dim] raw values

Checksums are xxHash3-64: non-cryptographic but ~30 GB/s, so verifying every
load costs little next to the read itself. They catch torn writes, bit flips and
swapped files; they do not stop a writer who forges a matching checksum.
Every header field is checked against the engine's own layout before any
payload byte is read, so a hostile file can cost at most one block read.
`BlockHeader.unpack` is the one header decoder: the store's reads and the
offline checker (`storage_check`) both use it.

Writes go to a unique temporary file and are renamed into place, so readers
never see a half-written entry and concurrent writers of one key leave one
complete entry.

`BlockCodec` is the entry format alone, on bytes (`redis.store` keeps the same
entries as Redis values); `BlockStore` adds the folder. Every store offers
connectors the same batched calls: `exists_many`, `read_many`, `write_many`.

Speed: an entry moves in one system call each way (`os.readv` / `os.writev`)
between its file and "parts", contiguous byte arrays that together hold the
payload in file order (one staging row, or one block's per-layer K and V slices
of a paged KV cache), so the payload is never copied in between; it is hashed in
those same buffers right after the read, while they are still in the CPU cache.
"""

from __future__ import annotations

import logging
import os
import stat
import struct
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import astuple, dataclass
from pathlib import Path

import torch
import xxhash

from kvrecover.kv_layout import KVCacheLayout
from kvrecover.kv_transfer.stores.entry_read import (
    ENDED,
    NOT_REGULAR,
    WRONG_SIZE,
    EntryReader,
    EntryReads,
)

MAGIC = b"KVRB"
VERSION = 1
HEADER = struct.Struct("<4sHH16s16sIIII8sQQ")
HEADER_CHECKSUM = struct.Struct("<Q")
PREFIX_SIZE = HEADER.size + HEADER_CHECKSUM.size
SUFFIX = ".kvblock"
MAX_SPARE_BYTES = 64 << 20  # encoded entries a writer keeps for reuse

logger = logging.getLogger(__name__)
DTYPE_ITEM_SIZES = {b"float32": 4, b"bfloat16": 2, b"float16": 2}


class BlockLoadError(Exception):
    """A stored block is missing, unreadable or fails verification."""


@dataclass(frozen=True)
class StoredBlock:
    """A verified block: its values and the payload checksum."""

    tensor: torch.Tensor  # [num_layers, 2, block_size, kv_heads, head_dim], on the CPU
    checksum: int


@dataclass(frozen=True)
class BlockHeader:
    """The header of a stored entry, every field as stored (`dtype_name` NUL padded)."""

    magic: bytes
    version: int
    flags: int
    fingerprint: bytes
    key: bytes
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype_name: bytes
    payload_nbytes: int
    payload_xxh3: int

    def pack(self) -> bytes:
        """The entry prefix: header bytes followed by their checksum."""
        header = HEADER.pack(*astuple(self))
        return header + HEADER_CHECKSUM.pack(xxhash.xxh3_64_intdigest(header))

    @classmethod
    def unpack(cls, prefix: bytes | bytearray | memoryview) -> BlockHeader:
        """Decode an entry's first PREFIX_SIZE bytes; BlockLoadError if they are too few or
        fail their checksum. The fields are not checked against any layout here."""
        if len(prefix) < PREFIX_SIZE:
            raise BlockLoadError(f"truncated: {len(prefix)} bytes")
        header = bytes(prefix[: HEADER.size])
        (stored_sum,) = HEADER_CHECKSUM.unpack_from(prefix, HEADER.size)
        if xxhash.xxh3_64_intdigest(header) != stored_sum:
            raise BlockLoadError("header checksum mismatch")
        return cls(*HEADER.unpack(header))

    def shape_nbytes(self) -> int | None:
        """The payload size that the shape fields and dtype imply; None for an unknown dtype."""
        item = DTYPE_ITEM_SIZES.get(self.dtype_name.rstrip(b"\0"))
        if item is None:
            return None
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * item


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The tensor's memory as flat writable bytes, no copy (contiguous, on the CPU)."""
    return tensor.view(torch.uint8).numpy().data.cast("B")


def payload_checksum(tensor: torch.Tensor) -> int:
    """xxh3-64 of a block's raw bytes (the tensor must be contiguous, on the CPU)."""
    return xxhash.xxh3_64_intdigest(byte_view(tensor.contiguous()))


def parts_checksum(parts: Sequence[memoryview]) -> int:
    """xxh3-64 of the concatenation of `parts`, without concatenating them."""
    if len(parts) == 1:
        return xxhash.xxh3_64_intdigest(parts[0])
    digest = xxhash.xxh3_64()
    for part in parts:
        digest.update(part)
    return digest.intdigest()


def _write_all(fd: int, buffers: list) -> None:
    """`os.writev` until every byte of `buffers` is written."""
    views = [memoryview(buffer).cast("B") for buffer in buffers]
    while views:
        written = os.writev(fd, views)
        if written <= 0:
            raise OSError("writev wrote nothing")
        while views and written >= len(views[0]):
            written -= len(views[0])
            views.pop(0)
        if views and written:
            views[0] = views[0][written:]


class BlockCodec:
    """The entry format of one engine layout, on bytes: `encode` (or `new_entry` +
    `seal`) for writers, `parse` / `parse_into` for readers. Any store (this folder,
    Redis) holds the same entries and runs the same checks."""

    def __init__(self, layout: KVCacheLayout) -> None:
        self.layout = layout
        self.block_shape = (layout.num_cache_tensors, *layout.block_shape)
        self.payload_nbytes = layout.block_nbytes
        self.entry_nbytes = PREFIX_SIZE + self.payload_nbytes
        self._dtype_name = str(layout.dtype).removeprefix("torch.").encode()[:8]
        self._spare_entries: list[bytearray] = []
        # A header's fields other than its key, once (the fingerprint is a sha256 per
        # call: a tenth of a small block's load when checked per entry).
        self._fingerprint = layout.fingerprint.encode()
        self._shape_fields = (layout.num_cache_tensors, layout.block_size, layout.num_kv_heads,
                              layout.head_dim, self._dtype_name.ljust(8, b"\0"),
                              self.payload_nbytes)

    def _header(self, key: bytes, payload_sum: int) -> bytes:
        """An entry's prefix: the header and its checksum."""
        header = HEADER.pack(
            MAGIC, VERSION, 0, self._fingerprint, key,
            self.layout.num_cache_tensors, self.layout.block_size, self.layout.num_kv_heads,
            self.layout.head_dim, self._dtype_name, self.payload_nbytes, payload_sum,
        )
        return header + HEADER_CHECKSUM.pack(xxhash.xxh3_64_intdigest(header))

    def new_entry(self) -> tuple[bytearray, torch.Tensor]:
        """A blank entry and a writable view of its payload as one block
        ([num_layers, 2, block_size, kv_heads, head_dim]); fill the view, then `seal`.
        Writers gather KV straight into it: one copy from the cache to the store."""
        try:  # a recycled buffer: fresh ones cost a page fault per 4 KiB
            entry = self._spare_entries.pop()
        except IndexError:
            entry = bytearray(self.entry_nbytes)
        payload = torch.frombuffer(entry, dtype=torch.uint8, offset=PREFIX_SIZE)
        return entry, payload.view(self.layout.dtype).view(self.block_shape)

    def seal(self, key: bytes, entry: bytearray) -> memoryview:
        """Write the header, with the checksums of the filled payload, into `entry`."""
        entry[:PREFIX_SIZE] = self._header(key, xxhash.xxh3_64_intdigest(
            memoryview(entry)[PREFIX_SIZE:]))
        return memoryview(entry)

    def recycle(self, entries: Sequence[tuple[bytes, memoryview | bytes]]) -> None:
        """Take back entries made by `new_entry` once written and referenced nowhere
        else, for reuse by `new_entry` (at most MAX_SPARE_BYTES of them are kept)."""
        room = max(0, MAX_SPARE_BYTES // self.entry_nbytes - len(self._spare_entries))
        for _, entry in entries[:room]:
            buffer = entry.obj if isinstance(entry, memoryview) else None
            if isinstance(buffer, bytearray) and len(buffer) == self.entry_nbytes:
                self._spare_entries.append(buffer)

    def encode(self, key: bytes, block: torch.Tensor) -> memoryview:
        """The stored form of one block: header, header checksum, raw payload."""
        if tuple(block.shape) != self.block_shape or block.dtype != self.layout.dtype:
            raise ValueError(f"block of shape {tuple(block.shape)} does not match the layout")
        entry, payload = self.new_entry()
        payload.copy_(block.detach())
        return self.seal(key, entry)

    def parse_into(self, key: bytes, raw: bytes, parts: Sequence[memoryview]) -> int:
        """Verify raw entry bytes, then copy the payload into `parts`; returns its checksum."""
        self._check_parts(parts)
        if len(raw) != PREFIX_SIZE + self.payload_nbytes:
            raise BlockLoadError(f"entry has {len(raw)} bytes")
        payload = memoryview(raw)[PREFIX_SIZE:]
        checksum = self._verify(key, raw[:PREFIX_SIZE], [payload])
        offset = 0
        for part in parts:
            part[:] = payload[offset : offset + part.nbytes]
            offset += part.nbytes
        return checksum

    def parse(self, key: bytes, raw: bytes) -> StoredBlock:
        """Verify header and payload of raw entry bytes; raise BlockLoadError if bad."""
        tensor = torch.empty(self.block_shape, dtype=self.layout.dtype)
        checksum = self.parse_into(key, raw, [byte_view(tensor)])
        return StoredBlock(tensor, checksum)

    def _verify(self, key: bytes, prefix: bytes | bytearray, parts: Sequence[memoryview]) -> int:
        """Check the header, then the payload held in `parts`; return the payload checksum."""
        return self.check_payload(parts, self._check_header(key, prefix))

    def check_payload(self, parts: Sequence[memoryview], checksum: int) -> int:
        """`checksum` if the payload held in `parts` has it, else BlockLoadError."""
        if parts_checksum(parts) != checksum:
            raise BlockLoadError("payload checksum mismatch")
        return checksum

    def _check_header(self, key: bytes, prefix: bytes | bytearray) -> int:
        """Check an entry's header against this layout and key; its payload checksum."""
        header = BlockHeader.unpack(prefix)
        expected = (MAGIC, VERSION, self._fingerprint, key, *self._shape_fields)
        actual = (header.magic, header.version, header.fingerprint, header.key, header.num_layers,
                  header.block_size, header.num_kv_heads, header.head_dim, header.dtype_name,
                  header.payload_nbytes)
        if actual != expected:
            raise BlockLoadError("header does not match this engine's layout or key")
        return header.payload_xxh3

    def _check_parts(self, parts: Sequence[memoryview]) -> None:
        nbytes = sum(part.nbytes for part in parts)
        if nbytes != self.payload_nbytes:
            raise ValueError(f"parts hold {nbytes} bytes; a block has {self.payload_nbytes}")


class BlockStore(BlockCodec):
    """Reads and writes verified KV blocks for one engine layout under `root`."""

    def __init__(self, root: str | os.PathLike, layout: KVCacheLayout) -> None:
        super().__init__(layout)
        self.root = Path(root)
        self.folder = self.root / layout.fingerprint
        self._folder = str(self.folder)

    def path(self, key: bytes) -> Path:
        """Where the block with this key lives."""
        return Path(self._path(key))

    def _path(self, key: bytes) -> str:
        name = key.hex()  # plain strings: pathlib costs more than a block's checksum here
        return f"{self._folder}/{name[:2]}/{name}{SUFFIX}"

    def exists(self, key: bytes) -> bool:
        """Whether an entry for the key exists (not yet verified)."""
        return os.path.isfile(self._path(key))

    def write(self, key: bytes, block: torch.Tensor) -> None:
        """Store one block atomically (temporary file + rename)."""
        block = block.detach().to("cpu").contiguous()
        if tuple(block.shape) != self.block_shape or block.dtype != self.layout.dtype:
            raise ValueError(f"block of shape {tuple(block.shape)} does not match the layout")
        self.write_parts(key, [byte_view(block)])

    def write_parts(self, key: bytes, parts: Sequence[memoryview]) -> None:
        """Store one block atomically from its parts (see the module docstring)."""
        self._check_parts(parts)
        header = self._header(key, parts_checksum(parts))
        target = self.path(key)
        temporary = target.with_name(f".{target.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
        flags, mode = os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666  # as open("wb"): umask decides
        try:
            fd = os.open(temporary, flags, mode)
        except FileNotFoundError:  # first block in this fan-out folder
            target.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(temporary, flags, mode)
        try:
            try:
                _write_all(fd, [header, *parts])
            finally:
                os.close(fd)
            os.replace(temporary, target)
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise

    def _open_entry(self, key: bytes) -> int:
        """A read descriptor of the entry, once it is known to be a regular file of
        this layout's size (before any of its bytes is read)."""
        # O_NONBLOCK: a FIFO planted under the entry's name must not block the open.
        fd = os.open(self._path(key), os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise BlockLoadError("entry is not a regular file")
            if info.st_size != PREFIX_SIZE + self.payload_nbytes:
                raise BlockLoadError(f"entry has {info.st_size} bytes, expected "
                                     f"{PREFIX_SIZE + self.payload_nbytes}")
        except BaseException:
            os.close(fd)
            raise
        return fd

    def read_raw(self, key: bytes) -> bytes:
        """The entry's bytes, after checking its size against the layout."""
        try:
            fd = self._open_entry(key)
            with open(fd, "rb") as handle:
                return handle.read(PREFIX_SIZE + self.payload_nbytes)
        except OSError as error:
            raise BlockLoadError(f"cannot read entry: {error}") from error

    def read_into(self, key: bytes, parts: Sequence[memoryview]) -> int:
        """Read one entry straight into its parts (writable; see the module docstring)
        and verify it; returns the payload checksum. After a BlockLoadError the parts
        hold garbage. (Parts of the wrong total size fail the length or checksum test.)"""
        return self.check_payload(parts, self.read_unchecked_into(key, parts))

    def read_entries_into(self, keys: Sequence[bytes], rows_address: int, row_stride: int,
                          every_row: bool = False) -> list[int | BlockLoadError | None] | None:
        """`read_into` of entry `keys[i]` into the row at `rows_address + i * row_stride`
        (host memory the caller keeps alive) for every i, in one C call off the GIL
        (`entry_read`): per entry its payload checksum, why it failed, or None (not read:
        after a failure, unless `every_row`). None where the C reader cannot be used."""
        reader = EntryReader.shared()
        if reader is None:
            return None
        reads = reader.read([os.fsencode(self._path(key)) for key in keys], rows_address,
                            row_stride, PREFIX_SIZE, self.payload_nbytes, every_row)
        results: list[int | BlockLoadError | None] = [None] * len(keys)
        for index in range(reads.tried):
            results[index] = self._entry_result(keys[index], reads, index)
        return results

    def _entry_result(self, key: bytes, reads: EntryReads, index: int) -> int | BlockLoadError:
        """Entry `index` of a C read: its payload checksum, or why it is not loadable."""
        status, size = reads.status[index], reads.sizes[index]
        if status < 0:
            return BlockLoadError(f"cannot read entry: {os.strerror(-status)}")
        if status == NOT_REGULAR:
            return BlockLoadError("entry is not a regular file")
        if status == WRONG_SIZE:
            return BlockLoadError(f"entry has {size} bytes, expected "
                                  f"{PREFIX_SIZE + self.payload_nbytes}")
        if status == ENDED:  # the file shrank after the size check
            return BlockLoadError(f"entry ended after {size} bytes")
        try:
            stored = self._check_header(
                key, reads.prefixes[index * PREFIX_SIZE : (index + 1) * PREFIX_SIZE])
        except BlockLoadError as error:
            return error
        if reads.checksums[index] != stored:
            return BlockLoadError("payload checksum mismatch")
        return stored

    def read_unchecked_into(self, key: bytes, parts: Sequence[memoryview]) -> int:
        """`read_into` but for the payload check: the stored payload checksum, once the
        header passed, for the caller to check wherever the payload ends up
        (`check_payload`)."""
        prefix = bytearray(PREFIX_SIZE)
        try:
            fd = self._open_entry(key)
            try:
                count = os.readv(fd, [prefix, *parts])
            finally:
                os.close(fd)
        except OSError as error:
            raise BlockLoadError(f"cannot read entry: {error}") from error
        if count != PREFIX_SIZE + self.payload_nbytes:  # the file shrank after the size check
            raise BlockLoadError(f"entry ended after {count} bytes")
        return self._check_header(key, prefix)

    def read(self, key: bytes) -> StoredBlock:
        """Read and verify one block."""
        return self.parse(key, self.read_raw(key))

    def write_entry(self, key: bytes, entry: bytes | memoryview) -> None:
        """Store one encoded entry atomically (temporary file + rename)."""
        target = self.path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        temporary = target.with_name(f".{target.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
        try:
            with open(temporary, "wb") as handle:
                handle.write(entry)
            os.replace(temporary, target)
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise

    # The batched interface every store offers (see `redis.store` for a networked one).
    def exists_many(self, keys: list[bytes]) -> list[bool]:
        """Whether an entry exists for each key (not yet verified)."""
        return [self.exists(key) for key in keys]

    def read_many(self, keys: list[bytes]) -> list[bytes | BlockLoadError]:
        """Each key's raw entry, or the BlockLoadError that reading it raised."""
        results: list[bytes | BlockLoadError] = []
        for key in keys:
            try:
                results.append(self.read_raw(key))
            except BlockLoadError as error:
                results.append(error)
        return results

    def write_many(self, entries: Sequence[tuple[bytes, bytes | memoryview]]) -> int:
        """Store each (key, encoded entry); returns how many writes failed (never raises)."""
        failures = 0
        for key, entry in entries:
            try:
                self.write_entry(key, entry)
            except Exception as error:
                failures += 1
                logger.debug("KV block %s not saved: %r", key.hex(), error)
        return failures

    def remove(self, key: bytes) -> None:
        """Delete an entry (used for entries that failed verification)."""
        self.path(key).unlink(missing_ok=True)

    def entries(self) -> Iterator[tuple[bytes, Path]]:
        """Every (key, path) stored under this layout's folder."""
        for path in sorted(self.folder.glob(f"*/*{SUFFIX}")):
            try:
                yield bytes.fromhex(path.name.removesuffix(SUFFIX)), path
            except ValueError:
                continue
