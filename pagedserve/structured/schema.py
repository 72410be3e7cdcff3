"""Which JSON-schema features a constrained request may use (the ones the grammar enforces), and the schema
as xgrammar is given it.

xgrammar compiles most schemas, but it silently ignores some keywords (`not`, `if`/`then`/`else`,
`uniqueItems`, `contains`, `dependentRequired`, `multipleOf` on non-integers, `allOf` of several schemas,
most non-standard formats, `multipleOf` beside a range, keywords beside a `$ref`, non-local `$ref`s, and it writes
a `pattern`'s literal quotes, backslashes and control characters unescaped; checked one by one against its
matcher, see tests/unit/test_structured_schema.py).
A schema using any of them gets a 400 naming the keyword and where it is, never output that quietly breaks
the schema. The schema is also checked against its JSON-Schema metaschema (jsonschema) first.
"""

from __future__ import annotations

import re
from typing import Any

from pagedserve.exceptions import InvalidRequestError

# Keywords that only describe: fine anywhere, nothing to enforce. OpenAPI's `discriminator` (pydantic writes it
# beside a discriminated union's oneOf) names the property whose const in each branch tells them apart: the
# branches enforce it.
ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$schema", "$id", "$comment",
                         "deprecated", "readOnly", "writeOnly", "discriminator"})
# Enforced keywords whose values are not subschemas.
ENFORCED = frozenset({"type", "enum", "const", "required", "minItems", "maxItems", "minimum", "maximum",
                      "exclusiveMinimum", "exclusiveMaximum", "minLength", "maxLength", "pattern", "format",
                      "minProperties", "maxProperties", "$ref", "multipleOf", "unevaluatedProperties"})
# Enforced keywords holding subschemas: keyword -> how they are held.
SUBSCHEMAS = {"properties": "map", "$defs": "map", "definitions": "map", "additionalProperties": "one",
              "items": "one", "prefixItems": "list", "anyOf": "list", "oneOf": "list", "allOf": "list",
              "propertyNames": "one"}
# Keywords accepted only with the value that asks for nothing.
NO_OP_VALUES = {"uniqueItems": False}
# A `pattern` whose literal characters need escaping inside a JSON string: xgrammar writes literals as they are
# (a quote, a backslash, a tab or newline unescaped: invalid JSON that ends with "stop"). Character classes are
# safe (it keeps quotes, backslashes and control characters out of them, `[^"\n]` and `[a-z"]` alike), so only
# the pattern outside its classes is searched (_outside_classes).
_UNESCAPED_LITERAL = re.compile(r'["\x00-\x1f]|\\\\|\\[nrtfv0]|\\x(?:[01][0-9a-fA-F]|22|5[cC])|'
                                r'\\u(?:00[01][0-9a-fA-F]|0022|005[cC])')
_RANGE_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_INT64 = (-(2 ** 63), 2 ** 63 - 1)
FORMATS = frozenset({"email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid", "uri",
                     "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"})


def _outside_classes(pattern: str) -> str:
    """The pattern with its character classes ([...], escapes and a leading ] inside them honoured) left out."""
    out: list[str] = []
    i, n = 0, len(pattern)
    while i < n:
        char = pattern[i]
        if char == "\\":
            out.append(pattern[i:i + 2])
            i += 2
        elif char == "[":
            i += 1
            if i < n and pattern[i] == "^":
                i += 1
            if i < n and pattern[i] == "]":  # a ] first in a class is a literal
                i += 1
            while i < n and pattern[i] != "]":
                i += 2 if pattern[i] == "\\" else 1
            i += 1
        else:
            out.append(char)
            i += 1
    return "".join(out)


def check_json_schema(schema: Any, param: str, root: str = "#") -> None:
    """InvalidRequestError naming the problem: not a valid JSON schema, or a feature nothing enforces, at a path
    under `root` (a tool's parameters: "tools[0].function.parameters#")."""
    try:
        _check_metaschema(schema, param, root)
        _check_features(schema, root, param, dialect_of(schema))
    except RecursionError:  # jsonschema recurses per level: ~120 nested schemas were a 500
        raise InvalidRequestError(f"{param}: the JSON schema is nested too deeply to check; flatten it (e.g. with "
                                  "$defs and $ref)", param=param) from None


def dialect_of(schema: Any) -> Any:
    """The jsonschema validator class of the schema's $schema (draft 2020-12 without one): draft-04's
    exclusiveMinimum: true is a flag, not a bound. For checking values against a schema as its author meant it."""
    import jsonschema

    return jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)


def _check_metaschema(schema: Any, param: str, root: str = "#") -> None:
    import jsonschema

    dialect = schema.get("$schema") if isinstance(schema, dict) else None
    if dialect is not None and not isinstance(dialect, str):
        raise InvalidRequestError(f"{param}: $schema must be a URI string, got {dialect!r}", param=param)
    validator = dialect_of(schema)
    try:
        validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path) or "(top level)"
        where = where if root == "#" else f"{root}/{where}"
        raise InvalidRequestError(f"{param}: invalid JSON schema at {where}: {exc.message}", param=param) from None


def _check_listed_values(schema: dict, path: str, param: str, dialect: Any) -> None:
    """xgrammar writes an 'enum' or 'const' value as listed and drops every keyword beside it ("abc" for an enum of
    "abc" and "xyz" with a pattern ^x, QA-F): fine where every value meets them, else a 400 naming the first that
    does not, for the caller to leave out."""
    import jsonschema

    listed = "const" if "const" in schema else "enum"
    rest = {key: schema[key] for key in _asking_beside(schema, listed)}
    if not rest:
        return
    values = [schema["const"]] if listed == "const" else schema["enum"] if isinstance(schema["enum"], list) else []
    try:
        validator = dialect(rest)
        for value in values:
            error = jsonschema.exceptions.best_match(validator.iter_errors(value))
            if error is not None:
                raise _unsupported(param, path, f"the '{listed}' value {value!r}, which the keywords beside it refuse "
                                                f"({error.message}; only the listed values are enforced: leave it out)")
    except InvalidRequestError:
        raise
    except Exception:  # noqa: BLE001 - a '$ref' it cannot resolve (referencing's error or jsonschema's, by version)
        raise _unsupported(param, path, f"keywords beside '{listed}' that hold a '$ref' (only the listed values are "
                                        "enforced)") from None


def _check_pattern(pattern: str, path: str, param: str) -> None:
    """A `pattern` the grammar enforces as written: no literal that JSON escapes (see _UNESCAPED_LITERAL), and
    nothing xgrammar's regex parser refuses; its JSON-schema converter would drop a lookahead, a group flag or a
    backreference with a log line and let strings through that break the pattern."""
    if _UNESCAPED_LITERAL.search(_outside_classes(pattern)):
        raise _unsupported(param, path, "a 'pattern' that writes a quote, a backslash or a control character "
                                        "(JSON strings escape them)")
    import xgrammar as xgr  # loaded for the compile that follows anyway

    try:
        xgr.Grammar.from_regex(pattern)
    except Exception as exc:  # noqa: BLE001 - xgrammar's parser errors: the client's pattern
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        reason = reason.rsplit(": ", 1)[-1]
        raise _unsupported(param, path, f"a 'pattern' with a regex feature the grammar cannot enforce ({reason})")


def _asks_nothing(key: str, value: Any) -> bool:
    """An annotation, or a keyword at the value that asks for nothing (uniqueItems: false)."""
    return key in ANNOTATIONS or (key in NO_OP_VALUES and value == NO_OP_VALUES[key])


def _asking_beside(schema: dict, key: str) -> list[str]:
    """The keywords beside `key` that ask for something (xgrammar drops them beside '$ref', 'anyOf' & co., and
    beside a listed value); definitions are not beside anything."""
    return [other for other, value in schema.items()
            if other not in (key, "$defs", "definitions") and not _asks_nothing(other, value)]


def _unsupported(param: str, path: str, what: str) -> InvalidRequestError:
    return InvalidRequestError(f"{param}: the JSON schema uses {what} at {path}, which structured outputs cannot "
                               "enforce; remove it or express it with supported keywords (see the README's "
                               "'Structured outputs' section)", param=param)


def _check_features(schema: Any, path: str, param: str, dialect: Any) -> None:
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"{param}: a schema at {path} must be an object or a boolean", param=param)
    for key, value in schema.items():
        where = f"{path}/{key}"
        if _asks_nothing(key, value):
            continue
        if key in SUBSCHEMAS:
            _check_subschemas(key, value, where, param, dialect)
        elif key not in ENFORCED:
            raise _unsupported(param, path, f"the keyword '{key}'")
    _check_values(schema, path, param, dialect)


def _check_subschemas(key: str, value: Any, where: str, param: str, dialect: Any) -> None:
    held = SUBSCHEMAS[key]
    if held == "map" and isinstance(value, dict):
        for name, sub in value.items():
            _check_features(sub, f"{where}/{name}", param, dialect)
    elif held == "list" and isinstance(value, list):
        if key == "allOf" and len(value) > 1:
            raise _unsupported(param, where, "'allOf' with more than one schema")
        for index, sub in enumerate(value):
            _check_features(sub, f"{where}/{index}", param, dialect)
    else:
        _check_features(value, where, param, dialect)


def _check_values(schema: dict, path: str, param: str, dialect: Any) -> None:
    fmt = schema.get("format")
    if fmt is not None and fmt not in FORMATS:
        raise _unsupported(param, path, f"format '{fmt}' (enforced formats: {', '.join(sorted(FORMATS))})")
    if "multipleOf" in schema and (schema.get("type") != "integer" or not isinstance(schema["multipleOf"], int)):
        raise _unsupported(param, path, "'multipleOf' on a non-integer")
    if "multipleOf" in schema and any(key in schema for key in _RANGE_KEYWORDS):
        raise _unsupported(param, path, "'multipleOf' together with a minimum or maximum")
    if isinstance(schema.get("pattern"), str):
        _check_pattern(schema["pattern"], path, param)
    types = schema.get("type")
    for key in _RANGE_KEYWORDS:  # xgrammar writes integer bounds as 64-bit integers (and fails on others)
        bound = schema.get(key)
        if (types == "integer" or (isinstance(types, list) and "integer" in types)) and \
                isinstance(bound, (int, float)) and not _INT64[0] <= bound <= _INT64[1]:
            raise _unsupported(param, path, f"an integer '{key}' beyond 64 bits ({bound:g})")
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        raise _unsupported(param, path, f"the non-local '$ref' {ref!r} (only references into the schema itself)")
    if isinstance(ref, str) and _asking_beside(schema, "$ref"):
        raise _unsupported(param, path, "keywords beside '$ref' (only the referenced schema is enforced)")
    for key in ("anyOf", "oneOf", "allOf"):  # xgrammar writes one of the schemas and drops the rest (QA-F)
        if key in schema and _asking_beside(schema, key):
            raise _unsupported(param, path, f"keywords beside '{key}' (only its schemas are enforced: move the "
                                            "keywords into each of them)")
    if "enum" in schema or "const" in schema:
        _check_listed_values(schema, path, param, dialect)
    properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    missing = [name for name in schema.get("required") or () if name not in properties]
    if missing:
        raise _unsupported(param, path, f"'required' naming {missing[0]!r}, which 'properties' does not define "
                                        "(only defined properties are written)")
    if schema.get("unevaluatedProperties", False) is not False:
        raise _unsupported(param, path, "'unevaluatedProperties' other than false")
    if ("pattern" in schema or "format" in schema) and ("minLength" in schema or "maxLength" in schema):
        raise _unsupported(param, path, "'minLength'/'maxLength' together with 'pattern' or 'format'")
