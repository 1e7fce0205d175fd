"""Structured outputs together with the rest of sampling (issue 27), offline: `n`
choices each walk their own grammar; logprobs stay the model's raw ones under a
grammar; the logits processors run before the grammar's mask."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import random_prompts
from structured_helpers import CHOICES, PERSON_SCHEMA, schema_errors

from kvrecover import LLM, SamplingParams
from kvrecover.sampling import choice_seed
from kvrecover.structured.params import StructuredOutputsParams as Spec

VOCAB = 384
PROMPT = random_prompts(1, [21], VOCAB, seed=11)[0]
TOL = 1e-4


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(str(tiny_llama), device="cpu", block_size=8, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def hf_logprobs(tiny_llama):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()

    def run(token_ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([token_ids])).logits[0].float().log_softmax(-1)
    return run


def combined(n: int, seed: int, **extra) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=120, n=n, logprobs=3,
                          presence_penalty=1.5, structured_outputs=Spec(json=PERSON_SCHEMA),
                          **extra)


def test_n_choices_each_follow_their_own_grammar_with_raw_logprobs(llm, hf_logprobs):
    output = llm.generate([{"prompt_token_ids": PROMPT}], combined(2, seed=7))[0]
    assert [c.index for c in output.outputs] == [0, 1]
    for choice in output.outputs:
        assert choice.finish_reason == "stop", choice
        assert schema_errors(json.loads(choice.text), PERSON_SCHEMA) == []
        # The model's raw logprobs: log_softmax of the unmasked, unpenalized logits.
        want = hf_logprobs(PROMPT + choice.token_ids)[len(PROMPT) - 1:]
        assert [r.token_id for r in choice.logprobs] == choice.token_ids
        for position, record in enumerate(choice.logprobs):
            assert abs(record.logprob - float(want[position, record.token_id])) < TOL
            assert [t for t, _ in record.top] == want[position].topk(3).indices.tolist()
    assert output.outputs[0].token_ids != output.outputs[1].token_ids
    # Choice i is the request of one choice seeded choice_seed(7, i): its own matcher.
    for index, choice in enumerate(output.outputs):
        alone = llm.generate([{"prompt_token_ids": PROMPT}],
                             combined(1, seed=choice_seed(7, index)))[0].outputs[0]
        assert alone.token_ids == choice.token_ids


def test_greedy_under_a_grammar_takes_the_penalized_argmax_of_what_it_allows(
        llm, tiny_llama, hf_logprobs):
    """The reference: Hugging Face's logits, the penalties (presence, frequency) from the
    output counts, then xgrammar's mask, then argmax; and the logprobs stay raw."""
    from kvrecover.structured.bitmask import TokenBitmask
    from kvrecover.structured.compiler import GrammarCompiler

    presence, frequency = 1.5, 0.7
    spec = Spec(json=PERSON_SCHEMA)
    params = SamplingParams(temperature=0, max_tokens=120, logprobs=0, structured_outputs=spec,
                            presence_penalty=presence, frequency_penalty=frequency)
    got = llm.generate([{"prompt_token_ids": PROMPT}], params)[0].outputs[0]
    plain = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(
        temperature=0, max_tokens=120, logprobs=0, structured_outputs=spec))[0].outputs[0]
    assert got.token_ids != plain.token_ids  # the penalties change this output
    # Without processors too, the mask leaves the raw logits (the logprobs) as they are.
    raw_plain = hf_logprobs(PROMPT + plain.token_ids)[len(PROMPT) - 1:]
    assert [abs(r.logprob - float(raw_plain[i, r.token_id])) < TOL
            for i, r in enumerate(plain.logprobs)] == [True] * len(plain.token_ids)
    assert got.finish_reason == "stop"
    assert schema_errors(json.loads(got.text), PERSON_SCHEMA) == []
    grammar = GrammarCompiler(tiny_llama, VOCAB, [1]).matcher(spec)
    raw = hf_logprobs(PROMPT + got.token_ids)[len(PROMPT) - 1:]
    counts = torch.zeros(VOCAB)
    want = []
    for position in range(len(got.token_ids)):
        logits = raw[position] - frequency * counts - presence * (counts > 0).float()
        logits = logits[None].clone()
        TokenBitmask(torch.device("cpu")).apply(logits, [grammar])
        token = int(logits.argmax())
        want.append(token)
        counts[token] += 1
        assert grammar.accept(token)
        if grammar.is_terminated:
            break
    assert got.token_ids == want
    assert [abs(r.logprob - float(raw[i, r.token_id])) < TOL
            for i, r in enumerate(got.logprobs)] == [True] * len(want)


def test_a_logit_bias_picks_among_what_the_grammar_allows(llm):
    tokenizer = llm.get_tokenizer()
    favoured = tokenizer.encode("negative", add_special_tokens=False)[0]
    spec = Spec(choice=CHOICES)
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=spec)
    biased = SamplingParams(temperature=0, max_tokens=40, structured_outputs=spec,
                            logit_bias={favoured: 100.0})
    # A bias on a token the grammar forbids here does not get it sampled.
    forbidden = tokenizer.encode("{", add_special_tokens=False)[0]
    against = SamplingParams(temperature=0, max_tokens=40, structured_outputs=spec,
                             logit_bias={forbidden: 100.0})
    outputs = llm.generate([{"prompt_token_ids": PROMPT}] * 3, [params, biased, against])
    texts = [o.outputs[0].text for o in outputs]
    assert texts[1] == "negative"
    assert texts[0] in CHOICES and texts[2] == texts[0]
