"""Logprobs (output and prompt) against Hugging Face's log_softmax, scoring a prompt
with max_tokens=0, and `n` choices: shared prompt blocks, seeded and reproducible."""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny_model, random_prompts

from kvrecover import LLM, SamplingParams

BLOCK = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("logprobs_model"), seed=3)


@pytest.fixture(scope="module")
def hf_logprobs(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def run(token_ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([token_ids])).logits[0].float().log_softmax(-1)
    return run


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), max_num_batched_tokens=32)  # prompts take several chunks


def check_record(record, want: torch.Tensor, token: int, k: int) -> None:
    assert record.token_id == token
    assert abs(record.logprob - float(want[token])) < 1e-4
    assert record.rank == int((want > want[token]).sum()) + 1
    top = want.topk(k)
    assert [t for t, _ in record.top] == top.indices.tolist()
    assert max(abs(lp - float(v)) for (_, lp), v in zip(record.top, top.values)) < 1e-4 \
        if k else record.top == []


@pytest.mark.parametrize("k", [0, 3])
def test_output_and_prompt_logprobs_equal_hf_log_softmax(llm, hf_logprobs, k):
    prompts = random_prompts(2, [70, 9], 384, seed=11)
    params = SamplingParams(temperature=0.8, seed=2, max_tokens=6, ignore_eos=True,
                            logprobs=k, prompt_logprobs=k, presence_penalty=1.0)
    for prompt, output in zip(prompts, llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params)):
        tokens = output.outputs[0].token_ids
        want = hf_logprobs(prompt + tokens)
        assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == len(prompt)
        for i in range(1, len(prompt)):
            check_record(output.prompt_logprobs[i], want[i - 1], prompt[i], k)
        records = output.outputs[0].logprobs
        assert len(records) == len(tokens)
        for j, (record, token) in enumerate(zip(records, tokens)):
            # Raw model logprobs: before the penalty and the temperature.
            check_record(record, want[len(prompt) - 1 + j], token, k)


def test_prompt_logprobs_skip_the_prefix_cache(llm, hf_logprobs):
    prompt = random_prompts(1, [50], 384, seed=12)[0]
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=1))
    hits = llm.stats["prefix_cache_hit_tokens"]
    output = llm.generate([{"prompt_token_ids": prompt}],
                          SamplingParams(max_tokens=0, prompt_logprobs=1))[0]
    assert llm.stats["prefix_cache_hit_tokens"] == hits  # every position recomputed
    assert output.outputs[0].token_ids == [] and output.outputs[0].finish_reason == "length"
    want = hf_logprobs(prompt)
    for i in range(1, len(prompt)):
        check_record(output.prompt_logprobs[i], want[i - 1], prompt[i], 1)


def test_max_tokens_zero_needs_prompt_logprobs():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(max_tokens=0)


def test_logprobs_on_the_overlapped_decode_path(model_dir, llm):
    prompt = random_prompts(1, [20], 384, seed=13)[0]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    want = llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0]
    overlapped = LLM(str(model_dir))
    overlapped.engine.model_runner.eager_overlap = True
    got = overlapped.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0]
    assert overlapped.stats["overlapped_steps"] > 0
    assert got.token_ids == want.token_ids
    assert [(r.token_id, r.rank, [t for t, _ in r.top]) for r in got.logprobs] == \
        [(r.token_id, r.rank, [t for t, _ in r.top]) for r in want.logprobs]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(got.logprobs, want.logprobs)) < 1e-5


def test_n_choices_share_the_prompt_and_are_seeded_per_choice(model_dir):
    llm = LLM(str(model_dir))
    prompt = random_prompts(1, [70], 384, seed=14)[0]  # 4 full blocks and 6 tokens
    params = SamplingParams(temperature=1.0, seed=9, n=3, max_tokens=6, ignore_eos=True)
    before = llm.stats
    output = llm.generate([{"prompt_token_ids": prompt}], params)[0]
    after = llm.stats
    assert [c.index for c in output.outputs] == [0, 1, 2]
    choices = [c.token_ids for c in output.outputs]
    assert len({tuple(c) for c in choices}) == 3  # seeded per choice: they differ
    # The prompt is computed once; the other choices hit its full blocks and compute
    # only the partial last block.
    full = (len(prompt) - 1) // BLOCK * BLOCK
    assert after["prompt_tokens_computed"] - before["prompt_tokens_computed"] == \
        len(prompt) + 2 * (len(prompt) - full)
    assert after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"] == 2 * full
    # Reproducible, and choice 0 is the n=1 request with the same seed.
    fresh = LLM(str(model_dir)).generate([{"prompt_token_ids": prompt}], params)[0]
    assert [c.token_ids for c in fresh.outputs] == choices
    single = llm.generate([{"prompt_token_ids": prompt}],
                          SamplingParams(temperature=1.0, seed=9, max_tokens=6, ignore_eos=True))
    assert single[0].outputs[0].token_ids == choices[0]


def test_n_above_the_cap_is_an_error():
    with pytest.raises(ValueError, match="n must be"):
        SamplingParams(n=17)


def test_aborting_an_n_request_aborts_every_choice(llm):
    prompt = random_prompts(1, [20], 384, seed=15)[0]
    engine = llm.engine
    engine.add_request("many", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, n=3, max_tokens=50, ignore_eos=True))
    assert {"many#0", "many#1", "many#2"} <= set(engine.scheduler.requests)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("many", {"prompt_token_ids": prompt}, SamplingParams(n=2))
    engine.step()
    engine.abort_request("many")
    assert not engine.has_unfinished() and not engine.scheduler.requests
    # The id is free again once its choices are gone.
    engine.add_request("many", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=1))
    while engine.has_unfinished():
        engine.step()
