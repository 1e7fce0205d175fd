"""Greedy outputs equal Hugging Face transformers token for token."""

from __future__ import annotations

import pytest
from conftest import hf_greedy, random_prompts

from kvrecover import LLM, SamplingParams

LENGTHS = [1, 7, 16, 33, 64, 100, 257, 310]


@pytest.mark.parametrize("block_size", [16, 13])
@pytest.mark.parametrize("model_fixture", ["tiny_llama", "tiny_llama_untied"])
def test_greedy_matches_hf(request, model_fixture, block_size):
    model_dir = request.getfixturevalue(model_fixture)
    prompts = random_prompts(8, LENGTHS, vocab_size=384, seed=block_size)
    expected = hf_greedy(model_dir, prompts, max_new_tokens=24)
    llm = LLM(str(model_dir), block_size=block_size, max_num_batched_tokens=64, device="cpu")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    assert llm.stats["prompt_tokens_computed"] == sum(len(p) for p in prompts)
