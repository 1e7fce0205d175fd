"""Issue 41 item 3 through a real server: a `response_format` json_schema keyword that
cannot be enforced, an unsatisfiable schema and an EBNF grammar without an end are 400s
that name the problem (compiled before any step), and what is enforced validates."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from conftest import build_tiny_model
from serving_utils import add_chat_template, in_process_server

pytestmark = pytest.mark.slow  # a server

PROMPT = "the capital of france is"
SMALL = {"type": "integer", "minimum": 0, "maximum": 9}


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    model_dir = add_chat_template(build_tiny_model(tmp_path_factory.mktemp("schema"), seed=3))
    with in_process_server(model_dir) as server_url:
        yield server_url


def post(url: str, **fields) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=60,
                      json={"prompt": PROMPT, "max_tokens": 60, "temperature": 1.0, "seed": 1,
                            **fields})


def schema_format(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


@pytest.mark.parametrize("schema, message", [
    ({"type": "array", "items": SMALL, "uniqueItems": True}, "'uniqueItems' at $"),
    ({"type": "object", "properties": {"a": SMALL}, "if": {"required": ["a"]},
      "then": {"required": ["b"]}}, "keyword 'if' at $"),
    ({"type": "object", "properties": {"a": SMALL, "b": SMALL},
      "dependentRequired": {"a": ["b"]}}, "'dependentRequired' at $.dependentRequired.a"),
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "unsatisfiable"),
    ({"allOf": [{"const": 1}, {"const": 2}]}, "unsatisfiable"),
])
def test_a_schema_that_cannot_be_enforced_is_a_400_naming_why(url, schema, message):
    response = post(url, response_format=schema_format(schema))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["param"] == "response_format"


def test_a_grammar_without_an_end_is_a_400(url):
    response = post(url, structured_outputs={"grammar": "root ::= root"})
    assert response.status_code == 400, response.text
    assert "no finite string" in response.json()["error"]["message"]


def test_a_merged_all_of_and_bounded_strings_validate(url):
    schema = {"allOf": [
        {"type": "object", "properties": {"a": SMALL, "s": {"type": "string", "maxLength": 5}},
         "required": ["a", "s"]},
        {"type": "object", "properties": {"a": {"type": "integer", "minimum": 4}}}]}
    for seed in range(4):
        response = post(url, response_format=schema_format(schema), seed=seed)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        if choice["finish_reason"] == "stop":
            jsonschema.Draft202012Validator(schema).validate(json.loads(choice["text"]))
