"""Shared by the structured-output and tool-call tests: bounded schemas (random weights
must still end their output), two families' chat templates with tool support, and a
small JSON-schema checker (`jsonschema` is not a dependency)."""

from __future__ import annotations

import json
import re
from pathlib import Path
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


# Qwen 2.5's layout in miniature: tools in the system turn, calls in <tool_call> tags,
# tool results in <tool_response> tags of a user turn.
HERMES_TEMPLATE = (
    "{%- if tools %}<s>system: # Tools\n<tools>\n{%- for tool in tools %}\n{{ tool | tojson }}"
    "{%- endfor %}\n</tools>\nFor each call return <tool_call>{\"name\": ..., \"arguments\": "
    "...}</tool_call>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<s>assistant:"
    "{%- for call in m.tool_calls %}\n<tool_call>\n{{ {'name': call.function.name, "
    "'arguments': call.function.arguments} | tojson }}\n</tool_call>{%- endfor %}\n"
    "{%- elif m.role == 'tool' %}<s>user: <tool_response>\n{{ m.content }}\n</tool_response>\n"
    "{%- else %}<s>{{ m.role }}: {{ m.content }}\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<s>assistant:{% endif %}"
)
# Llama 3.1's layout in miniature: JSON calls with "parameters", results as ipython turns.
LLAMA3_TEMPLATE = (
    "{%- if tools %}<s>system: Environment: ipython\nRespond with a JSON function call in "
    "the format {\"name\": function name, \"parameters\": dictionary of argument name and "
    "its value}.\n{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<s>assistant: "
    "{{ {'name': m.tool_calls[0].function.name, "
    "'parameters': m.tool_calls[0].function.arguments} | tojson }}\n"
    "{%- elif m.role == 'tool' %}<s>ipython: {{ m.content }}\n"
    "{%- else %}<s>{{ m.role }}: {{ m.content }}\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<s>assistant:{% endif %}"
)
WEATHER = {"type": "object",
           "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
MESSAGES = [{"role": "user", "content": "weather in paris?"}]
CALL_TEXT = {  # what each family's model writes for one call
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}'
              '\n</tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}',
}


def with_template(model_dir: Path, template: str) -> Path:
    path = model_dir / "tokenizer_config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "chat_template": template}))
    return model_dir


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
