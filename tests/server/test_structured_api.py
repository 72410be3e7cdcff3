"""Structured outputs over HTTP with the official openai client, on a tiny random-weight model: whatever the
weights, the grammar alone must make every output valid."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest

from tests.server.server_utils import module_server, openai_client
from tests.server.test_api import metric_value

MODEL = "tiny"


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    yield from module_server(tiny_model_dir("llama", max_position_embeddings=1024), "--served-model-name", MODEL,
                             "--max-model-len", "1024",
                             "--dtype", "float32", tmp_path_factory=tmp_path_factory)


@pytest.fixture
def client(server):
    return openai_client(server)


class Address(pydantic.BaseModel):
    city: str = pydantic.Field(min_length=1, max_length=12)
    zip_code: int = pydantic.Field(ge=10000, le=99999)


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=10)
    age: int = pydantic.Field(ge=0, le=130)
    role: Literal["admin", "user", "guest"]
    nickname: str | None = pydantic.Field(default=None, max_length=6)
    tags: list[Literal["red", "green"]] = pydantic.Field(max_length=3)
    address: Address
    previous: list[Address] = pydantic.Field(max_length=2)


def test_parse_with_a_pydantic_model(client):
    for seed in range(3):
        completion = client.chat.completions.parse(
            model=MODEL, messages=[{"role": "user", "content": "Describe a person."}], response_format=Person,
            max_tokens=600, seed=seed)
        choice = completion.choices[0]
        assert choice.finish_reason == "stop"
        person = choice.message.parsed
        assert isinstance(person, Person) and isinstance(person.address, Address)
        assert 0 <= person.age <= 130 and len(person.name) <= 10


CATALOGUE = {"type": "object", "additionalProperties": False, "required": ["sku", "count", "sizes", "meta"],
             "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                            "count": {"type": "integer", "minimum": -5, "maximum": 5},
                            "price": {"type": "number", "minimum": 0},
                            "sizes": {"type": "array", "minItems": 1, "maxItems": 3,
                                      "items": {"enum": ["S", "M", "L"]}},
                            "meta": {"type": "object", "required": ["ok"], "additionalProperties": False,
                                     "properties": {"ok": {"type": "boolean"}, "note": {"type": ["string", "null"],
                                                                                         "maxLength": 5}}}}}


def test_fifty_random_completions_all_validate(client):
    texts = []
    for schema in (Person.model_json_schema(), CATALOGUE):
        response = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "JSON please"}], temperature=1.0, n=25, seed=11,
            max_tokens=600, response_format={"type": "json_schema",
                                             "json_schema": {"name": "s", "schema": schema, "strict": True}})
        for choice in response.choices:
            assert choice.finish_reason == "stop", choice.message.content
            jsonschema.validate(json.loads(choice.message.content), schema)
            texts.append(choice.message.content)
    assert len(texts) == 50 and len(set(texts)) > 40  # sampled, not one answer repeated


def test_regex_and_choice_on_both_endpoints(client):
    completion = client.completions.create(model=MODEL, prompt="Code:", max_tokens=30, temperature=1.0, n=5,
                                           extra_body={"structured_outputs": {"regex": "[A-Z]{2}[0-9]{3}"}})
    assert all(re.fullmatch(r"[A-Z]{2}[0-9]{3}", c.text) for c in completion.choices)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Pick"}], n=5,
                                          max_tokens=10, temperature=1.0,
                                          extra_body={"structured_outputs": {"choice": ["left", "right"]}})
    assert {c.message.content for c in chat.choices} <= {"left", "right"}
    grammar = client.completions.create(model=MODEL, prompt="Sum:", max_tokens=30, temperature=1.0,
                                        extra_body={"structured_outputs": {"grammar": 'root ::= [1-9] " + " [1-9]'}})
    assert re.fullmatch(r"[1-9] \+ [1-9]", grammar.choices[0].text)


def test_json_object_is_an_object_or_cut_short(client):
    response = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "{}"}], n=8,
                                              temperature=1.0, seed=2, max_tokens=200,
                                              response_format={"type": "json_object"})
    for choice in response.choices:
        assert choice.message.content.startswith("{")
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)


def test_constrained_and_free_requests_in_one_batch(server):
    async def run() -> list:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        calls = []
        for i in range(8):
            extra = {"structured_outputs": {"json": CATALOGUE}} if i % 2 else {}
            calls.append(client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"Item {i}"}], max_tokens=300, seed=i,
                temperature=1.0, extra_body=extra))
        return await asyncio.gather(*calls)

    client = openai_client(server)
    for i, response in enumerate(asyncio.run(run())):
        text = response.choices[0].message.content
        if i % 2:
            jsonschema.validate(json.loads(text), CATALOGUE)
        else:  # a free request is what it is alone (seeded sampling does not depend on the batch)
            alone = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"Item {i}"}],
                                                   max_tokens=300, seed=i, temperature=1.0)
            assert text == alone.choices[0].message.content


def test_streamed_json_equals_non_streamed(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=400, temperature=1.0, seed=5,
                  response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": CATALOGUE}})
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs)
              if c.choices]
    assert "".join(pieces) == whole and len(pieces) > 3


def test_repeated_schema_is_compiled_once(server, client):
    schema = {"type": "object", "properties": {"unique_field_for_cache_test": {"type": "boolean"}},
              "required": ["unique_field_for_cache_test"]}
    before = metric_value(server, "pagedserve:grammar_compile_seconds_count", model_name=MODEL)
    for _ in range(3):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=50,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "b", "schema": schema}})
    assert metric_value(server, "pagedserve:grammar_compile_seconds_count", model_name=MODEL) == before + 1


@pytest.mark.parametrize("body, named", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "uniqueItems": True}}}}, "uniqueItems"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}}},
     "invalid JSON schema"),
    ({"structured_outputs": {"regex": "[a-z"}}, "regex cannot be compiled"),
    ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "undefined_rule"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one of"),
    ({"guided_json": {"type": "object"}}, '{"structured_outputs": {"json": ...}}'),
    ({"guided_regex": "[a-z]+"}, '{"structured_outputs": {"regex": ...}}'),  # the matching key (QA-F)
    ({"guided_choice": ["a"], "guided_decoding_backend": "xgrammar"}, '{"structured_outputs": {"choice": ...}}'),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "not both"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "'g', which is not among the tools"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "--enable-auto-tool-choice"),
])
def test_bad_structured_requests_get_400_naming_the_problem(server, body, named):
    for stream in (False, True):
        response = httpx.post(f"{server.url}/v1/chat/completions", timeout=30, json={
            "model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 5, "stream": stream,
            **body})
        assert response.status_code == 400, response.text
        assert named in response.json()["error"]["message"]
    ok = httpx.post(f"{server.url}/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 3})
    assert ok.status_code == 200
