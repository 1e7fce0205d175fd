"""Tool calls through the official `openai` client against real servers on loopback, for
two families: a Qwen-style checkpoint (Hermes `<tool_call>` template, parser chosen from
it) and a Llama-3-style one (JSON calls, `llama3_json`). Random weights never call a tool
by themselves, so `auto` is driven by a grammar that writes the family's call text;
`required` and a named function are enforced by the server's own grammar."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from conftest import build_tiny_model
from serving_utils import in_process_server
from structured_helpers import (
    CALL_TEXT,
    HERMES_TEMPLATE,
    LLAMA3_TEMPLATE,
    MESSAGES,
    TIME,
    TOOLS,
    WEATHER,
    schema_errors,
    with_template,
)

pytestmark = pytest.mark.slow  # servers

@pytest.fixture(scope="module", params=["hermes", "llama3_json"])
def family(request, tmp_path_factory):
    """(parser, server URL, model dir): a tiny Qwen2 with the Hermes template (parser
    chosen automatically) or a tiny Llama with the Llama 3 template (parser given)."""
    if request.param == "hermes":
        model_dir = with_template(build_tiny_model(tmp_path_factory.mktemp("qwen_tools"),
                                                   model_type="qwen2", seed=2), HERMES_TEMPLATE)
        options = {}
    else:
        model_dir = with_template(build_tiny_model(tmp_path_factory.mktemp("llama_tools"),
                                                   seed=3), LLAMA3_TEMPLATE)
        options = {"tool_call_parser": "llama3_json"}
    with in_process_server(model_dir, **options) as url:
        yield request.param, url, model_dir


SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def chat(url: str, stream: bool = False, **fields):
    return sdk(url).chat.completions.create(
        model="tiny", messages=fields.pop("messages", MESSAGES), tools=TOOLS, temperature=0,
        max_tokens=120, stream=stream, **fields)


def streamed(url: str, **fields) -> tuple[str, list[dict], str | None, int]:
    """(content, tool calls assembled from their deltas, finish reason, chunks)."""
    content, calls, finish, chunks = [], {}, None, 0
    for chunk in chat(url, stream=True, **fields):
        chunks += 1
        delta = chunk.choices[0].delta
        content.append(delta.content or "")
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = call.id or entry["id"]
            if call.function is not None:
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return "".join(content), [calls[i] for i in sorted(calls)], finish, chunks


def test_auto_calls_are_parsed_whole_and_streamed(family):
    parser, url, _ = family
    force = {"extra_body": {"structured_outputs": {"choice": [CALL_TEXT[parser]]}}}
    answer = chat(url, **force).choices[0]
    assert answer.finish_reason == "tool_calls"
    assert answer.message.content is None
    (call,) = answer.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Oslo", "days": 2}
    content, calls, finish, _ = streamed(url, **force)
    assert finish == "tool_calls" and content.strip() == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == \
        [("get_weather", {"city": "Oslo", "days": 2})]
    assert calls[0]["id"].startswith("call_")


def test_auto_text_without_calls_is_content(family):
    _, url, _ = family
    answer = chat(url, extra_body={"structured_outputs": {"choice": ["It is sunny."]}})
    assert answer.choices[0].message.content == "It is sunny."
    assert answer.choices[0].message.tool_calls is None
    assert answer.choices[0].finish_reason == "stop"
    content, calls, finish, _ = streamed(
        url, extra_body={"structured_outputs": {"choice": ["It is sunny."]}})
    assert (content, calls, finish) == ("It is sunny.", [], "stop")


def test_required_makes_valid_calls(family):
    _, url, _ = family
    answer = chat(url, tool_choice="required").choices[0]
    assert answer.finish_reason == "tool_calls" and answer.message.tool_calls
    for call in answer.message.tool_calls:
        assert schema_errors(json.loads(call.function.arguments),
                             SCHEMAS[call.function.name]) == []
    content, calls, finish, _ = streamed(url, tool_choice="required")
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in answer.message.tool_calls]


def test_a_named_function_is_called_and_its_arguments_stream_in_fragments(family):
    _, url, _ = family
    choice = {"type": "function", "function": {"name": "get_time"}}
    answer = chat(url, tool_choice=choice).choices[0]
    (call,) = answer.message.tool_calls
    assert call.function.name == "get_time" and answer.finish_reason == "tool_calls"
    assert schema_errors(json.loads(call.function.arguments), TIME) == []
    content, calls, finish, chunks = streamed(url, tool_choice=choice)
    assert finish == "tool_calls" and chunks > 3  # the arguments came in pieces
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_time", call.function.arguments)]


def test_tools_and_tool_results_render_through_the_template(family):
    from transformers import AutoTokenizer

    _, url, model_dir = family
    messages = [*MESSAGES,
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {
                        "name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    answer = sdk(url).chat.completions.create(
        model="tiny", messages=messages, tools=TOOLS, max_tokens=2, temperature=0,
        extra_body={"return_token_ids": True})
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    rendered = [*MESSAGES, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}}]},
        {"role": "tool", "content": "sunny, 21 C", "tool_call_id": "call_1"}]
    text = tokenizer.apply_chat_template(rendered, tools=TOOLS, tokenize=False,
                                         add_generation_prompt=True)
    assert "sunny, 21 C" in text and '"get_weather"' in text and '"Paris"' in text
    assert answer.model_extra["prompt_token_ids"] == tokenizer.encode(text,
                                                                      add_special_tokens=False)
    # tool_choice="none": the tools stay out of the prompt and no call is parsed.
    none = sdk(url).chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=2,
        temperature=0, extra_body={"return_token_ids": True})
    plain = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert none.model_extra["prompt_token_ids"] == tokenizer.encode(plain,
                                                                    add_special_tokens=False)


@pytest.mark.parametrize("fields, param, message", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "names the function 'nope', which is not one of the tools"),
    ({"tool_choice": "sometimes"}, "tool_choice", "tool_choice must be 'none', 'auto'"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]},
     "tools[0].function.name", "must be 1 to 64 letters"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]", "must be {'type': 'function'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
     "tools[0].function.parameters", "must be a JSON schema object"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools", "distinct function names"),
    ({"tools": [{"type": "function", "function": {"name": "f",
                                                  "parameters": {"type": "nope"}}}],
      "tool_choice": "required"}, "tool_choice", "structured_outputs.json does not compile"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice", "tool_choice needs tools"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot be combined"),
    ({"messages": [{"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[0].tool_calls[0].function.arguments", "must be JSON text"),
])
def test_bad_tools_are_400s_and_the_server_goes_on(family, fields, param, message):
    _, url, _ = family
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 3, **fields}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"]
    still = chat(url, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert still.choices[0].finish_reason == "tool_calls"
