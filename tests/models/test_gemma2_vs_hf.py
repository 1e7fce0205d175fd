"""Gemma 2 equals Hugging Face transformers token for token.

A tiny Gemma 2 with a 20-token window on its even layers, soft-caps small enough to
bite (attention 2.0, final logits 3.0), `query_pre_attn_scalar` != head_dim, GeGLU,
(1 + w) norms with random weights, and tied, scaled embeddings: prompts shorter
than, equal to and much longer than the window, under chunked prefill, odd block
sizes, prefix-cache reuse, a tight KV budget and every CPU attention kernel. Bad
configs are refused at start-up, naming the field.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import build_tiny_model, random_prompts
from test_llm_vs_hf import GREEDY, as_requests, hf_reference, perturb_and_save, token_ids

from kvrecover import LLM
from kvrecover.entrypoints.server.chat_template import ChatTemplate
from kvrecover.models.registry import load_model_config
from kvrecover.step_messages import ScheduledRequest
from kvrecover.tokenizer import Tokenizer

WINDOW = 20
LENGTHS = [6, WINDOW, WINDOW + 1, 90, 150]
GEMMA2 = dict(model_type="gemma2", sliding_window=WINDOW, head_dim=16, query_pre_attn_scalar=24,
              attn_logit_softcapping=2.0, final_logit_softcapping=3.0, tie_word_embeddings=True,
              num_hidden_layers=4)


@pytest.fixture(scope="module")
def tiny_gemma2(tmp_path_factory) -> Path:
    raw = build_tiny_model(tmp_path_factory.mktemp("gemma2_raw"), seed=9, **GEMMA2)
    folder = perturb_and_save(raw, tmp_path_factory.mktemp("gemma2"), seed=9)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Gemma2ForCausalLM"]
    assert config["layer_types"] == ["sliding_attention", "full_attention"] * 2
    # A Gemma tokenizer config (the tokenizer itself is the tiny one).
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    tokenizer_config.update(tokenizer_class="GemmaTokenizer", add_bos_token=True,
                            chat_template="{{ bos_token }}{% for m in messages %}"
                                          "<start_of_turn>{{ m['content'] }}{% endfor %}")
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return folder


def _prompts() -> list[list[int]]:
    return random_prompts(len(LENGTHS), LENGTHS, vocab_size=384, seed=12)


@pytest.mark.parametrize("block_size", [3, 5, 16])
def test_gemma2_matches_hf_under_chunked_prefill(tiny_gemma2, block_size):
    prompts = _prompts()
    expected = hf_reference(tiny_gemma2, prompts)
    llm = LLM(str(tiny_gemma2), block_size=block_size, max_num_batched_tokens=32, device="cpu")
    assert llm.engine.model_runner.model.layer_windows() == [WINDOW, None, WINDOW, None]
    assert token_ids(llm.generate(as_requests(prompts), GREEDY)) == expected


@pytest.mark.parametrize("engine", [
    {"batch_invariant": True},  # the C kernel
    {"batch_invariant": True, "native_kernels": False},  # its torch fallback
])
def test_gemma2_matches_hf_on_the_invariant_kernels(tiny_gemma2, engine):
    prompts = _prompts()
    expected = hf_reference(tiny_gemma2, prompts)
    llm = LLM(str(tiny_gemma2), block_size=5, max_num_batched_tokens=32, device="cpu", **engine)
    assert token_ids(llm.generate(as_requests(prompts), GREEDY)) == expected


def test_gemma2_prefix_cache_and_tight_budget_keep_outputs(tiny_gemma2):
    prompts = _prompts()
    expected = hf_reference(tiny_gemma2, prompts)
    llm = LLM(str(tiny_gemma2), block_size=16, max_num_batched_tokens=64, device="cpu")
    assert token_ids(llm.generate(as_requests(prompts), GREEDY)) == expected
    assert token_ids(llm.generate(as_requests(prompts), GREEDY)) == expected
    assert llm.stats["prefix_cache_hit_tokens"] == sum((len(p) - 1) // 16 * 16 for p in prompts)
    # A block holds one KV cache group's layers: room for the longest request alone.
    longest = max(len(p) for p in prompts) + GREEDY.max_tokens
    needed = llm.engine.scheduler.kv_manager.max_blocks_needed(longest)
    tight = LLM(str(tiny_gemma2), block_size=16, max_num_batched_tokens=64, device="cpu",
                num_kv_blocks=needed + 1)
    assert token_ids(tight.generate(as_requests(prompts), GREEDY)) == expected
    assert tight.stats["num_preemptions"] > 0


def test_gemma2_reads_its_tokenizer_and_chat_template(tiny_gemma2):
    tokenizer = Tokenizer(tiny_gemma2)
    text = "hello, my name is kv."
    assert tokenizer.decode(tokenizer.encode(text)) == text
    chat = ChatTemplate(tiny_gemma2).prompt_token_ids([{"role": "user", "content": "hello"}])
    assert chat == [0, *tokenizer.encode("<start_of_turn>hello")]  # bos_token "<s>" is id 0


def _gemma2_config(tmp_path: Path, **fields) -> Path:
    config = dict(architectures=["Gemma2ForCausalLM"], vocab_size=384, hidden_size=64,
                  intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, **fields)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_gemma2_defaults_are_hfs(tmp_path):
    config = load_model_config(_gemma2_config(tmp_path))
    assert config.layer_windows() == [4096, None, 4096]  # layer 0 is a sliding one
    assert (config.head_dim, config.query_pre_attn_scalar) == (256, 256.0)
    assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (50.0, 30.0)
    assert config.tie_word_embeddings and config.hidden_activation == "gelu_pytorch_tanh"
    nulls = load_model_config(_gemma2_config(tmp_path, attn_logit_softcapping=None,
                                             final_logit_softcapping=None,
                                             layer_types=["full_attention"] * 3))
    assert nulls.layer_windows() == [None] * 3
    assert nulls.attn_logit_softcapping is None and nulls.final_logit_softcapping is None


@pytest.mark.parametrize("fields, message", [
    ({"layer_types": ["sliding_attention"] * 2}, "layer_types=.* must be a list of one type per layer"),
    ({"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]},
     "layer_types names chunked_attention"),
    ({"attn_logit_softcapping": 0}, "attn_logit_softcapping=.* must be a positive finite number"),
    ({"final_logit_softcapping": -30.0}, "final_logit_softcapping=.* must be a positive finite number"),
    ({"sliding_window": 0}, "sliding_window=.* must be a positive integer"),
    ({"query_pre_attn_scalar": 0}, "query_pre_attn_scalar=.* must be a positive finite number"),
    ({"hidden_activation": "relu"}, "hidden_activation='relu' must be one of silu"),
    ({"attention_bias": True}, "attention_bias is not supported"),
])
def test_bad_gemma2_configs_are_refused_naming_the_field(tmp_path, fields, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(_gemma2_config(tmp_path, **fields)), device="cpu")


def model_logits(llm, prompt: list[int], block_size: int = 16) -> torch.Tensor:
    """The engine's model's float32 logits of the last prompt token, one prefill step."""
    runner = llm.engine.model_runner
    count = -(-len(prompt) // block_size)
    # One table per KV cache group, each of its own blocks.
    tables = [list(range(1 + g * count, 1 + (g + 1) * count))
              for g in range(len(runner.layout.kv_groups))]
    step = runner.inputs.build([ScheduledRequest("r", prompt, 0, tables[0], True, GREEDY, 0,
                                                 tables if len(tables) > 1 else [])])
    with torch.no_grad():
        hidden = runner.model(step.input_ids, step.positions, runner.layer_caches, step.attn,
                              layer_meta=runner._layer_meta(step))
        return runner.model.logits(hidden[step.sample_rows])[0]


def hf_logits(model_dir: Path, prompt: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor([prompt])).logits[0, -1]


def test_gemma2_logits_are_soft_capped_as_in_hf(tiny_gemma2):
    """Greedy ids cannot see the final cap (tanh keeps the order): compare logits."""
    prompt = _prompts()[3]
    llm = LLM(str(tiny_gemma2), block_size=16, device="cpu")
    ours, theirs = model_logits(llm, prompt), hf_logits(tiny_gemma2, prompt)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    assert ours.abs().max() < 3.0 < 2 * ours.abs().max()  # the cap (3.0) binds
