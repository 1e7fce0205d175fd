"""Mixture-of-experts families (Mixtral, Qwen3-MoE, gpt-oss) equal Hugging Face token for token.

Float32 on the CPU (the reference kernels, and the batch-invariant ones), on tiny random checkpoints with 8 experts and top-2 (the
routing differs between tokens: asserted), under chunked prefill, odd block
sizes, prefix-cache reuse and a KV budget tight enough to preempt (Mixtral also
with a sliding window; gpt-oss with its sliding and full layers, a window shorter
than most prompts, attention sinks, YaRN and clamped experts); checkpoints
with the classic per-expert tensors and with the fused ones `transformers`
holds in memory load alike.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import build_tiny_model, hf_greedy, random_prompts

from kvrecover import LLM, SamplingParams

LENGTHS = [7, 33, 100, 150]
MAX_NEW = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
FAMILIES = ["tiny_mixtral", "tiny_qwen3_moe", "tiny_gpt_oss"]
PROMPTS = random_prompts(len(LENGTHS), LENGTHS, vocab_size=384, seed=0)

_HF_CACHE: dict[tuple, list[list[int]]] = {}


def hf_reference(model_dir: Path, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    key = (str(model_dir), tuple(map(tuple, prompts)))
    if key not in _HF_CACHE:
        _HF_CACHE[key] = hf_greedy(model_dir, prompts, MAX_NEW)
    return _HF_CACHE[key]


def generate(llm: LLM, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    return [o.outputs[0].token_ids for o in outputs]


def hf_expert_sets(model_dir: Path, prompt: list[int]) -> set[tuple[int, ...]]:
    """The top-k expert sets HF's routers pick for the tokens of `prompt`, over all layers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    top_k = model.config.num_experts_per_tok
    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt]), output_router_logits=True)
    return {tuple(sorted(row)) for logits in out.router_logits
            for row in logits.topk(top_k, dim=-1).indices.tolist()}


@pytest.fixture(scope="module")
def tiny_qwen3_moe_sparse_step(tmp_path_factory) -> Path:
    """Qwen3-MoE without top-k renormalisation, experts every second layer."""
    return build_tiny_model(
        tmp_path_factory.mktemp("qwen3_moe_step"), model_type="qwen3_moe", seed=9,
        num_hidden_layers=4, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=40,
        norm_topk_prob=False, decoder_sparse_step=2, head_dim=32,
    )


@pytest.fixture(scope="module")
def tiny_mixtral_windowed(tmp_path_factory) -> Path:
    """Mixtral whose layers attend over the last 24 tokens (shorter than most prompts)."""
    return build_tiny_model(
        tmp_path_factory.mktemp("mixtral_windowed"), model_type="mixtral", seed=10,
        num_local_experts=8, num_experts_per_tok=2, sliding_window=24,
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_routing_differs_between_tokens(request, family):
    model_dir = request.getfixturevalue(family)
    assert len(hf_expert_sets(model_dir, PROMPTS[1])) >= 2


@pytest.mark.parametrize("block_size", [16, 13])
@pytest.mark.parametrize("family", [*FAMILIES, "tiny_qwen3_moe_sparse_step",
                                    "tiny_mixtral_windowed"])
def test_greedy_matches_hf_under_chunked_prefill(request, family, block_size):
    model_dir = request.getfixturevalue(family)
    # A 64-token budget prefills the longer prompts in several chunks.
    llm = LLM(str(model_dir), block_size=block_size, max_num_batched_tokens=64, device="cpu")
    assert generate(llm) == hf_reference(model_dir)
    assert llm.stats["prompt_tokens_computed"] == sum(map(len, PROMPTS))


@pytest.mark.parametrize("family", FAMILIES)
def test_float32_batch_invariant_kernels_match_hf(request, family):
    """The CPU-invariant kernels (fixed-tile experts) in float32 give HF's tokens too."""
    model_dir = request.getfixturevalue(family)
    llm = LLM(str(model_dir), block_size=16, max_num_batched_tokens=64, device="cpu",
              batch_invariant=True)
    assert llm.engine.model_runner.backend.name == "cpu_invariant"
    assert generate(llm) == hf_reference(model_dir)


@pytest.mark.parametrize("family", [*FAMILIES, "tiny_mixtral_windowed"])
def test_prefix_cache_reuse_keeps_hf_outputs(request, family):
    model_dir = request.getfixturevalue(family)
    llm = LLM(str(model_dir), block_size=16, max_num_batched_tokens=128, device="cpu")
    first = generate(llm)
    second = generate(llm)
    assert first == second == hf_reference(model_dir)
    hits = sum((len(p) - 1) // 16 * 16 for p in PROMPTS)
    assert hits > 0 and llm.stats["prefix_cache_hit_tokens"] == hits


@pytest.mark.parametrize("family", FAMILIES)
def test_tight_kv_budget_preempts_and_keeps_hf_outputs(request, family):
    model_dir = request.getfixturevalue(family)
    # The longest request (150 + 16 tokens) needs 11 blocks of 16; 14 hold it, not the batch.
    # gpt-oss's three KV cache groups (a full layer, two windowed) share the budget: the
    # longest request needs 25 of them at its peak, and 26 (one is the null block) leave no
    # room for the batch even with the smaller chunks the scheduler falls back to.
    blocks = 26 if family == "tiny_gpt_oss" else 15
    llm = LLM(str(model_dir), block_size=16, max_num_batched_tokens=64, device="cpu",
              num_kv_blocks=blocks)
    assert generate(llm) == hf_reference(model_dir)
    assert llm.stats["num_preemptions"] > 0


def test_fused_expert_tensors_load_like_per_expert_ones(tiny_mixtral, tiny_mixtral_fused):
    llm = LLM(str(tiny_mixtral_fused), block_size=16, device="cpu")
    assert generate(llm) == hf_reference(tiny_mixtral)


def test_save_pretrained_writes_per_expert_tensors(tiny_mixtral, tiny_qwen3_moe):
    """What the loader's renames cover (`moe.expert_renames`): transformers 5 writes
    the classic per-expert names."""
    from safetensors import safe_open

    for folder, name in ((tiny_mixtral, "model.layers.0.block_sparse_moe.experts.7.w3.weight"),
                         (tiny_qwen3_moe, "model.layers.0.mlp.experts.7.up_proj.weight")):
        with safe_open(str(folder / "model.safetensors"), "pt") as handle:
            assert name in handle.keys()
        assert json.loads((folder / "config.json").read_text())["num_experts_per_tok"] == 2
