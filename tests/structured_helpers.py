"""Shared by the structured-output tests: bounded schemas (random weights must still end
their output) and a small JSON-schema checker (`jsonschema` is not a dependency)."""

from __future__ import annotations

import re
from typing import Any

# Every string and number is bounded, so even random weights complete an instance. (A
# string bounded by `maxLength` instead of a pattern would admit raw control characters
# in xgrammar 0.2.9: JSON that does not parse.)
PERSON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "admin": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                 "maxItems": 3},
    },
    "required": ["name", "age", "admin", "color", "tags"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,5}-[0-9]{3}"
CHOICES = ["positive", "negative", "neutral"]
GRAMMAR = 'root ::= "(" [0-9] ("+" [0-9])? ")"'


def schema_errors(value: Any, schema: dict[str, Any], path: str = "$") -> list[str]:
    """What makes `value` fail `schema` (the keywords PERSON_SCHEMA and the tool schemas
    of the tests use); empty when it validates."""
    errors: list[str] = []
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} not in {schema['enum']}")
    if "const" in schema and value != schema["const"]:
        errors.append(f"{path}: {value!r} != {schema['const']!r}")
    kind = schema.get("type")
    checks = {"object": dict, "array": list, "string": str, "boolean": bool}
    if kind == "integer":
        if not isinstance(value, int) or isinstance(value, bool):
            return errors + [f"{path}: {value!r} is not an integer"]
        if value < schema.get("minimum", value) or value > schema.get("maximum", value):
            errors.append(f"{path}: {value} out of range")
    elif kind in checks and not isinstance(value, checks[kind]):
        return errors + [f"{path}: {value!r} is not {kind}"]
    if kind == "string" and len(value) > schema.get("maxLength", len(value)):
        errors.append(f"{path}: {value!r} is too long")
    if kind == "string" and not re.search(schema.get("pattern", ""), value):
        errors.append(f"{path}: {value!r} does not match {schema['pattern']!r}")
    if kind == "array":
        if len(value) > schema.get("maxItems", len(value)):
            errors.append(f"{path}: too many items")
        for i, item in enumerate(value):
            errors += schema_errors(item, schema.get("items", {}), f"{path}[{i}]")
    if kind == "object":
        properties = schema.get("properties", {})
        errors += [f"{path}: {key!r} missing" for key in schema.get("required", [])
                   if key not in value]
        for key, item in value.items():
            if key in properties:
                errors += schema_errors(item, properties[key], f"{path}.{key}")
            elif schema.get("additionalProperties") is False:
                errors.append(f"{path}: unexpected {key!r}")
    return errors
