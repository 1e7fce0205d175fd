"""ops.cpu.attention / ops.cpu.native_build: the fused C paged-attention kernel.

Bitwise: every position of a long prompt computed in a prefill equals the same
query as a decode step, inside chunks of 16..512 tokens and inside batches of
1..64 requests, for random shapes (head_dim 64/128, GQA groups 1/3/4, block
sizes 16/32) and thread splits 1/2/3; close to float32 SDPA. The build: cached
per source and machine, one warning and the torch fallback without a compiler
or with `native_kernels=False` (`KVRECOVER_NATIVE_KERNELS=0`).
"""

from __future__ import annotations

import ast
import random
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

from kvrecover.ops.backend import select_backend
from kvrecover.ops.cpu import native_build
from kvrecover.ops.cpu.attention import (
    CpuInvariantAttention,
    NativeInvariantAttention,
    invariant_cpu_attention,
)
from kvrecover.ops.reference.attention_metadata import AttentionMetadata

CPU = torch.device("cpu")
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


@pytest.fixture(scope="module")
def library():
    lib = native_build.load_library("paged_attention")
    assert lib is not None, "the C kernel must build on the test machines (build-essential)"
    return lib


def _kernel(library, threads=None):
    return NativeInvariantAttention(library, num_threads=threads)


def _cache(num_blocks, block_size, kv_heads, head_dim, dtype):
    """NaN everywhere but the zeroed null block 0 (as the engine allocates it): a slot
    the kernel reads before it is written poisons the output."""
    cache = torch.full((2, num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype)
    cache[:, 0].zero_()
    return cache


def _sdpa(q, k, v, scale):
    return F.scaled_dot_product_attention(
        *(t.float().transpose(0, 1) for t in (q, k, v)), is_causal=True, scale=scale,
        enable_gqa=True).transpose(0, 1)


SHAPES = [  # dtype, block_size, heads, kv_heads, head_dim
    (torch.bfloat16, 16, 9, 3, 64),
    (torch.bfloat16, 32, 8, 2, 128),
    (torch.bfloat16, 16, 4, 4, 128),
    (torch.float16, 32, 12, 3, 64),
    (torch.float32, 16, 6, 2, 64),
    (torch.bfloat16, 5, 4, 1, 24),  # not a multiple of 16: the scalar path of the build
]


@pytest.mark.parametrize("dtype, block_size, heads, kv_heads, head_dim", SHAPES)
def test_prefill_decode_and_chunks_give_the_same_bits(
    library, dtype, block_size, heads, kv_heads, head_dim
):
    generator = torch.Generator().manual_seed(head_dim + heads)
    length, scale = 520, head_dim**-0.5
    q, k, v = (torch.randn(length, h, head_dim, generator=generator).to(dtype)
               for h in (heads, kv_heads, kv_heads))
    num_blocks = -(-length // block_size) + 3
    table = random.Random(block_size).sample(range(1, num_blocks), num_blocks - 1)  # scattered
    cache = _cache(num_blocks, block_size, kv_heads, head_dim, dtype)
    full = _kernel(library).forward(
        q, k, v, cache, AttentionMetadata.build([0], [length], [table], block_size, CPU), scale)
    assert torch.allclose(full.float(), _sdpa(q, k, v, scale), atol=TOLERANCE[dtype])
    for threads in (1, 2, 3):
        again = _kernel(library, threads).forward(
            q, k, v, _cache(num_blocks, block_size, kv_heads, head_dim, dtype),
            AttentionMetadata.build([0], [length], [table], block_size, CPU), scale)
        assert torch.equal(again, full), threads
    decode = _kernel(library, 1)
    for pos in range(length):  # every position as a decode step over the prefill's cache
        meta = AttentionMetadata.build([pos], [1], [table], block_size, CPU)
        out = decode.forward(q[pos : pos + 1], k[pos : pos + 1], v[pos : pos + 1], cache, meta,
                             scale)
        assert torch.equal(out[0], full[pos]), pos
    for chunk in (16, 37, 64, 128, 512):
        chunk_cache = _cache(num_blocks, block_size, kv_heads, head_dim, dtype)
        attention, outs = _kernel(library, 1 + chunk % 3), []
        for s in range(0, length, chunk):
            e = min(length, s + chunk)
            meta = AttentionMetadata.build([s], [e - s], [table], block_size, CPU)
            outs.append(attention.forward(q[s:e], k[s:e], v[s:e], chunk_cache, meta, scale))
        assert torch.equal(torch.cat(outs), full), chunk


def test_a_request_gives_the_same_bits_in_any_batch(library):
    """Batches of 1..64 requests mixing fresh prompts, chunks after a cached prefix and
    decodes: each request's rows equal the rows it gets alone."""
    rng = random.Random(7)
    generator = torch.Generator().manual_seed(7)
    heads, kv_heads, head_dim, block_size = 12, 4, 64, 16
    requests = []
    next_block = 1
    for _ in range(64):
        cached = rng.choice([0, 0, rng.randrange(1, 200)])
        new = rng.choice([1, 1, rng.randrange(2, 60)])
        blocks = -(-(cached + new) // block_size)
        table = list(range(next_block, next_block + blocks))
        next_block += blocks
        kv = [torch.randn(cached + new, kv_heads, head_dim, generator=generator).bfloat16()
              for _ in range(2)]
        q = torch.randn(new, heads, head_dim, generator=generator).bfloat16()
        requests.append((cached, new, table, q, *kv))
    cache = _cache(next_block, block_size, kv_heads, head_dim, torch.bfloat16)
    for cached, _new, table, _q, k, v in requests:  # the cached prefixes, written directly
        for pos in range(cached):
            slot = table[pos // block_size], pos % block_size
            cache[0][slot], cache[1][slot] = k[pos], v[pos]
    alone = []
    for cached, new, table, q, k, v in requests:
        meta = AttentionMetadata.build([cached], [new], [table], block_size, CPU)
        alone.append(_kernel(library, 1).forward(q, k[cached:], v[cached:], cache, meta, 0.125))
    for size in (1, 2, 5, 17, 40, 64):
        start = (size * 11) % (64 - size + 1)
        batch = requests[start : start + size]
        meta = AttentionMetadata.build([r[0] for r in batch], [r[1] for r in batch],
                                       [r[2] for r in batch], block_size, CPU)
        together = _kernel(library, 1 + size % 3).forward(
            torch.cat([r[3] for r in batch]), torch.cat([r[4][r[0]:] for r in batch]),
            torch.cat([r[5][r[0]:] for r in batch]), cache, meta, 0.125)
        assert torch.equal(together, torch.cat(alone[start : start + size])), size


def test_agrees_with_the_torch_invariant_attention(library):
    generator = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(200, h, 64, generator=generator).bfloat16() for h in (9, 3, 3))
    meta = AttentionMetadata.build([0], [200], [list(range(1, 14))], 16, CPU)
    native = _kernel(library).forward(q, k, v, _cache(14, 16, 3, 64, torch.bfloat16), meta, 0.125)
    fallback = CpuInvariantAttention().forward(q, k, v, _cache(14, 16, 3, 64, torch.bfloat16),
                                               meta, 0.125)
    assert torch.allclose(native.float(), fallback.float(), atol=1e-2)


def test_rejects_mismatched_dtypes_and_thread_counts(library):
    meta = AttentionMetadata.build([0], [4], [[1]], 16, CPU)
    q, k = torch.zeros(4, 2, 16), torch.zeros(4, 1, 16)
    with pytest.raises(ValueError, match="must equal the cache dtype"):
        _kernel(library).forward(q, k, k, _cache(2, 16, 1, 16, torch.bfloat16), meta, 1.0)
    strided = _cache(2, 16, 1, 16, torch.float32).transpose(1, 2)
    with pytest.raises(ValueError, match="kv_cache must be contiguous"):
        _kernel(library).forward(q, k, k, strided, meta, 1.0)
    with pytest.raises(ValueError, match="num_threads must be None or an integer >= 1, got 0"):
        _kernel(library, 0)


def test_build_is_cached_per_source_and_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("KVRECOVER_CACHE", str(tmp_path))
    monkeypatch.setattr(native_build, "_loaded", {})
    assert native_build.load_library("paged_attention") is not None
    built = sorted(p.name for p in (tmp_path / "kernels").iterdir())
    assert len([n for n in built if n.endswith(".so")]) == 1, built  # no partial file left
    compiles = []
    real_run = native_build.subprocess.run

    def counting_run(command, **kwargs):
        compiles.extend(["-shared"] if "-shared" in command else [])
        return real_run(command, **kwargs)

    monkeypatch.setattr(native_build.subprocess, "run", counting_run)
    monkeypatch.setattr(native_build, "_loaded", {})
    assert native_build.load_library("paged_attention") is not None
    assert compiles == []  # found in the cache, not compiled again


def test_falls_back_to_torch_with_one_warning(tmp_path, monkeypatch):
    monkeypatch.setenv("KVRECOVER_CACHE", str(tmp_path))
    monkeypatch.setattr(native_build, "_loaded", {})
    monkeypatch.setenv("CC", "/bin/false")  # a compiler that fails
    with pytest.warns(RuntimeWarning, match="building the C kernel 'paged_attention' failed"):
        assert isinstance(invariant_cpu_attention(), CpuInvariantAttention)
    with warnings.catch_warnings(record=True) as later:  # remembered: no second warning
        warnings.simplefilter("always")
        assert isinstance(invariant_cpu_attention(), CpuInvariantAttention)
    assert later == []
    assert not list((tmp_path / "kernels").glob("*.so"))  # no partial build left behind
    monkeypatch.setattr(native_build, "_loaded", {})
    monkeypatch.delenv("CC")
    with pytest.warns(RuntimeWarning, match="native_kernels=False"):
        assert isinstance(invariant_cpu_attention(native_kernels=False), CpuInvariantAttention)
    assert not list((tmp_path / "kernels").glob("*.so"))  # not allowed: nothing was built
    # KVRECOVER_NATIVE_KERNELS=0 is the default of the engine option (`select_backend`).
    monkeypatch.setenv("KVRECOVER_NATIVE_KERNELS", "0")
    with pytest.warns(RuntimeWarning, match="KVRECOVER_NATIVE_KERNELS=0"):
        backend = select_backend("auto", CPU, dtype=torch.bfloat16)
    assert isinstance(backend.attention, CpuInvariantAttention)
    assert isinstance(invariant_cpu_attention(), NativeInvariantAttention)  # the option decides


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_the_kernel_shares_torchs_openmp_runtime(library):
    """Built with -fopenmp, the library must bind to the libgomp torch loaded, not bring
    a second OpenMP runtime whose threads would fight torch's for the cores. Read in a
    fresh process holding only torch and the kernel: this test process may hold other
    packages' vendored runtimes (scikit-learn's, on the GPU machine)."""
    script = (
        "import torch\n"
        "from kvrecover.ops.cpu import native_build\n"
        "assert native_build.load_library('paged_attention') is not None\n"
        "maps = open('/proc/self/maps').read().splitlines()\n"
        "print(sorted({l.split()[-1] for l in maps if 'gomp' in l or 'libomp' in l}))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120, check=True)
    runtimes = ast.literal_eval(result.stdout.strip().splitlines()[-1])
    assert len(runtimes) == 1, runtimes
