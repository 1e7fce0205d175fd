"""Tool-call parsers (Hermes `<tool_call>`, Llama 3 JSON), whole and streamed, and how a
checkpoint's parser is chosen."""

from __future__ import annotations

import json

import pytest

from kvrecover.entrypoints.openai.tool_parsers import (
    ToolCallStream,
    choose_parser,
    parse_tool_calls,
)

HERMES = ('I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
          '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
LLAMA = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
         '{"name": "get_time", "parameters": {}}')


def calls_of(calls) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in calls]


EXPECTED = [("get_weather", {"city": "Paris"}), ("get_time", {})]


@pytest.mark.parametrize("parser, text, content", [
    ("hermes", HERMES, "I will check."), ("llama3_json", LLAMA, None),
    ("llama3_json", LLAMA.replace("<|python_tag|>", "  "), None)])
def test_whole_outputs_give_their_calls_and_content(parser, text, content):
    found_content, calls = parse_tool_calls(parser, text)
    assert found_content == content and calls_of(calls) == EXPECTED
    assert len({call.id for call in calls}) == 2 and calls[0].id.startswith("call_")


@pytest.mark.parametrize("parser, text", [
    ("hermes", "no calls here"), ("hermes", "<tool_call>{not json}</tool_call>"),
    ("llama3_json", "plain text {"), ("llama3_json", '{"name": "f", "parameters": {'),
    ("llama3_json", '{"city": "Paris"}')])
def test_text_that_is_not_calls_stays_content(parser, text):
    assert parse_tool_calls(parser, text) == (text, [])


@pytest.mark.parametrize("parser, text", [("hermes", HERMES), ("llama3_json", LLAMA),
                                          ("hermes", "plain <tool text"),
                                          ("llama3_json", "plain text")])
@pytest.mark.parametrize("piece", [1, 3, 7])
def test_streamed_pieces_give_the_same_calls(parser, text, piece):
    stream = ToolCallStream(parser)
    content, calls = [], []
    for start in range(0, len(text), piece):
        more_content, more = stream.feed(text[start:start + piece])
        content.append(more_content)
        calls += more
    more_content, more = stream.finish()
    whole_content, whole_calls = parse_tool_calls(parser, text)
    assert calls_of(calls + more) == calls_of(whole_calls)
    assert "".join(content).strip() + more_content.strip() == (whole_content or "").strip()


def test_a_hermes_call_is_sent_as_soon_as_it_closes():
    stream = ToolCallStream("hermes")
    assert stream.feed("Hi <tool") == ("Hi ", [])  # a partial tag is held back
    assert stream.feed('_call>{"name": "f", "arguments": {}}') == ("", [])
    content, calls = stream.feed("</tool_call>")
    assert content == "" and calls_of(calls) == [("f", {})]


@pytest.mark.parametrize("template, model_type, parser", [
    ("{% for t in tools %}<tool_call>{% endfor %}", "llama", "hermes"),
    ('{% if tools %}{"name": function name, "parameters": ...}{% endif %}', "llama",
     "llama3_json"),
    ("<|python_tag|>", None, "llama3_json"),
    ("{{ messages }}", "qwen2", "hermes"),
    ("{{ messages }}", "llama", None),
    (None, None, None),
])
def test_the_parser_follows_the_template_then_the_family(template, model_type, parser):
    assert choose_parser(template, model_type) == parser
