"""Sliding-window models (Mistral) equal Hugging Face transformers token for token.

A tiny Mistral with a 24-token window: prompts shorter than, equal to and much
longer than the window, generating past it; chunked prefill, odd block sizes,
prefix-cache reuse, a KV budget tight enough to preempt, and every CPU attention
kernel (torch reference, the C kernel, its torch fallback). Bad windows are
refused at start-up, naming the field.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import build_tiny_model, random_prompts
from test_llm_vs_hf import GREEDY, as_requests, hf_reference, perturb_and_save, token_ids

from kvrecover import LLM
from kvrecover.models.registry import load_model_config

WINDOW = 24
# Shorter than, equal to, one past and several times the window.
LENGTHS = [7, WINDOW, WINDOW + 1, 100, 170]


@pytest.fixture(scope="module")
def tiny_mistral(tmp_path_factory) -> Path:
    """Mistral: the Llama layers, each attending over the last 24 positions."""
    raw = build_tiny_model(tmp_path_factory.mktemp("mistral_raw"), model_type="mistral", seed=7,
                           sliding_window=WINDOW)
    folder = perturb_and_save(raw, tmp_path_factory.mktemp("mistral"), seed=7)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["MistralForCausalLM"]
    assert config["sliding_window"] == WINDOW
    return folder


@pytest.fixture(scope="module")
def tiny_mistral_full(tmp_path_factory) -> Path:
    """Mistral with `sliding_window: null`: full attention (Mistral v0.2 on)."""
    raw = build_tiny_model(tmp_path_factory.mktemp("mistral_full_raw"), model_type="mistral",
                           seed=8, sliding_window=None)
    return perturb_and_save(raw, tmp_path_factory.mktemp("mistral_full"), seed=8)


def _prompts() -> list[list[int]]:
    return random_prompts(len(LENGTHS), LENGTHS, vocab_size=384, seed=11)


@pytest.mark.parametrize("block_size", [3, 5, 16])
def test_mistral_window_matches_hf_under_chunked_prefill(tiny_mistral, block_size):
    prompts = _prompts()
    expected = hf_reference(tiny_mistral, prompts)
    llm = LLM(str(tiny_mistral), block_size=block_size, max_num_batched_tokens=32, device="cpu")
    assert llm.engine.model_runner.model.layer_windows() == [WINDOW] * 3
    assert token_ids(llm.generate(as_requests(prompts), GREEDY)) == expected
    assert llm.stats["num_preemptions"] == 0


@pytest.mark.parametrize("engine", [
    {"batch_invariant": True},  # the C kernel
    {"batch_invariant": True, "native_kernels": False},  # its torch fallback
])
def test_mistral_window_matches_hf_on_the_invariant_kernels(tiny_mistral, engine):
    prompts = _prompts()
    expected = hf_reference(tiny_mistral, prompts)
    llm = LLM(str(tiny_mistral), block_size=5, max_num_batched_tokens=32, device="cpu", **engine)
    assert token_ids(llm.generate(as_requests(prompts), GREEDY)) == expected


def test_mistral_prefix_cache_reuse_keeps_outputs(tiny_mistral):
    prompts = _prompts()
    expected = hf_reference(tiny_mistral, prompts)
    llm = LLM(str(tiny_mistral), block_size=16, max_num_batched_tokens=64, device="cpu")
    first = token_ids(llm.generate(as_requests(prompts), GREEDY))
    second = token_ids(llm.generate(as_requests(prompts), GREEDY))
    assert first == second == expected
    assert llm.stats["prefix_cache_hit_tokens"] == sum((len(p) - 1) // 16 * 16 for p in prompts)


def test_mistral_tight_kv_budget_preempts_and_keeps_outputs(tiny_mistral):
    prompts = _prompts()
    expected = hf_reference(tiny_mistral, prompts)
    # The longest request (170 + 20 tokens) would need 12 blocks of 16 with full
    # attention, and 14 usable blocks would not hold the batch; the window (24 tokens,
    # chunks of 64) keeps at most 7 per request and releases the rest: no preemption.
    llm = LLM(str(tiny_mistral), block_size=16, max_num_batched_tokens=64, device="cpu",
              num_kv_blocks=15)
    assert token_ids(llm.generate(as_requests(prompts), GREEDY)) == expected
    assert llm.stats["num_preemptions"] == 0
    # 7 usable blocks hold one request at a time: the batch preempts.
    llm = LLM(str(tiny_mistral), block_size=16, max_num_batched_tokens=64, device="cpu",
              num_kv_blocks=8)
    assert token_ids(llm.generate(as_requests(prompts), GREEDY)) == expected
    assert llm.stats["num_preemptions"] > 0


def test_mistral_without_a_window_is_full_attention(tiny_mistral_full):
    prompts = _prompts()
    expected = hf_reference(tiny_mistral_full, prompts)
    llm = LLM(str(tiny_mistral_full), block_size=16, max_num_batched_tokens=32, device="cpu")
    assert llm.engine.model_runner.model.layer_windows() == [None] * 3
    assert token_ids(llm.generate(as_requests(prompts), GREEDY)) == expected


def _mistral_config(tmp_path: Path, **fields) -> Path:
    config = dict(architectures=["MistralForCausalLM"], vocab_size=384, hidden_size=64,
                  intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, **fields)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_mistral_window_defaults_as_in_hf(tmp_path):
    assert load_model_config(_mistral_config(tmp_path)).layer_windows() == [4096, 4096]


@pytest.mark.parametrize("window", [0, -3, 2.5, "64", True])
def test_a_window_that_is_not_a_positive_int_is_refused(tmp_path, window):
    with pytest.raises(ValueError, match="sliding_window=.* must be a positive integer"):
        load_model_config(_mistral_config(tmp_path, sliding_window=window))
