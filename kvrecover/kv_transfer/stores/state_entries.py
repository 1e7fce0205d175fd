"""Stored recurrent states: a hybrid model's linear-attention state at a block boundary.

A connector that declares `supports_recurrent_states` stores, with a prompt's KV,
the conv and recurrent states of every linear-attention layer at the prompt's last
loadable block boundary (the one a consumer's claim ends at) and at every
`KVTransferConfig.state_interval_blocks`-th block boundary before it (where a failed
load resumes, `store_states`). The state travels in
the store's own entry format (`block_store`: header, layout fingerprint, xxh3
checksums), cut into as many block-sized entries as it needs ("chunks"), chunk i keyed
by `group_block_key(hash, STATE_KEY_GROUP + i)` of the chain hash of the block that
ends at the boundary. The chunks' joined payloads are

    magic "KVRS", state signature digest (16 bytes), state_nbytes u64,
    the checkpointed state tensors layer by layer (raw values), zero padding

Chunk 0 is written last, so a scheduler that finds chunk 0 (`state_key`) finds a
complete state unless the store lost some since; a reader checks every chunk, then
the signature and size, and treats any mismatch as a failed load.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Sequence
from typing import Protocol

import torch

from kvrecover.kv_layout import group_block_key
from kvrecover.kv_transfer.stores.block_store import BlockLoadError, StoredBlock

MAGIC = b"KVRS"
STATE_HEADER = struct.Struct("<4s16sQ")
# The "group" whose key digests name a state's chunks: far above any KV cache group.
STATE_KEY_GROUP = 0x5354_0000
# The block id a read filter (`base.ReadFilter`) sees for a state chunk's read.
STATE_READ_BLOCK_ID = -1


class RecurrentStateAccess(Protocol):
    """What a connector's worker role needs of the worker's recurrent states
    (`worker/recurrent_states.py` implements it)."""

    @property
    def state_signature(self) -> str:
        """The layers, names, shapes and dtypes of the checkpointed states, as text."""
        ...

    @property
    def bytes_per_checkpoint(self) -> int:
        """Bytes of one stored state (without the chunks' header and padding)."""
        ...

    def read_checkpoint(self, slot: int) -> bytes:
        """The states in checkpoint slot `slot`, layer by layer."""
        ...

    def install(self, request_id: str, position: int, payload: bytes | None) -> None:
        """Make `payload` (None: zeros, for a load that failed) the request's state at
        `position`, so its next slice continues from there."""
        ...

    def keep_resume_state(self, request_id: str, position: int, payload: bytes) -> None:
        """Keep `payload` as the request's state at `position` for its next slice, if
        that starts there (a load that failed after `position`; rule 8)."""
        ...


class EntryCodec(Protocol):
    """The part of a block store's codec (`block_store.BlockCodec`) state chunks use."""

    payload_nbytes: int

    def new_entry(self) -> tuple[bytearray, torch.Tensor]: ...

    def seal(self, key: bytes, entry: bytearray) -> memoryview: ...

    def parse(self, key: bytes, raw: bytes) -> StoredBlock: ...


def state_key(block_hash: bytes) -> bytes:
    """The key of chunk 0 of the state at the end of the block of this chain hash (the
    one a claim looks up)."""
    return group_block_key(block_hash, STATE_KEY_GROUP)


def state_keys(block_hash: bytes, state_nbytes: int, chunk_nbytes: int) -> list[bytes]:
    """The keys of every chunk of a state of `state_nbytes` in entries of `chunk_nbytes`."""
    count = math.ceil((STATE_HEADER.size + state_nbytes) / chunk_nbytes)
    return [group_block_key(block_hash, STATE_KEY_GROUP + i) for i in range(count)]


def _digest(signature: str) -> bytes:
    return hashlib.blake2b(signature.encode(), digest_size=16).digest()


def encode_state(codec: EntryCodec, keys: Sequence[bytes], signature: str,
                 state: bytes) -> list[tuple[bytes, memoryview]]:
    """The stored entries of one state, chunk 0 last (keys from `state_keys`)."""
    data = STATE_HEADER.pack(MAGIC, _digest(signature), len(state)) + state
    size = codec.payload_nbytes
    entries = []
    for index, key in enumerate(keys):
        entry, payload = codec.new_entry()
        chunk = data[index * size : (index + 1) * size]
        flat = payload.view(-1).view(torch.uint8)
        flat.zero_()
        flat[: len(chunk)].copy_(torch.frombuffer(bytearray(chunk), dtype=torch.uint8))
        entries.append((key, codec.seal(key, entry)))
    return entries[1:] + entries[:1]


def decode_state(codec: EntryCodec, keys: Sequence[bytes], signature: str, state_nbytes: int,
                 raws: Sequence[bytes]) -> bytes:
    """The state in verified raw chunks (in key order); BlockLoadError if a chunk is bad
    or the state is of another layout."""
    data = b"".join(codec.parse(key, raw).tensor.view(-1).view(torch.uint8).numpy().tobytes()
                    for key, raw in zip(keys, raws))
    magic, digest, nbytes = STATE_HEADER.unpack_from(data)
    if magic != MAGIC or digest != _digest(signature) or nbytes != state_nbytes:
        raise BlockLoadError("the stored recurrent state is of another layout")
    return data[STATE_HEADER.size : STATE_HEADER.size + nbytes]
