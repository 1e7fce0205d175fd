"""Gemma 3 (text) equals Hugging Face transformers token for token.

A tiny Gemma 3 whose layers 0, 1 and 3 slide over 16 tokens and layer 2 attends to
everything; the local rope base (500) differs from the global one (50 000, linear
scaling x4), q/k norms and all other norms carry random (1 + w) weights, the final
logits are soft-capped. Prompts shorter than, equal to and much longer than the
window, under chunked prefill, odd block sizes, prefix-cache reuse, a tight KV
budget and every CPU attention kernel; the `sliding_window_pattern` fallback and
bad configs at start-up.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import build_tiny_model, random_prompts
from test_gemma2_vs_hf import hf_logits, model_logits
from test_llm_vs_hf import GREEDY, as_requests, hf_reference, perturb_and_save, token_ids

from kvrecover import LLM
from kvrecover.models.registry import load_model_config

WINDOW = 16
LENGTHS = [5, WINDOW, WINDOW + 1, 80, 140]
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
GEMMA3 = dict(model_type="gemma3_text", sliding_window=WINDOW, head_dim=16, num_hidden_layers=4,
              layer_types=LAYER_TYPES, query_pre_attn_scalar=24, final_logit_softcapping=3.0,
              rope_theta=50_000.0, rope_local_base_freq=500.0,
              rope_scaling={"rope_type": "linear", "factor": 4.0}, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory) -> Path:
    raw = build_tiny_model(tmp_path_factory.mktemp("gemma3_raw"), seed=13, **GEMMA3)
    folder = perturb_and_save(raw, tmp_path_factory.mktemp("gemma3"), seed=13)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"]
    assert config["model_type"] == "gemma3_text" and config["layer_types"] == LAYER_TYPES
    return folder


def _prompts() -> list[list[int]]:
    return random_prompts(len(LENGTHS), LENGTHS, vocab_size=384, seed=14)


@pytest.mark.parametrize("block_size", [3, 5, 16])
def test_gemma3_matches_hf_under_chunked_prefill(tiny_gemma3, block_size):
    prompts = _prompts()
    expected = hf_reference(tiny_gemma3, prompts)
    llm = LLM(str(tiny_gemma3), block_size=block_size, max_num_batched_tokens=32, device="cpu")
    model = llm.engine.model_runner.model
    assert model.layer_windows() == [WINDOW, WINDOW, None, WINDOW]
    assert [layer.self_attn.rotary for layer in model.layers] == [
        model.local_rotary, model.local_rotary, model.rotary, model.local_rotary]
    assert token_ids(llm.generate(as_requests(prompts), GREEDY)) == expected


@pytest.mark.parametrize("engine", [
    {"batch_invariant": True},  # the C kernel
    {"batch_invariant": True, "native_kernels": False},  # its torch fallback
])
def test_gemma3_matches_hf_on_the_invariant_kernels(tiny_gemma3, engine):
    prompts = _prompts()
    expected = hf_reference(tiny_gemma3, prompts)
    llm = LLM(str(tiny_gemma3), block_size=5, max_num_batched_tokens=32, device="cpu", **engine)
    assert token_ids(llm.generate(as_requests(prompts), GREEDY)) == expected


def test_gemma3_prefix_cache_and_tight_budget_keep_outputs(tiny_gemma3):
    prompts = _prompts()
    expected = hf_reference(tiny_gemma3, prompts)
    llm = LLM(str(tiny_gemma3), block_size=16, max_num_batched_tokens=64, device="cpu")
    assert token_ids(llm.generate(as_requests(prompts), GREEDY)) == expected
    assert token_ids(llm.generate(as_requests(prompts), GREEDY)) == expected
    assert llm.stats["prefix_cache_hit_tokens"] == sum((len(p) - 1) // 16 * 16 for p in prompts)
    # A block holds one KV cache group's layers: room for the longest request alone.
    longest = max(len(p) for p in prompts) + GREEDY.max_tokens
    needed = llm.engine.scheduler.kv_manager.max_blocks_needed(longest)
    tight = LLM(str(tiny_gemma3), block_size=16, max_num_batched_tokens=64, device="cpu",
                num_kv_blocks=needed + 1)
    assert token_ids(tight.generate(as_requests(prompts), GREEDY)) == expected
    assert tight.stats["num_preemptions"] > 0


def test_gemma3_logits_equal_hfs(tiny_gemma3):
    prompt = _prompts()[4]
    llm = LLM(str(tiny_gemma3), block_size=16, device="cpu")
    ours, theirs = model_logits(llm, prompt), hf_logits(tiny_gemma3, prompt)
    assert ours.abs().max() < 3.0  # the final soft-cap
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def _gemma3_config(tmp_path: Path, **fields) -> Path:
    config = dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=384,
                  hidden_size=64, intermediate_size=128, num_hidden_layers=7,
                  num_attention_heads=4, num_key_value_heads=2, **fields)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_gemma3_defaults_and_the_pattern_fallback_are_hfs(tmp_path):
    from transformers import AutoConfig

    config = load_model_config(_gemma3_config(tmp_path))
    hf = AutoConfig.from_pretrained(tmp_path)
    expected = [4096 if kind == "sliding_attention" else None for kind in hf.layer_types]
    assert config.layer_windows() == expected == [4096] * 5 + [None, 4096]  # every 6th is full
    assert (config.rope_theta, config.local_rope_theta) == (1e6, 1e4)
    assert config.attn_logit_softcapping is None and config.final_logit_softcapping is None
    # The Hub's older form: a pattern int, rope_theta / rope_local_base_freq / rope_scaling.
    old = load_model_config(_gemma3_config(
        tmp_path, sliding_window=8, sliding_window_pattern=3, rope_theta=2e5,
        rope_local_base_freq=300.0, rope_scaling={"rope_type": "linear", "factor": 8.0}))
    hf = AutoConfig.from_pretrained(tmp_path)
    assert old.layer_windows() == [8 if kind == "sliding_attention" else None
                                   for kind in hf.layer_types] == [8, 8, None, 8, 8, None, 8]
    assert (old.rope_theta, old.local_rope_theta) == (2e5, 300.0)
    assert old.rope_scaling == hf.rope_parameters["full_attention"]
    assert old.local_rope_scaling is None


@pytest.mark.parametrize("fields, message", [
    ({"layer_types": ["full_attention"] * 6}, "layer_types=.* must be a list of one type per layer"),
    ({"layer_types": ["full_attention"] * 6 + ["global"]}, "layer_types names global"),
    ({"sliding_window_pattern": 0}, "sliding_window_pattern=.* must be a positive integer"),
    ({"sliding_window": -1}, "sliding_window=.* must be a positive integer"),
    ({"final_logit_softcapping": 0.0}, "final_logit_softcapping=.* must be a positive finite number"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention is not supported"),
])
def test_bad_gemma3_configs_are_refused_naming_the_field(tmp_path, fields, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(_gemma3_config(tmp_path, **fields)), device="cpu")
