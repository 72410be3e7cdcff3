"""Structured-output requests without a model or grammar library: what is accepted and what gets a 400
naming the problem (tests/models/test_structured_outputs.py checks the accepted keywords against xgrammar)."""

from __future__ import annotations


import pytest

from pagedserve.exceptions import InvalidRequestError
from pagedserve.structured.params import StructuredOutputsConfig, StructuredOutputsParams
from pagedserve.structured.schema import check_json_schema


def test_exactly_one_kind():
    assert StructuredOutputsParams(regex="a+").kind == "regex"
    with pytest.raises(InvalidRequestError, match="exactly one of"):
        StructuredOutputsParams(regex="a+", choice=["a"])
    with pytest.raises(InvalidRequestError, match="exactly one of"):
        StructuredOutputsParams()
    with pytest.raises(InvalidRequestError, match="not valid JSON"):
        StructuredOutputsParams(json="{nope")
    with pytest.raises(InvalidRequestError, match="choice must be"):
        StructuredOutputsParams(choice=[])


def test_integer_bounds_beyond_64_bits_are_named():
    """xgrammar's converter failed with its internal check ("Check failed: (val >= MIN_INT64_AS_DOUBLE)")."""
    for schema in ({"type": "integer", "minimum": -1e20}, {"type": ["integer", "null"], "maximum": 2 ** 64}):
        with pytest.raises(InvalidRequestError, match="an integer '(minimum|maximum)' beyond 64 bits"):
            check_json_schema(schema, "response_format")
    check_json_schema({"type": "number", "minimum": -1e20}, "response_format")
    check_json_schema({"type": "integer", "minimum": -(2 ** 63), "maximum": 2 ** 63 - 1}, "response_format")


def test_request_forms():
    assert StructuredOutputsParams.from_response_format({"type": "text"}) is None
    assert StructuredOutputsParams.from_response_format({"type": "json_object"}).kind == "json_object"
    spec = StructuredOutputsParams.from_response_format(
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer"}, "strict": True}})
    assert spec.json == {"type": "integer"} and spec.param == "response_format"
    with pytest.raises(InvalidRequestError, match="needs a json_schema object"):
        StructuredOutputsParams.from_response_format({"type": "json_schema"})
    with pytest.raises(InvalidRequestError, match="'yaml' is not supported"):
        StructuredOutputsParams.from_response_format({"type": "yaml"})
    for no_type in ({}, {"json_schema": {"schema": {}}}, "json_object"):  # OpenAI's type is required: not "text"
        with pytest.raises(InvalidRequestError, match="response_format needs a type"):
            StructuredOutputsParams.from_response_format(no_type)
    for schema in (None, False, 3):
        with pytest.raises(InvalidRequestError, match="schema must be a JSON Schema object"):
            StructuredOutputsParams.from_response_format({"type": "json_schema", "json_schema": {"schema": schema}})
    with pytest.raises(InvalidRequestError, match="unknown field 'jsn'"):
        StructuredOutputsParams.from_request({"jsn": {}})
    # The same schema written differently shares one compiled grammar.
    a = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    b = StructuredOutputsParams(json='{"properties": {"a": {"type": "integer"}}, "type": "object"}')
    assert a.key == b.key


def test_config_flag():
    assert StructuredOutputsConfig.parse(None).backend == "auto"
    assert StructuredOutputsConfig.parse('{"backend": "xgrammar", "compile_timeout_s": 5}').compile_timeout_s == 5
    with pytest.raises(ValueError, match="backend 'outlines' is not available"):
        StructuredOutputsConfig.parse('{"backend": "outlines"}')
    with pytest.raises(ValueError, match="unknown key 'bakend'"):
        StructuredOutputsConfig.parse('{"bakend": "xgrammar"}')
    with pytest.raises(ValueError, match="must be a JSON object"):
        StructuredOutputsConfig.parse("xgrammar")


@pytest.mark.parametrize("schema, named", [
    ({"not": {"type": "string"}}, "'not'"),
    ({"type": "array", "uniqueItems": True}, "'uniqueItems'"),
    ({"if": {"type": "string"}, "then": {"maxLength": 1}}, "'if'"),
    ({"type": "object", "properties": {"a": {"type": "number", "multipleOf": 0.5}}}, "'multipleOf' on a non-integer"),
    ({"allOf": [{"type": "integer"}, {"minimum": 1}]}, "'allOf' with more than one"),
    ({"type": "string", "format": "idn-email"}, "format 'idn-email'"),
    ({"type": "string", "pattern": "a+", "maxLength": 3}, "together with 'pattern'"),
    ({"type": "object", "patternProperties": {"^x": {}}}, "'patternProperties'"),
    # Each of these gave output that breaks the schema, with finish_reason "stop" (xgrammar 0.2.9):
    ({"type": "integer", "multipleOf": 7, "minimum": 10}, "'multipleOf' together with a minimum"),
    ({"type": "string", "pattern": '^a\\\\b"c$'}, "writes a quote, a backslash"),
    ({"type": "string", "pattern": "^a\\tb$"}, "writes a quote, a backslash"),
    ({"type": "string", "pattern": "^(x\"y|q)$"}, "writes a quote, a backslash"),
    ({"type": "string", "pattern": '[a-z]"[0-9]'}, "writes a quote, a backslash"),  # between classes: a literal
    # xgrammar's JSON-schema converter dropped these with a log line; its regex parser refuses them:
    ({"type": "string", "pattern": "(?=a)b"}, "Lookahead is not supported"),
    ({"type": "string", "pattern": "(?i)abc"}, "Group modifier flag"),
    ({"type": "string", "pattern": "(?P<n>a)b"}, "Group modifier flag"),
    ({"type": "string", "pattern": "a++"}, "repetition modifiers"),
    ({"type": "string", "pattern": "(a)\\1"}, "Backreference"),
    ({"$ref": "#/$defs/a", "minimum": 1000, "$defs": {"a": {"type": "integer"}}}, "keywords beside '$ref'"),
    ({"$ref": "http://example.com/schema.json"}, "non-local '$ref'"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]}, "'required' naming 'b'"),
    # xgrammar writes a listed value as it is and one of anyOf's schemas, dropping every keyword beside them (QA-F):
    ({"type": "string", "enum": ["abc", "xyz"], "pattern": "^x"}, "'enum' value 'abc'"),
    ({"type": "integer", "enum": [1, 7], "minimum": 5}, "'enum' value 1"),
    ({"type": "string", "enum": ["a", 1]}, "'enum' value 1"),
    ({"const": "hello", "maxLength": 2}, "'const' value 'hello'"),
    ({"anyOf": [{"type": "integer"}, {"type": "string"}], "minimum": 5}, "keywords beside 'anyOf'"),
    ({"type": "object", "oneOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}]},
     "keywords beside 'oneOf'"),
    ({"allOf": [{"type": "integer"}], "type": "string"}, "keywords beside 'allOf'"),
])
def test_unenforceable_features_are_named(schema, named):
    with pytest.raises(InvalidRequestError, match="cannot enforce") as info:
        check_json_schema(schema, "response_format")
    assert named in info.value.message and info.value.param == "response_format"


def test_invalid_schema_is_named():
    with pytest.raises(InvalidRequestError, match="invalid JSON schema at type"):
        check_json_schema({"type": "foo"}, "response_format")
    with pytest.raises(InvalidRequestError, match="invalid JSON schema"):
        check_json_schema({"type": "string", "maxLength": -1}, "response_format")


def test_wrong_types_are_invalid_requests_not_crashes():
    """Found by the property tests (tests/server/test_request_properties.py): each was a 500 once."""
    with pytest.raises(InvalidRequestError, match="json_object must be true or false"):
        StructuredOutputsParams.from_request({"json_object": [], "disable_any_whitespace": []})
    with pytest.raises(InvalidRequestError, match="disable_any_whitespace must be true or false"):
        StructuredOutputsParams.from_request({"regex": "a", "disable_any_whitespace": "yes"})
    with pytest.raises(InvalidRequestError, match="choice must be"):
        StructuredOutputsParams.from_request({"choice": {"a": 1}})
    with pytest.raises(InvalidRequestError, match=r"\$schema must be a URI string"):
        check_json_schema({"$schema": {}}, "response_format")


@pytest.mark.parametrize("kind,value", [("json", {"type": "string", "enum": ["a\ud800"]}), ("regex", "a\udfff"),
                                        ("choice", ["x", "\ud800"]), ("grammar", 'root ::= "\ud800"')])
def test_a_lone_surrogate_is_named_not_left_to_the_compiler(kind, value):
    """Valid JSON, not Unicode: a 400 naming it (xgrammar's own error named its internals); a pair is fine."""
    with pytest.raises(InvalidRequestError, match=f"structured_outputs's {kind} holds a lone surrogate"):
        StructuredOutputsParams(**{kind: value})
    paired = "\ud83d\ude00".encode("utf-16", "surrogatepass").decode("utf-16")
    assert StructuredOutputsParams(regex=paired).spec == paired


@pytest.mark.parametrize("schema", [
    {"type": "string", "pattern": "^\\d{3}-[a-z]+\\.com\\s?$"},  # classes keep quotes and control characters out
    *({"type": "string", "pattern": p} for p in ('[a-z"]+', '[^"]+', "^[^\\n]+$", "[^\\\\]+", "[\\]\"]x")),
    {"$ref": "#/$defs/a", "description": "x", "$defs": {"a": {"type": "integer"}}},
    {"type": "integer", "multipleOf": 7},
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    {"type": "string", "enum": ["xa", "xb"], "pattern": "^x"},  # every listed value meets the keywords beside it
    {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None, "title": "pydantic's Optional"},
    {"anyOf": [{"type": "string"}, {"type": "null"}], "uniqueItems": False},  # asks for nothing
    # draft-04's exclusiveMinimum is a flag: the listed values are read by the schema's own dialect
    {"$schema": "http://json-schema.org/draft-04/schema#", "type": "integer", "minimum": 0, "exclusiveMinimum": True,
     "enum": [1, 2]},
])
def test_their_safe_neighbours_are_accepted(schema):
    check_json_schema(schema, "response_format")


def test_a_backend_other_than_xgrammar_is_refused_not_ignored():
    for backend in (None, "auto", "xgrammar"):
        assert StructuredOutputsParams.from_request({"regex": "a+", "backend": backend}).kind == "regex"
    with pytest.raises(InvalidRequestError, match="backend 'guidance' is not available"):
        StructuredOutputsParams.from_request({"regex": "a+", "backend": "guidance"})


def test_pydantic_s_discriminated_union_is_accepted():
    """pydantic (and the openai SDK's strict form of it) writes OpenAPI's `discriminator` beside a discriminated
    union's oneOf: an annotation here, as each branch's const property enforces it (a 400 before)."""
    from typing import Literal, Union

    from openai.lib._pydantic import to_strict_json_schema
    from pydantic import BaseModel, Field

    class Cat(BaseModel):
        pet_type: Literal["cat"]
        meows: int

    class Dog(BaseModel):
        pet_type: Literal["dog"]
        barks: float

    class Owner(BaseModel):
        pet: Union[Cat, Dog] = Field(discriminator="pet_type")

    for schema in (Owner.model_json_schema(), to_strict_json_schema(Owner)):
        assert "discriminator" in schema["properties"]["pet"]
        check_json_schema(schema, "response_format")
