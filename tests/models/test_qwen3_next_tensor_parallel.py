"""Linear-attention hybrids at tensor_parallel_size 2 on the CPU (gloo, two processes):
Qwen3.5 dense and MoE, Qwen3-Next with and without experts give Hugging Face's greedy
ids (float32) under chunked prefill, prefix-cache reuse from each rank's own state
checkpoints and preemption; a rank holds exactly its heads' slice of every weight and
its slice of every expert; sizes that do not split the linear heads or the experts are
refused at start-up; a rank killed mid-run ends every request with an error naming it,
bounded, with no process left behind."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
from conftest import hf_greedy
from safetensors.torch import load_file
from test_qwen3_next_vs_hf import FAMILIES, PROMPTS, build_hybrid, generate

from kvrecover import LLM, SamplingParams
from kvrecover.models.loader import load_weights, skip_weight_init
from kvrecover.models.registry import build_model, check_tensor_parallel_family, load_model_config
from kvrecover.models.registry import model_class as family_class
from kvrecover.ops.backend import select_backend

MAX_NEW = 8
DENSE = {
    "qwen3_5": FAMILIES["qwen3_5"],
    # Qwen3-Next's grouped projections (in_proj_qkvz, in_proj_ba), every layer dense.
    "qwen3_next_dense": {**FAMILIES["qwen3_next"], "mlp_only_layers": [0, 1, 2, 3]},
}
# One KV head: both ranks hold it (replicated), each with its own query heads and gates.
ONE_KV_HEAD = {"qwen3_5_one_kv_head": {**FAMILIES["qwen3_5"], "num_key_value_heads": 1}}
ALL = {**DENSE, **ONE_KV_HEAD, "qwen3_next": FAMILIES["qwen3_next"], "qwen3_5_moe": FAMILIES["qwen3_5_moe"]}
_HF: dict[str, list[list[int]]] = {}
_DIRS: dict[str, Path] = {}


def checkpoint(name: str, tmp_path_factory) -> Path:
    if name not in _DIRS:
        _DIRS[name] = build_hybrid(tmp_path_factory.mktemp(name), **ALL[name])
    return _DIRS[name]


@pytest.fixture(scope="module", params=list(ALL))
def any_hybrid(request, tmp_path_factory) -> tuple[str, Path]:
    return request.param, checkpoint(request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=list(DENSE))
def dense_hybrid(request, tmp_path_factory) -> tuple[str, Path]:
    return request.param, checkpoint(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def qwen3_5_dir(tmp_path_factory) -> Path:
    return checkpoint("qwen3_5", tmp_path_factory)


@pytest.fixture(scope="module")
def qwen3_next_dir(tmp_path_factory) -> Path:
    """Qwen3-Next with routed and shared experts (layers 0, 1, 3)."""
    return checkpoint("qwen3_next", tmp_path_factory)


def reference(name: str, folder: Path) -> list[list[int]]:
    if name not in _HF:
        _HF[name] = hf_greedy(folder, PROMPTS, MAX_NEW)
    return _HF[name]


def at_size_2(folder: Path, **options) -> LLM:
    return LLM(str(folder), device="cpu", tensor_parallel_size=2, **options)


def test_greedy_at_size_2_equals_hf_under_chunked_prefill(any_hybrid):
    name, folder = any_hybrid
    with at_size_2(folder, block_size=4, max_num_batched_tokens=12) as llm:
        assert generate(llm) == reference(name, folder)
        assert llm.stats["prompt_tokens_computed"] == sum(map(len, PROMPTS))


def test_prefix_cache_reuse_at_size_2_resumes_from_every_ranks_checkpoints(qwen3_5_dir):
    """The second pass resumes at cached block boundaries: each rank restores its own
    heads' states from its own checkpoint slots (a rank without them would fail the
    step or compute on zeros)."""
    with at_size_2(qwen3_5_dir, block_size=4, max_num_batched_tokens=12) as llm:
        first = generate(llm)
        computed = llm.stats["prompt_tokens_computed"]
        assert first == generate(llm) == reference("qwen3_5", qwen3_5_dir)
        hits = sum((len(p) - 1) // 4 * 4 for p in PROMPTS)
        assert hits > 0 and llm.stats["prefix_cache_hit_tokens"] == hits
        assert llm.stats["prompt_tokens_computed"] == 2 * computed - hits
        assert llm.engine.model_runner.recurrent_states.checkpoints  # rank 0's pool


def test_tight_kv_budget_at_size_2_preempts_and_keeps_hf_outputs(qwen3_next_dir):
    with at_size_2(qwen3_next_dir, block_size=4, max_num_batched_tokens=32,
                   num_kv_blocks=17) as llm:
        assert generate(llm) == reference("qwen3_next", qwen3_next_dir)
        assert llm.stats["num_preemptions"] > 0


def _rank_model(model_dir: Path, rank: int, size: int):
    class FakeGroup:  # loading needs the rank only; no collective runs here
        def __init__(self) -> None:
            self.rank, self.size = rank, size

    config = load_model_config(model_dir)
    with skip_weight_init():
        model = build_model(config, select_backend("torch", torch.device("cpu")), 64,
                            FakeGroup())
    load_weights(model, model_dir)
    return config, model


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_holds_exactly_its_heads_of_each_weight(dense_hybrid, rank):
    name, folder = dense_hybrid
    config, model = _rank_model(folder, rank, 2)
    weights = {key.removeprefix("model."): value
               for key, value in load_file(str(folder / "model.safetensors")).items()}
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    hk, hv = config.linear_num_key_heads // 2, config.linear_num_value_heads // 2
    key_dim, whole_key = hk * dk, config.linear_num_key_heads * dk

    def rows(tensor, start, count):
        return tensor[start : start + count]

    linear = model.layers[0].self_attn
    prefix = "layers.0.linear_attn."
    qkv_rows = torch.cat([torch.arange(rank * key_dim, (rank + 1) * key_dim),
                          whole_key + torch.arange(rank * key_dim, (rank + 1) * key_dim),
                          2 * whole_key + torch.arange(rank * hv * dv, (rank + 1) * hv * dv)])
    assert torch.equal(linear.conv1d.weight, weights[prefix + "conv1d.weight"][qkv_rows])
    if name == "qwen3_5":
        assert torch.equal(linear.in_proj_qkv.weight, weights[prefix + "in_proj_qkv.weight"][qkv_rows])
        assert torch.equal(linear.in_proj_z.weight,
                           rows(weights[prefix + "in_proj_z.weight"], rank * hv * dv, hv * dv))
        for proj in ("in_proj_b", "in_proj_a"):
            assert torch.equal(getattr(linear, proj).weight,
                               rows(weights[f"{prefix}{proj}.weight"], rank * hv, hv))
    else:  # grouped by key head: one range per rank
        qkvz, ba = weights[prefix + "in_proj_qkvz.weight"], weights[prefix + "in_proj_ba.weight"]
        assert torch.equal(linear.in_proj_qkvz.weight, qkvz.chunk(2)[rank])
        assert torch.equal(linear.in_proj_ba.weight, ba.chunk(2)[rank])
    for param in ("A_log", "dt_bias"):
        assert torch.equal(getattr(linear, param), rows(weights[prefix + param], rank * hv, hv))
    assert torch.equal(linear.norm.weight, weights[prefix + "norm.weight"])
    assert torch.equal(linear.out_proj.weight,
                       weights[prefix + "out_proj.weight"][:, rank * hv * dv : (rank + 1) * hv * dv])
    full = model.layers[1].self_attn
    prefix, dim = "layers.1.self_attn.", config.head_dim
    heads, kv_heads = config.num_attention_heads // 2, config.num_key_value_heads // 2
    assert torch.equal(full.q_proj.weight, weights[prefix + "q_proj.weight"].chunk(2)[rank])
    assert full.q_proj.weight.shape[0] == 2 * heads * dim  # each head's query and gate
    for proj in ("k_proj", "v_proj"):
        assert torch.equal(getattr(full, proj).weight,
                           rows(weights[f"{prefix}{proj}.weight"], rank * kv_heads * dim,
                                kv_heads * dim))
    assert torch.equal(full.o_proj.weight,
                       weights[prefix + "o_proj.weight"][:, rank * heads * dim : (rank + 1) * heads * dim])
    assert torch.equal(full.q_norm.weight, weights[prefix + "q_norm.weight"])
    specs = model.recurrent_state_specs(4)[0]
    assert dict((s.name, s.shape) for s in specs)["state"] == (hv, dk, dv)  # own heads only


def test_sizes_that_do_not_split_the_linear_heads_are_refused_at_start_up(qwen3_5_dir):
    started = time.monotonic()
    # 4 splits the 4 attention heads (2 KV heads replicated) and the MLP, not 2 key heads.
    with pytest.raises(ValueError, match="tensor_parallel_size 4 does not divide the model's "
                                         "linear_num_key_heads 2"):
        LLM(str(qwen3_5_dir), device="cpu", tensor_parallel_size=4)
    assert time.monotonic() - started < 5  # before any rank process starts


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_holds_its_slice_of_every_expert_and_the_shared_expert(qwen3_next_dir, rank):
    config, model = _rank_model(qwen3_next_dir, rank, 2)
    weights = load_file(str(qwen3_next_dir / "model.safetensors"))
    prefix = "model.layers.0.mlp."
    block = model.layers[0].mlp
    size = config.moe_intermediate_size // 2
    cols = slice(rank * size, (rank + 1) * size)
    assert torch.equal(block.gate.weight, weights[prefix + "gate.weight"])  # replicated
    assert torch.equal(block.shared_expert_gate.weight, weights[prefix + "shared_expert_gate.weight"])
    for expert in range(config.num_experts):
        name = f"{prefix}experts.{expert}."
        assert torch.equal(block.experts.gate_up_proj[expert], torch.cat([
            weights[name + "gate_proj.weight"][cols], weights[name + "up_proj.weight"][cols]]))
        assert torch.equal(block.experts.down_proj[expert], weights[name + "down_proj.weight"][:, cols])
    shared = config.shared_expert_intermediate_size // 2
    rows = slice(rank * shared, (rank + 1) * shared)
    assert torch.equal(block.shared_expert.down_proj.weight,
                       weights[prefix + "shared_expert.down_proj.weight"][:, rows])
    assert torch.equal(block.shared_expert.gate_up_proj.weight, torch.cat([
        weights[prefix + "shared_expert.gate_proj.weight"][rows],
        weights[prefix + "shared_expert.up_proj.weight"][rows]]))


@pytest.mark.parametrize(("field", "value"), [("moe_intermediate_size", 9),
                                              ("shared_expert_intermediate_size", 7)])
def test_expert_sizes_that_do_not_split_are_refused(field, value):
    from kvrecover.models.qwen3_next import Qwen3NextConfig

    sizes = {"moe_intermediate_size": 8, "shared_expert_intermediate_size": 8, field: value}
    config = Qwen3NextConfig(
        architecture="Qwen3NextForCausalLM", vocab_size=10, hidden_size=16,
        intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=1e4,
        max_position_embeddings=16, tie_word_embeddings=False,
        layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
        linear_num_value_heads=2, num_experts=2, num_experts_per_tok=1, **sizes)
    with pytest.raises(ValueError, match=f"tensor_parallel_size 2 does not divide the "
                                         f"model's {field} {value}"):
        check_tensor_parallel_family(family_class(config.architecture), config, 2)


def test_a_rank_killed_mid_generation_ends_every_request_with_an_error(qwen3_5_dir):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    llm = at_size_2(qwen3_5_dir, block_size=4, num_kv_blocks=64)
    ranks = [rank.process for rank in llm.engine.model_runner.ranks]
    ids = [f"r{i}" for i in range(len(PROMPTS))]
    for request_id, prompt in zip(ids, PROMPTS):
        llm.engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    for _ in range(3):
        llm.engine.step()
    os.kill(ranks[0].pid, signal.SIGKILL)
    finished, started = {}, time.monotonic()
    while llm.engine.has_unfinished():
        finished.update((o.request_id, o) for o in llm.engine.step() if o.finished)
        assert time.monotonic() - started < 10
    assert sorted(finished) == ids
    for output in finished.values():
        assert output.outputs[0].finish_reason == "error"
        assert "rank 1 died (killed by SIGKILL)" in output.error
    assert llm.engine.closed
    for process in ranks:
        assert process.poll() is not None
