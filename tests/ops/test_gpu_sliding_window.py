"""Sliding windows, soft-capping, attention sinks and the Gemma ops on the GPU (Triton): attention
against a dense masked reference with NaN planted before every window, batch and
chunk invariance, the (1 + w) norm and GeGLU against the torch ops, and windowed
models (Mistral, Gemma 2, Gemma 3) whose float32 tokens equal the CPU path's, eager and in
CUDA graphs, with bf16 batch-invariant logits exact.

Marked `gpu` and skipped without CUDA (the kernel tests also run under
`TRITON_INTERPRET=1`).
"""

from __future__ import annotations

import pytest
import torch
from conftest import TRITON_TESTS, build_tiny_model, random_prompts
from test_gpu import (
    DEVICE,
    DTYPES,
    GREEDY,
    _decode_logits,
    _make_llm,
    _schedule,
    _triton_attention,
    needs_cuda,
)
from test_sliding_window_attention import dense_reference, window_step

from kvrecover import LLM

pytestmark = TRITON_TESTS

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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("requests", [MIXED, DECODE], ids=["mixed", "decode"])
@pytest.mark.parametrize("window", [None, 64])
@pytest.mark.parametrize("batch_invariant", [False, True], ids=["fast", "invariant"])
def test_soft_capped_attention_matches_dense_reference(dtype, requests, window, batch_invariant):
    q, k, v, cache, tables, keys, values = window_step(requests, 16, window or 10_000, dtype)
    out = _triton_attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), cache.to(DEVICE),
                            _schedule(requests, tables), 16, batch_invariant, window=window,
                            softcap=0.5)
    expected = dense_reference(q, keys, values, requests, window or 10_000, 32**-0.5, 0.5)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double().cpu(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("requests", [MIXED, DECODE], ids=["mixed", "decode"])
@pytest.mark.parametrize("window", [None, 64])
@pytest.mark.parametrize("batch_invariant", [False, True], ids=["fast", "invariant"])
def test_attention_sinks_match_dense_reference(dtype, requests, window, batch_invariant):
    """gpt-oss's sinks: one logit per query head in the softmax denominator (decode goes
    through the split-context kernel and its combine, fused or not)."""
    q, k, v, cache, tables, keys, values = window_step(requests, 16, window or 10_000, dtype)
    sinks = torch.randn(q.shape[1], generator=torch.Generator().manual_seed(2)) * 2
    out = _triton_attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), cache.to(DEVICE),
                            _schedule(requests, tables), 16, batch_invariant, window=window,
                            sinks=sinks.to(DEVICE))
    expected = dense_reference(q, keys, values, requests, window or 10_000, 32**-0.5,
                               sinks=sinks)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double().cpu(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma_norm_and_geglu_match_the_torch_ops(dtype):
    from kvrecover.ops.reference.torch_ops import TorchOps
    from kvrecover.ops.triton.fused_ops import TritonOps

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(37, 320, generator=gen).to(device=DEVICE, dtype=dtype)
    residual = torch.randn(37, 320, generator=gen).to(device=DEVICE, dtype=dtype)
    weight = torch.randn(320, generator=gen).to(device=DEVICE, dtype=dtype)
    gate_up = torch.randn(37, 640, generator=gen).to(device=DEVICE, dtype=dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(TritonOps().rms_norm_plus_one(x, weight, 1e-6),
                               TorchOps().rms_norm_plus_one(x, weight, 1e-6), rtol=tol, atol=tol)
    out, res = TritonOps().add_rms_norm_plus_one(x.clone(), residual.clone(), weight, 1e-6)
    ref_out, ref_res = TorchOps().add_rms_norm_plus_one(x, residual, weight, 1e-6)
    assert torch.equal(res, ref_res)
    torch.testing.assert_close(out, ref_out, rtol=tol, atol=tol)
    torch.testing.assert_close(TritonOps().gelu_tanh_mul(gate_up), TorchOps().gelu_tanh_mul(gate_up),
                               rtol=tol, atol=tol)


@pytest.fixture(scope="module")
def gemma2_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("gpu_gemma2"), model_type="gemma2",
                            num_hidden_layers=4, head_dim=32, num_attention_heads=8,
                            num_key_value_heads=2, hidden_size=128, sliding_window=24,
                            query_pre_attn_scalar=48, attn_logit_softcapping=2.0,
                            final_logit_softcapping=3.0, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def gemma3_model(tmp_path_factory):
    """Gemma 3-shaped: five sliding layers to one full one, two rope bases, q/k norms."""
    return build_tiny_model(tmp_path_factory.mktemp("gpu_gemma3"), model_type="gemma3_text",
                            num_hidden_layers=6, head_dim=32, num_attention_heads=8,
                            num_key_value_heads=2, hidden_size=128, sliding_window=24,
                            query_pre_attn_scalar=32, rope_theta=1e6, rope_local_base_freq=1e4,
                            rope_scaling={"rope_type": "linear", "factor": 8.0},
                            tie_word_embeddings=True)


@pytest.mark.parametrize("model", ["gemma2_model", "gemma3_model"])
@pytest.mark.parametrize("enforce_eager", [True, pytest.param(False, marks=needs_cuda)])
@pytest.mark.parametrize("batch_invariant", [False, True], ids=["fast", "invariant"])
def test_gemma_float32_tokens_match_cpu(request, model, enforce_eager, batch_invariant):
    model_dir = request.getfixturevalue(model)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(6, [1, 9, 24, 130, 17, 300], 384)]
    cpu = LLM(str(model_dir), device="cpu", max_num_batched_tokens=64)
    expected = [o.outputs[0].token_ids for o in cpu.generate(prompts, GREEDY)]
    gpu = _make_llm(model_dir, dtype="float32", max_num_batched_tokens=64,
                    enforce_eager=enforce_eager, batch_invariant=batch_invariant)
    assert [o.outputs[0].token_ids for o in gpu.generate(prompts, GREEDY)] == expected


@needs_cuda
@pytest.mark.parametrize("model", ["windowed_model", "gemma2_model", "gemma3_model"])
def test_bf16_batch_invariant_windowed_logits_are_exact(request, model):
    """Same logits bits for one request alone (eager, big chunks) and batched (graphs,
    small chunks) on a windowed model."""
    model_dir = request.getfixturevalue(model)
    prompts = random_prompts(5, [600, 3, 77, 250, 31], 384, seed=4)
    alone = _make_llm(model_dir, dtype="bfloat16", batch_invariant=True, enforce_eager=True,
                      max_num_batched_tokens=2048)
    expected = _decode_logits(alone, [prompts[0]], 0)
    batched = _make_llm(model_dir, dtype="bfloat16", batch_invariant=True,
                        max_num_batched_tokens=96)
    got = _decode_logits(batched, prompts, 0)
    assert len(got) == len(expected) == GREEDY.max_tokens
    for step, (a, b) in enumerate(zip(got, expected)):
        assert torch.equal(a, b), step
