"""The GPU mixture-of-experts path: the fused Triton MoE and torch's grouped-mm against the
reference, routing stability and bits on the batch-invariant path, CUDA-graph
capture, and the engine (float32 equal to the CPU, bf16 batch-invariant exact,
recovery exact in bf16 batch-invariant mode).

Marked `gpu` and skipped without CUDA (the lead runs them on the H200).
"""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts

from kvrecover import LLM, KVTransferConfig, SamplingParams
from kvrecover.models.moe import ExpertWeights, route_topk
from kvrecover.ops.reference.grouped_moe import grouped_mm_available, grouped_mm_moe
from kvrecover.ops.reference.moe import reference_moe
from kvrecover.ops.reference.torch_ops import TorchOps

CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a real GPU")]
ENGINE_DEVICE = "cuda:0"
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
# A Qwen3-30B-A3B-like layer, scaled down: 64 experts of 256, top-8, hidden 512.
HIDDEN, INTERMEDIATE, EXPERTS, TOP_K = 512, 256, 64, 8


def experts_and_router(dtype: torch.dtype, seed: int = 0) -> tuple[ExpertWeights, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    experts = ExpertWeights(EXPERTS, HIDDEN, INTERMEDIATE)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=generator)
                                   * HIDDEN**-0.5)
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=generator)
                                * INTERMEDIATE**-0.5)
    router = torch.randn(EXPERTS, HIDDEN, generator=generator) * HIDDEN**-0.5
    return experts.to("cuda", dtype), router.to("cuda", dtype)


def route(x: torch.Tensor, router: torch.Tensor, linear=torch.nn.functional.linear):
    return route_topk(linear(x, router), TOP_K, renormalize=True)


def inputs(num_tokens: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, HIDDEN, generator=generator).to("cuda", dtype)


@pytest.mark.parametrize("batch_invariant", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 7, 64, 300])  # decode and prefill tile configs
def test_fused_moe_matches_reference(dtype, num_tokens, batch_invariant):
    from kvrecover.ops.triton.moe import fused_moe

    experts, router = experts_and_router(dtype)
    x = inputs(num_tokens, dtype, seed=num_tokens)
    weights, ids = route(x, router)
    expected = reference_moe(x, weights, ids, experts, TorchOps().silu_mul)
    got = fused_moe(x, weights, ids, experts, batch_invariant=batch_invariant)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("batch_invariant", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 7, 300])
def test_fused_moe_with_biases_and_the_clamp_matches_reference(dtype, num_tokens,
                                                               batch_invariant):
    """gpt-oss's experts: a bias after each matmul and the clamped SwiGLU."""
    from kvrecover.models.gpt_oss import GptOssExperts
    from kvrecover.ops.interface import ClampedSwiGLU
    from kvrecover.ops.triton.moe import fused_moe

    plain, router = experts_and_router(dtype)
    experts = GptOssExperts(EXPERTS, HIDDEN, INTERMEDIATE, ClampedSwiGLU(1.702, 0.5))
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        experts.gate_up_proj.copy_(plain.gate_up_proj.float().cpu())
        experts.down_proj.copy_(plain.down_proj.float().cpu())
        experts.gate_up_bias.copy_(torch.randn(experts.gate_up_bias.shape, generator=generator))
        experts.down_bias.copy_(torch.randn(experts.down_bias.shape, generator=generator))
    experts = experts.to("cuda", dtype)
    x = inputs(num_tokens, dtype, seed=num_tokens)
    weights, ids = route(x, router)
    expected = reference_moe(x, weights, ids, experts, TorchOps().silu_mul)
    got = fused_moe(x, weights, ids, experts, batch_invariant=batch_invariant)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)


@pytest.mark.skipif(not CUDA or not grouped_mm_available(torch.empty(0, device="cuda",
                                                                      dtype=torch.bfloat16)),
                    reason="torch._grouped_mm needs bf16 on sm90+")
@pytest.mark.parametrize("num_tokens", [1, 64, 300])
def test_grouped_mm_moe_matches_reference(num_tokens):
    experts, router = experts_and_router(torch.bfloat16)
    x = inputs(num_tokens, torch.bfloat16, seed=num_tokens)
    weights, ids = route(x, router)
    expected = reference_moe(x, weights, ids, experts, TorchOps().silu_mul)
    got = grouped_mm_moe(x, weights, ids, experts, TorchOps().silu_mul)
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)


def test_batch_invariant_fused_moe_route_and_bits_do_not_depend_on_the_batch():
    from kvrecover.ops.triton.batch_invariant_matmul import linear as invariant_linear
    from kvrecover.ops.triton.moe import fused_moe

    dtype = torch.bfloat16
    experts, router = experts_and_router(dtype)
    others = inputs(600, dtype, seed=1)
    for index, target in enumerate(inputs(4, dtype, seed=2)):
        near = target + 0.01 * inputs(64, dtype, seed=3 + index)  # shares its experts
        alone_w, alone_ids = route(target[None], router, invariant_linear)
        alone = fused_moe(target[None], alone_w, alone_ids, experts, batch_invariant=True)[0]
        for size, row, pool in ((2, 1, others), (16, 15, near), (64, 3, near), (65, 64, others),
                                (513, 200, others)):
            batch = torch.cat([pool[: size - 1][:row], target[None], pool[: size - 1][row:]])
            weights, ids = route(batch, router, invariant_linear)
            assert torch.equal(ids[row], alone_ids[0]), (size, row)
            got = fused_moe(batch, weights, ids, experts, batch_invariant=True)[row]
            assert torch.equal(got, alone), (size, row)


def test_fused_moe_replays_in_a_cuda_graph():
    from kvrecover.ops.triton.moe import fused_moe

    experts, router = experts_and_router(torch.bfloat16)
    static_x = inputs(16, torch.bfloat16, seed=5)
    fused_moe(static_x, *route(static_x, router), experts)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fused_moe(static_x, *route(static_x, router), experts)
    for seed in (6, 7):
        x = inputs(16, torch.bfloat16, seed=seed)
        static_x.copy_(x)
        graph.replay()
        assert torch.equal(static_out, fused_moe(x, *route(x, router), experts))


@pytest.mark.parametrize("block_m", [16, 64])
def test_triton_align_is_the_torch_align_on_cuda_and_in_a_graph(block_m):
    from kvrecover.ops.reference.grouped_moe import align_by_expert
    from kvrecover.ops.triton.moe_align import (
        MAX_ASSIGNMENTS,
        align_by_expert_triton,
        triton_align_applies,
    )

    generator = torch.Generator().manual_seed(block_m)
    for num_experts, top_k in ((8, 2), (64, 8), (128, 8), (512, 10)):
        for num_tokens in (1, 3, 16, 17, 100, MAX_ASSIGNMENTS // top_k):
            ids = torch.stack([torch.randperm(num_experts, generator=generator)[:top_k]
                               for _ in range(num_tokens)]).cuda()
            assert triton_align_applies(ids, num_experts)
            got = align_by_expert_triton(ids, num_experts, block_m)
            expected = align_by_expert(ids, num_experts, block_m)
            assert torch.equal(got.sorted_ids, expected.sorted_ids), (num_experts, num_tokens)
            assert torch.equal(got.block_expert, expected.block_expert), (num_experts, num_tokens)
    static_ids = torch.zeros(16, 8, dtype=torch.int64, device="cuda")
    align_by_expert_triton(static_ids, 64, block_m)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = align_by_expert_triton(static_ids, 64, block_m)
    for ids in (torch.randperm(64, generator=generator)[:8].repeat(16, 1),
                torch.stack([torch.randperm(64, generator=generator)[:8] for _ in range(16)])):
        static_ids.copy_(ids)
        graph.replay()
        expected = align_by_expert(static_ids, 64, block_m)
        assert torch.equal(captured.sorted_ids, expected.sorted_ids)
        assert torch.equal(captured.block_expert, expected.block_expert)


# ----- the engine ---------------------------------------------------------------------
MOE_FAMILIES = ["tiny_mixtral", "tiny_qwen3_moe", "tiny_gpt_oss"]


def _token_ids(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("enforce_eager", [True, False])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_float32_moe_tokens_match_cpu(request, family, enforce_eager):
    model_dir = request.getfixturevalue(family)
    prompts = random_prompts(6, [1, 9, 40, 130, 17, 64], 384)
    cpu = LLM(str(model_dir), device="cpu", max_num_batched_tokens=64)
    gpu = LLM(str(model_dir), device=ENGINE_DEVICE, attention_backend="triton", dtype="float32",
              max_num_batched_tokens=64, enforce_eager=enforce_eager)
    assert _token_ids(gpu, prompts) == _token_ids(cpu, prompts)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_bf16_batch_invariant_moe_tokens_do_not_depend_on_the_batch(request, family):
    model_dir = request.getfixturevalue(family)
    prompts = random_prompts(5, [600, 3, 77, 250, 31], 384, seed=4)
    alone = LLM(str(model_dir), device=ENGINE_DEVICE, dtype="bfloat16", batch_invariant=True,
                enforce_eager=True, max_num_batched_tokens=2048)
    batched = LLM(str(model_dir), device=ENGINE_DEVICE, dtype="bfloat16", batch_invariant=True,
                  max_num_batched_tokens=96)  # CUDA graphs for decode
    assert _token_ids(batched, prompts)[0] == _token_ids(alone, prompts[:1])[0]


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_models_run_the_invariant_kernels_by_default(request, family, tiny_llama):
    moe = LLM(str(request.getfixturevalue(family)), device=ENGINE_DEVICE, dtype="bfloat16")
    assert moe.engine.model_runner.backend.batch_invariant
    dense = LLM(str(tiny_llama), device=ENGINE_DEVICE, dtype="bfloat16")
    assert not dense.engine.model_runner.backend.batch_invariant


@pytest.mark.parametrize("mode", [{"batch_invariant": True}, {}], ids=["invariant", "default"])
@pytest.mark.parametrize("policy", ["recompute", "fail"])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_bf16_moe_recovery_is_exact(request, tmp_path, family, policy, mode):
    model_dir = request.getfixturevalue(family)
    prompts = random_prompts(4, [100, 70, 40, 90], 384, seed=11)
    engine = dict(device=ENGINE_DEVICE, dtype="bfloat16", **mode)
    producer = KVTransferConfig("SharedStorageConnector", "kv_producer",
                                {"shared_storage_path": str(tmp_path)})
    _token_ids(LLM(str(model_dir), kv_transfer_config=producer, **engine), prompts)
    baseline = _token_ids(LLM(str(model_dir), max_num_batched_tokens=32, **engine), prompts)
    faults = [{"requests": "first", "blocks": "middle", "kind": "missing"}]
    consumer = KVTransferConfig("FaultInjectionConnector", "kv_consumer",
                                {"shared_storage_path": str(tmp_path), "faults": faults},
                                kv_load_failure_policy=policy)
    llm = LLM(str(model_dir), kv_transfer_config=consumer, max_num_batched_tokens=32, **engine)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    got = [o.outputs[0].token_ids for o in outputs]
    if policy == "recompute":
        assert got == baseline and llm.stats["kv_load_recovered_requests"] >= 1
    else:
        assert outputs[0].outputs[0].finish_reason == "error" and got[1:] == baseline[1:]
