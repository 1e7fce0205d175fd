"""Every JSON-schema keyword is enforced or refused (issue 41 item 3): through the offline
API on random weights, an output that ends with `stop` parses and validates with
`jsonschema`; a keyword xgrammar would drop is a ValueError (the server's 400) naming it
and its JSON path; an unsatisfiable schema is one too; no raw control character ever
appears inside a JSON string; an EBNF grammar without an end is refused at compile time."""

from __future__ import annotations

import json

import jsonschema
import pytest
from conftest import random_prompts

from kvrecover import LLM, SamplingParams
from kvrecover import StructuredOutputsParams as Spec
from kvrecover.structured.compiler import GrammarCompiler
from kvrecover.structured.schema import enforceable_schema

VOCAB = 384
PROMPTS = random_prompts(4, [9, 30, 3, 17], VOCAB, seed=5)
WORD = {"type": "string", "pattern": "^[a-z]{1,4}$"}
SMALL = {"type": "integer", "minimum": 0, "maximum": 9}


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(str(tiny_llama), device="cpu", block_size=8, max_num_batched_tokens=64)


def sample(llm: LLM, schema, seeds=range(4), max_tokens: int = 80) -> list[str]:
    """The outputs that ended under the grammar (seeded, temperature 1)."""
    outputs = llm.generate(
        [{"prompt_token_ids": PROMPTS[seed % len(PROMPTS)]} for seed in seeds],
        [SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens,
                        structured_outputs=Spec(json=schema)) for seed in seeds])
    texts = [o.outputs[0].text for o in outputs if o.outputs[0].finish_reason == "stop"]
    assert texts, [o.outputs[0].text for o in outputs]
    return texts


def assert_valid(llm: LLM, schema, **kwargs) -> list[object]:
    values = [json.loads(text) for text in sample(llm, schema, **kwargs)]
    for value in values:
        jsonschema.Draft202012Validator(schema).validate(value)
    return values


def refused(llm: LLM, schema, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}],
                     SamplingParams(max_tokens=5, structured_outputs=Spec(json=schema)))


def test_all_of_object_parts_are_merged_and_every_part_holds(llm):
    schema = {"allOf": [
        {"type": "object", "properties": {"a": SMALL}, "required": ["a"]},
        {"type": "object", "properties": {"b": WORD, "a": {"type": "integer", "minimum": 5}},
         "required": ["b"]},
    ]}
    values = assert_valid(llm, schema)
    assert all(5 <= v["a"] <= 9 and set(v) == {"a", "b"} for v in values)


@pytest.mark.parametrize("parts", [
    [{"type": "string"}, {"type": "integer"}],
    [{"const": 1}, {"const": 2}],
    [{"type": "object", "properties": {"a": {"const": 1}}, "required": ["a"]},
     {"type": "object", "properties": {"a": {"const": 2}}}],
    [{"type": "integer", "minimum": 5}, {"type": "integer", "maximum": 3}],
])
def test_an_impossible_all_of_is_refused_as_unsatisfiable(llm, parts):
    refused(llm, {"allOf": parts}, "unsatisfiable")


def test_unique_items_is_refused_naming_its_path(llm):
    schema = {"type": "object", "properties": {
        "tags": {"type": "array", "items": SMALL, "uniqueItems": True}}, "required": ["tags"]}
    refused(llm, schema, r"'uniqueItems' at \$\.properties\.tags ")
    # uniqueItems that cannot be broken (at most one item) is enforced as it is.
    assert_valid(llm, {"type": "array", "items": SMALL, "uniqueItems": True, "maxItems": 1})


def test_if_then_else_is_refused(llm):
    schema = {"type": "object", "properties": {"a": SMALL}, "if": {"required": ["a"]},
              "then": {"required": ["b"]}, "else": {}}
    refused(llm, schema, r"keyword '(if|then|else)' at \$ is not supported")


def test_dependent_required_is_refused_unless_it_cannot_be_broken(llm):
    schema = {"type": "object", "properties": {"a": SMALL, "b": WORD},
              "dependentRequired": {"a": ["b"]}}
    refused(llm, schema, r"'dependentRequired' at \$\.dependentRequired\.a ")
    # When a is required, so is b: written into required and enforced.
    schema = {**schema, "required": ["a"]}
    values = assert_valid(llm, schema)
    assert all("b" in v for v in values)


@pytest.mark.parametrize("schema, keyword", [
    ({"not": {"type": "string"}}, "not"),
    ({"type": "array", "contains": SMALL}, "contains"),
    ({"type": "object", "patternProperties": {"^x": SMALL}}, "patternProperties"),
    ({"type": "object", "propertyNames": {"maxLength": 2}}, "propertyNames"),
    ({"type": "number", "multipleOf": 0.5}, "multipleOf"),
    ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, "maxLength"),
    ({"type": "string", "pattern": "a\\tb"}, "pattern"),
    ({"type": "string", "pattern": 'a"b'}, "pattern"),
    ({"type": "string", "format": "shoe-size"}, "format"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),
    ({"type": "object", "minProperties": 1}, "minProperties"),
    ({"type": "object", "dependentSchemas": {"a": {}}}, "dependentSchemas"),
    ({"type": "array", "items": [SMALL]}, "items"),
    ({"$ref": "https://example.com/s.json"}, r"\$ref"),
])
def test_a_keyword_xgrammar_would_drop_is_refused_by_name(llm, schema, keyword):
    refused(llm, schema, f"keyword '{keyword}' at \\$")


def test_annotations_are_ignored_and_the_rest_enforced(llm):
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": "x",
              "title": "t", "description": "d", "$comment": "c", "examples": [{}],
              "type": "object", "properties": {"a": {**SMALL, "default": 3, "deprecated": True,
                                                     "readOnly": True, "writeOnly": False}},
              "required": ["a"]}
    assert_valid(llm, schema)


@pytest.mark.parametrize("schema", [
    {"type": "string", "enum": ["ab", 1, None]},  # xgrammar wrote 1 and null too
    {"type": "object", "properties": {"a": SMALL}, "required": ["a", "b"]},  # b was dropped
    {"type": "array", "items": {"minimum": 3, "maximum": 4}, "minItems": 1, "maxItems": 2},
    {"oneOf": [{"type": "boolean"}, {"type": "null"}]},
    {"type": ["integer", "boolean"], "minimum": 3, "maximum": 4},
    {"enum": [{"a": 1}, [1, 2]]},
    {"$defs": {"w": WORD}, "type": "object", "properties": {"x": {"$ref": "#/$defs/w"}},
     "required": ["x"]},
])
def test_outputs_validate_where_xgrammar_alone_broke_the_schema(llm, schema):
    assert_valid(llm, schema)


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": SMALL}, "required": ["b"],
     "additionalProperties": False},
    {"type": "string", "const": 1},
    # additionalProperties beside allOf sees none of its parts' properties: a is banned.
    {"allOf": [{"type": "object", "properties": {"a": SMALL}, "required": ["a"]}],
     "additionalProperties": False},
    {"type": "integer", "exclusiveMinimum": 2, "exclusiveMaximum": 3},
    {"type": "array", "items": False, "minItems": 1},
    {"anyOf": [{"type": "string", "minLength": 3, "maxLength": 2}, False]},
])
def test_an_unsatisfiable_schema_is_refused(llm, schema):
    refused(llm, schema, "unsatisfiable")


def test_no_raw_control_character_inside_a_json_string(llm):
    # A length-bounded string was [^"\\\r\n]{0,8} in xgrammar: U+0000-U+001F written raw.
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 8},
                                               "t": {"type": "string", "minLength": 1,
                                                     "maxLength": 6}},
              "required": ["s", "t"], "additionalProperties": False}
    values = assert_valid(llm, schema, seeds=range(24), max_tokens=60)
    assert len(values) >= 12


def test_the_control_character_grammar_bans_them_in_every_string(tiny_llama):
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from kvrecover.structured.compiler import json_grammar

    grammar = xgr.Grammar.from_ebnf(json_grammar(enforceable_schema(
        {"type": "array", "prefixItems": [{"type": "string", "maxLength": 3},
                                          {"type": "string", "minLength": 1},
                                          {"type": "string"}], "items": False})))
    assert accepts(grammar, '["ab", "c", "d"]')
    for raw in ("\x00", "\x01", "\t", "\x1f", "\n"):
        for index in range(3):
            strings = ['"a"'] * 3
            strings[index] = f'"a{raw}"'
            assert not accepts(grammar, f"[{', '.join(strings)}]"), (raw, index)


@pytest.mark.parametrize("grammar", ["root ::= root", 'root ::= "a" root',
                                     'root ::= "x" e\ne ::= e "y"'])
def test_a_grammar_without_an_end_is_refused_at_compile_time(tiny_llama, llm, grammar):
    compiler = GrammarCompiler(tiny_llama, VOCAB, [1])
    with pytest.raises(ValueError, match="structured_outputs.grammar does not compile: no "
                                         "finite string"):
        compiler.compile(Spec(grammar=grammar))
    with pytest.raises(ValueError, match="no finite string"):  # before any step
        llm.generate([{"prompt_token_ids": PROMPTS[0]}],
                     SamplingParams(max_tokens=5, structured_outputs=Spec(grammar=grammar)))
    # Grammars that do end still compile.
    compiler.compile(Spec(grammar='root ::= a\na ::= "x" a | "y"'))
    compiler.compile(Spec(grammar='root ::= "a" [b-c]* ("d" | e)?\ne ::= e "x"'))


@pytest.mark.parametrize("string", [{"maxLength": 2}, {"pattern": "^.{0,2}$"},
                                    {"pattern": "^[^a]{0,2}$"}])
def test_no_surrogate_bytes_inside_a_json_string(llm, string):
    # xgrammar's string characters admitted the UTF-8 bytes of a surrogate (ED A7 AD
    # here): '["|\ufffd\ufffd\ufffd"]', four characters where maxLength is 2.
    schema = {"type": "array", "items": {"type": "string", **string},
              "minItems": 1, "maxItems": 1}
    prompts = random_prompts(2, [7, 19], VOCAB, seed=9)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts] * 4, [
        SamplingParams(temperature=1.0, seed=seed + i, max_tokens=60,
                       structured_outputs=Spec(json=schema)) for seed in range(4) for i in (0, 1)])
    for output in outputs:
        text = output.outputs[0].text
        assert "\ufffd" not in text
        if output.outputs[0].finish_reason == "stop":
            jsonschema.Draft202012Validator(schema).validate(json.loads(text))
