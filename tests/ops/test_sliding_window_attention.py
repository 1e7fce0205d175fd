"""Sliding-window and soft-capped attention in every CPU kernel against a dense masked
reference.

A query at position q sees keys q - window < k <= q (Hugging Face's
`sliding_window_causal`). Keys before every query's window are planted with NaN,
and whole blocks before it point at a NaN block (as a freed, reused or failed
block would): the output must not change. The invariant kernels also give the
same bits for a query in a prefill, a chunk or a decode step. Soft-capping maps
each score s to cap * tanh(s / cap) before the mask (Gemma 2).
"""

from __future__ import annotations

import pytest
import torch

from kvrecover.ops.cpu import native_build
from kvrecover.ops.cpu.attention import CpuInvariantAttention, NativeInvariantAttention
from kvrecover.ops.reference.attention_metadata import AttentionMetadata
from kvrecover.ops.reference.torch_attention import TorchPagedAttention

CPU = torch.device("cpu")
# (tokens already cached, new tokens) per request.
CASES = {
    "decode": [(5, 1), (40, 1), (0, 1), (77, 1)],
    "decode_equal": [(50, 1), (50, 1)],
    "fresh": [(0, 9), (0, 45), (0, 45)],
    "chunk_after_prefix": [(60, 8), (3, 20)],
    "mixed": [(90, 1), (0, 40), (33, 12), (19, 1)],
}


def _kernels():
    kernels = {"torch": TorchPagedAttention(), "torch_tiles": CpuInvariantAttention()}
    library = native_build.load_library("paged_attention")
    if library is not None:
        kernels["native"] = NativeInvariantAttention(library)
    return kernels


KERNELS = _kernels()


def dense_reference(query, keys, values, requests, window, scale, softcap=None, sinks=None):
    """Float64 softmax attention of each request over its whole sequence, banded (and
    soft-capped; with `sinks` [Hq], each head's sink as one more logit in the softmax,
    its probability then dropped)."""
    outputs, row = [], 0
    group = query.shape[1] // keys[0].shape[1]
    for (computed, length), k, v in zip(requests, keys, values):
        k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
        q = query[row : row + length].double()
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        query_pos = computed + torch.arange(length)[:, None]
        key_pos = torch.arange(computed + length)[None, :]
        visible = (key_pos <= query_pos) & (key_pos > query_pos - window)
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is None:
            probs = scores.softmax(-1)
        else:
            sink_column = sinks.double()[:, None, None].expand(-1, length, 1)
            probs = torch.cat((scores, sink_column), -1).softmax(-1)[..., :-1]
        outputs.append(torch.einsum("hqk,khd->qhd", probs, v))
        row += length
    return torch.cat(outputs)


def window_step(requests, block_size, window, dtype=torch.float32, seed=0, head_dim=32):
    """A NaN cache (null block 0 zeroed, a NaN block 1) holding each request's cached keys
    from its earliest window start on; blocks wholly before it point at block 1. Returns
    q, k, v of the new tokens, the cache, the block tables and each request's whole
    keys and values (for `dense_reference`)."""
    heads, kv_heads = 6, 2
    generator = torch.Generator().manual_seed(seed)
    num_blocks = 2 + sum(-(-(c + n) // block_size) for c, n in requests)
    cache = torch.full((2, num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype)
    cache[:, 0] = 0
    free = list(range(2, num_blocks))
    tables, keys, values = [], [], []
    total = sum(n for _, n in requests)
    query = torch.randn(total, heads, head_dim, generator=generator).to(dtype)
    new_k = torch.randn(total, kv_heads, head_dim, generator=generator).to(dtype)
    new_v = torch.randn(total, kv_heads, head_dim, generator=generator).to(dtype)
    row = 0
    for computed, length in requests:
        first_key = max(0, computed - window + 1)
        table = []
        for block in range(-(-(computed + length) // block_size)):
            table.append(1 if (block + 1) * block_size <= first_key else free.pop())
        seq_k = torch.randn(computed, kv_heads, head_dim, generator=generator).to(dtype)
        seq_v = torch.randn(computed, kv_heads, head_dim, generator=generator).to(dtype)
        for p in range(first_key, computed):
            cache[0, table[p // block_size], p % block_size] = seq_k[p]
            cache[1, table[p // block_size], p % block_size] = seq_v[p]
        keys.append(torch.cat((seq_k, new_k[row : row + length])))
        values.append(torch.cat((seq_v, new_v[row : row + length])))
        tables.append(table)
        row += length
    return query, new_k, new_v, cache, tables, keys, values


def _setup(requests, block_size, window, dtype=torch.float32, seed=0, head_dim=32):
    query, key, value, cache, tables, keys, values = window_step(requests, block_size, window,
                                                                 dtype, seed, head_dim)
    meta = AttentionMetadata.build([c for c, _ in requests], [n for _, n in requests], tables,
                                   block_size, CPU)
    return query, key, value, cache, meta, keys, values


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("block_size,window", [(3, 7), (5, 24), (16, 1), (16, 20), (16, 200)])
def test_window_attention_matches_dense_reference_and_ignores_nan(kernel, case, block_size,
                                                                  window):
    requests = CASES[case]
    query, key, value, cache, meta, keys, values = _setup(requests, block_size, window)
    scale = 32**-0.5
    out = KERNELS[kernel].forward(query, key, value, cache, meta, scale, window)
    assert torch.isfinite(out).all()
    expected = dense_reference(query, keys, values, requests, window, scale)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_full_attention_is_unchanged_by_a_window_too_wide_to_cut(kernel):
    requests = CASES["mixed"]
    query, key, value, cache, meta, *_ = _setup(requests, 16, 10_000)
    scale = 32**-0.5
    attention = KERNELS[kernel]
    windowed = attention.forward(query.clone(), key, value, cache.clone(), meta, scale, 10_000)
    full = attention.forward(query.clone(), key, value, cache.clone(), meta, scale, None)
    torch.testing.assert_close(windowed, full, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kernel", ["torch_tiles", "native"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_invariant_window_bits_equal_in_prefill_chunks_and_decode(kernel, dtype):
    if kernel not in KERNELS:
        pytest.skip("the C kernel did not build here")
    attention, window, block_size, length = KERNELS[kernel], 21, 5, 70
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(length, 6, 32, generator=generator).to(dtype)
    k = torch.randn(length, 2, 32, generator=generator).to(dtype)
    v = torch.randn(length, 2, 32, generator=generator).to(dtype)
    table = list(range(1, 1 + -(-length // block_size)))
    scale = 32**-0.5

    def run(splits: list[int]) -> torch.Tensor:
        cache = torch.zeros(2, len(table) + 1, block_size, 2, 32, dtype=dtype)
        outs, start = [], 0
        for end in splits:
            meta = AttentionMetadata.build([start], [end - start], [table], block_size, CPU)
            outs.append(attention.forward(q[start:end], k[start:end], v[start:end], cache, meta,
                                          scale, window))
            start = end
        return torch.cat(outs)

    whole = run([length])
    assert torch.equal(run([13, 40, 41, length]), whole)
    assert torch.equal(run(list(range(1, length + 1))), whole)  # one token at a time


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("case", ["decode", "fresh", "mixed"])
@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("softcap", [0.5, 4.0])
def test_soft_capped_attention_matches_dense_reference(kernel, case, window, softcap):
    requests = CASES[case]
    query, key, value, cache, meta, keys, values = _setup(requests, 5, window or 10_000)
    scale = 1.5  # large scores: the cap binds
    out = KERNELS[kernel].forward(query, key, value, cache, meta, scale, window, softcap)
    expected = dense_reference(query, keys, values, requests, window or 10_000, scale, softcap)
    uncapped = dense_reference(query, keys, values, requests, window or 10_000, scale)
    assert (expected - uncapped).abs().max() > 0.1  # the cap changes the result
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", ["torch_tiles", "native"])
def test_soft_capped_window_bits_equal_in_prefill_and_decode(kernel):
    if kernel not in KERNELS:
        pytest.skip("the C kernel did not build here")
    attention, window, block_size, length = KERNELS[kernel], 9, 3, 40
    generator = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(length, h, 32, generator=generator).to(torch.bfloat16)
               for h in (6, 2, 2))
    table = list(range(1, 1 + -(-length // block_size)))
    outs = []
    for splits in ([length], list(range(1, length + 1))):
        cache = torch.zeros(2, len(table) + 1, block_size, 2, 32, dtype=torch.bfloat16)
        pieces, start = [], 0
        for end in splits:
            meta = AttentionMetadata.build([start], [end - start], [table], block_size, CPU)
            pieces.append(attention.forward(q[start:end], k[start:end], v[start:end], cache,
                                            meta, 0.5, window, 2.0))
            start = end
        outs.append(torch.cat(pieces))
    assert torch.equal(outs[0], outs[1])
