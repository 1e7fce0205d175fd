"""ops.cpu_invariant_*: a token's bits on the CPU do not depend on its batch or chunking.

Per op, bitwise: linears (a row alone, in batches of 1..64 rows, in chunks of
16..512; each small and large tile size used only where proven), attention (every position of a long prompt against the same query as
a decode step, and inside chunks and mixed batches), and the row-local small
ops. Then the engine in bf16 (invariant by default): greedy tokens (and
the logits behind them) across `max_num_batched_tokens`, batch compositions and
prefix-cache hits; and the reference scenario in bf16 (slow).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import random_prompts
from torch import nn

from kvrecover import LLM, SamplingParams
from kvrecover.ops.backend import select_backend
from kvrecover.ops.cpu.attention import CpuInvariantAttention, NativeInvariantAttention
from kvrecover.ops.cpu.invariant_ops import InvariantCpuOps
from kvrecover.ops.reference.attention_metadata import AttentionMetadata
from kvrecover.ops.reference.torch_ops import TorchOps
from kvrecover.worker.sampler import Sampler

CPU = torch.device("cpu")
HALF = [torch.bfloat16, torch.float16]


def _linear(in_features: int, out_features: int, dtype: torch.dtype, bias: bool) -> nn.Linear:
    layer = nn.Linear(in_features, out_features, bias=bias).to(dtype)
    with torch.no_grad():
        layer.weight.normal_(0, in_features**-0.5)
    return layer


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("threads", [1, 2])
def test_linear_row_bits_do_not_depend_on_batch_or_chunk(dtype, threads):
    torch.set_num_threads(threads)
    generator = torch.Generator().manual_seed(0)
    ops = InvariantCpuOps()
    for in_features, out_features, bias in ((64, 96, False), (576, 960, True), (200, 77, False)):
        layer = _linear(in_features, out_features, dtype, bias)
        holder = nn.Sequential(layer)
        ops.prepare_weights(holder)
        x = torch.randn(512, in_features, generator=generator).to(dtype)
        alone = torch.cat([ops.linear(x[i : i + 1], layer) for i in range(0, 512, 7)])
        rows = list(range(0, 512, 7))
        for size in (*range(1, 65), 100, 255, 300):  # batches of 1..64 rows at varying offsets
            start = (size * 13) % (512 - size)
            batched = ops.linear(x[start : start + size], layer)
            for i in range(start, start + size):
                if i % 7 == 0:
                    assert torch.equal(batched[i - start], alone[rows.index(i)]), (size, i)
        for chunk in (16, 17, 64, 200, 512):  # a prompt in chunks
            chunked = torch.cat([ops.linear(x[s : s + chunk], layer) for s in range(0, 512, chunk)])
            assert torch.equal(chunked[::7], alone), chunk


def test_linear_validates_tile_rows():
    with pytest.raises(ValueError, match="tile_rows must be an integer >= 1, got 0"):
        InvariantCpuOps(tile_rows=0)


def _cache(num_blocks, block_size, num_kv_heads, head_dim, dtype):
    return torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_size, heads, kv_heads, head_dim", [(16, 9, 3, 64), (5, 4, 1, 32)])
def test_attention_prefill_equals_decode_at_every_position(
    dtype, block_size, heads, kv_heads, head_dim
):
    generator = torch.Generator().manual_seed(1)
    length = 300
    q, k, v = (torch.randn(length, h, head_dim, generator=generator).to(dtype)
               for h in (heads, kv_heads, kv_heads))
    num_blocks = -(-length // block_size) + 2
    table = list(range(1, num_blocks - 1))
    attention = CpuInvariantAttention()
    cache = _cache(num_blocks, block_size, kv_heads, head_dim, dtype)
    full = attention.forward(q, k, v, cache, AttentionMetadata.build(
        [0], [length], [table], block_size, CPU), 0.125)
    # Accurate: against float32 SDPA.
    reference = torch.nn.functional.scaled_dot_product_attention(
        *(t.float().transpose(0, 1) for t in (q, k, v)), is_causal=True, scale=0.125,
        enable_gqa=True).transpose(0, 1)
    assert torch.allclose(full.float(), reference, atol=2e-2 if dtype != torch.float32 else 1e-5)
    # Every position as a decode step over the cache the prefill wrote.
    decode_cache = cache.clone()
    for pos in range(length):
        meta = AttentionMetadata.build([pos], [1], [table], block_size, CPU)
        out = attention.forward(q[pos : pos + 1], k[pos : pos + 1], v[pos : pos + 1],
                                decode_cache, meta, 0.125)
        assert torch.equal(out[0], full[pos]), pos
    # Chunks of 16..512 tokens.
    for chunk in (16, 37, 64, 128, 512):
        chunk_cache = torch.zeros_like(cache)
        outs = []
        for s in range(0, length, chunk):
            e = min(length, s + chunk)
            meta = AttentionMetadata.build([s], [e - s], [table], block_size, CPU)
            outs.append(attention.forward(q[s:e], k[s:e], v[s:e], chunk_cache, meta, 0.125))
        assert torch.equal(torch.cat(outs), full), chunk


def test_attention_of_a_request_does_not_depend_on_its_batch():
    generator = torch.Generator().manual_seed(2)
    heads, kv_heads, head_dim, block_size = 4, 2, 16, 16
    lengths = [40, 7, 130, 1, 65]
    attention = CpuInvariantAttention()
    tables, next_block = [], 1
    for n in lengths:
        blocks = -(-n // block_size)
        tables.append(list(range(next_block, next_block + blocks)))
        next_block += blocks
    qkv = [tuple(torch.randn(n, h, head_dim, generator=generator).bfloat16()
                 for h in (heads, kv_heads, kv_heads)) for n in lengths]
    alone = []
    for (q, k, v), table, n in zip(qkv, tables, lengths):
        cache = _cache(next_block, block_size, kv_heads, head_dim, torch.bfloat16)
        meta = AttentionMetadata.build([0], [n], [table], block_size, CPU)
        alone.append(attention.forward(q, k, v, cache, meta, 0.25))
    cache = _cache(next_block, block_size, kv_heads, head_dim, torch.bfloat16)
    meta = AttentionMetadata.build([0] * len(lengths), lengths, tables, block_size, CPU)
    together = attention.forward(*(torch.cat(t) for t in zip(*qkv)), cache, meta, 0.25)
    assert torch.equal(together, torch.cat(alone))


def test_attention_validates_its_tiles():
    with pytest.raises(ValueError, match="key_chunk must be an integer >= 1, got 0"):
        CpuInvariantAttention(key_chunk=0)


@pytest.mark.parametrize("dtype", HALF)
def test_norm_rotary_swiglu_and_sampling_are_row_local(dtype):
    from kvrecover.models.rope import RotaryEmbedding

    generator = torch.Generator().manual_seed(3)
    ops = TorchOps()
    rows = 64
    x = torch.randn(rows, 576, generator=generator).to(dtype)
    residual = torch.randn(rows, 576, generator=generator).to(dtype)
    weight = (1 + 0.1 * torch.randn(576, generator=generator)).to(dtype)
    gate_up = torch.randn(rows, 2 * 1536, generator=generator).to(dtype)
    rotary = RotaryEmbedding(64, 1024, 10000.0, None)
    positions = torch.randint(0, 1024, (rows,), generator=generator)
    q = torch.randn(rows, 9, 64, generator=generator).to(dtype)
    k = torch.randn(rows, 3, 64, generator=generator).to(dtype)
    logits = torch.randn(rows, 384, generator=generator)
    batched = (ops.rms_norm(x.clone(), weight, 1e-5), *ops.add_rms_norm(x, residual, weight, 1e-5),
               ops.silu_mul(gate_up.clone()), *ops.rotary(rotary, positions, q, k))
    greedy = SamplingParams(temperature=0)
    tokens = Sampler(CPU)(logits, [greedy] * rows, [0] * rows)
    for i in range(rows):
        one = slice(i, i + 1)
        alone = (ops.rms_norm(x[one].clone(), weight, 1e-5),
                 *ops.add_rms_norm(x[one], residual[one], weight, 1e-5),
                 ops.silu_mul(gate_up[one].clone()),
                 *ops.rotary(rotary, positions[one], q[one], k[one]))
        for got, want in zip(alone, batched):
            assert torch.equal(got[0], want[i]), i
        assert Sampler(CPU)(logits[one], [greedy], [0]) == [tokens[i]]


def test_backend_selection_on_the_cpu():
    plain = select_backend("auto", CPU, dtype=torch.float32)
    assert plain.name == "torch" and not plain.batch_invariant
    for dtype in HALF:  # invariant by default in bf16/fp16 (bench/NOTES.md, "bf16 on the CPU")
        default = select_backend("auto", CPU, dtype=dtype)
        assert default.name == "cpu_invariant" and default.batch_invariant
        assert isinstance(default.attention, NativeInvariantAttention)
    for dtype in (*HALF, torch.float32):
        invariant = select_backend("auto", CPU, dtype=dtype, batch_invariant=True)
        assert invariant.name == "cpu_invariant" and invariant.batch_invariant
        assert isinstance(invariant.ops, InvariantCpuOps)
        assert isinstance(invariant.attention, NativeInvariantAttention)  # the C kernel built


def test_backend_falls_back_to_torch_attention_without_the_c_kernel(monkeypatch):
    from kvrecover.ops.cpu import native_build

    monkeypatch.setattr(native_build, "_loaded", {"paged_attention": None})
    invariant = select_backend("auto", CPU, dtype=torch.bfloat16, batch_invariant=True)
    assert invariant.name == "cpu_invariant"
    assert isinstance(invariant.attention, CpuInvariantAttention)


def test_large_tiles_are_used_only_where_they_match_small_ones(monkeypatch):
    from kvrecover.ops.cpu import tiled_linear

    model = nn.Sequential(_linear(64, 96, torch.bfloat16, False))
    ops = InvariantCpuOps(tile_rows=16, large_tile_rows=64)
    ops.prepare_weights(model)
    assert ops.linears.large_tile_rows == 64  # proven equal on this machine
    real = tiled_linear._matmul

    def large_rows_differ(x, layer):  # a library whose large-M kernel sums differently
        out = real(x, layer)
        return out * 1.01 if x.shape[0] == 64 else out

    monkeypatch.setattr(tiled_linear, "_matmul", large_rows_differ)
    ops = InvariantCpuOps(tile_rows=16, large_tile_rows=64)
    ops.prepare_weights(nn.Sequential(_linear(64, 96, torch.bfloat16, False)))
    assert ops.linears.large_tile_rows is None
    x = torch.randn(200, 64).bfloat16()
    assert torch.equal(ops.linear(x, model[0])[:16], ops.linear(x[:16], model[0]))
    with pytest.raises(ValueError, match="large_tile_rows must be a multiple of tile_rows"):
        InvariantCpuOps(tile_rows=16, large_tile_rows=40)


def test_small_tiles_are_proven_per_size_and_pad_to_the_smallest(monkeypatch):
    from kvrecover.ops.cpu import tiled_linear

    real = tiled_linear._matmul
    shapes: list[int] = []

    def four_rows_differ(x, layer):  # a library whose 4-row kernel sums differently
        shapes.append(x.shape[0])
        out = real(x, layer)
        return out * 1.01 if x.shape[0] == 4 else out

    monkeypatch.setattr(tiled_linear, "_matmul", four_rows_differ)
    layer = _linear(64, 96, torch.bfloat16, False)
    ops = InvariantCpuOps(tile_rows=16, large_tile_rows=64)
    ops.prepare_weights(nn.Sequential(layer))
    assert 4 not in ops.linears.small_tiles and ops.linears.small_tiles[-1] == 16
    assert 8 in ops.linears.small_tiles  # proven equal on this machine
    x = torch.randn(40, 64).bfloat16()
    reference = torch.cat([real(x[s : s + 16], layer) for s in range(0, 48, 16)])[:40]
    for rows, runs in ((3, [8]), (8, [8]), (16, [16]), (19, [32]), (40, [32, 8])):
        shapes.clear()
        assert torch.equal(ops.linear(x[:rows], layer), reference[:rows]), rows
        assert shapes == runs, rows


def test_medium_tiles_run_a_batch_above_tile_rows_in_one_call_only_where_proven(monkeypatch):
    from kvrecover.ops.cpu import tiled_linear

    real = tiled_linear._matmul
    shapes: list[int] = []
    layer = _linear(64, 96, torch.bfloat16, False)
    x = torch.randn(100, 64).bfloat16()
    reference = torch.cat([real(x[s : s + 16], layer) for s in range(0, 112, 16)])[:100]

    def recording(x, layer):
        shapes.append(x.shape[0])
        return real(x, layer)

    monkeypatch.setattr(tiled_linear, "_matmul", recording)
    ops = InvariantCpuOps(tile_rows=16, large_tile_rows=256)
    ops.prepare_weights(nn.Sequential(layer))
    assert ops.linears.medium_tiles == (32, 64, 128)  # proven equal on this machine
    for rows, runs in ((17, [32]), (32, [32]), (33, [32, 2]), (100, [64, 32, 4])):
        shapes.clear()
        assert torch.equal(ops.linear(x[:rows], layer), reference[:rows]), rows
        assert shapes == runs, rows

    def thirty_two_rows_differ(x, layer):  # a library whose 32-row kernel sums differently
        shapes.append(x.shape[0])
        out = real(x, layer)
        return out * 1.01 if x.shape[0] == 32 else out

    monkeypatch.setattr(tiled_linear, "_matmul", thirty_two_rows_differ)
    ops = InvariantCpuOps(tile_rows=16, large_tile_rows=256)
    ops.prepare_weights(nn.Sequential(layer))
    assert ops.linears.medium_tiles == (64, 128)
    for rows, runs in ((17, [16, 2]), (40, [16, 16, 8]), (100, [64, 16, 16, 4])):
        shapes.clear()
        assert torch.equal(ops.linear(x[:rows], layer), reference[:rows]), rows
        assert shapes == runs, rows


def _llm(model, max_num_batched_tokens, **kwargs):
    return LLM(str(model), device="cpu", dtype="bfloat16", num_kv_blocks=96,
               max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=8, **kwargs)


def _greedy_with_logits(llm, prompts, max_tokens):
    """Greedy tokens per prompt, and the float32 logits row behind every sampled token
    (tokens alone hide small differences on a tiny random model)."""
    runner = llm.engine.model_runner
    seen: dict[str, list[torch.Tensor]] = {}
    sample = runner._sample

    def recording_sample(logits, sampling, greedy=None):
        for row, scheduled in enumerate(sampling):
            seen.setdefault(scheduled.request_id, []).append(logits[row].clone())
        return sample(logits, sampling, greedy)

    runner._sample = recording_sample
    try:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    finally:
        runner._sample = sample
    tokens = [o.outputs[0].token_ids for o in outputs]
    return tokens, [torch.stack(seen[o.request_id]) for o in outputs]


def _assert_same(run, expected):
    assert run[0] == expected[0]
    for got, want in zip(run[1], expected[1]):
        assert torch.equal(got, want)


@pytest.mark.parametrize("native", [True, False], ids=["c-kernel-default", "torch-fallback"])
def test_engine_bf16_bits_do_not_depend_on_chunking_batch_or_prefix_cache(
    tiny_llama, monkeypatch, native
):
    """bf16 by default (the C kernel), and with `batch_invariant=True` where the C
    kernel is unavailable (the torch attention)."""
    flags = {}
    if not native:
        from kvrecover.ops.cpu import native_build

        monkeypatch.setattr(native_build, "_loaded", {"paged_attention": None})
        flags = {"batch_invariant": True}
    prompts = random_prompts(5, [70, 13, 150, 33, 1], 384, seed=5)
    shared = prompts[2][:96]  # full-block prefix shared with prompt 2: cache hits later
    prompts.append(shared + prompts[0][:20])
    runs = {}
    for budget in (16, 64, 512):
        llm = _llm(tiny_llama, budget, enable_prefix_caching=False, **flags)
        backend = llm.engine.model_runner.backend
        assert backend.name == "cpu_invariant"
        assert backend.attention.name == ("cpu_native" if native else "cpu_invariant")
        runs[budget] = _greedy_with_logits(llm, prompts, 10)
    _assert_same(runs[16], runs[512])
    _assert_same(runs[64], runs[512])
    # One at a time (no batch mates), then all again with the prefix cache warm.
    llm = _llm(tiny_llama, 64, **flags)
    alone = [_greedy_with_logits(llm, [p], 10) for p in prompts]
    _assert_same(([a[0][0] for a in alone], [a[1][0] for a in alone]), runs[64])
    hits_before = llm.stats["prefix_cache_hit_tokens"]
    again = _greedy_with_logits(llm, list(reversed(prompts)), 10)
    assert llm.stats["prefix_cache_hit_tokens"] > hits_before
    _assert_same((again[0][::-1], again[1][::-1]), runs[64])


@pytest.mark.slow
def test_scenario_in_bf16_on_the_default_model(tmp_path):
    """The reference scenario (four processes, built-in model) in bf16: sync and async
    recovery byte-identical to the baseline."""
    from kvrecover import scenario

    result = subprocess.run(
        [sys.executable, "-m", "kvrecover", "scenario", "--device", "cpu", "--dtype", "bfloat16",
         "--batch-invariant", "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout
    baseline = (tmp_path / scenario.DECODE_OUTPUT).read_text()
    for name in (scenario.SYNC_RECOVERED_OUTPUT, scenario.ASYNC_RECOVERED_OUTPUT):
        assert (tmp_path / name).read_text() == baseline
