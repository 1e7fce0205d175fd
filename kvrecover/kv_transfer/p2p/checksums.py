"""The checksum a producer answers for each block of a pull, and the consumer's check.

A block's checksum covers its bytes block-major: K of every cache tensor in order, then
V. Two algorithms, named in the producer's handshake (`checksum`), so that a consumer
hashes its staged rows the way the producer hashed its cache:

- `xxh3` (a CPU cache's default): xxh3-64 of those bytes, streamed piece by piece.
- `fold64` (a GPU cache's default): a hash computed with torch ops where the bytes are,
  so a GPU's blocks are never copied to the host to be checked. Each 32-bit word w at
  word position i of the block is mixed by a bijection of 64-bit words, h(w + i * G),
  and the mixed words are summed modulo 2^64. A change of one word always changes the
  sum (each mix is a bijection); any other change goes unseen with a chance of about
  2^-64, which is what a check against torn, stale or flipped blocks needs (it is no
  defence against an adversary who chooses the bytes: neither is xxh3).

Both run on any device; `checksum_blocks` copies a GPU's blocks to the host for xxh3 only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import xxhash

XXH3 = "xxh3"
FOLD64 = "fold64"
ALGORITHMS = (XXH3, FOLD64)

_MASK64 = (1 << 64) - 1
_LOW32 = 0xFFFFFFFF
# splitmix64's constants: the golden ratio's increment and its two odd multipliers.
_STEP = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def default_algorithm(cache: torch.Tensor) -> str:
    """fold64 for a cache on a GPU (hashed where it is), xxh3 on the CPU (faster there)."""
    return FOLD64 if cache.is_cuda else XXH3


def checksum_blocks(algorithm: str, sides: Sequence[torch.Tensor],
                    block_ids: Sequence[int]) -> list[int]:
    """Each block's checksum by `algorithm` (unsigned 64-bit ints): `sides[c]` is cache
    tensor c's bytes as a uint8 (2, blocks, half) tensor (the producer's cache, or a
    staged view's `[:, c]`), and a block's bytes are K of every tensor, then V."""
    if algorithm == XXH3 and sides and sides[0].is_cuda:  # only the blocks to the host
        ids = torch.as_tensor(list(block_ids), dtype=torch.long, device=sides[0].device)
        gathered = [side.index_select(1, ids).cpu().numpy() for side in sides]
        return xxh3_checksums(gathered, range(len(ids)))
    if algorithm == XXH3:
        return xxh3_checksums([side.numpy() for side in sides], block_ids)
    if algorithm == FOLD64:
        return fold64_checksums(sides, block_ids)
    raise ValueError(f"unknown checksum algorithm {algorithm!r}")


def xxh3_checksums(sides: Sequence, block_ids: Sequence[int]) -> list[int]:
    """xxh3 of each block's bytes, streamed piece by piece from `sides` (numpy arrays
    laid out as `checksum_blocks`'s tensors)."""
    checksums = []
    for block_id in block_ids:
        digest = xxhash.xxh3_64()
        for side in range(2):
            for array in sides:
                digest.update(array[side, block_id])
        checksums.append(digest.intdigest())
    return checksums


def _signed(value: int) -> int:
    """`value` modulo 2^64 as a signed 64-bit int (torch's int64 arithmetic wraps so)."""
    value &= _MASK64
    return value - (1 << 64) if value >> 63 else value


def fold64_checksums(sides: Sequence[torch.Tensor], block_ids: Sequence[int]) -> list[int]:
    """fold64 of each block (module docstring), computed on the tensors' device: on a
    GPU by a Triton kernel that reads the bytes once (`ops/triton/block_hash.py`), else
    by torch ops, one (side, cache tensor) piece of every block at a time."""
    if not block_ids:
        return []
    device = sides[0].device
    ids = torch.as_tensor(list(block_ids), dtype=torch.long, device=device)
    half = sides[0].shape[-1]
    word_type = torch.int32 if half % 4 == 0 else torch.uint8
    if device.type == "cuda" and word_type is torch.int32:
        from kvrecover.ops.triton.block_hash import fold64_partials

        return [value & _MASK64 for value in fold64_partials(list(sides), ids).tolist()]
    words = half // 4 if word_type is torch.int32 else half
    steps = torch.arange(words, dtype=torch.int64, device=device) * _signed(_STEP)
    total = torch.zeros(len(ids), dtype=torch.int64, device=device)
    piece = 0
    for side in range(2):
        for cache in sides:
            mixed = cache[side].index_select(0, ids).view(word_type).to(torch.int64)
            mixed &= _LOW32  # the word unsigned
            mixed += steps
            mixed += _signed(piece * words * _STEP)  # the word's position in its block
            mixed *= _signed(_MIX1)
            mixed ^= (mixed >> 32) & _LOW32  # a logical shift: torch's >> keeps the sign
            mixed *= _signed(_MIX2)
            total += mixed.sum(dim=1)
            piece += 1
    return [value & _MASK64 for value in total.tolist()]


def fold64_reference(block: bytes, half: int) -> int:
    """fold64 of one block's bytes (block-major, `half` bytes a piece), in plain Python:
    what the tests hold `fold64_checksums` to on every device (it relies on int64
    arithmetic wrapping)."""
    word_bytes = 4 if half % 4 == 0 else 1
    total = 0
    for index in range(len(block) // word_bytes):
        word = int.from_bytes(block[index * word_bytes:(index + 1) * word_bytes], "little")
        mixed = (word + index * _STEP) * _MIX1 & _MASK64
        mixed = (mixed ^ (mixed >> 32)) * _MIX2 & _MASK64
        total += mixed
    return total & _MASK64
