"""Structured outputs through the official `openai` client against a real server on
loopback: `response_format` and vLLM's `structured_outputs` on completions and chat
give outputs that parse and validate (random weights: only the grammar makes them),
identical ids alone and in a batch, and bad specs are 400s while the server goes on."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from conftest import build_tiny_model
from serving_utils import add_chat_template, in_process_server
from structured_helpers import CHOICES, GRAMMAR, PERSON_SCHEMA, REGEX, schema_errors

pytestmark = pytest.mark.slow  # a server

PROMPT = "the capital of france is"
MESSAGES = [{"role": "user", "content": "describe a person"}]
JSON_SCHEMA_FORMAT = {"type": "json_schema",
                      "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    model_dir = add_chat_template(build_tiny_model(tmp_path_factory.mktemp("structured"),
                                                   seed=3))
    with in_process_server(model_dir) as server_url:
        yield server_url


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def completion(url: str, **fields) -> openai.types.Completion:
    extra = {key: fields.pop(key) for key in ("structured_outputs", "response_format")
             if key in fields}
    return sdk(url).completions.create(model="tiny", prompt=fields.pop("prompt", PROMPT),
                                       max_tokens=fields.pop("max_tokens", 100), temperature=0,
                                       extra_body={**extra, "return_token_ids": True}, **fields)


def test_json_schema_completions_and_chat_parse_and_validate(url):
    text = completion(url, response_format=JSON_SCHEMA_FORMAT).choices[0].text
    assert schema_errors(json.loads(text), PERSON_SCHEMA) == []
    chat = sdk(url).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=100,
                                            temperature=0, response_format=JSON_SCHEMA_FORMAT)
    assert chat.choices[0].finish_reason == "stop"
    assert schema_errors(json.loads(chat.choices[0].message.content), PERSON_SCHEMA) == []
    streamed = sdk(url).chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=100, temperature=0, stream=True,
        response_format=JSON_SCHEMA_FORMAT)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed)
    assert text == chat.choices[0].message.content


def test_vllm_structured_outputs_regex_choice_grammar_and_json(url):
    assert re.fullmatch(REGEX, completion(url, structured_outputs={"regex": REGEX})
                        .choices[0].text)
    assert completion(url, structured_outputs={"choice": CHOICES}).choices[0].text in CHOICES
    text = completion(url, structured_outputs={"grammar": GRAMMAR}).choices[0].text
    assert re.fullmatch(r"\([0-9](\+[0-9])?\)", text)
    text = completion(url, structured_outputs={"json": json.dumps(PERSON_SCHEMA)}).choices[0].text
    assert schema_errors(json.loads(text), PERSON_SCHEMA) == []
    seeded = sdk(url).chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=60, temperature=1.0, seed=4,
        extra_body={"structured_outputs": {"regex": REGEX}})
    assert re.fullmatch(REGEX, seeded.choices[0].message.content)


def test_greedy_ids_under_a_grammar_are_the_same_alone_and_in_a_batch(url):
    def ids(fields: dict) -> list[int]:
        return completion(url, **fields).choices[0].model_extra["token_ids"]

    constrained = {"response_format": JSON_SCHEMA_FORMAT, "prompt": "hello, my name is"}
    alone = ids(constrained)
    others = [{"prompt": PROMPT, "max_tokens": 40}, {"structured_outputs": {"regex": REGEX}},
              {"prompt": "the quick brown fox", "structured_outputs": {"choice": CHOICES}}]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(ids, [others[0], constrained, *others[1:]] * 2))
    assert results[1] == results[5] == alone


@pytest.mark.parametrize("fields, message", [
    ({"response_format": {"type": "yaml"}}, "response_format.type must be one of"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema must be a JSON schema object"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "structured_outputs.json does not compile"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex does not compile"),
    ({"structured_outputs": {"grammar": "root ::= ("}},
     "structured_outputs.grammar does not compile"),
    ({"structured_outputs": {"choice": []}}, "choice must be a non-empty list"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one of"),
    ({"structured_outputs": {"guided_json": {}}}, "unknown field 'guided_json'"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
     "not both"),
])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_bad_structured_outputs_are_400s_and_the_server_goes_on(url, fields, message, path):
    body = {"prompt": PROMPT} if path == "/v1/completions" else {"messages": MESSAGES}
    response = httpx.post(f"{url}{path}", timeout=60,
                          json={**body, "max_tokens": 5, "temperature": 0, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and message in error["message"]
    assert error["param"].split(".")[0] in fields  # the field the client sent
    assert completion(url, structured_outputs={"choice": CHOICES}).choices[0].text in CHOICES
