"""Structured outputs through the offline API: outputs follow their grammar on random
weights, greedy ids do not depend on the batch, and a replayed prefix resumes exactly."""

from __future__ import annotations

import json
import re

import pytest
from conftest import random_prompts
from structured_helpers import CHOICES, GRAMMAR, PERSON_SCHEMA, REGEX, schema_errors

from kvrecover import LLM, SamplingParams
from kvrecover import StructuredOutputsParams as Spec

VOCAB = 384
PROMPTS = random_prompts(4, [9, 30, 3, 17], VOCAB, seed=5)
# Bounded grammars: random weights end them too (json_object's keys are unbounded).
SPECS = [Spec(json=PERSON_SCHEMA), Spec(regex=REGEX), Spec(choice=CHOICES),
         Spec(grammar=GRAMMAR)]


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(str(tiny_llama), device="cpu", block_size=8, max_num_batched_tokens=64)


def params(spec: Spec | None, temperature: float = 0.0, seed: int | None = None,
           max_tokens: int = 80) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens,
                          structured_outputs=spec)


def check_follows(spec: Spec, text: str) -> None:
    if spec.kind == "json":
        assert schema_errors(json.loads(text), PERSON_SCHEMA) == []
    elif spec.kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif spec.kind == "regex":
        assert re.fullmatch(REGEX, text)
    elif spec.kind == "choice":
        assert text in CHOICES
    else:
        assert re.fullmatch(r"\([0-9](\+[0-9])?\)", text)


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (1.0, 7)])
def test_every_kind_of_grammar_is_followed_and_ends_the_output(llm, temperature, seed):
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]] * len(SPECS),
                           [params(s, temperature, seed) for s in SPECS for _ in range(2)])
    for i, output in enumerate(outputs):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion
        assert completion.token_ids[-1] == 1  # EOS, allowed once the grammar is complete
        check_follows(SPECS[i // 2], completion.text)


def test_json_object_outputs_an_object(llm):
    # Seeded sampling that happens to close its object within the budget (greedy on
    # random weights repeats one key character forever).
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS] * 4,
                           [params(Spec(json_object=True), 1.0, seed, max_tokens=60)
                            for seed in range(4) for _ in PROMPTS])
    texts = [o.outputs[0].text for o in outputs if o.outputs[0].finish_reason == "stop"]
    assert texts
    for text in texts:
        assert isinstance(json.loads(text), dict)
    for output in outputs:  # an unfinished one is a prefix of an object
        assert output.outputs[0].text.startswith("{")


def test_the_grammar_ends_the_output_even_with_ignore_eos(llm):
    spec = Spec(choice=CHOICES)
    output = llm.generate([{"prompt_token_ids": PROMPTS[0]}],
                          SamplingParams(temperature=0, max_tokens=50, ignore_eos=True,
                                         structured_outputs=spec))[0].outputs[0]
    assert output.finish_reason == "stop" and output.text in CHOICES


def test_greedy_ids_under_a_grammar_do_not_depend_on_the_batch(llm):
    spec = Spec(json=PERSON_SCHEMA)
    alone = llm.generate([{"prompt_token_ids": PROMPTS[1]}], params(spec))[0]
    others = [{"prompt_token_ids": p} for p in (PROMPTS[0], PROMPTS[2], PROMPTS[3])]
    batch = llm.generate([others[0], {"prompt_token_ids": PROMPTS[1]}, *others[1:]],
                         [params(None, max_tokens=30), params(spec),
                          params(Spec(regex=REGEX)), params(None, 1.0, 3, 25)])
    assert batch[1].outputs[0].token_ids == alone.outputs[0].token_ids
    # An unconstrained neighbour is the same as alone too.
    free = llm.generate([others[0]], params(None, max_tokens=30))[0]
    assert batch[0].outputs[0].token_ids == free.outputs[0].token_ids


def test_grammar_steps_leave_the_overlapped_path_and_the_rest_stay_on_it(tiny_llama):
    llm = LLM(str(tiny_llama), device="cpu", block_size=8)
    runner = llm.engine.model_runner
    runner.eager_overlap = True  # the real overlapped path, eagerly on the CPU
    launched: list[str] = []
    launch = runner.launch_decode

    def logged_launch(scheduler_output, previous=None):
        launched.extend(s.request_id for s in scheduler_output.scheduled)
        return launch(scheduler_output, previous)

    runner.launch_decode = logged_launch
    spec = Spec(choice=CHOICES)
    unconstrained = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    free = llm.generate([{"prompt_token_ids": PROMPTS[0]}], unconstrained)[0]
    constrained = llm.generate([{"prompt_token_ids": PROMPTS[1]}], params(spec))[0]
    launched.clear()
    mixed = llm.generate([{"prompt_token_ids": PROMPTS[0]}, {"prompt_token_ids": PROMPTS[1]}],
                         [unconstrained, params(spec)])
    assert mixed[0].outputs[0].token_ids == free.outputs[0].token_ids
    assert mixed[1].outputs[0].token_ids == constrained.outputs[0].token_ids
    check_follows(spec, mixed[1].outputs[0].text)
    assert len(constrained.outputs[0].token_ids) < 40 - 2  # the free one outlives it
    assert mixed[1].request_id not in launched  # never overlapped
    # Once the grammar's request ended, the free one went back to the overlapped path.
    assert launched.count(mixed[0].request_id) > 0


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (1.0, 11)])
def test_a_replayed_prefix_resumes_the_undisturbed_output(llm, temperature, seed):
    from kvrecover.sampling import resumed_request_seed

    spec = Spec(json=PERSON_SCHEMA)
    whole = llm.generate([{"prompt_token_ids": PROMPTS[2]}],
                         params(spec, temperature, seed))[0].outputs[0].token_ids
    cut = len(whole) // 2
    resumed_seed = None if seed is None else resumed_request_seed(seed, cut)
    rest = llm.generate(
        [{"prompt_token_ids": PROMPTS[2] + whole[:cut]}],
        params(Spec(json=PERSON_SCHEMA, replay_prompt_tokens=cut), temperature, resumed_seed,
               max_tokens=80 - cut))[0].outputs[0]
    assert whole[:cut] + rest.token_ids == whole


def test_bad_specs_and_replays_are_value_errors_and_the_engine_goes_on(llm):
    with pytest.raises(ValueError, match="structured_outputs.regex does not compile"):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], params(Spec(regex="[a-")))
    with pytest.raises(ValueError, match="resumed output does not follow the request's grammar"):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}],
                     params(Spec(choice=CHOICES, replay_prompt_tokens=3)))
    with pytest.raises(ValueError, match="replay_prompt_tokens must be shorter than the prompt"):
        llm.generate([{"prompt_token_ids": PROMPTS[2]}],
                     params(Spec(choice=CHOICES, replay_prompt_tokens=3)))
    text = llm.generate([{"prompt_token_ids": PROMPTS[0]}],
                        params(Spec(choice=CHOICES)))[0].outputs[0].text
    assert text in CHOICES


def test_a_request_ends_when_its_grammar_does_and_errs_on_a_forbidden_token(tiny_llama):
    from kvrecover.engine.request import Request, RequestStatus
    from kvrecover.structured.compiler import GrammarCompiler

    compiler = GrammarCompiler(tiny_llama, VOCAB, [1])

    def request(ignore_eos: bool) -> Request:
        params = SamplingParams(max_tokens=50, ignore_eos=ignore_eos,
                                structured_outputs=Spec(choice=["a"]))
        made = Request("r", None, [5, 6], params, frozenset({1}), 0, 512)
        made.grammar = compiler.matcher(params.structured_outputs)
        return made

    from transformers import AutoTokenizer

    (token,) = AutoTokenizer.from_pretrained(str(tiny_llama)).encode(
        "a", add_special_tokens=False)
    done = request(ignore_eos=True)
    done.append_output_token(token)
    assert not done.is_finished
    done.append_output_token(1)  # EOS completes the grammar, even under ignore_eos
    assert done.status is RequestStatus.FINISHED_STOPPED
    wrong = request(ignore_eos=False)
    wrong.append_output_token(token + 1)
    assert wrong.status is RequestStatus.FINISHED_ERROR and wrong.error_type == "internal_error"
    assert "forbids" in (wrong.error or "")
