"""Greedy outputs equal Hugging Face transformers token for token.

Covers the Llama family we support (Llama with llama3 rope and tied embeddings,
plain Llama, Qwen2 with attention bias, Qwen3 with q/k norm), a sharded
checkpoint, prefix caching, preemption, and the built-in default model (slow).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import build_tiny_model, hf_greedy, random_prompts

from kvrecover import LLM, SamplingParams

LENGTHS = [1, 7, 16, 33, 64, 100, 257, 310]
SHORT_LENGTHS = [7, 33, 100, 310]
MAX_NEW = 20
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)

_HF_CACHE: dict[tuple, list[list[int]]] = {}


def hf_reference(model_dir: Path, prompts: list[list[int]], max_new_tokens: int = MAX_NEW):
    """hf_greedy, memoised: several tests compare against the same reference."""
    key = (str(model_dir), tuple(map(tuple, prompts)), max_new_tokens)
    if key not in _HF_CACHE:
        _HF_CACHE[key] = hf_greedy(model_dir, prompts, max_new_tokens)
    return _HF_CACHE[key]


def perturb_and_save(model_dir: Path, out_dir: Path, seed: int, **save_kwargs) -> Path:
    """Give every 1-D weight (norms, biases) random values, so a mis-loaded bias or
    q/k norm changes the outputs (HF initialises them to ones and zeros)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                base = 1.0 if "norm" in name else 0.0
                param.copy_(base + 0.2 * torch.randn(param.shape, generator=generator))
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, **save_kwargs)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out_dir / name).write_bytes((model_dir / name).read_bytes())
    return out_dir


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory) -> Path:
    """Qwen2: biased q/k/v projections."""
    raw = build_tiny_model(tmp_path_factory.mktemp("qwen2_raw"), model_type="qwen2", seed=2)
    folder = perturb_and_save(raw, tmp_path_factory.mktemp("qwen2"), seed=2)
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    return folder


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory) -> Path:
    """Qwen3: per-head q/k RMSNorm, explicit head_dim != hidden/heads."""
    raw = build_tiny_model(
        tmp_path_factory.mktemp("qwen3_raw"), model_type="qwen3", seed=3, head_dim=32
    )
    folder = perturb_and_save(raw, tmp_path_factory.mktemp("qwen3"), seed=3)
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    return folder


@pytest.fixture(scope="module")
def tiny_sharded(tiny_llama_untied, tmp_path_factory) -> Path:
    """The untied tiny Llama saved in several shards with a model.safetensors.index.json."""
    folder = perturb_and_save(
        tiny_llama_untied, tmp_path_factory.mktemp("sharded"), seed=4, max_shard_size="200KB"
    )
    assert (folder / "model.safetensors.index.json").is_file()
    assert len(list(folder.glob("model-*.safetensors"))) > 2
    return folder


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def as_requests(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in prompts]


@pytest.mark.parametrize(
    "model_fixture, block_size, lengths",
    [
        ("tiny_llama", 16, LENGTHS),
        ("tiny_llama", 13, LENGTHS),
        # The other models: fewer prompts keep the HF reference loop short.
        ("tiny_llama_untied", 16, SHORT_LENGTHS),
        ("tiny_qwen2", 16, SHORT_LENGTHS),
        ("tiny_qwen3", 8, SHORT_LENGTHS),
        ("tiny_sharded", 16, SHORT_LENGTHS),
    ],
)
def test_greedy_matches_hf(request, model_fixture, block_size, lengths):
    model_dir = request.getfixturevalue(model_fixture)
    prompts = random_prompts(len(lengths), lengths, vocab_size=384, seed=0)
    expected = hf_reference(model_dir, prompts)
    # A small token budget makes the long prompts prefill in several chunks.
    llm = LLM(str(model_dir), block_size=block_size, max_num_batched_tokens=64, device="cpu")
    outputs = llm.generate(as_requests(prompts), GREEDY)
    assert token_ids(outputs) == expected
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    assert llm.stats["prompt_tokens_computed"] == sum(len(p) for p in prompts)
    assert llm.stats["num_preemptions"] == 0


def test_prefix_cache_reuses_blocks_and_keeps_outputs(tiny_llama):
    block_size = 16
    prompts = random_prompts(8, LENGTHS, vocab_size=384, seed=0)
    expected = hf_reference(tiny_llama, prompts)
    llm = LLM(str(tiny_llama), block_size=block_size, max_num_batched_tokens=256, device="cpu")
    first = llm.generate(as_requests(prompts), GREEDY)
    assert llm.stats["prefix_cache_hit_tokens"] == 0  # random prompts share nothing
    second = llm.generate(as_requests(prompts), GREEDY)
    assert token_ids(first) == token_ids(second) == expected
    # Every full block of each prompt except the one holding its last token is a hit.
    hits = sum((len(p) - 1) // block_size * block_size for p in prompts)
    assert hits > 0
    assert llm.stats["prefix_cache_hit_tokens"] == hits
    assert llm.stats["prompt_tokens_computed"] == 2 * sum(len(p) for p in prompts) - hits


def test_prefix_cache_shared_prefix_within_one_batch(tiny_llama):
    # Prompts that share a 64-token prefix, submitted after the first has run once.
    base = random_prompts(1, [64], vocab_size=384, seed=5)[0]
    tails = random_prompts(3, [5, 20, 40], vocab_size=384, seed=6)
    prompts = [base + tail for tail in tails]
    expected = hf_reference(tiny_llama, prompts)
    llm = LLM(str(tiny_llama), block_size=16, device="cpu")
    assert token_ids(llm.generate(as_requests(prompts[:1]), GREEDY)) == expected[:1]
    outputs = llm.generate(as_requests(prompts), GREEDY)
    assert token_ids(outputs) == expected
    # Each prompt hits the 4 blocks of the shared prefix and nothing of its own tail.
    assert llm.stats["prefix_cache_hit_tokens"] == 3 * 64


def test_no_reuse_without_prefix_caching(tiny_llama):
    prompts = random_prompts(8, LENGTHS, vocab_size=384, seed=0)
    expected = hf_reference(tiny_llama, prompts)
    llm = LLM(
        str(tiny_llama), block_size=16, max_num_batched_tokens=256, device="cpu",
        enable_prefix_caching=False,
    )
    first = llm.generate(as_requests(prompts), GREEDY)
    second = llm.generate(as_requests(prompts), GREEDY)
    assert token_ids(first) == token_ids(second) == expected
    assert llm.stats["prefix_cache_hit_tokens"] == 0
    assert llm.stats["prompt_tokens_computed"] == 2 * sum(len(p) for p in prompts)


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_preemption_keeps_outputs_equal_to_hf(tiny_llama, enable_prefix_caching):
    prompts = random_prompts(8, LENGTHS, vocab_size=384, seed=0)
    expected = hf_reference(tiny_llama, prompts)
    # The longest request (310 + 20 tokens) needs 21 blocks of 16: 24 usable blocks
    # hold it but not the whole batch, so running requests get preempted.
    llm = LLM(
        str(tiny_llama), block_size=16, max_num_batched_tokens=128, device="cpu",
        num_kv_blocks=25, enable_prefix_caching=enable_prefix_caching,
    )
    outputs = llm.generate(as_requests(prompts), GREEDY)
    assert llm.stats["num_preemptions"] > 0
    assert token_ids(outputs) == expected
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)


# ----- the built-in default model ----------------------------------------------------

LONG_TEXT = (
    "The history of computing is a story of abstraction. Early machines were programmed "
    "by rewiring panels of plugs and switches, and a single calculation could take days to "
    "set up. Stored-program computers changed that: instructions lived in the same memory "
    "as data, so a program could be loaded, modified and replaced in minutes. Assemblers "
    "gave names to machine instructions, compilers translated arithmetic formulas into "
    "those instructions, and operating systems let many programs share one machine without "
    "knowing about each other. Each layer hid the details of the one below it, and each "
    "made programmers more productive while costing some efficiency. Time-sharing systems "
    "in the nineteen sixties let dozens of users work at terminals at once, and the "
    "personal computers of the nineteen eighties put a whole machine on every desk. "
    "Networks then connected those desks, first within a building and later across the "
    "world, and the web turned the network into a library that anyone could read and "
    "write. Today large language models are trained on much of that library. They are "
    "served by inference engines that batch requests from many users, keep the attention "
    "keys and values of every conversation in a paged cache, and move those caches between "
    "machines so that the expensive prefill of a long prompt can run on one server while "
    "the token-by-token decoding runs on another. When a cache transfer fails, the engine "
    "must notice, throw away the damaged blocks, and recompute exactly what was lost, so "
    "that the user never sees a wrong word. In this essay we describe"
)
DEFAULT_PROMPTS = [
    "The capital of France is",
    "Here is a short poem about the sea:\n",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Photosynthesis is the process by which green plants use sunlight to turn water and "
    "carbon dioxide into sugar and oxygen. The most important pigment involved is",
    LONG_TEXT,
]


@pytest.mark.slow
def test_default_model_greedy_matches_hf():
    llm = LLM(device="cpu", dtype="float32")
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.encode(text) for text in DEFAULT_PROMPTS]
    assert max(len(p) for p in prompts) >= 300
    expected = hf_greedy(llm.engine.model_dir, prompts, max_new_tokens=MAX_NEW)
    outputs = llm.generate(DEFAULT_PROMPTS, GREEDY)
    assert [o.prompt_token_ids for o in outputs] == prompts
    assert token_ids(outputs) == expected
    assert outputs[0].outputs[0].text.strip().startswith("Paris")
