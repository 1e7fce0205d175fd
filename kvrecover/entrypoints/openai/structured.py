"""A request's structured-output fields -> the engine's `StructuredOutputsParams`.

OpenAI's `response_format` (`{"type": "text"}`, `{"type": "json_object"}`,
`{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`) and vLLM's
`structured_outputs` (`json`, `regex`, `choice`, `grammar`, `json_object`), on
completions and chat alike; at most one of the two. A field of the wrong shape is a
400 naming it here; a spec that does not compile is a 400 from the engine.
"""

from __future__ import annotations

from typing import Any

from kvrecover.entrypoints.openai.protocol import ApiError
from kvrecover.structured.params import KINDS, StructuredOutputsParams

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")


def structured_outputs_of(response_format: Any, structured_outputs: Any
                          ) -> StructuredOutputsParams | None:
    """The grammar that a request's `response_format` or `structured_outputs` asks for."""
    if response_format is not None and structured_outputs is not None:
        raise ApiError(400, "give response_format or structured_outputs, not both",
                       param="structured_outputs")
    if structured_outputs is not None:
        return _from_structured_outputs(structured_outputs)
    if response_format is not None:
        return _from_response_format(response_format)
    return None


def _from_structured_outputs(value: Any) -> StructuredOutputsParams:
    if not isinstance(value, dict):
        raise ApiError(400, f"structured_outputs must be an object with one of "
                            f"{', '.join(KINDS)}", param="structured_outputs")
    given = {key: item for key, item in value.items() if item is not None}
    unknown = sorted(set(given) - set(KINDS))
    if unknown:
        raise ApiError(400, f"structured_outputs: unknown field {unknown[0]!r}; the fields "
                            f"are {', '.join(KINDS)}", param=f"structured_outputs.{unknown[0]}")
    try:
        return StructuredOutputsParams(**given)
    except ValueError as error:
        raise ApiError(400, str(error), param="structured_outputs") from error


def _from_response_format(value: Any) -> StructuredOutputsParams | None:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in RESPONSE_FORMAT_TYPES:
        raise ApiError(400, f"response_format.type must be one of "
                            f"{', '.join(RESPONSE_FORMAT_TYPES)}, got {kind!r:.80}",
                       param="response_format.type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    spec = value.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise ApiError(400, "response_format.json_schema.schema must be a JSON schema object",
                       param="response_format.json_schema.schema")
    return StructuredOutputsParams(json=schema)
