"""A request's JSON schema -> one that xgrammar 0.2.9 enforces exactly, or a ValueError.

xgrammar drops many keywords silently (`allOf`, `not`, `uniqueItems`, `if`/`then`/`else`,
`dependentRequired`, `contains`, `patternProperties`, `multipleOf` on numbers, a length
beside a `pattern`, an `enum` value of the wrong `type`, a `required` key without a
property, ...), so its output could break the schema and still end with `stop`.
`enforceable_schema` walks the schema once and returns an equivalent one made only of
what xgrammar enforces: `allOf` parts merged (their conflicts are an unsatisfiable
schema), a `type` list split into an `anyOf`, `enum`/`const` values filtered by `type`
and spelled out as schemas, a `oneOf` of disjoint types read as an `anyOf`. Every other
keyword that constrains the value is a ValueError naming it and its JSON path (the
server's 400); so is a schema that no value satisfies. Annotations are dropped.

The result may be narrower than the schema (xgrammar's strict mode: no properties beyond
`properties` unless `additionalProperties` allows them, no items beyond `prefixItems`;
a schema without `type` takes the one type its keywords speak of): every output it
admits still validates against the request's schema.
"""

from __future__ import annotations

import json
import math
from typing import Any

ANNOTATIONS = frozenset({
    "title", "description", "$comment", "examples", "default", "deprecated", "readOnly",
    "writeOnly", "$schema", "$id"})
TYPES = ("null", "boolean", "object", "array", "number", "integer", "string")
NUMBER_KEYS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                         "multipleOf"})
STRING_KEYS = frozenset({"minLength", "maxLength", "pattern", "format"})
ARRAY_KEYS = frozenset({"items", "prefixItems", "minItems", "maxItems", "uniqueItems"})
OBJECT_KEYS = frozenset({"properties", "required", "additionalProperties", "minProperties",
                         "maxProperties", "dependentRequired"})
FAMILY = {"number": NUMBER_KEYS, "integer": NUMBER_KEYS, "string": STRING_KEYS,
          "array": ARRAY_KEYS, "object": OBJECT_KEYS, "null": frozenset(),
          "boolean": frozenset()}
GENERAL_KEYS = frozenset({"type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref",
                          "$defs", "definitions"})
KNOWN = NUMBER_KEYS | STRING_KEYS | ARRAY_KEYS | OBJECT_KEYS | GENERAL_KEYS | ANNOTATIONS
# The formats xgrammar writes a grammar for (any other would be ignored).
FORMATS = frozenset(
    "date time date-time duration email idn-email hostname idn-hostname ipv4 ipv6 uri "
    "uri-reference iri iri-reference uuid uri-template json-pointer relative-json-pointer "
    "regex byte binary".split())
# Escapes a `pattern` may use: xgrammar reads any other (\t, \\, \x22, \u0001, ...) as a
# literal that it writes raw (control characters and quotes inside the JSON string).
PATTERN_ESCAPES = frozenset("dDwWsSbB.^$*+?()[]{}|/-")
MAX_ANYOF = 64


class Unsatisfiable(ValueError):
    """No value satisfies the schema at `path`."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"the JSON schema is unsatisfiable: {reason} at {path}")
        self.path = path
        self.reason = reason


def unsupported(keyword: str, path: str, why: str = "") -> ValueError:
    return ValueError(f"JSON schema keyword {keyword!r} at {path} is not supported"
                      f"{': ' + why if why else ''} (it cannot be enforced)")


def invalid(keyword: str, path: str, what: str) -> ValueError:
    return ValueError(f"JSON schema keyword {keyword!r} at {path} {what}")


def enforceable_schema(schema: Any) -> dict[str, Any]:
    """The schema (a dict or its JSON text) as one xgrammar enforces exactly; a ValueError
    naming the keyword and its path, or saying the schema is unsatisfiable."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as error:
            raise ValueError(f"the JSON schema is not JSON: {error}") from error
    if schema is True:
        schema = {}
    if schema is False:
        raise Unsatisfiable("$", "the schema is false")
    if not isinstance(schema, dict):
        raise ValueError(f"a JSON schema must be an object or a boolean, got "
                         f"{type(schema).__name__}")
    defs: dict[str, Any] = {}
    for key in ("$defs", "definitions"):
        value = schema.get(key, {})
        if not isinstance(value, dict):
            raise invalid(key, "$", "must be an object")
        for name, item in value.items():
            defs[f"#/{key}/{name}"] = _normalize(item, f"$.{key}.{name}")
    result = _normalize(schema, "$", root=True)
    if defs:
        # Every reference points into one table, `$defs`, in the result.
        result["$defs"] = {ref.split("/", 2)[2].replace("/", "__"): item
                           for ref, item in defs.items()}
        result = _retarget(result)
    return result


def _retarget(value: Any) -> Any:
    if isinstance(value, dict):
        out = {key: _retarget(item) for key, item in value.items()}
        ref = out.get("$ref")
        if isinstance(ref, str) and ref.startswith(("#/$defs/", "#/definitions/")):
            out["$ref"] = "#/$defs/" + ref.split("/", 2)[2].replace("/", "__")
        return out
    if isinstance(value, list):
        return [_retarget(item) for item in value]
    return value


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "integer" if value.is_integer() else "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    raise ValueError(f"not a JSON value: {value!r:.80}")


def _types_of(schema: dict[str, Any], path: str) -> list[str] | None:
    kind = schema.get("type")
    if kind is None:
        return None
    kinds = kind if isinstance(kind, list) else [kind]
    if not kinds or not all(isinstance(k, str) and k in TYPES for k in kinds):
        raise invalid("type", path, f"must be one of {', '.join(TYPES)} or a list of "
                      f"them, got {kind!r:.80}")
    return list(dict.fromkeys(kinds))


def _admits(types: list[str], value: Any) -> bool:
    kind = _json_type(value)
    return kind in types or (kind == "integer" and "number" in types)


def _canon(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def _value_schema(value: Any) -> dict[str, Any]:
    """A schema that only `value` satisfies, in the keywords xgrammar writes compactly
    (its own spelling of an object or array const is not the output's)."""
    if isinstance(value, dict):
        return {"type": "object", "properties": {k: _value_schema(v) for k, v in value.items()},
                "required": list(value), "additionalProperties": False}
    if isinstance(value, list):
        if not value:
            return {"type": "array", "maxItems": 0}
        return {"type": "array", "prefixItems": [_value_schema(v) for v in value],
                "items": False, "minItems": len(value), "maxItems": len(value)}
    return {"const": value}


def _normalize(schema: Any, path: str, root: bool = False) -> dict[str, Any]:
    if schema is True:
        return {}
    if schema is False:
        raise Unsatisfiable(path, "the schema is false")
    if not isinstance(schema, dict):
        raise ValueError(f"the JSON schema at {path} must be an object or a boolean, got "
                         f"{type(schema).__name__}")
    for key in schema:
        if key not in KNOWN:
            raise unsupported(key, path)
        if key in ("$defs", "definitions") and not root:
            raise unsupported(key, path, "only the root schema may hold definitions")
    body = {k: v for k, v in schema.items()
            if k not in ANNOTATIONS and k not in ("$defs", "definitions")}
    if "allOf" in body:
        parts = body.pop("allOf")
        if not isinstance(parts, list) or not parts:
            raise invalid("allOf", path, "must be a non-empty list of schemas")
        merged: Any = body
        for index, part in enumerate(parts):
            merged = _merge(merged, _strip(part, f"{path}.allOf[{index}]"), path)
        return _normalize(merged, path)
    if "$ref" in body:
        ref = body.pop("$ref")
        if body:
            raise unsupported(sorted(body)[0], path, "beside $ref")
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith(
                ("#/$defs/", "#/definitions/"))):
            raise unsupported("$ref", path, f"only '#', '#/$defs/...' and "
                                            f"'#/definitions/...' are, got {ref!r:.80}")
        return {"$ref": ref}
    if "oneOf" in body:
        branches = body.pop("oneOf")
        if not isinstance(branches, list) or not branches:
            raise invalid("oneOf", path, "must be a non-empty list of schemas")
        if len(branches) > 1 and not _disjoint(branches, path):
            raise unsupported("oneOf", path, "its branches may overlap (only a oneOf whose "
                                             "branches have disjoint types is)")
        if "anyOf" in body:
            raise unsupported("oneOf", path, "beside anyOf")
        body["anyOf"] = branches
    if "anyOf" in body:
        branches = body.pop("anyOf")
        if not isinstance(branches, list) or not branches:
            raise invalid("anyOf", path, "must be a non-empty list of schemas")
        options: list[dict[str, Any]] = []
        last: Unsatisfiable | None = None
        for index, branch in enumerate(branches):
            try:
                # The siblings of anyOf hold for every branch: merged into each.
                part = _merge(dict(body), _strip(branch, f"{path}.anyOf[{index}]"), path) \
                    if body else branch
                options.extend(_flatten(_normalize(part, f"{path}.anyOf[{index}]")))
            except Unsatisfiable as error:
                last = error
        if not options:
            assert last is not None
            raise Unsatisfiable(path, f"every branch of anyOf is ({last.reason} at "
                                      f"{last.path})")
        if len(options) > MAX_ANYOF:
            raise unsupported("anyOf", path, f"it expands to over {MAX_ANYOF} branches")
        return options[0] if len(options) == 1 else {"anyOf": options}
    types = _types_of(body, path)
    if "const" in body or "enum" in body:
        return _values(body, types, path)
    if types is None:
        families = [kind for kind in ("number", "string", "array", "object")
                    if any(key in FAMILY[kind] for key in body)]
        if not families:
            return {}
        types = families
    if len(types) > 1:
        return _normalize({"anyOf": [{**body, "type": kind} for kind in types]}, path)
    kind = types[0]
    out: dict[str, Any] = {"type": kind}
    given = {k: v for k, v in body.items() if k in FAMILY[kind]}
    if kind in ("number", "integer"):
        out.update(_number(given, kind, path))
    elif kind == "string":
        out.update(_string(given, path))
    elif kind == "array":
        out.update(_array(given, path))
    elif kind == "object":
        out.update(_object(given, path))
    return out


def _flatten(schema: dict[str, Any]) -> list[dict[str, Any]]:
    return list(schema["anyOf"]) if set(schema) == {"anyOf"} else [schema]


def _strip(schema: Any, path: str) -> Any:
    if isinstance(schema, dict):
        return {k: v for k, v in schema.items() if k not in ANNOTATIONS}
    if isinstance(schema, bool):
        return schema
    raise ValueError(f"the JSON schema at {path} must be an object or a boolean")


def _disjoint(branches: list[Any], path: str) -> bool:
    seen: set[str] = set()
    for branch in branches:
        if not isinstance(branch, dict):
            return False
        types = _types_of(branch, path)
        if types is None:
            values = branch.get("enum", [branch["const"]] if "const" in branch else None)
            if not isinstance(values, list):
                return False
            types = [_json_type(value) for value in values]
        kinds = set(types)
        if "number" in kinds:
            kinds.add("integer")
        if "integer" in kinds:
            kinds.add("number")
        if kinds & seen:
            return False
        seen |= kinds
    return True


def _values(body: dict[str, Any], types: list[str] | None, path: str) -> dict[str, Any]:
    values: list[Any] | None = None
    if "enum" in body:
        if not isinstance(body["enum"], list) or not body["enum"]:
            raise invalid("enum", path, "must be a non-empty list")
        values = list(body["enum"])
    if "const" in body:
        const = body["const"]
        values = [const] if values is None or any(_canon(v) == _canon(const)
                                                  for v in values) else []
        if not values:
            raise Unsatisfiable(path, "const is not in enum")
    assert values is not None
    other = sorted(k for k in body if k not in ("enum", "const", "type"))
    if types is not None:
        other = [k for k in other if any(k in FAMILY[t] for t in types)]
    if other:
        raise unsupported(other[0], path, "beside enum or const")
    if types is not None:
        values = [v for v in values if _admits(types, v)]
        if not values:
            raise Unsatisfiable(path, f"no value of enum or const has type "
                                      f"{'/'.join(types)}")
    unique = list({_canon(v): v for v in values}.values())
    if all(not isinstance(v, (dict, list)) for v in unique):
        return {"const": unique[0]} if len(unique) == 1 else {"enum": unique}
    schemas = [_value_schema(v) for v in unique]
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def _number_of(given: dict[str, Any], key: str, path: str) -> float | int | None:
    value = given.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise unsupported(key, path, f"it must be a number, got {value!r:.40}")
    return value


def _number(given: dict[str, Any], kind: str, path: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        value = _number_of(given, key, path)
        if value is not None:
            out[key] = value
    multiple = _number_of(given, "multipleOf", path)
    if multiple is not None:
        if kind != "integer" or not float(multiple).is_integer() or multiple <= 0:
            raise unsupported("multipleOf", path, "only a positive integer multipleOf of an "
                                                  "integer is")
        if multiple != 1:
            out["multipleOf"] = int(multiple)
    if kind == "integer":  # as whole inclusive bounds (xgrammar refuses 2.5 for an integer)
        lows = [math.ceil(out.pop("minimum"))] if "minimum" in out else []
        if "exclusiveMinimum" in out:
            lows.append(math.floor(out.pop("exclusiveMinimum")) + 1)
        highs = [math.floor(out.pop("maximum"))] if "maximum" in out else []
        if "exclusiveMaximum" in out:
            highs.append(math.ceil(out.pop("exclusiveMaximum")) - 1)
        lo, hi = max(lows, default=None), min(highs, default=None)
        if lo is not None and hi is not None and lo > hi:
            raise Unsatisfiable(path, "no integer lies between the bounds")
        out.update({k: v for k, v in (("minimum", lo), ("maximum", hi)) if v is not None})
        return out
    low = max([v for v in (out.get("minimum"), out.get("exclusiveMinimum")) if v is not None],
              default=None)
    high = min([v for v in (out.get("maximum"), out.get("exclusiveMaximum")) if v is not None],
               default=None)
    if low is not None and high is not None and (low > high or low == high and low in (
            out.get("exclusiveMinimum"), out.get("exclusiveMaximum"))):
        raise Unsatisfiable(path, "no number lies between the bounds")
    return out


def _count(given: dict[str, Any], key: str, path: str) -> int | None:
    value = given.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise invalid(key, path, f"must be an integer >= 0, got {value!r:.40}")
    return value


def _string(given: dict[str, Any], path: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    low, high = _count(given, "minLength", path), _count(given, "maxLength", path)
    if low is not None and high is not None and low > high:
        raise Unsatisfiable(path, "minLength is above maxLength")
    pattern = given.get("pattern")
    if pattern is not None:
        if not isinstance(pattern, str):
            raise invalid("pattern", path, "must be a string")
        if low is not None or high is not None:
            raise unsupported("minLength" if low is not None else "maxLength", path,
                              "beside a pattern (write the length into the pattern)")
        _check_pattern(pattern, path)
        out["pattern"] = _without_surrogates(pattern)
    if low:
        out["minLength"] = low
    if high is not None:
        out["maxLength"] = high
    fmt = given.get("format")
    if fmt is not None:
        if fmt not in FORMATS:
            raise unsupported("format", path, f"format {fmt!r:.40} is unknown; the known "
                                              f"are {', '.join(sorted(FORMATS))}")
        if pattern is not None or low or high is not None:
            raise unsupported("format", path, "beside pattern, minLength or maxLength")
        out["format"] = fmt
    return out


def _check_pattern(pattern: str, path: str) -> None:
    bad = next((c for c in pattern if ord(c) < 0x20 or c == '"'), None)
    if bad is not None:
        raise unsupported("pattern", path, f"it holds {bad!r}, which xgrammar would write "
                                           "unescaped")
    index = 0
    while index < len(pattern):
        if pattern[index] == "\\":
            escape = pattern[index + 1:index + 2]
            if escape not in PATTERN_ESCAPES:
                raise unsupported("pattern", path, f"the escape \\{escape} (only "
                                                   "\\d \\w \\s, their negations and "
                                                   "escaped punctuation are)")
            index += 2
        else:
            index += 1


NO_SURROGATE = "\\ud800-\\udfff"


def _without_surrogates(pattern: str) -> str:
    """`pattern` with `.`, `[^...]`, `\\D`, `\\W` and `\\S` kept off surrogate code points
    (xgrammar's JSON-string regexes admit their UTF-8 bytes: text of U+FFFD)."""
    out: list[str] = []
    index, in_class, negated = 0, False, False
    while index < len(pattern):
        char = pattern[index]
        if char == "\\":
            escape = pattern[index:index + 2]
            if escape in ("\\D", "\\W", "\\S"):
                inner = {"\\D": "0-9", "\\W": "A-Za-z0-9_", "\\S": " \\t\\n\\r\\f\\v"}[escape]
                if in_class:
                    raise unsupported("pattern", "$", f"{escape} inside a class")
                escape = f"[^{inner}{NO_SURROGATE}]"
            out.append(escape)
            index += 2
            continue
        if in_class:
            if char == "]" and not (out and out[-1] in ("[", "[^")):
                if negated:
                    out.append(NO_SURROGATE)
                in_class = False
            out.append(char)
        elif char == "[":
            negated = pattern[index + 1:index + 2] == "^"
            out.append("[^" if negated else "[")
            index += 2 if negated else 1
            in_class = True
            continue
        elif char == ".":
            out.append(f"[^{NO_SURROGATE}]")
        else:
            out.append(char)
        index += 1
    return "".join(out)


def _array(given: dict[str, Any], path: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    low = _count(given, "minItems", path) or 0
    high = _count(given, "maxItems", path)
    if high is not None and low > high:
        raise Unsatisfiable(path, "minItems is above maxItems")
    prefix = given.get("prefixItems", [])
    if not isinstance(prefix, list):
        raise invalid("prefixItems", path, "must be a list of schemas")
    items: list[dict[str, Any]] = []
    for index, item in enumerate(prefix):
        if high is not None and index >= high:
            break
        try:
            items.append(_normalize(item, f"{path}.prefixItems[{index}]"))
        except Unsatisfiable:
            if low > index:
                raise
            high = index
            break
    rest: Any = given.get("items", True)
    if isinstance(rest, list):
        raise unsupported("items", path, "a list of items (write prefixItems)")
    if high is None or high > len(items):
        try:
            rest_schema: Any = _normalize(rest, f"{path}.items")
        except Unsatisfiable:
            if low > len(items):
                raise
            rest_schema, high = False, len(items)
    else:
        rest_schema = False
    if items:
        out["prefixItems"] = items
    if rest_schema is False:
        out["items"] = False
        if not items:
            out["maxItems"] = 0
    else:
        out["items"] = rest_schema
    if low:
        out["minItems"] = low
    if high is not None:
        out["maxItems"] = high
    unique = given.get("uniqueItems", False)
    if not isinstance(unique, bool):
        raise invalid("uniqueItems", path, "must be a boolean")
    if unique and (high is None or high > 1):
        raise unsupported("uniqueItems", path, "only with maxItems <= 1")
    return out


def _object(given: dict[str, Any], path: str) -> dict[str, Any]:
    properties = given.get("properties", {})
    if not isinstance(properties, dict):
        raise invalid("properties", path, "must be an object")
    required = given.get("required", [])
    if not isinstance(required, list) or not all(isinstance(k, str) for k in required):
        raise invalid("required", path, "must be a list of strings")
    required = list(dict.fromkeys(required))
    extra: Any = given.get("additionalProperties", True)
    # Which other names the schema allows: any (absent), those of extra_schema, or none.
    allows_others = extra is not False
    extra_schema: Any = None  # None: none beyond properties (xgrammar's strict mode)
    if extra is not True and extra is not False:
        try:
            extra_schema = _normalize(extra, f"{path}.additionalProperties")
        except Unsatisfiable:
            allows_others = False
    out_properties: dict[str, Any] = {}
    for key, item in properties.items():
        try:
            out_properties[key] = _normalize(item, f"{path}.properties.{key}")
        except Unsatisfiable as error:
            if key in required:
                raise
            if extra_schema is not None:
                raise unsupported("properties", f"{path}.properties.{key}", "a property no "
                                  "value satisfies beside additionalProperties") from error
    for key in required:
        if key not in out_properties:
            if not allows_others:
                raise Unsatisfiable(path, f"required {key!r} is not allowed "
                                          "(additionalProperties is false)")
            # Allowed by additionalProperties (or by its absence: any value).
            out_properties[key] = extra_schema if extra_schema is not None else {}
    low = _count(given, "minProperties", path)
    if low is not None and low > len(required):
        raise unsupported("minProperties", path, "only when required names as many")
    high = _count(given, "maxProperties", path)
    if high is not None and (extra_schema is not None or high < len(out_properties)):
        raise unsupported("maxProperties", path, "only when the properties are at most as "
                                                 "many and no others are allowed")
    dependent = given.get("dependentRequired", {})
    if not isinstance(dependent, dict):
        raise invalid("dependentRequired", path, "must be an object")
    for key, needed in dependent.items():
        possible = key in out_properties or extra_schema is not None
        if possible and key not in required and not set(needed) <= set(required):
            raise unsupported("dependentRequired", f"{path}.dependentRequired.{key}",
                              "only when its property is required or absent, or what it "
                              "needs is required")
        if key in required and not set(needed) <= set(out_properties):
            missing = sorted(set(needed) - set(out_properties))
            if not allows_others:
                raise Unsatisfiable(path, f"dependentRequired needs {missing[0]!r}, which "
                                          "is not allowed")
        if key in required:
            for name in needed:
                if name not in required:
                    required.append(name)
                    out_properties.setdefault(name, extra_schema or {})
    out: dict[str, Any] = {"properties": out_properties} if out_properties else {}
    if required:
        out["required"] = required
    out["additionalProperties"] = extra_schema if extra_schema is not None else False
    return out


def _merge(a: Any, b: Any, path: str) -> Any:
    """The schema of the values that satisfy both `a` and `b` (raw schemas, one level
    merged; nested ones merged as they are reached); `False` when there is none."""
    if a is True or a == {}:
        return b
    if b is True or b == {}:
        return a
    if a is False or b is False:
        raise Unsatisfiable(path, "an allOf part is false")
    a, b = dict(a), dict(b)
    for side in (a, b):
        if "$ref" in side:
            raise unsupported("allOf", path, "a part with $ref")
        if "allOf" in side:
            nested = side.pop("allOf")
            merged: Any = side
            for part in nested if isinstance(nested, list) else [nested]:
                merged = _merge(merged, _strip(part, path), path)
            side.clear()
            side.update(merged)
    out: dict[str, Any] = {}
    for key in set(a) | set(b):
        if key in ANNOTATIONS:
            continue
        if key not in a or key not in b:
            out[key] = a[key] if key in a else b[key]
            continue
        x, y = a[key], b[key]
        if _canon(x) == _canon(y) and key not in ("anyOf", "oneOf"):
            out[key] = x
        elif key == "type":
            tx, ty = _types_of(a, path) or [], _types_of(b, path) or []
            both = [t for t in tx if t in ty] + (["integer"] if "integer" in tx and "number"
                                                  in ty or "number" in tx and "integer" in ty
                                                  else [])
            both = list(dict.fromkeys(both))
            if not both:
                raise Unsatisfiable(path, f"allOf asks for type {x!r} and type {y!r}")
            out[key] = both if len(both) > 1 else both[0]
        elif key in ("enum", "const"):
            continue  # below
        elif key in ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties"):
            out[key] = max(x, y)
        elif key in ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties"):
            out[key] = min(x, y)
        elif key == "uniqueItems":
            out[key] = bool(x) or bool(y)
        elif key == "multipleOf" and all(isinstance(v, int) and not isinstance(v, bool)
                                         and v > 0 for v in (x, y)):
            out[key] = x * y // math.gcd(x, y)
        elif key == "required":
            out[key] = list(dict.fromkeys(list(x) + list(y)))
        elif key == "items":
            out[key] = _merge(x, y, f"{path}.items")
        elif key in ("properties", "additionalProperties", "prefixItems", "anyOf", "oneOf",
                     "dependentRequired"):
            continue  # below
        else:
            raise unsupported(key, path, "two different values in allOf")
    _merge_values(a, b, out, path)
    _merge_properties(a, b, out, path)
    if "prefixItems" in a and "prefixItems" in b:
        px, py = a["prefixItems"], b["prefixItems"]
        rest_x, rest_y = a.get("items", True), b.get("items", True)
        out["prefixItems"] = [
            _merge(px[i] if i < len(px) else rest_x, py[i] if i < len(py) else rest_y,
                   f"{path}.prefixItems[{i}]") for i in range(max(len(px), len(py)))]
    if "dependentRequired" in a and "dependentRequired" in b:
        dx, dy = a["dependentRequired"], b["dependentRequired"]
        out["dependentRequired"] = {k: list(dict.fromkeys(dx.get(k, []) + dy.get(k, [])))
                                    for k in set(dx) | set(dy)}
    for key in ("anyOf", "oneOf"):
        if key in a and key in b:
            if key == "oneOf":
                raise unsupported("oneOf", path, "in two parts of allOf")
            out[key] = [_merge(_strip(x, path), _strip(y, path), path)
                        for x in a[key] for y in b[key]][:MAX_ANYOF + 1]
    return out


def _merge_values(a: dict[str, Any], b: dict[str, Any], out: dict[str, Any],
                  path: str) -> None:
    sets = []
    for side in (a, b):
        values = None
        if "enum" in side:
            values = list(side["enum"]) if isinstance(side["enum"], list) else []
        if "const" in side:
            values = [side["const"]] if values is None or any(
                _canon(v) == _canon(side["const"]) for v in values) else []
        if values is not None:
            sets.append(values)
    if not sets:
        return
    values = sets[0]
    for other in sets[1:]:
        keys = {_canon(v) for v in other}
        values = [v for v in values if _canon(v) in keys]
    if not values:
        raise Unsatisfiable(path, "the parts of allOf allow no common enum or const value")
    out.pop("const", None)
    out["enum"] = values


def _merge_properties(a: dict[str, Any], b: dict[str, Any], out: dict[str, Any],
                      path: str) -> None:
    if not any(k in side for side in (a, b) for k in ("properties", "additionalProperties")):
        return
    pa, pb = a.get("properties", {}), b.get("properties", {})
    ea, eb = a.get("additionalProperties", True), b.get("additionalProperties", True)
    properties = {}
    for key in list(pa) + [k for k in pb if k not in pa]:
        try:
            properties[key] = _merge(pa.get(key, ea), pb.get(key, eb),
                                     f"{path}.properties.{key}")
        except Unsatisfiable:
            properties[key] = False  # allowed only when absent
    if properties:
        out["properties"] = properties
    try:
        extra = _merge(ea, eb, f"{path}.additionalProperties")
    except Unsatisfiable:
        extra = False
    if extra is not True:
        out["additionalProperties"] = extra
    else:
        out.pop("additionalProperties", None)
