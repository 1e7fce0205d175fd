"""The model registry (models/registry.py): architectures name families, each family
reads its own config fields, builds its layers from the shared ones, and an unknown
architecture is refused with the list of known ones. No checkpoint weights needed."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from kvrecover.models.config import ModelConfig
from kvrecover.models.gemma2 import Gemma2Config, Gemma2ForCausalLM
from kvrecover.models.gemma3 import Gemma3Config, Gemma3ForCausalLM
from kvrecover.models.gpt_oss import GptOssConfig, GptOssForCausalLM
from kvrecover.models.layers import Attention, CausalLM, DecoderLayer, GatedMLP
from kvrecover.models.llama import LlamaConfig, LlamaForCausalLM
from kvrecover.models.mistral import MistralConfig, MistralForCausalLM
from kvrecover.models.mixtral import MixtralConfig, MixtralForCausalLM
from kvrecover.models.qwen2 import Qwen2Config, Qwen2ForCausalLM
from kvrecover.models.qwen3 import Qwen3Config, Qwen3ForCausalLM
from kvrecover.models.qwen3_moe import Qwen3MoeConfig, Qwen3MoeForCausalLM
from kvrecover.models.qwen3_next import (
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeConfig,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3_5MoeVisionLanguageConfig,
    Qwen3_5VisionLanguageConfig,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)
from kvrecover.models.registry import (
    MODELS,
    build_model,
    load_model_config,
    model_class,
    supported_architectures,
)
from kvrecover.ops.backend import select_backend

BASE = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
            max_position_embeddings=512, eos_token_id=1, torch_dtype="float32")
FAMILIES = {
    "LlamaForCausalLM": ({"rope_theta": 500000.0, "tie_word_embeddings": True},
                         LlamaForCausalLM, LlamaConfig),
    "Qwen2ForCausalLM": ({}, Qwen2ForCausalLM, Qwen2Config),
    "Qwen3ForCausalLM": ({"head_dim": 32, "attention_bias": False},
                         Qwen3ForCausalLM, Qwen3Config),
    "MistralForCausalLM": ({"sliding_window": 32}, MistralForCausalLM, MistralConfig),
}
FULL_ATTENTION = ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
# Families whose layers are not the Llama ones (their own test below).
GEMMA_FAMILIES = {
    "Gemma2ForCausalLM": ({"sliding_window": 32, "head_dim": 16}, Gemma2ForCausalLM,
                          Gemma2Config),
    "Gemma3ForCausalLM": ({"sliding_window": 32, "head_dim": 16, "sliding_window_pattern": 2},
                          Gemma3ForCausalLM, Gemma3Config),
}
# ModelConfig.identity of these configs before the registry existed (issue 20): stored
# KV is keyed by it, so moving fields into family configs must not change it.
IDENTITIES = {
    "LlamaForCausalLM": "d1b93b121236ae03",
    "Qwen2ForCausalLM": "d045a6f452188253",
    "Qwen3ForCausalLM": "810c787e4cfd3ab6",
    "MistralForCausalLM": "8736bae1726e13a0",
}


def checkpoint_config(tmp_path: Path, architecture: str, **fields) -> Path:
    folder = tmp_path / architecture
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(
        json.dumps({"architectures": [architecture], **BASE, **fields}))
    return folder


# The mixture-of-experts families (their configs: tests/models/test_moe_families.py).
MOE_FAMILIES = {
    "MixtralForCausalLM": ({}, MixtralForCausalLM, MixtralConfig),
    "Qwen3MoeForCausalLM": ({}, Qwen3MoeForCausalLM, Qwen3MoeConfig),
}
# gpt-oss (its config and layers: tests/models/test_gpt_oss.py).
GPT_OSS = {"GptOssForCausalLM": ({}, GptOssForCausalLM, GptOssConfig)}


HYBRID_FAMILIES = {  # linear-attention hybrids (tests/models/test_qwen3_next_vs_hf.py)
    "Qwen3NextForCausalLM": ({}, Qwen3NextForCausalLM, Qwen3NextConfig),
    "Qwen3_5ForCausalLM": ({}, Qwen3_5ForCausalLM, Qwen3_5Config),
    "Qwen3_5MoeForCausalLM": ({}, Qwen3_5MoeForCausalLM, Qwen3_5MoeConfig),
    "Qwen3_5ForConditionalGeneration": ({}, Qwen3_5ForConditionalGeneration,
                                        Qwen3_5VisionLanguageConfig),
    "Qwen3_5MoeForConditionalGeneration": ({}, Qwen3_5MoeForConditionalGeneration,
                                           Qwen3_5MoeVisionLanguageConfig),
}


def test_every_supported_architecture_is_registered_with_a_family():
    every = {**FAMILIES, **MOE_FAMILIES, **GEMMA_FAMILIES, **GPT_OSS, **HYBRID_FAMILIES}
    assert supported_architectures() == tuple(every)
    for architecture, (_, model, config) in every.items():
        assert model_class(architecture) is model
        assert issubclass(model, CausalLM) and model.config_class is config
        assert issubclass(config, ModelConfig)
        module, name = MODELS[architecture]
        assert model.__module__ == f"kvrecover.models.{module}" and model.__name__ == name


@pytest.mark.parametrize("architecture", FAMILIES)
def test_each_family_reads_its_config(tmp_path, architecture):
    fields, _, config_class = FAMILIES[architecture]
    config = load_model_config(checkpoint_config(tmp_path, architecture, **fields))
    assert type(config) is config_class
    assert config.architecture == architecture
    assert config.identity == IDENTITIES[architecture]
    assert (config.attention_bias, config.qk_norm) == {
        "LlamaForCausalLM": (False, False),
        "Qwen2ForCausalLM": (True, False),  # Qwen2's default: biased q/k/v
        "Qwen3ForCausalLM": (False, True),
        "MistralForCausalLM": (False, False),
    }[architecture]
    assert config.eos_token_ids == [1]


def test_config_json_overrides_a_family_default(tmp_path):
    config = load_model_config(checkpoint_config(tmp_path, "Qwen2ForCausalLM",
                                                 attention_bias=False))
    assert config.attention_bias is False


@pytest.mark.parametrize("architecture", FAMILIES)
def test_each_family_builds_from_the_shared_layers(tmp_path, architecture):
    fields, model_class_, _ = FAMILIES[architecture]
    config = load_model_config(checkpoint_config(tmp_path, architecture, **fields))
    backend = select_backend("torch", torch.device("cpu"))
    model = build_model(config, backend, max_positions=64)
    assert type(model) is model_class_
    assert len(model.layers) == config.num_hidden_layers
    layer = model.layers[0]
    assert type(layer) is DecoderLayer
    assert type(layer.self_attn) is Attention and type(layer.mlp) is GatedMLP
    assert (layer.self_attn.qkv_proj.bias is not None) == config.attention_bias
    assert (layer.self_attn.q_norm is not None) == config.qk_norm
    assert layer.self_attn.rotary is model.rotary  # one table, shared by every layer
    windows = [32, 32] if architecture == "MistralForCausalLM" else [None, None]
    assert model.layer_windows() == [layer.self_attn.window for layer in model.layers] == windows
    assert model.required_features(config).sliding_window == (windows[0] is not None)
    assert (model.lm_head.weight is model.embed_tokens.weight) == config.tie_word_embeddings


def test_gemma2_builds_from_the_shared_layers_with_its_options(tmp_path):
    fields, _, _ = GEMMA_FAMILIES["Gemma2ForCausalLM"]
    config = load_model_config(checkpoint_config(tmp_path, "Gemma2ForCausalLM", **fields))
    model = build_model(config, select_backend("torch", torch.device("cpu")), max_positions=64)
    assert model.layer_windows() == [32, None]  # HF: even layers slide
    assert [layer.self_attn.window for layer in model.layers] == [32, None]
    features = model.required_features(config)
    assert features.sliding_window and features.logit_softcap
    for layer in model.layers:
        assert type(layer) is DecoderLayer and layer.mlp.activation == "gelu_pytorch_tanh"
        norms = [layer.input_layernorm, layer.post_attention_layernorm,
                 layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm]
        assert all(norm is not None and norm.plus_one for norm in norms)
        assert layer.self_attn.scale == 256**-0.5 and layer.self_attn.softcap == 50.0
    assert model.norm.plus_one and model.final_logit_softcap == 30.0
    assert model.lm_head.weight is model.embed_tokens.weight  # Gemma ties by default


def test_gemma3_adds_qk_norms_and_a_local_rotary_table(tmp_path):
    fields, _, _ = GEMMA_FAMILIES["Gemma3ForCausalLM"]
    config = load_model_config(checkpoint_config(tmp_path, "Gemma3ForCausalLM", **fields))
    model = build_model(config, select_backend("torch", torch.device("cpu")), max_positions=64)
    assert model.layer_windows() == [32, None]
    assert model.rotary_tables() == [model.rotary, model.local_rotary]
    assert [layer.self_attn.rotary for layer in model.layers] == [model.local_rotary,
                                                                   model.rotary]
    for layer in model.layers:
        assert layer.self_attn.q_norm.plus_one and layer.self_attn.k_norm.plus_one
        assert layer.self_attn.softcap is None  # Gemma 3: no attention soft-cap by default
    assert not model.required_features(config).logit_softcap
    assert model.final_logit_softcap is None


def test_unknown_architecture_lists_the_known_ones(tmp_path):
    folder = checkpoint_config(tmp_path, "GPT2LMHeadModel")
    with pytest.raises(ValueError) as error:
        load_model_config(folder)
    message = str(error.value)
    assert "unsupported architecture 'GPT2LMHeadModel'" in message
    assert str(folder / "config.json") in message
    assert all(name in message for name in FAMILIES)


def test_a_config_of_another_family_is_refused():
    config = ModelConfig("LlamaForCausalLM", **{k: v for k, v in BASE.items() if k not in (
        "eos_token_id", "torch_dtype")}, head_dim=16, rope_theta=1e4, tie_word_embeddings=False)
    backend = select_backend("torch", torch.device("cpu"))
    with pytest.raises(ValueError, match="LlamaForCausalLM needs a LlamaConfig"):
        build_model(config, backend, max_positions=64)


@pytest.mark.parametrize("architecture", FULL_ATTENTION)
def test_full_attention_families_refuse_sliding_windows(tmp_path, architecture):
    fields = {**FAMILIES[architecture][0], "use_sliding_window": True, "sliding_window": 32}
    with pytest.raises(ValueError, match="sliding-window attention"):
        load_model_config(checkpoint_config(tmp_path, architecture, **fields))


def test_a_model_without_decoder_layers_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="num_hidden_layers=0 must be a positive integer"):
        load_model_config(checkpoint_config(tmp_path, "LlamaForCausalLM", num_hidden_layers=0))
    # A config built in code (not read from config.json) is refused by the model.
    config = dataclasses.replace(
        load_model_config(checkpoint_config(tmp_path / "ok", "LlamaForCausalLM")),
        num_hidden_layers=0)
    model = build_model(config, select_backend("torch", torch.device("cpu")), max_positions=64)
    with pytest.raises(ValueError, match="no decoder layers.*num_hidden_layers"):
        model(torch.tensor([3, 4]), torch.tensor([0, 1]), [], None)
