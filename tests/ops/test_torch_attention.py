"""The torch paged attention and the torch small ops against plain references.

Covers each branch of `TorchPagedAttention.forward`: decode-only steps, fresh
prompts (causal, with and without padding rows), chunks after a cached prefix,
and mixed prefill + decode batches; GQA and plain multi-head; several block sizes.
"""

from __future__ import annotations

import pytest
import torch

from kvrecover.models.rope import RotaryEmbedding
from kvrecover.ops.cpu import onednn
from kvrecover.ops.reference.attention_metadata import AttentionMetadata
from kvrecover.ops.reference.torch_attention import TorchPagedAttention
from kvrecover.ops.reference.torch_ops import TorchOps

# (tokens already cached, new tokens) per request.
CASES = {
    "decode": [(5, 1), (17, 1), (0, 1), (40, 1)],
    "decode_equal": [(21, 1), (21, 1), (21, 1)],
    "chunk_alone": [(21, 6)],
    "fresh_equal": [(0, 9), (0, 9)],
    "fresh_padded": [(0, 1), (0, 23), (0, 7)],
    "chunk_after_prefix": [(16, 8), (3, 20)],
    "mixed": [(30, 1), (0, 12), (7, 5), (19, 1)],
    "single_long": [(0, 300)],
}


def _reference(query, cache_keys, cache_values, new_keys, new_values, requests, scale):
    """Per-request softmax attention in float64 over [cached prefix, new tokens]."""
    outputs, row = [], 0
    group = query.shape[1] // new_keys.shape[1]
    for (computed, length), prefix_k, prefix_v in zip(requests, cache_keys, cache_values):
        k = torch.cat((prefix_k, new_keys[row : row + length])).double()
        v = torch.cat((prefix_v, new_values[row : row + length])).double()
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        q = query[row : row + length].double()
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        causal = torch.arange(computed + length)[None, :] <= computed + torch.arange(length)[:, None]
        scores = scores.masked_fill(~causal, float("-inf"))
        outputs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
        row += length
    return torch.cat(outputs)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (4, 4)])
def test_paged_attention_matches_reference(case, block_size, heads, kv_heads):
    _check_paged_attention(CASES[case], block_size, heads, kv_heads)


@pytest.mark.parametrize("case", ["decode", "decode_equal", "chunk_after_prefix", "chunk_alone",
                                  "mixed"])
def test_stale_nan_blocks_never_reach_the_output(case):
    """Slots past a request's context (the tail of its last block, blocks it holds
    beyond its context) may hold a failed load's NaNs: they must not leak in."""
    _check_paged_attention(CASES[case], 16, 6, 2, fill=float("nan"), extra_blocks=2)


@pytest.mark.parametrize("case", ["decode", "decode_equal", "mixed"])
@pytest.mark.parametrize("gather_bytes", [1, 2 * 2 * 3 * 16 * 2 * 16 * 4])
def test_decode_in_slices_matches_reference(monkeypatch, case, gather_bytes):
    """Decodes gathered a few requests at a time (as long contexts are on the CPU)
    give the same result, stale NaNs still kept out."""
    from kvrecover.ops.reference import torch_attention

    monkeypatch.setattr(torch_attention, "_GATHER_BYTES", gather_bytes)
    _check_paged_attention(CASES[case], 16, 6, 2, fill=float("nan"), extra_blocks=1)


@pytest.mark.parametrize("case", list(CASES))
def test_cpu_float32_backend_matches_reference_with_its_native_kernel(case):
    """The CPU float32 backend sends every step of these heads (head_dim 16) to the C
    kernel (reading the cache in place, prefills in query tiles where the CPU has
    AVX-512, token by token elsewhere): it matches the reference, stale NaNs kept out."""
    from kvrecover.ops.backend import select_backend
    from kvrecover.ops.cpu.attention import NativeInvariantAttention
    from kvrecover.ops.cpu.native_build import cpu_flags

    attention = select_backend("auto", torch.device("cpu"), dtype=torch.float32).attention
    assert isinstance(attention._native_kernel, NativeInvariantAttention)
    assert attention._native_kernel.tiled(torch.float32, 16) == ("avx512f" in cpu_flags().split())
    _check_paged_attention(CASES[case], 16, 6, 2, fill=float("nan"), extra_blocks=1,
                           attention=attention)


def test_steps_go_to_the_native_kernel_only_where_it_is_fast():
    class Recording(TorchPagedAttention):
        steps: list[list[int]] = []
        head_dim = 16  # the head size it "vectorizes"
        tiles = False  # whether it "tiles" prefills

        def vectorized(self, num_heads, num_kv_heads, head_dim):
            return head_dim == self.head_dim

        def tiled(self, dtype, head_dim):
            return self.tiles

        def forward(self, query, key, value, kv_cache, meta, *args):
            self.steps.append(meta.query_lens)
            return super().forward(query, key, value, kv_cache, meta, *args)

    attention = TorchPagedAttention(native_kernel=Recording())
    for case in ("decode", "mixed", "fresh_padded", "decode_equal"):
        _check_paged_attention(CASES[case], 16, 6, 2, attention=attention)
    assert Recording.steps == [[1, 1, 1, 1], [1, 1, 1]]  # decode-only steps
    Recording.tiles = True
    _check_paged_attention(CASES["mixed"], 16, 6, 2, attention=attention)
    assert Recording.steps[2:] == [[n for _, n in CASES["mixed"]]]
    Recording.head_dim = 8  # a shape it would run on its slow path: torch keeps it
    _check_paged_attention(CASES["decode"], 16, 6, 2, attention=attention)
    assert len(Recording.steps) == 3
    from kvrecover.ops.backend import select_backend

    plain = select_backend("auto", torch.device("cpu"), dtype=torch.float32,
                           native_kernels=False).attention
    assert plain._native_kernel is None


def _check_paged_attention(requests, block_size, heads, kv_heads, fill=None, extra_blocks=0,
                           attention=None):
    head_dim = 16
    num_blocks = 1 + sum(-(-(c + n) // block_size) + extra_blocks for c, n in requests) + 3
    generator = torch.Generator().manual_seed(0)
    kv_cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=generator)
    if fill is not None:
        kv_cache.fill_(fill)  # every slot not written below is stale
    kv_cache[:, 0] = 0  # the null block, as allocated
    free = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
    tables = [[free.pop() for _ in range(-(-(c + n) // block_size) + extra_blocks)]
              for c, n in requests]
    if fill is not None:
        for (computed, _), table in zip(requests, tables):
            for p in range(computed):
                block, offset = table[p // block_size], p % block_size
                kv_cache[:, block, offset] = torch.randn(2, kv_heads, head_dim, generator=generator)
    cached_k, cached_v = [], []
    for (computed, _), table in zip(requests, tables):
        slots = [table[p // block_size] * block_size + p % block_size for p in range(computed)]
        cached_k.append(kv_cache[0].view(-1, kv_heads, head_dim)[slots].clone())
        cached_v.append(kv_cache[1].view(-1, kv_heads, head_dim)[slots].clone())
    total = sum(n for _, n in requests)
    query = torch.randn(total, heads, head_dim, generator=generator)
    key = torch.randn(total, kv_heads, head_dim, generator=generator)
    value = torch.randn(total, kv_heads, head_dim, generator=generator)
    meta = AttentionMetadata.build(
        [c for c, _ in requests], [n for _, n in requests], tables, block_size, torch.device("cpu")
    )
    scale = head_dim**-0.5
    attention = TorchPagedAttention() if attention is None else attention
    out = attention.forward(query, key, value, kv_cache, meta, scale)
    expected = _reference(query, cached_k, cached_v, key, value, requests, scale)
    assert out.shape == (total, heads, head_dim)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_is_bitwise_hf_rotate_half(dtype):
    rotary = RotaryEmbedding(64, 512, 10000.0, None)
    qkv = torch.randn(37, 12 * 64).to(dtype)
    query, key = qkv[:, : 8 * 64].view(37, 8, 64), qkv[:, 8 * 64 : 10 * 64].view(37, 2, 64)
    positions = torch.randint(0, 512, (37,))
    cos = rotary.cos_cache[positions].to(dtype).unsqueeze(1)
    sin = rotary.sin_cache[positions].to(dtype).unsqueeze(1)
    out_q, out_k = TorchOps().rotary(rotary, positions, query, key)
    assert torch.equal(out_q, query * cos + _rotate_half(query) * sin)
    assert torch.equal(out_k, key * cos + _rotate_half(key) * sin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_and_silu_mul_are_bitwise_hf(dtype):
    x = torch.randn(11, 96).to(dtype)
    weight = torch.randn(96).to(dtype)
    hf = x.float()
    hf = weight * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    before = x.clone()
    assert torch.equal(TorchOps().rms_norm(x, weight, 1e-6), hf)
    assert torch.equal(x, before)  # the input is never written
    gate_up = torch.randn(11, 2 * 96).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(TorchOps().silu_mul(gate_up), torch.nn.functional.silu(gate) * up)


@pytest.mark.parametrize("rows", [0, 1, 8, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear_dense_and_packed(rows, bias):
    layer = torch.nn.Linear(96, 40, bias=bias)
    dense = layer.weight.detach().clone()
    x = torch.randn(rows, 96)
    expected = torch.nn.functional.linear(x, dense, layer.bias)
    torch.testing.assert_close(TorchOps().linear(x, layer), expected, rtol=0, atol=0)
    assert not layer.weight.is_mkldnn  # a forward never repacks a weight
    if not onednn.pack_linear(layer):
        pytest.skip("this torch build cannot pack oneDNN weights")
    assert layer.weight.is_mkldnn
    torch.testing.assert_close(TorchOps().linear(x, layer), expected, rtol=1e-5, atol=1e-5)


def test_pack_linear_weights_packs_every_float32_linear_once():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4).to(torch.bfloat16))
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch build")
    assert onednn.pack_linear_weights(model) == 1  # the bf16 linear stays dense
    assert model[0].weight.is_mkldnn and not model[1].weight.is_mkldnn
    packed = model[0].weight
    assert onednn.pack_linear_weights(model) == 1  # already packed: kept as it is
    assert model[0].weight is packed


def test_linear_falls_back_where_weights_cannot_be_packed(monkeypatch):
    """A torch build whose oneDNN cannot pack weights gets F.linear, not an error."""

    def cannot_pack(*args):
        raise RuntimeError("no packed linear weights in this build")

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", cannot_pack)
    layer = torch.nn.Linear(96, 40)
    model = torch.nn.Sequential(layer)
    assert onednn.pack_linear_weights(model) == 0
    assert not layer.weight.is_mkldnn
    x = torch.randn(5, 96)
    expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
    torch.testing.assert_close(TorchOps().linear(x, layer), expected, rtol=0, atol=0)
