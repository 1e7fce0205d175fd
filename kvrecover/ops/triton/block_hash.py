"""fold64 block checksums in one pass over the bytes (`kv_transfer/p2p/checksums.py`
defines the hash; its torch version materialises int64 temporaries of eight times the
bytes, op by op).

One launch per cache tensor, a program per (block, side): it reads that piece's 32-bit
words once, mixes each with its position in the block and sums the mixes into one
int64 partial, which the caller sums over the pieces (modulo 2^64, as int64 adds wrap).
The arithmetic is the torch version's, op for op, in wrapping int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The signed int64 values of splitmix64's constants (`checksums.py`).
_STEP = -7046029254386353131  # 0x9E3779B97F4A7C15
_MIX1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_MIX2 = -7723592293110705685  # 0x94D049BB133111EB
WORDS_PER_ITERATION = 1024


@triton.jit
def _fold64_pieces(words_ptr, ids_ptr, out_ptr, side_stride, block_stride, num_words,
                   cache_index, num_caches, STEP: tl.constexpr, MIX1: tl.constexpr,
                   MIX2: tl.constexpr, BLOCK: tl.constexpr):
    index = tl.program_id(0)
    side = tl.program_id(1)
    block = tl.load(ids_ptr + index).to(tl.int64)
    base = words_ptr + side.to(tl.int64) * side_stride + block * block_stride
    piece = side * num_caches + cache_index
    first = piece.to(tl.int64) * num_words
    total = tl.zeros([BLOCK], dtype=tl.int64)
    for start in range(0, num_words, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        inside = offsets < num_words
        word = tl.load(base + offsets, mask=inside, other=0).to(tl.int64) & 0xFFFFFFFF
        mixed = word + (first + offsets) * STEP
        mixed = mixed * MIX1
        mixed = mixed ^ ((mixed >> 32) & 0xFFFFFFFF)
        mixed = mixed * MIX2
        total += tl.where(inside, mixed, 0)
    tl.store(out_ptr + index * (2 * num_caches) + piece, tl.sum(total, axis=0))


def fold64_partials(sides: list[torch.Tensor], block_ids: torch.Tensor) -> torch.Tensor:
    """Each selected block's fold64 (int64, wrapped) of the uint8 (2, blocks, half)
    tensors `sides` (half a multiple of 4, the last dimension contiguous), on their
    device: [len(block_ids)] int64."""
    num_caches = len(sides)
    partials = torch.empty(len(block_ids), 2 * num_caches, dtype=torch.int64,
                           device=block_ids.device)
    for cache_index, side_bytes in enumerate(sides):
        words = side_bytes.view(torch.int32)
        _fold64_pieces[(len(block_ids), 2)](
            words, block_ids, partials, words.stride(0), words.stride(1), words.shape[2],
            cache_index, num_caches, STEP=_STEP, MIX1=_MIX1, MIX2=_MIX2,
            BLOCK=WORDS_PER_ITERATION)
    return partials.sum(dim=1)
