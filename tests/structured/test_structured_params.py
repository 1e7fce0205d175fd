"""StructuredOutputsParams: one grammar per request, of the right shape, cached by spec."""

from __future__ import annotations

import pytest

from kvrecover import SamplingParams
from kvrecover.structured.params import StructuredOutputsParams


def test_exactly_one_kind():
    with pytest.raises(ValueError, match="exactly one of json, regex, choice, grammar, "
                                         "json_object; got none"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="got json, regex"):
        StructuredOutputsParams(json={"type": "object"}, regex="a+")


@pytest.mark.parametrize("fields, message", [
    ({"json": 5}, "json must be a JSON schema"),
    ({"choice": []}, "choice must be a non-empty list"),
    ({"choice": ["a", 3]}, "choice must be a non-empty list of non-empty strings"),
    ({"regex": ""}, "regex must be a non-empty string"),
    ({"grammar": ["root"]}, "grammar must be a non-empty string"),
    ({"json_object": 1}, "json_object must be true"),
    ({"regex": "a", "replay_prompt_tokens": -1}, "replay_prompt_tokens must be an integer"),
])
def test_bad_shapes_are_value_errors(fields, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**fields)


def test_the_cache_key_is_the_canonical_spec():
    a = StructuredOutputsParams(json={"type": "object", "required": ["x"]})
    b = StructuredOutputsParams(json={"required": ["x"], "type": "object"},
                                replay_prompt_tokens=4)
    assert a.cache_key() == b.cache_key() == ("json", '{"required":["x"],"type":"object"}')
    assert a == b  # the replay count is not part of the grammar
    assert StructuredOutputsParams(choice=["a", "b"]).cache_key() == ("choice", '["a", "b"]')
    assert StructuredOutputsParams(json_object=True).kind == "json_object"


def test_sampling_params_take_a_dict_and_reject_unknown_fields():
    params = SamplingParams(structured_outputs={"regex": "[0-9]+"})
    assert params.structured_outputs == StructuredOutputsParams(regex="[0-9]+")
    with pytest.raises(ValueError, match="unknown field 'guided_json'"):
        SamplingParams(structured_outputs={"guided_json": {}})
    with pytest.raises(ValueError, match="structured_outputs must be"):
        SamplingParams(structured_outputs="[0-9]+")
