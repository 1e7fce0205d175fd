"""The MoE families' configs and loading (models/mixtral.py, models/qwen3_moe.py, moe.py):
the fields each reads, which layers are sparse, and bad input refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from kvrecover import LLM
from kvrecover.models.layers import GatedMLP
from kvrecover.models.moe import SparseMoeBlock, route_topk
from kvrecover.models.registry import build_model, load_model_config, model_class
from kvrecover.ops.backend import select_backend


def edited_copy(model_dir: Path, target: Path, **config_changes) -> Path:
    """A copy of checkpoint `model_dir` whose config.json has `config_changes`."""
    shutil.copytree(model_dir, target)
    config = json.loads((target / "config.json").read_text())
    config.update(config_changes)
    (target / "config.json").write_text(json.dumps(config))
    return target


def test_mixtral_reads_its_experts(tiny_mixtral):
    config = load_model_config(tiny_mixtral)
    assert (config.num_experts, config.num_experts_per_tok) == (8, 2)
    model = build_model(config, select_backend("torch", torch.device("cpu")), max_positions=64)
    assert all(type(layer.mlp) is SparseMoeBlock for layer in model.layers)
    experts = model.layers[0].mlp.experts
    assert tuple(experts.gate_up_proj.shape) == (8, 2 * 128, 64)
    assert tuple(experts.down_proj.shape) == (8, 64, 128)


def test_mixtral_reads_its_sliding_window_and_needs_the_feature(tmp_path, tiny_mixtral):
    model = load_model_config(tiny_mixtral)
    assert model.sliding_window is None and set(model.layer_windows()) == {None}
    windowed = load_model_config(edited_copy(tiny_mixtral, tmp_path / "w", sliding_window=32))
    assert windowed.layer_windows() == [32] * windowed.num_hidden_layers
    needed = model_class("MixtralForCausalLM").required_features(windowed)
    assert (needed.moe, needed.sliding_window) == (True, True)
    backend = select_backend("torch", torch.device("cpu"))
    layers = build_model(windowed, backend, max_positions=64).layers
    assert [layer.self_attn.window for layer in layers] == windowed.layer_windows()


def test_qwen3_moe_dense_layers_follow_mlp_only_layers_and_the_sparse_step(tmp_path,
                                                                           tiny_qwen3_moe):
    config = load_model_config(tiny_qwen3_moe)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
            config.norm_topk_prob, config.mlp_only_layers) == (8, 2, 48, True, [1])
    backend = select_backend("torch", torch.device("cpu"))
    kinds = [type(layer.mlp) for layer in build_model(config, backend, 64).layers]
    assert kinds == [SparseMoeBlock, GatedMLP, SparseMoeBlock]
    stepped = load_model_config(edited_copy(tiny_qwen3_moe, tmp_path / "step",
                                            decoder_sparse_step=2, mlp_only_layers=[]))
    kinds = [type(layer.mlp) for layer in build_model(stepped, backend, 64).layers]
    assert kinds == [GatedMLP, SparseMoeBlock, GatedMLP]


def test_route_topk_is_softmax_then_topk_then_renormalise():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    probs = torch.softmax(logits, dim=-1)
    weights, ids = route_topk(logits, 2, renormalize=False)
    assert ids.tolist() == [[1, 2]] and torch.equal(weights, probs[:, [1, 2]])
    weights, _ = route_topk(logits, 2, renormalize=True)
    assert torch.allclose(weights.sum(-1), torch.ones(1)) and weights.dtype == torch.float32
    assert route_topk(logits.bfloat16(), 2, True, torch.bfloat16)[0].dtype == torch.bfloat16


@pytest.mark.parametrize("family, changes, message", [
    ("tiny_mixtral", {"num_experts_per_tok": 9}, r"num_experts_per_tok=9 must be an integer in "
                                                 r"\[1, num_local_experts=8\]"),
    ("tiny_mixtral", {"num_local_experts": 0}, "num_local_experts=.* must be a positive integer"),
    ("tiny_qwen3_moe", {"moe_intermediate_size": None}, r"moe_intermediate_size is missing "
                                                        r"\(required\)"),
    ("tiny_qwen3_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step=.* must be a positive"),
    ("tiny_mixtral", {"sliding_window": 0}, "sliding_window=.* must be a positive integer"),
    ("tiny_qwen3_moe", {"use_sliding_window": True, "sliding_window": 32},
     "sliding-window attention"),
    ("tiny_mixtral", {"quantization_config": {"quant_method": "mxfp4"}},
     r"quantization_config \('mxfp4'\).*unquantized"),
    ("tiny_qwen3_moe", {"quantization_config": {"quant_method": "fp8"}},
     r"quantization_config \('fp8'\)"),
    ("tiny_llama", {"quantization_config": {"quant_method": "gptq"}},
     r"quantization_config \('gptq'\)"),  # a dense family refuses it as well
])
def test_a_config_that_cannot_run_is_refused_by_field(request, tmp_path, family, changes,
                                                      message):
    folder = edited_copy(request.getfixturevalue(family), tmp_path / "bad", **changes)
    with pytest.raises(ValueError, match=message):
        load_model_config(folder)


@pytest.mark.parametrize("family, changes, message", [
    # More experts in config.json than in the weights: the router has too few rows.
    ("tiny_mixtral", {"num_local_experts": 12},
     r"checkpoint tensor 'model\.layers\.\d\.block_sparse_moe\.gate\.weight' has shape "
     r"\(8, 64\), expected \(12, 64\)"),
    # Fewer: the checkpoint's expert 4 has nowhere to go.
    ("tiny_qwen3_moe", {"num_experts": 4},
     r"checkpoint tensor 'model\.layers\.\d\.mlp\.experts\.[4-7]\.\w+\.weight': expert [4-7] "
     r"is out of range for 4 experts"),
    ("tiny_mixtral", {"intermediate_size": 96},
     r"checkpoint tensor 'model\.layers\.\d\.block_sparse_moe\.experts\.\d\.w\d\.weight'.* "
     r"does not fit"),
    ("tiny_qwen3_moe", {"moe_intermediate_size": 32},
     r"checkpoint tensor 'model\.layers\.\d\.mlp\.experts\.\d\.\w+_proj\.weight'.*does not fit"),
])
def test_weights_that_do_not_fit_the_config_are_refused_naming_the_tensor(
        request, tmp_path, family, changes, message):
    folder = edited_copy(request.getfixturevalue(family), tmp_path / "bad", **changes)
    with pytest.raises(ValueError, match=message):
        LLM(str(folder), device="cpu", num_kv_blocks=8)


def test_a_checkpoint_missing_one_experts_tensor_is_refused(tiny_mixtral, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = edited_copy(tiny_mixtral, tmp_path / "bad")
    state = load_file(str(folder / "model.safetensors"))
    del state["model.layers.1.block_sparse_moe.experts.5.w3.weight"]
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"lacks shards up:5 of layers\.1\.mlp\.experts\."
                                         r"gate_up_proj; does config.json match the weights"):
        LLM(str(folder), device="cpu", num_kv_blocks=8)
