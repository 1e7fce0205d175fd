"""Sliding-window attention on the GPU (Triton): against a dense masked reference with
NaN planted before every window, batch and chunk invariance, and a windowed model
(Mistral) whose float32 tokens equal the CPU path's, eager and in CUDA graphs.

Marked `gpu` and skipped without CUDA (the kernel tests also run under
`TRITON_INTERPRET=1`).
"""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny_model, random_prompts
from test_gpu import (
    CUDA,
    DEVICE,
    DTYPES,
    GREEDY,
    INTERPRET,
    _make_llm,
    _schedule,
    _triton_attention,
    needs_cuda,
)
from test_sliding_window_attention import dense_reference, window_step

from kvrecover import LLM

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (CUDA or INTERPRET), reason="needs CUDA (or TRITON_INTERPRET=1)"),
]

# Contexts past several 256-key segments, so that whole segments are skipped.
MIXED = [(0, 70), (37, 1), (0, 1), (300, 45), (16, 16), (600, 1)]
DECODE = [(37, 1), (0, 1), (700, 1), (255, 1), (256, 1), (1000, 1)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("requests", [MIXED, DECODE], ids=["mixed", "decode"])
@pytest.mark.parametrize("block_size,window", [(16, 20), (5, 64), (16, 300), (13, 1)])
@pytest.mark.parametrize("batch_invariant", [False, True], ids=["fast", "invariant"])
def test_window_attention_matches_dense_reference_and_ignores_nan(
    dtype, requests, block_size, window, batch_invariant
):
    q, k, v, cache, tables, keys, values = window_step(requests, block_size, window, dtype)
    to = dict(device=DEVICE)
    out = _triton_attention(q.to(**to), k.to(**to), v.to(**to), cache.to(**to),
                            _schedule(requests, tables), block_size, batch_invariant,
                            window=window)
    assert torch.isfinite(out).all()
    expected = dense_reference(q, keys, values, requests, window, 32**-0.5)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double().cpu(), expected, rtol=tol, atol=tol)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_window_attention_is_batch_and_chunk_invariant(dtype):
    """A windowed request's rows are bit-identical alone, in chunks, and as decodes."""
    length, block_size, window = 700, 16, 300
    q, k, v, cache, (table,), _, _ = window_step([(0, length)], block_size, window, dtype)
    q, k, v, cache = (t.to(DEVICE) for t in (q, k, v, cache))
    alone = _triton_attention(q, k, v, cache.clone(), _schedule([(0, length)], [table]),
                              block_size, batch_invariant=True, window=window)
    chunked = cache.clone()
    pieces = []
    for start, end in ((0, 64), (64, 333), (333, 698), (698, 699), (699, 700)):
        pieces.append(_triton_attention(
            q[start:end], k[start:end], v[start:end], chunked,
            _schedule([(start, end - start)], [table]), block_size, batch_invariant=True,
            window=window,
        ))
    assert torch.equal(torch.cat(pieces), alone)


@pytest.fixture(scope="module")
def windowed_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("gpu_mistral"), model_type="mistral",
                            num_hidden_layers=2, head_dim=32, num_attention_heads=8,
                            num_key_value_heads=2, hidden_size=128, sliding_window=24)


@pytest.mark.parametrize("enforce_eager", [True, pytest.param(False, marks=needs_cuda)])
@pytest.mark.parametrize("batch_invariant", [False, True], ids=["fast", "invariant"])
def test_windowed_model_float32_tokens_match_cpu(windowed_model, enforce_eager, batch_invariant):
    prompts = [{"prompt_token_ids": p} for p in random_prompts(6, [1, 9, 24, 130, 17, 300], 384)]
    cpu = LLM(str(windowed_model), device="cpu", max_num_batched_tokens=64)
    expected = [o.outputs[0].token_ids for o in cpu.generate(prompts, GREEDY)]
    gpu = _make_llm(windowed_model, dtype="float32", max_num_batched_tokens=64,
                    enforce_eager=enforce_eager, batch_invariant=batch_invariant)
    assert [o.outputs[0].token_ids for o in gpu.generate(prompts, GREEDY)] == expected
