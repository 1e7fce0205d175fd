"""ops.cpu.csrc/query_tile.h: the C kernel's query tiles give each token the bits it gets
alone.

A step of several requests (fresh prompts, chunks after a cached prefix, decodes; odd
lengths, tiles cut mid-request) runs its prefill tokens in tiles; every row must equal
the same token computed as a one-token decode step (the per-token path), for float32 and
bf16, GQA groups 1/4/8, head_dim 64/128, block sizes 16/32, with and without a sliding
window, soft-capping and sinks, on 1 and 2 threads.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvrecover.ops.cpu import native_build
from kvrecover.ops.cpu.attention import NativeInvariantAttention
from kvrecover.ops.cpu.attention.c_kernel import MAX_TILE_ROWS, step_tiles
from kvrecover.ops.reference.attention_metadata import AttentionMetadata

CPU = torch.device("cpu")
# (cached tokens, new tokens) per request: a fresh odd prompt, chunks after prefixes
# (one not block-aligned), a long one cut into several tiles, decodes.
REQUESTS = [(0, 37), (45, 29), (100, 1), (16, 16), (0, 83), (7, 1), (130, 21)]


@pytest.fixture(scope="module")
def library():
    lib = native_build.load_library("paged_attention")
    assert lib is not None, "the C kernel must build on the test machines (build-essential)"
    return lib


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size, heads, kv_heads, head_dim", [
    (16, 4, 4, 64), (32, 8, 2, 128), (16, 16, 2, 64), (32, 12, 3, 64), (16, 8, 1, 128),
])
@pytest.mark.parametrize("window, softcap, sinks", [
    (None, None, False), (24, None, False), (None, 30.0, True),
])
def test_tiled_rows_equal_the_same_tokens_alone(library, dtype, block_size, heads, kv_heads,
                                                head_dim, window, softcap, sinks):
    generator = torch.Generator().manual_seed(heads * head_dim + block_size)
    scale = head_dim**-0.5
    tables, next_block = [], 1
    for cached, new in REQUESTS:
        blocks = -(-(cached + new) // block_size)
        tables.append(random.Random(next_block).sample(range(next_block, next_block + blocks),
                                                       blocks))
        next_block += blocks
    cache = torch.full((2, next_block, block_size, kv_heads, head_dim), float("nan"),
                       dtype=dtype)
    cache[:, 0].zero_()
    qkv = [[torch.randn(cached + new, h, head_dim, generator=generator).to(dtype)
            for h in (heads, kv_heads, kv_heads)] for cached, new in REQUESTS]
    sink_logits = torch.randn(heads, generator=generator) if sinks else None
    kernel = NativeInvariantAttention(library, num_threads=1)
    extras = {"window": window, "softcap": softcap, "sinks": sink_logits}
    for (cached, _), table, (q, k, v) in zip(REQUESTS, tables, qkv, strict=True):
        if cached:  # the prefix, written (and attended) as a prefill of its own
            meta = AttentionMetadata.build([0], [cached], [table], block_size, CPU)
            kernel.forward(q[:cached], k[:cached], v[:cached], cache, meta, scale, **extras)
    for threads in (1, 2):
        step = AttentionMetadata.build([c for c, _ in REQUESTS], [n for _, n in REQUESTS],
                                       tables, block_size, CPU)
        together = NativeInvariantAttention(library, num_threads=threads).forward(
            torch.cat([q[c:] for (c, _), (q, _, _) in zip(REQUESTS, qkv, strict=True)]),
            torch.cat([k[c:] for (c, _), (_, k, _) in zip(REQUESTS, qkv, strict=True)]),
            torch.cat([v[c:] for (c, _), (_, _, v) in zip(REQUESTS, qkv, strict=True)]),
            cache, step, scale, **extras)
        row = 0
        for (cached, new), table, (q, k, v) in zip(REQUESTS, tables, qkv, strict=True):
            for pos in range(cached, cached + new):  # each token as a one-token step
                meta = AttentionMetadata.build([pos], [1], [table], block_size, CPU)
                alone = kernel.forward(q[pos : pos + 1], k[pos : pos + 1], v[pos : pos + 1],
                                       cache, meta, scale, **extras)
                assert torch.equal(together[row], alone[0]), (threads, cached, pos)
                row += 1
        assert not torch.isnan(together).any()


def test_tiles_cut_each_request_into_runs_within_the_row_bound():
    firsts, counts = step_tiles([1, 37, 1, 16, 17], group=3)
    assert firsts == [0, 1, 17, 33, 38, 39, 55, 71]
    assert counts == [1, 16, 16, 5, 1, 16, 16, 1]
    _, counts = step_tiles([40], group=8)
    assert counts == [MAX_TILE_ROWS // 8] * 5
    assert step_tiles([3], group=MAX_TILE_ROWS * 2) == ([0, 1, 2], [1, 1, 1])
