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

Writes go to a unique temporary file and are renamed into place, so readers
never see a half-written entry and concurrent writers of one key leave one
complete entry.
"""

from __future__ import annotations

import os
import stat
import struct
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from kvrecover.kv_layout import KVCacheLayout

MAGIC = b"KVRB"
VERSION = 1
HEADER = struct.Struct("<4sHH16s16sIIII8sQQ")
HEADER_CHECKSUM = struct.Struct("<Q")
PREFIX_SIZE = HEADER.size + HEADER_CHECKSUM.size
SUFFIX = ".kvblock"


class BlockLoadError(Exception):
    """A stored block is missing, unreadable or fails verification."""


@dataclass(frozen=True)
class StoredBlock:
    """A verified block: its values and the payload checksum."""

    tensor: torch.Tensor  # [num_layers, 2, block_size, kv_heads, head_dim], on the CPU
    checksum: int


def payload_checksum(tensor: torch.Tensor) -> int:
    """xxh3-64 of a block's raw bytes (the tensor must be contiguous, on the CPU)."""
    return xxhash.xxh3_64_intdigest(tensor.contiguous().view(torch.uint8).numpy())


class BlockStore:
    """Reads and writes verified KV blocks for one engine layout under `root`."""

    def __init__(self, root: str | os.PathLike, layout: KVCacheLayout) -> None:
        self.root = Path(root)
        self.layout = layout
        self.folder = self.root / layout.fingerprint
        self.block_shape = (layout.num_layers, *layout.block_shape)
        self.payload_nbytes = layout.block_nbytes
        self._dtype_name = str(layout.dtype).removeprefix("torch.").encode()[:8]

    def path(self, key: bytes) -> Path:
        """Where the block with this key lives."""
        name = key.hex()
        return self.folder / name[:2] / f"{name}{SUFFIX}"

    def exists(self, key: bytes) -> bool:
        """Whether an entry for the key exists (not yet verified)."""
        return self.path(key).is_file()

    def write(self, key: bytes, block: torch.Tensor) -> None:
        """Store one block atomically (temporary file + rename)."""
        block = block.detach().to("cpu").contiguous()
        if tuple(block.shape) != self.block_shape or block.dtype != self.layout.dtype:
            raise ValueError(f"block of shape {tuple(block.shape)} does not match the layout")
        payload = block.view(torch.uint8).numpy()
        header = HEADER.pack(
            MAGIC, VERSION, 0, self.layout.fingerprint.encode(), key,
            self.layout.num_layers, self.layout.block_size, self.layout.num_kv_heads,
            self.layout.head_dim, self._dtype_name, payload.nbytes,
            xxhash.xxh3_64_intdigest(payload),
        )
        target = self.path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        temporary = target.with_name(f".{target.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
        try:
            with open(temporary, "wb") as handle:
                handle.write(header)
                handle.write(HEADER_CHECKSUM.pack(xxhash.xxh3_64_intdigest(header)))
                handle.write(payload.tobytes())
            os.replace(temporary, target)
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise

    def read_raw(self, key: bytes) -> bytes:
        """The entry's bytes, after checking its size against the layout."""
        try:
            # O_NONBLOCK: a FIFO planted under the entry's name must not block the open.
            fd = os.open(self.path(key), os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
            with open(fd, "rb") as handle:
                info = os.fstat(handle.fileno())
                if not stat.S_ISREG(info.st_mode):
                    raise BlockLoadError("entry is not a regular file")
                size = info.st_size
                if size != PREFIX_SIZE + self.payload_nbytes:
                    raise BlockLoadError(f"entry has {size} bytes, expected "
                                         f"{PREFIX_SIZE + self.payload_nbytes}")
                return handle.read(size)
        except OSError as error:
            raise BlockLoadError(f"cannot read entry: {error}") from error

    def parse(self, key: bytes, raw: bytes) -> StoredBlock:
        """Verify header and payload of raw entry bytes; raise BlockLoadError if bad."""
        if len(raw) != PREFIX_SIZE + self.payload_nbytes:
            raise BlockLoadError(f"entry has {len(raw)} bytes")
        header = raw[: HEADER.size]
        (stored_header_sum,) = HEADER_CHECKSUM.unpack_from(raw, HEADER.size)
        if xxhash.xxh3_64_intdigest(header) != stored_header_sum:
            raise BlockLoadError("header checksum mismatch")
        (magic, version, _flags, fingerprint, stored_key, layers, block_size, heads, head_dim,
         dtype_name, nbytes, payload_sum) = HEADER.unpack(header)
        expected = (MAGIC, VERSION, self.layout.fingerprint.encode(), key,
                    self.layout.num_layers, self.layout.block_size, self.layout.num_kv_heads,
                    self.layout.head_dim, self._dtype_name.ljust(8, b"\0"), self.payload_nbytes)
        actual = (magic, version, fingerprint, stored_key, layers, block_size, heads, head_dim,
                  dtype_name, nbytes)
        if actual != expected:
            raise BlockLoadError("header does not match this engine's layout or key")
        payload = memoryview(raw)[PREFIX_SIZE:]
        if xxhash.xxh3_64_intdigest(payload) != payload_sum:
            raise BlockLoadError("payload checksum mismatch")
        tensor = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        return StoredBlock(tensor.view(self.layout.dtype).view(self.block_shape), payload_sum)

    def read(self, key: bytes) -> StoredBlock:
        """Read and verify one block."""
        return self.parse(key, self.read_raw(key))

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
