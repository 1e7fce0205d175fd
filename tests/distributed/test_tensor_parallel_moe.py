"""Mixture-of-experts families at tensor_parallel_size 2 on the CPU (gloo, two
processes): each expert's intermediate dim split, the router replicated; greedy ids
equal Hugging Face (float32) under chunked prefill, from per-expert and from fused
expert tensors; a rank holds exactly its slice of every expert."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import hf_greedy, random_prompts
from safetensors.torch import load_file

from kvrecover import LLM, SamplingParams
from kvrecover.models.loader import load_weights, skip_weight_init
from kvrecover.models.registry import build_model, load_model_config
from kvrecover.ops.backend import select_backend

MAX_NEW = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
PROMPTS = random_prompts(3, [7, 33, 60], vocab_size=384, seed=4)


def generate_ids(model_dir: Path) -> list[list[int]]:
    with LLM(str(model_dir), device="cpu", block_size=8, num_kv_blocks=64,
             max_num_batched_tokens=24, tensor_parallel_size=2) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("family", ["tiny_qwen3_moe", "tiny_mixtral"])
def test_greedy_at_size_2_equals_hugging_face(family, request):
    model_dir = request.getfixturevalue(family)
    assert generate_ids(model_dir) == hf_greedy(model_dir, PROMPTS, MAX_NEW)


def test_fused_expert_tensors_load_by_slice_at_size_2(tiny_mixtral, tiny_mixtral_fused):
    assert generate_ids(tiny_mixtral_fused) == hf_greedy(tiny_mixtral, PROMPTS, MAX_NEW)


def _rank_experts(model_dir: Path, rank: int):
    class FakeGroup:  # loading needs the rank only; no collective runs here
        def __init__(self) -> None:
            self.rank, self.size = rank, 2

    config = load_model_config(model_dir)
    with skip_weight_init():
        model = build_model(config, select_backend("torch", torch.device("cpu")), 64,
                            FakeGroup())
    load_weights(model, model_dir)
    return config, model.layers[0].mlp


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_holds_its_slice_of_every_expert(tiny_mixtral, tiny_mixtral_fused, rank):
    config, block = _rank_experts(tiny_mixtral, rank)
    _, fused_block = _rank_experts(tiny_mixtral_fused, rank)
    weights = load_file(str(tiny_mixtral / "model.safetensors"))
    size = config.intermediate_size // 2
    rows = slice(rank * size, (rank + 1) * size)
    prefix = "model.layers.0.block_sparse_moe."
    assert torch.equal(block.gate.weight, weights[prefix + "gate.weight"])  # replicated
    for expert in range(config.num_experts):
        name = f"{prefix}experts.{expert}."
        assert torch.equal(block.experts.gate_up_proj[expert], torch.cat([
            weights[name + "w1.weight"][rows], weights[name + "w3.weight"][rows]]))
        assert torch.equal(block.experts.down_proj[expert], weights[name + "w2.weight"][:, rows])
    assert torch.equal(fused_block.experts.gate_up_proj, block.experts.gate_up_proj)
    assert torch.equal(fused_block.experts.down_proj, block.experts.down_proj)
