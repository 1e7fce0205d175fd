"""config.json checks (issue 41 item 6): every field a family reads is checked at
start-up, a bad one a ValueError naming the field, its value and what is allowed, for
every family (`models/config.py` `FieldReader`). Config parsing only: no weights."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from kvrecover import LLM
from kvrecover.entrypoints.cli.main import main
from kvrecover.models.registry import MODELS, load_model_config

BASE: dict[str, Any] = dict(
    vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
    rope_theta=10000.0, max_position_embeddings=512, tie_word_embeddings=False,
    eos_token_id=1, torch_dtype="float32")
EXPERTS = dict(num_experts_per_tok=2, moe_intermediate_size=32)
HYBRID = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
              linear_value_head_dim=16, linear_conv_kernel_dim=4, partial_rotary_factor=0.25,
              layer_types=["linear_attention", "full_attention"], attention_bias=False)
HYBRID_EXPERTS = dict(num_experts=4, **EXPERTS, shared_expert_intermediate_size=32)
GEMMA = dict(sliding_window=32, query_pre_attn_scalar=16, attn_logit_softcapping=50.0,
             final_logit_softcapping=30.0)
# Each family's valid config (beyond BASE) and the fields it reads beyond the common ones.
FAMILY_CONFIGS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": dict(attention_bias=False),
    "Qwen2ForCausalLM": dict(attention_bias=True),
    "Qwen3ForCausalLM": dict(attention_bias=False),
    "MistralForCausalLM": dict(sliding_window=32),
    "MixtralForCausalLM": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=32),
    "Qwen3MoeForCausalLM": dict(num_experts=4, **EXPERTS, decoder_sparse_step=1,
                                norm_topk_prob=True),
    "Gemma2ForCausalLM": GEMMA,
    "Gemma3ForCausalLM": dict(GEMMA, sliding_window_pattern=2, rope_local_base_freq=10000.0),
    "GptOssForCausalLM": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=32,
                              swiglu_alpha=1.702, swiglu_limit=7.0, attention_bias=True),
    "Qwen3NextForCausalLM": dict(HYBRID, **HYBRID_EXPERTS, decoder_sparse_step=1,
                                 norm_topk_prob=True),
    "Qwen3_5ForCausalLM": HYBRID,
    "Qwen3_5MoeForCausalLM": dict(HYBRID, **HYBRID_EXPERTS),
    "Qwen3_5ForConditionalGeneration": HYBRID,
    "Qwen3_5MoeForConditionalGeneration": dict(HYBRID, **HYBRID_EXPERTS),
}
VISION_LANGUAGE = ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")

# What each field must be: a positive int, a positive finite number, or true/false;
# "required" fields have no default (missing is an error); windows and soft-caps may be
# null, so null is not a bad value for any of them.
REQUIRED_INTS = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_local_experts", "num_experts_per_tok",
                 "moe_intermediate_size", "shared_expert_intermediate_size",
                 "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                 "linear_value_head_dim", "linear_conv_kernel_dim"}
INTS = REQUIRED_INTS | {"num_experts", "num_key_value_heads", "head_dim", "max_position_embeddings",
                        "sliding_window", "sliding_window_pattern", "decoder_sparse_step"}
NUMBERS = {"rms_norm_eps", "rope_theta", "rope_local_base_freq", "query_pre_attn_scalar",
           "attn_logit_softcapping", "final_logit_softcapping", "swiglu_alpha",
           "swiglu_limit", "partial_rotary_factor"}
FLAGS = {"attention_bias", "tie_word_embeddings", "norm_topk_prob"}
# Bad values by kind; "missing" deletes the field (bad only where it is required).
BAD = {"negative": -1, "zero": 0, "string": "x", "bool": True, "fraction": 1.5,
       "nan": math.nan, "inf": math.inf, "missing": None}


def family_config(architecture: str) -> dict[str, Any]:
    """A valid config.json of `architecture` (a Qwen3.5 vision-language one nests it)."""
    fields = {**BASE, **FAMILY_CONFIGS[architecture]}
    if architecture in VISION_LANGUAGE:
        return {"architectures": [architecture], "text_config": fields}
    return {"architectures": [architecture], **fields}


def write_config(folder: Path, config: dict[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def with_field(config: dict[str, Any], name: str, value: Any) -> dict[str, Any]:
    """`config` with field `name` set to `value` (None: deleted), in its text config."""
    config = json.loads(json.dumps(config))
    fields = config.get("text_config", config)
    if value is None:
        fields.pop(name, None)
    else:
        fields[name] = value
    return config


def is_bad(architecture: str, name: str, kind: str) -> bool:
    """Whether BAD[kind] is not allowed for field `name` of `architecture`."""
    if kind == "missing":
        return name in REQUIRED_INTS
    if name in FLAGS:
        return kind != "bool"
    if name in NUMBERS:
        return kind != "fraction" or name == "partial_rotary_factor"  # at most 1
    if name == "num_experts" and architecture == "Qwen3NextForCausalLM":
        return kind != "zero"  # 0: a dense Qwen3-Next
    return True  # INTS: all but a positive int


def read_fields(architecture: str) -> list[str]:
    fields = set(BASE) | set(FAMILY_CONFIGS[architecture])
    return sorted(fields & (INTS | NUMBERS | FLAGS))


@pytest.mark.parametrize("architecture", MODELS)
def test_each_familys_valid_config_loads(tmp_path, architecture):
    config = load_model_config(write_config(tmp_path, family_config(architecture)))
    assert config.architecture == architecture and config.rms_norm_eps == 1e-5


@pytest.mark.parametrize("kind", BAD)
@pytest.mark.parametrize("architecture", MODELS)
def test_a_bad_value_is_a_value_error_naming_the_field(tmp_path, architecture, kind):
    config, value = family_config(architecture), BAD[kind]
    unrefused = []
    for name in read_fields(architecture):
        if not is_bad(architecture, name, kind):
            continue
        folder = write_config(tmp_path / name, with_field(config, name, value))
        expected = (f"{name} is missing (required)" if kind == "missing"
                    else f"{name}={json.loads(json.dumps(value))!r} must be ")
        try:
            load_model_config(folder)
        except ValueError as error:
            message = str(error)
            if expected not in message or str(folder / "config.json") not in message:
                unrefused.append(f"{name}: {message}")
        except Exception as error:  # noqa: BLE001 - any other error is what this test catches
            unrefused.append(f"{name}: {type(error).__name__}: {error}")
        else:
            unrefused.append(f"{name}: accepted {value!r}")
    assert not unrefused, "\n".join(unrefused)


@pytest.mark.parametrize(("changes", "message"), [
    ({"num_key_value_heads": 3}, "num_key_value_heads=3 must be a divisor of "
                                 "num_attention_heads (4)"),
    ({"head_dim": None, "hidden_size": 66}, "hidden_size=66 must be a multiple of "
                                           "num_attention_heads (4)"),
    ({"head_dim": 15}, "head_dim=15 must be even"),
    ({"torch_dtype": "int8"}, "torch_dtype='int8' must be a floating-point torch dtype"),
    ({"eos_token_id": "x"}, "eos_token_id='x' must be a token id"),
    ({"eos_token_id": [1, -2]}, "eos_token_id=[1, -2] must be a token id"),
    ({"use_sliding_window": "false"}, "use_sliding_window='false' must be true or false"),
    ({"rope_scaling": "linear"}, "rope_scaling='linear' must be a JSON object or null"),
    ({"rope_scaling": {"rope_type": "ntk"}}, "unsupported rope_scaling type 'ntk'"),
    ({"rope_scaling": {"rope_type": "linear"}}, "linear rope scaling needs factor"),
    ({"rope_scaling": {"rope_type": "linear", "factor": -2.0}},
     "rope_scaling.factor=-2.0 must be a positive finite number"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "beta_fast": "x"}},
     "rope_scaling.beta_fast='x' must be a positive finite number or null"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 256}},
     "rope_scaling.high_freq_factor=4.0 must be greater than low_freq_factor (4.0)"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                       "original_max_position_embeddings": 0}},
     "rope_scaling.original_max_position_embeddings=0 must be a positive integer"),
    ({"rope_theta": None, "rope_parameters": {"rope_type": "default", "rope_theta": -1}},
     "rope_parameters.rope_theta=-1 must be a positive finite number"),
    ({"rope_parameters": ["default"]}, "rope_parameters=['default'] must be a JSON object"),
])
def test_cross_field_and_nested_checks_name_the_field(tmp_path, changes, message):
    config = family_config("LlamaForCausalLM")
    for name, value in changes.items():
        config = with_field(config, name, value)
    with pytest.raises(ValueError) as error:
        load_model_config(write_config(tmp_path, config))
    assert message in str(error.value)


@pytest.mark.parametrize(("architecture", "changes", "message"), [
    ("Gemma2ForCausalLM", {"layer_types": ["full_attention"]},
     "layer_types=['full_attention'] must be a list of one type per layer"),
    ("GptOssForCausalLM", {"layer_types": ["full_attention", "chunked"]},
     "layer_types names chunked"),
    ("Qwen3NextForCausalLM", {"layer_types": "linear_attention"},
     "layer_types='linear_attention' must be a list of one type per layer"),
    ("Qwen3MoeForCausalLM", {"mlp_only_layers": [0, 2]},
     "mlp_only_layers=[0, 2] must be a list of layer indices in [0, 2)"),
    ("Qwen3MoeForCausalLM", {"num_experts_per_tok": 5},
     "num_experts_per_tok=5 must be an integer in [1, num_experts=4]"),
    ("Gemma3ForCausalLM", {"rope_parameters": {"full_attention": {"rope_theta": "x"}}},
     "rope_parameters.full_attention.rope_theta='x' must be a positive finite number"),
    ("Gemma3ForCausalLM", {"hidden_activation": "relu"},
     "hidden_activation='relu' must be one of silu, gelu_pytorch_tanh"),
    ("Qwen3_5ForCausalLM", {"partial_rotary_factor": 1.5},
     "partial_rotary_factor=1.5 must be a positive finite number at most 1.0"),
    ("Qwen3_5ForCausalLM", {"hidden_act": "gelu"}, "hidden_act='gelu' must be one of silu"),
])
def test_family_lists_and_choices_name_the_field(tmp_path, architecture, changes, message):
    config = family_config(architecture)
    for name, value in changes.items():
        config = with_field(config, name, value)
    with pytest.raises(ValueError) as error:
        load_model_config(write_config(tmp_path, config))
    assert message in str(error.value)


@pytest.mark.parametrize(("text", "message"), [
    ("[1, 2]", "config.json must hold a JSON object, got \\[1, 2\\]"),
    ("{", "config.json is not valid JSON"),
])
def test_a_config_json_that_is_not_an_object_is_a_value_error(tmp_path, text, message):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match=message):
        load_model_config(tmp_path)


def test_llm_refuses_a_bad_config_before_loading_weights(tmp_path):
    """The folder has no weights: the config's ValueError comes first."""
    folder = write_config(tmp_path, with_field(family_config("LlamaForCausalLM"),
                                               "rms_norm_eps", -1e-6))
    with pytest.raises(ValueError, match=r"rms_norm_eps=-1e-06 must be a positive finite"):
        LLM(model=str(folder), device="cpu")


def test_serve_refuses_a_bad_config_with_one_line_and_no_traceback(tmp_path, capsys):
    folder = write_config(tmp_path, with_field(family_config("LlamaForCausalLM"),
                                               "num_attention_heads", None))
    assert main(["serve", "--model", str(folder), "--device", "cpu", "--port", "0"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert lines == [f"kvrecover: error: {folder / 'config.json'}: num_attention_heads is "
                     "missing (required)"], captured.err
    assert "Traceback" not in captured.err
