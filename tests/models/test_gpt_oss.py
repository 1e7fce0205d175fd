"""gpt-oss's config, layers and loading (models/gpt_oss.py), and its numerics against
Hugging Face's own pieces: YaRN's rotary tables, the router's order, the clamped
SwiGLU of the experts in every CPU kernel. Bad input is refused by name; MXFP4
checkpoints are refused with what to use instead. (Token equality with Hugging
Face: tests/models/test_moe_vs_hf.py.)"""

from __future__ import annotations

import math

import pytest
import torch
from test_moe_families import edited_copy

from kvrecover import LLM
from kvrecover.models.gpt_oss import GptOssExperts, GptOssMoeBlock, _deinterleave
from kvrecover.models.moe import route_topk_logits
from kvrecover.models.registry import build_model, load_model_config, model_class
from kvrecover.models.rope import RotaryEmbedding
from kvrecover.ops.backend import select_backend
from kvrecover.ops.cpu.invariant_ops import InvariantCpuOps
from kvrecover.ops.interface import ClampedSwiGLU
from kvrecover.ops.reference.grouped_moe import grouped_mm_available, grouped_mm_moe
from kvrecover.ops.reference.moe import reference_moe
from kvrecover.ops.reference.torch_ops import TorchOps

CPU = torch.device("cpu")


def test_gpt_oss_reads_its_config_and_builds_its_layers(tiny_gpt_oss):
    config = load_model_config(tiny_gpt_oss)
    assert config.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    assert config.layer_windows() == [24, None, 24]
    assert (config.num_experts, config.num_experts_per_tok) == (8, 2)
    assert (config.swiglu_alpha, config.swiglu_limit, config.attention_bias) == (1.702, 1.0, True)
    assert config.rope_scaling["rope_type"] == "yarn" and config.rope_theta == 150000.0
    needed = model_class("GptOssForCausalLM").required_features(config)
    assert (needed.moe, needed.attention_sinks, needed.sliding_window) == (True, True, True)
    model = build_model(config, select_backend("torch", CPU), max_positions=64)
    for layer, window in zip(model.layers, config.layer_windows()):
        attention = layer.self_attn
        assert attention.window == window and attention.sinks.shape == (4,)
        assert attention.qkv_proj.bias is not None and attention.o_proj.bias is not None
        assert type(layer.mlp) is GptOssMoeBlock and layer.mlp.router.bias is not None
        assert layer.mlp.experts.clamped_swiglu == ClampedSwiGLU(1.702, 1.0)


def test_absent_fields_take_hugging_faces_defaults(tiny_gpt_oss, tmp_path):
    folder = edited_copy(tiny_gpt_oss, tmp_path / "defaults")
    raw = (folder / "config.json").read_text()
    import json

    fields = json.loads(raw)
    for name in ("layer_types", "sliding_window", "rope_parameters", "swiglu_alpha",
                 "swiglu_limit", "attention_bias"):
        fields.pop(name)
    (folder / "config.json").write_text(json.dumps(fields))
    config = load_model_config(folder)
    assert config.layer_windows() == [128, None, 128]
    assert (config.swiglu_alpha, config.swiglu_limit, config.attention_bias) == (1.702, 7.0, True)
    assert config.rope_theta == 150000.0
    assert config.rope_scaling == {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                   "beta_slow": 1.0, "truncate": False,
                                   "original_max_position_embeddings": 4096}


@pytest.mark.parametrize("scaling", [
    {"factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
     "original_max_position_embeddings": 4096},  # gpt-oss's own
    {"factor": 4.0, "original_max_position_embeddings": 64},  # truncated, default betas
    {"factor": 8.0, "original_max_position_embeddings": 256, "attention_factor": 1.25},
    {"factor": 8.0, "original_max_position_embeddings": 256, "mscale": 1.0,
     "mscale_all_dim": 0.5},
])
def test_yarn_tables_are_bitwise_hugging_faces(scaling):
    """inv_freq and the cos/sin scaling as `_compute_yarn_parameters` and
    `GptOssRotaryEmbedding` compute them, bit for bit."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    parameters = {"rope_type": "yarn", "rope_theta": 150000.0, **scaling}
    hf_config = GptOssConfig(head_dim=64, num_attention_heads=4, hidden_size=256,
                             max_position_embeddings=8192, rope_parameters=dict(parameters))
    hf_rotary = GptOssRotaryEmbedding(hf_config)
    positions = torch.arange(300)
    hf_cos, hf_sin = hf_rotary(torch.zeros(1, dtype=torch.float32), positions[None])
    ours = RotaryEmbedding(64, 300, 150000.0, parameters)
    assert torch.equal(ours.cos_cache[:, :32], hf_cos[0])
    assert torch.equal(ours.sin_cache[:, :32], hf_sin[0])
    assert torch.equal(ours.cos_cache[:, 32:], ours.cos_cache[:, :32])
    assert hf_rotary.attention_scaling != 1.0


@pytest.mark.parametrize("rope, message", [
    ({"rope_type": "yarn", "rope_theta": 150000.0}, "yarn rope scaling needs factor"),
    ({"rope_type": "dynamic", "factor": 2.0}, "unsupported rope_scaling type 'dynamic'"),
])
def test_a_rope_scaling_that_cannot_be_computed_is_refused(tiny_gpt_oss, tmp_path, rope,
                                                           message):
    folder = edited_copy(tiny_gpt_oss, tmp_path / "rope", rope_parameters=rope)
    with pytest.raises(ValueError, match=message):
        load_model_config(folder)


def test_yarn_without_its_pre_training_length_takes_max_position_embeddings(tiny_gpt_oss,
                                                                           tmp_path):
    folder = edited_copy(tiny_gpt_oss, tmp_path / "rope", rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "rope_theta": 150000.0})
    assert load_model_config(folder).rope_scaling["original_max_position_embeddings"] == 1024


def test_the_router_takes_the_top_k_logits_then_softmaxes_over_them():
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.0], [1.0, 1.5, 4.0, -2.0]])
    weights, ids = route_topk_logits(logits, 2)
    assert ids.tolist() == [[1, 3], [2, 1]]
    assert torch.equal(weights, torch.softmax(logits.gather(1, ids), dim=-1))
    assert route_topk_logits(logits.bfloat16(), 2)[0].dtype == torch.bfloat16


def random_experts(dtype: torch.dtype, hidden: int = 64, intermediate: int = 32,
                   num_experts: int = 4) -> tuple[GptOssExperts, dict[str, torch.Tensor]]:
    """Experts loaded through the checkpoint loaders from HF-layout tensors (interleaved,
    transposed), and those tensors."""
    generator = torch.Generator().manual_seed(0)
    hf = {
        "gate_up_proj": torch.randn(num_experts, hidden, 2 * intermediate, generator=generator),
        "gate_up_proj_bias": torch.randn(num_experts, 2 * intermediate, generator=generator),
        "down_proj": torch.randn(num_experts, intermediate, hidden, generator=generator) * 0.2,
        "down_proj_bias": torch.randn(num_experts, hidden, generator=generator),
    }
    experts = GptOssExperts(num_experts, hidden, intermediate, ClampedSwiGLU(1.702, 1.5))
    with torch.no_grad():
        for name, param in (("gate_up_proj", experts.gate_up_proj),
                            ("gate_up_proj_bias", experts.gate_up_bias),
                            ("down_proj", experts.down_proj)):
            param.weight_loader(param, hf[name], "hf")
        experts.down_bias.copy_(hf["down_proj_bias"])
    return experts.to(dtype), {name: t.to(dtype) for name, t in hf.items()}


def hf_experts_output(hf: dict[str, torch.Tensor], x: torch.Tensor, ids: torch.Tensor,
                      weights: torch.Tensor) -> torch.Tensor:
    """Hugging Face's `GptOssExperts.forward` on the same tensors."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts as HfExperts

    num_experts, hidden, double = hf["gate_up_proj"].shape
    config = GptOssConfig(num_local_experts=num_experts, hidden_size=hidden,
                          intermediate_size=double // 2, swiglu_limit=1.5)
    module = HfExperts(config).to(x.dtype)
    with torch.no_grad():
        for name, tensor in hf.items():
            getattr(module, name).copy_(tensor)
        return module(x, ids, weights)


def test_the_clamped_swiglu_is_bitwise_hugging_faces_gate():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts as HfExperts

    from kvrecover.ops.reference.moe import clamped_swiglu

    hf = HfExperts(GptOssConfig(swiglu_limit=1.5, num_local_experts=2, hidden_size=8,
                                intermediate_size=8))
    gate_up = torch.randn(50, 64, generator=torch.Generator().manual_seed(1)) * 3
    for dtype in (torch.float32, torch.bfloat16):
        interleaved = gate_up.to(dtype)
        expected = hf._apply_gate(interleaved)
        got = clamped_swiglu(_deinterleave(interleaved), ClampedSwiGLU(1.702, 1.5))
        assert torch.equal(got, expected)
    clamped = (gate_up[:, ::2] > 1.5) | (gate_up[:, 1::2].abs() > 1.5)
    assert clamped.any() and not clamped.all()  # the clamp binds somewhere


KERNELS = {
    "reference": lambda x, w, ids, experts: reference_moe(x, w, ids, experts, TorchOps().silu_mul),
    "grouped_mm": lambda x, w, ids, experts: grouped_mm_moe(x, w, ids, experts,
                                                            TorchOps().silu_mul),
}


@pytest.mark.parametrize("kernel", ["reference", "grouped_mm", "cpu_invariant"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_cpu_moe_kernel_runs_the_biased_clamped_experts_as_hugging_face(kernel, dtype):
    experts, hf = random_experts(dtype)
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(21, 64, generator=generator).to(dtype)
    weights, ids = route_topk_logits(torch.randn(21, 4, generator=generator).to(dtype), 2)
    if kernel == "grouped_mm" and not grouped_mm_available(x):
        pytest.skip("torch._grouped_mm does not run this dtype here")
    if kernel == "cpu_invariant":
        ops = InvariantCpuOps()
        ops.prepare_weights(torch.nn.ModuleList([experts]))
        got = ops.moe(x, weights, ids, experts)
    else:
        got = KERNELS[kernel](x, weights, ids, experts)
    expected = hf_experts_output(hf, x, ids, weights)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)
    unclamped, _ = random_experts(dtype)
    unclamped.clamped_swiglu = ClampedSwiGLU(1.702, math.inf)
    drift = reference_moe(x, weights, ids, unclamped, TorchOps().silu_mul) - expected
    assert drift.abs().max() > 0.1  # the clamp binds on these inputs


def test_an_mxfp4_checkpoint_is_refused_with_what_to_use(tiny_gpt_oss, tmp_path):
    folder = edited_copy(tiny_gpt_oss, tmp_path / "mxfp4",
                         quantization_config={"quant_method": "mxfp4"})
    with pytest.raises(ValueError, match=r"MXFP4 checkpoint.*use a bf16 checkpoint"):
        load_model_config(folder)


@pytest.mark.parametrize("changes, message", [
    ({"num_experts_per_tok": 9}, r"num_experts_per_tok=9 must be an integer in "
                                 r"\[1, num_local_experts=8\]"),
    ({"swiglu_limit": -1.0}, "swiglu_limit=.* must be a positive finite number"),
    ({"layer_types": ["full_attention"]}, "layer_types=.* must be a list of one type per layer"),
])
def test_a_config_that_cannot_run_is_refused_by_field(tiny_gpt_oss, tmp_path, changes,
                                                      message):
    folder = edited_copy(tiny_gpt_oss, tmp_path / "bad", **changes)
    with pytest.raises(ValueError, match=message):
        load_model_config(folder)


@pytest.mark.parametrize("changes, message", [
    ({"num_local_experts": 12},
     r"checkpoint tensor 'model\.layers\.\d\.mlp\.experts\.\w+': shape \(8, .*does not fit"),
    ({"num_local_experts": 4},
     r"checkpoint tensor 'model\.layers\.\d\.mlp\.experts\.\w+': shape \(8, .*does not fit"),
    ({"intermediate_size": 96},
     r"checkpoint tensor 'model\.layers\.\d\.mlp\.experts\.\w+': shape .*does not fit "
     r"\[E, \w, \w+\] = \(8, "),
])
def test_weights_that_do_not_fit_the_config_are_refused_naming_the_tensor(
        tiny_gpt_oss, tmp_path, changes, message):
    folder = edited_copy(tiny_gpt_oss, tmp_path / "bad", **changes)
    with pytest.raises(ValueError, match=message):
        LLM(str(folder), device="cpu", num_kv_blocks=8)
