"""A property of structured outputs over generated JSON schemas (objects with typed
properties, required, enums, consts, arrays with minItems/maxItems, nesting, allOf merges,
anyOf, and now and then a keyword that cannot be enforced): sampled on random weights
at temperature 1, a schema is either refused with a ValueError that names a keyword or
says it is unsatisfiable, or every output that ends parses and validates with
`jsonschema`."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from conftest import random_prompts
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrecover import LLM, SamplingParams
from kvrecover import StructuredOutputsParams as Spec

VOCAB = 384
PROMPTS = random_prompts(2, [7, 19], VOCAB, seed=9)
NAMES = ["a", "b", "c"]
SCALARS = st.one_of(st.integers(-3, 12), st.sampled_from(["x", "yz", "", "a\nb"]),
                    st.booleans(), st.none())
REFUSAL = re.compile(r"keyword '[^']+' at \$|unsatisfiable")


@st.composite
def integers(draw):
    schema = {"type": "integer"}
    for key in draw(st.lists(st.sampled_from(["minimum", "maximum", "exclusiveMinimum",
                                              "exclusiveMaximum"]), max_size=2, unique=True)):
        schema[key] = draw(st.integers(-2, 12))
    if "minimum" not in schema and "exclusiveMinimum" not in schema:
        schema["minimum"] = 0  # bounded: random weights end it
    if "maximum" not in schema and "exclusiveMaximum" not in schema:
        schema["maximum"] = draw(st.integers(0, 99))
    return schema


LEAVES = st.one_of(
    integers(),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.builds(lambda n, m: {"type": "string", "pattern": f"^[a-z]{{{n},{n + m}}}$"},
              st.integers(0, 2), st.integers(0, 3)),
    st.builds(lambda low, high: {"type": "string", "minLength": low, "maxLength": high},
              st.integers(0, 2), st.integers(0, 5)),
    st.builds(lambda values: {"enum": values}, st.lists(SCALARS, min_size=1, max_size=4)),
    st.builds(lambda value: {"const": value}, SCALARS),
    st.builds(lambda kind, values: {"type": kind, "enum": values},
              st.sampled_from(["string", "integer", "boolean"]),
              st.lists(SCALARS, min_size=1, max_size=4)),
    st.sampled_from([{"type": "array", "items": {"type": "integer", "minimum": 0,
                                                 "maximum": 3}, "uniqueItems": True},
                     {"not": {"type": "null"}}, {"type": "number", "multipleOf": 0.5}]),
)


def objects(children):
    return st.builds(
        lambda properties, required, closed: {
            "type": "object", "properties": properties, "required": required,
            **({"additionalProperties": False} if closed else {})},
        st.dictionaries(st.sampled_from(NAMES), children, min_size=1, max_size=3),
        st.lists(st.sampled_from(NAMES), max_size=3, unique=True), st.booleans())


def extend(children):
    return st.one_of(
        objects(children),
        st.builds(lambda items, low, extra: {"type": "array", "items": items, "minItems": low,
                                             "maxItems": low + extra},
                  children, st.integers(0, 2), st.integers(-1, 2)),
        st.builds(lambda parts: {"allOf": parts}, st.lists(objects(children), min_size=2,
                                                           max_size=2)),
        st.builds(lambda parts: {"allOf": parts}, st.lists(children, min_size=1, max_size=2)),
        st.builds(lambda parts: {"anyOf": parts}, st.lists(children, min_size=1, max_size=3)),
    )


SCHEMAS = st.recursive(LEAVES, extend, max_leaves=6)


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(str(tiny_llama), device="cpu", block_size=8, max_num_batched_tokens=64)


def test_generated_schemas_are_refused_by_keyword_or_their_outputs_validate(llm):
    counts = {"refused": 0, "validated": 0, "unfinished": 0}

    @settings(derandomize=True, database=None, deadline=None, max_examples=60,
              suppress_health_check=list(HealthCheck))
    @given(SCHEMAS, st.integers(0, 2**16))
    def check(schema, seed):
        params = [SamplingParams(temperature=1.0, seed=seed + i, max_tokens=60,
                                 structured_outputs=Spec(json=schema)) for i in range(2)]
        try:
            outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        except ValueError as error:
            assert REFUSAL.search(str(error)), str(error)
            counts["refused"] += 1
            return
        validator = jsonschema.Draft202012Validator(schema)
        for output in outputs:
            completion = output.outputs[0]
            if completion.finish_reason != "stop":
                assert len(completion.token_ids) == 60
                counts["unfinished"] += 1
                continue
            value = json.loads(completion.text)  # a raw control character would fail here
            validator.validate(value)
            counts["validated"] += 1

    check()
    # The generator reaches both outcomes, and most outputs end within the budget.
    assert counts["refused"] >= 3 and counts["validated"] >= 15, counts
