"""Structured outputs and tool calls together with `n`, logprobs and penalties (issue 27),
through the official `openai` client against a real server on loopback: every choice
follows its own grammar and is parsed on its own, logprobs come with it, and the
tokens are the offline API's (whose penalties are checked against a reference in
tests/structured/test_structured_sampling.py)."""

from __future__ import annotations

import json

import openai
import pytest
from conftest import build_tiny_model
from serving_utils import add_chat_template, in_process_server
from structured_helpers import (
    HERMES_TEMPLATE,
    MESSAGES,
    PERSON_SCHEMA,
    TIME,
    TOOLS,
    WEATHER,
    schema_errors,
    with_template,
)

from kvrecover import LLM, SamplingParams
from kvrecover.structured.params import StructuredOutputsParams

pytestmark = pytest.mark.slow  # a server

PROMPT = "the capital of france is"
JSON_SCHEMA_FORMAT = {"type": "json_schema",
                      "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True}}
KNOBS = {"temperature": 1.0, "seed": 7, "presence_penalty": 1.5, "n": 2}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return add_chat_template(build_tiny_model(tmp_path_factory.mktemp("structured_sampling"),
                                              seed=3))


@pytest.fixture(scope="module")
def url(model_dir):
    with in_process_server(model_dir) as server_url:
        yield server_url


@pytest.fixture(scope="module")
def reference(model_dir):
    return LLM(str(model_dir))


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def offline(reference, prompt) -> list[list[int]]:
    params = SamplingParams(max_tokens=100, structured_outputs=StructuredOutputsParams(
        json=PERSON_SCHEMA), **KNOBS)
    return [c.token_ids for c in reference.generate([prompt], params)[0].outputs]


def test_n_choices_with_a_json_schema_logprobs_and_a_penalty(url, reference):
    client = sdk(url)
    whole = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=100, logprobs=2, **KNOBS,
        extra_body={"response_format": JSON_SCHEMA_FORMAT, "return_token_ids": True})
    assert [c.index for c in whole.choices] == [0, 1]
    for choice in whole.choices:
        assert choice.finish_reason == "stop"
        assert schema_errors(json.loads(choice.text), PERSON_SCHEMA) == []
        token_ids = choice.model_extra["token_ids"]
        assert len(choice.logprobs.tokens) == len(token_ids)
        # The top 2 and the sampled token (keyed by text: one entry where they meet);
        # raw logprobs, so the top ones are mostly tokens the grammar forbids.
        for token, top in zip(choice.logprobs.tokens, choice.logprobs.top_logprobs):
            assert token in top and 2 <= len(top) <= 3
        assert token_ids[-1] == 1  # EOS, allowed once the grammar is complete
        assert "".join(choice.logprobs.tokens[:-1]) == choice.text  # EOS: no text
    assert [c.model_extra["token_ids"] for c in whole.choices] == offline(reference, PROMPT)
    streamed = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=100, logprobs=2, stream=True, **KNOBS,
        extra_body={"response_format": JSON_SCHEMA_FORMAT, "return_token_ids": True})
    texts, logprobs = {0: "", 1: ""}, {0: [], 1: []}
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.logprobs is not None:
                logprobs[choice.index] += choice.logprobs.token_logprobs
    assert [texts[0], texts[1]] == [c.text for c in whole.choices]
    assert [logprobs[0], logprobs[1]] == [c.logprobs.token_logprobs for c in whole.choices]


def test_chat_n_choices_with_a_json_schema_and_logprobs(url, reference, model_dir):
    from transformers import AutoTokenizer

    answer = sdk(url).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=100,
        logprobs=True, top_logprobs=1, response_format=JSON_SCHEMA_FORMAT,
        extra_body={"return_token_ids": True}, **KNOBS)
    for choice in answer.choices:
        assert choice.finish_reason == "stop"
        assert schema_errors(json.loads(choice.message.content), PERSON_SCHEMA) == []
        assert len(choice.logprobs.content) == len(choice.model_extra["token_ids"])
    prompt_ids = AutoTokenizer.from_pretrained(model_dir).apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False)
    prompt_ids = AutoTokenizer.from_pretrained(model_dir).encode(prompt_ids,
                                                                 add_special_tokens=False)
    assert answer.model_extra["prompt_token_ids"] == prompt_ids
    assert [c.model_extra["token_ids"] for c in answer.choices] == \
        offline(reference, {"prompt_token_ids": list(prompt_ids)})


@pytest.fixture(scope="module")
def hermes_url(tmp_path_factory):
    model_dir = with_template(build_tiny_model(tmp_path_factory.mktemp("qwen_n_tools"),
                                               model_type="qwen2", seed=2), HERMES_TEMPLATE)
    with in_process_server(model_dir) as server_url:
        yield server_url


def test_required_tool_calls_of_n_choices_are_parsed_per_choice(hermes_url):
    fields = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required",
              "max_tokens": 150, "temperature": 1.0, "seed": 5, "n": 2}
    answer = sdk(hermes_url).chat.completions.create(**fields)
    calls = []
    for choice in answer.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        for call in choice.message.tool_calls:
            assert schema_errors(json.loads(call.function.arguments),
                                 SCHEMAS[call.function.name]) == []
        calls.append([(c.function.name, json.loads(c.function.arguments))
                      for c in choice.message.tool_calls])
    assert calls[0] != calls[1]  # two seeds, two answers: neither took the other's text
    assembled: dict[int, dict[int, dict]] = {0: {}, 1: {}}
    finishes = {}
    for chunk in sdk(hermes_url).chat.completions.create(stream=True, **fields):
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                entry = assembled[choice.index].setdefault(call.index, {"name": "", "args": ""})
                entry["name"] += call.function.name or ""
                entry["args"] += call.function.arguments or ""
            finishes[choice.index] = choice.finish_reason or finishes.get(choice.index)
    assert finishes == {0: "tool_calls", 1: "tool_calls"}
    assert [[(e["name"], json.loads(e["args"])) for _, e in sorted(assembled[i].items())]
            for i in (0, 1)] == calls
