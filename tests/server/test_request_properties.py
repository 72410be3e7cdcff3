"""Property-based requests against a real server: hypothesis builds request bodies from the pydantic request
models' own field types (well-formed JSON, values anywhere in or far outside their valid ranges) and sends
them; whatever they hold, the answer is never a 5xx and the engine never dies."""

from __future__ import annotations

import json
import types
import typing
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from pagedserve.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                                    EmbeddingRequest, TokenizeRequest)
from tests.server.server_utils import start_server

MODEL = "tiny"
VOCAB_SIZE = 512  # tests/tiny_models.py
# Integers around every edge the server has: token ids vs the vocabulary, max_model_len, the limits set
# below, int32/int64 and beyond.
EDGE_INTS = [0, 1, 2, 4, 5, 20, 21, 63, 64, 65, VOCAB_SIZE - 1, VOCAB_SIZE, 2**31, 2**63 - 1, 2**63, 2**64,
             -1, -2, -(2**63), -(2**63) - 1, 10**40]
EDGE_FLOATS = [0.0, -0.0, 1e-6, 0.5, 1.0, 2.0, 2.0001, -2.0, 100.0, 100.5, -100.5, 1e308, -1e308,
               float("inf"), float("-inf"), float("nan")]
# Small bounds, so that a request inside them is quick on a tiny model, and requests test the bounds too.
LIMIT_FLAGS = ["--max-n", "3", "--max-request-tokens", "256", "--max-stop-sequences", "3",
               "--max-logit-bias-entries", "4", "--max-stop-token-ids", "4", "--max-prompts-per-request", "3"]

ints = st.one_of(st.integers(-3, 70), st.sampled_from(EDGE_INTS))
# Fields that hold token ids get ids around the vocabulary's edges (the model types cannot say which do).
TOKEN_ID_FIELDS = frozenset({"prompt", "logit_bias", "stop_token_ids", "tokens", "input"})
token_ids = st.one_of(st.integers(0, VOCAB_SIZE - 1), st.sampled_from([VOCAB_SIZE, VOCAB_SIZE + 1, 10**6, -1, 2**63]))
floats = st.one_of(st.floats(-3, 3), st.sampled_from(EDGE_FLOATS))
texts = st.one_of(st.text(max_size=12), st.sampled_from(["", "The quick brown fox", "<|im_end|>", "\x00", "你好"]))
json_values = st.recursive(st.none() | st.booleans() | ints | floats | texts,
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
                           max_leaves=6)


def bounded(examples: int) -> Any:
    """hypothesis settings for these server tests: a fixed number of examples, reproducible (derandomized,
    no example database), no deadline (a request's time depends on the box)."""
    return settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

def strategy_for(annotation: Any, integers: st.SearchStrategy = ints) -> st.SearchStrategy:
    """Values of a pydantic field's annotation, edges and nonsense of the right JSON shape included."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*(strategy_for(a, integers) for a in args))
    if origin is typing.Literal:
        return st.sampled_from(args) | texts
    # Containers empty or not as often (hypothesis' own lists lean to the empty one it shrinks to).
    if origin is list:
        return st.just([]) | st.lists(strategy_for(args[0], integers), min_size=1, max_size=3)
    if origin is dict:
        keys = st.one_of(integers.map(str), st.sampled_from(["x", "", "1.5", " 3"])) if args[0] is str else texts
        return st.just({}) | st.dictionaries(keys, strategy_for(args[1], integers), min_size=1, max_size=3)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return model_bodies(annotation)
    simple = {int: integers, float: floats, bool: st.booleans(), str: texts, type(None): st.none(), Any: json_values}
    return simple[annotation]


def field_strategy(model: type[BaseModel], name: str) -> st.SearchStrategy:
    return strategy_for(model.model_fields[name].annotation, token_ids if name in TOKEN_ID_FIELDS else ints)


def model_bodies(model: type[BaseModel], fixed: dict | None = None, max_optional: int = 4) -> st.SearchStrategy:
    """JSON bodies for `model`: its required fields, plus up to `max_optional` of its optional ones (a body
    with every field set would nearly always stop at the first unsupported one, never reaching the engine)."""
    fixed = fixed or {}
    fields = {name: field_strategy(model, name) for name in model.model_fields if name not in fixed}
    required = {name: fields[name] for name, f in model.model_fields.items() if f.is_required() and name in fields}
    optional_names = sorted(name for name in fields if name not in required)
    chosen = (st.lists(st.sampled_from(optional_names), max_size=max_optional, unique=True) if optional_names
              else st.just([]))
    base = st.fixed_dictionaries({**required, **fixed})
    return st.tuples(base, chosen.flatmap(lambda names: st.fixed_dictionaries({n: fields[n] for n in names}))
                     ).map(lambda parts: {**parts[1], **parts[0]})


def chat_messages() -> st.SearchStrategy:
    content = texts | st.none() | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"])},
                                                                 optional={"text": texts}), max_size=2)
    roles = st.sampled_from(["user", "user", "assistant", "system", "", "tool"])
    return st.lists(st.fixed_dictionaries({"role": roles, "content": content}), min_size=1, max_size=3) | st.just([])


# The model name mostly right (else every request is a quick 404); prompts and messages in shapes the
# serving layer reaches deep with.
FIXED = {"model": st.sampled_from([MODEL] * 5 + [None, "nope"])}
# Prompts mostly valid, so the other fields' values reach the engine; any shape the model allows besides.
PROMPTS = (st.sampled_from(["The quick brown fox", "hi"]) | st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1,
                                                                     max_size=6)
           | field_strategy(CompletionRequest, "prompt"))
BODIES = {
    "/v1/completions": model_bodies(CompletionRequest, {**FIXED, "prompt": PROMPTS}, max_optional=3),
    "/v1/chat/completions": model_bodies(ChatCompletionRequest, {**FIXED, "messages": chat_messages()},
                                         max_optional=3),
    "/tokenize": model_bodies(TokenizeRequest, FIXED),
    "/detokenize": model_bodies(DetokenizeRequest, FIXED),
}
NUM_EXAMPLES = {"/v1/completions": 40, "/v1/chat/completions": 40, "/tokenize": 20, "/detokenize": 20}
# Every optional field of the completions model alone on a valid request: each gets its own examples, so
# an edge of one field (a token id past the vocabulary in logit_bias) is not left to chance among thirty.
COMPLETION_FIELDS = sorted(name for name, f in CompletionRequest.model_fields.items()
                           if not f.is_required() and name != "model")
VALID_COMPLETION = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 4}


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    # One passive thread: many tiny steps run fastest so when other processes share the cores.
    srv = start_server(tiny_model_dir("llama"), "--served-model-name", MODEL, "--max-model-len", "64",
                       "--dtype", "float32", "--max-num-seqs", "8", "--num-threads", "1",
                       "--omp-wait-policy", "passive", *LIMIT_FLAGS,
                       log_dir=tmp_path_factory.mktemp("logs"))
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def check_answer(http: httpx.Client, path: str, body: dict) -> None:
    response = http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    assert response.status_code < 500, (body, response.text)
    if response.status_code >= 400:
        assert response.json()["error"]["message"]
    elif body.get("stream") is True and path.startswith("/v1/"):
        events = [json.loads(line[6:]) for line in response.text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        errors = [e["error"] for e in events if "error" in e]
        assert not [e for e in errors if e["code"] >= 500], (body, errors)
    health = http.get("/health")
    assert health.status_code == 200, (body, health.text)


@pytest.mark.parametrize("path", list(BODIES))
def test_generated_requests_never_get_a_5xx(http, path):
    @bounded(NUM_EXAMPLES[path])
    @given(BODIES[path])
    def check(body: dict) -> None:
        check_answer(http, path, body)

    check()


@pytest.mark.parametrize("field", COMPLETION_FIELDS)
def test_each_completion_field_alone_never_gets_a_5xx(http, field):
    values = field_strategy(CompletionRequest, field)

    @bounded(15)
    @given(values)
    def check(value: Any) -> None:
        check_answer(http, "/v1/completions", {**VALID_COMPLETION, field: value})

    check()


def test_server_still_answers_after_the_fuzzing(http):
    still_fine = {"model": MODEL, "prompt": "still fine", "max_tokens": 3, "ignore_eos": True}
    ok = http.post("/v1/completions", json=still_fine)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


LIMITED = [  # (body changes on a valid completion, the field the 400 must name)
    ({"n": 4}, "n"),
    ({"stop": ["a", "b", "c", "d"]}, "stop"),
    ({"stop": ["x" * 1025]}, "stop"),
    ({"stop_token_ids": [1, 2, 3, 4, 5]}, "stop_token_ids"),
    ({"stop_token_ids": [VOCAB_SIZE]}, "stop_token_ids"),
    ({"logit_bias": {str(i): 1 for i in range(5)}}, "logit_bias"),
    ({"logit_bias": {str(VOCAB_SIZE): 1}}, "logit_bias"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"prompt": ["a", "b", "c", "d"]}, "prompt"),
    ({"prompt": [[1], [2], [3], [4]]}, "prompt"),
    ({"prompt": [1, VOCAB_SIZE]}, "prompt"),
    ({"n": 3, "prompt": ["a", "b", "c"], "max_tokens": 40}, "max_tokens"),  # 3 x 3 x 41 > 256
    ({"seed": 2**64}, "seed"),
    ({"top_k": 2**63}, "top_k"),
    ({"temperature": float("nan")}, "temperature"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"request_id": "x" * 129}, "request_id"),
]


@pytest.mark.parametrize("changes,param", LIMITED, ids=[p for _, p in LIMITED])
def test_out_of_bounds_field_gets_400_naming_it(http, changes, param):
    response = http.post("/v1/completions", content=json.dumps({**VALID_COMPLETION, **changes}),
                         headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text


def test_chat_limits_and_reserved_template_arguments(http):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for changes, param in [({"n": 4}, "n"), ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
                           ({"max_completion_tokens": 0}, "max_completion_tokens")]:
        response = http.post("/v1/chat/completions", json={**chat, **changes})
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    # Within the limits: the largest n the server allows works.
    ok = http.post("/v1/chat/completions", json={**chat, "n": 3})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 3


def test_limit_flags_are_generated_with_their_help():
    import subprocess
    import sys

    help_text = subprocess.run([sys.executable, "-m", "pagedserve", "serve", "--help"], capture_output=True,
                               text=True, check=True).stdout
    for flag in ("--max-n", "--max-stop-sequences", "--max-logit-bias-entries", "--max-request-tokens",
                 "--max-prompts-per-request", "--max-stop-token-ids"):
        assert flag in help_text
    assert "--fault-injection" not in help_text  # testing only: hidden


# ---- /v1/embeddings, on a tiny decoder served as an embedder ---------------------------------------------
EMBED_MODEL = "tiny-embed"
EMBED_FIELDS = sorted(name for name, f in EmbeddingRequest.model_fields.items() if name != "model")


@pytest.fixture(scope="module")
def embed_http(tiny_model_dir, tmp_path_factory):
    srv = start_server(tiny_model_dir("qwen3", is_matryoshka=True), "--runner", "pooling", "--served-model-name",
                       EMBED_MODEL, "--dtype", "float32", "--max-model-len", "64", "--num-threads", "1",
                       "--omp-wait-policy", "passive", log_dir=tmp_path_factory.mktemp("logs"))
    with httpx.Client(base_url=srv.url, timeout=60) as client:
        yield client
    assert srv.stop() == 0, srv.log()


@pytest.mark.parametrize("field", EMBED_FIELDS)
def test_each_embedding_field_alone_never_gets_a_5xx(embed_http, field):
    values = field_strategy(EmbeddingRequest, field)

    @bounded(15)
    @given(values)
    def check(value: Any) -> None:
        check_answer(embed_http, "/v1/embeddings", {"model": EMBED_MODEL, "input": "The quick brown fox", field: value})

    check()


def test_generated_embedding_requests_never_get_a_5xx(embed_http):
    @bounded(40)
    @given(model_bodies(EmbeddingRequest, {"model": st.sampled_from([EMBED_MODEL] * 5 + [None, "nope"])}))
    def check(body: dict) -> None:
        check_answer(embed_http, "/v1/embeddings", body)

    check()


# ---- structured outputs and tools: generated grammars and tool lists reach the compiler and the readers --
from pagedserve.structured.schema import ANNOTATIONS, ENFORCED, SUBSCHEMAS  # noqa: E402

SCHEMA_KEYWORDS = sorted(ANNOTATIONS | ENFORCED | set(SUBSCHEMAS) | {"not", "if", "uniqueItems", "contains"})
schema_values = st.one_of(json_values, st.sampled_from(["string", "integer", "object", "array", "number", "null",
                                                        "email", "^[a-z]+$", "#/$defs/a", "#"]))
schemas = st.recursive(
    st.booleans() | st.dictionaries(st.sampled_from(SCHEMA_KEYWORDS), schema_values, max_size=3),
    lambda inner: st.dictionaries(st.sampled_from(SCHEMA_KEYWORDS),
                                  inner | schema_values | st.lists(inner, max_size=2)
                                  | st.dictionaries(texts, inner, max_size=2), max_size=3),
    max_leaves=8)
STRUCTURED = st.one_of(
    st.fixed_dictionaries({"json": schemas}),
    st.fixed_dictionaries({"regex": texts | st.sampled_from(["[a-z]+", "(a|b", "a{2,1}", "\\d{3}", ".*", "[^"])}),
    st.fixed_dictionaries({"choice": st.lists(texts, max_size=3) | json_values}),
    st.fixed_dictionaries({"grammar": texts | st.sampled_from(['root ::= "a" | "b"', "root ::=", "root ::= x",
                                                               'root ::= [0-9]+ "."'])}),
    st.fixed_dictionaries({"json_object": json_values}, optional={"disable_any_whitespace": json_values}),
    st.dictionaries(texts, json_values, max_size=2))
TOOLS = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["function", "function", "x"]),
                                        "function": st.fixed_dictionaries(
                                            {"name": st.sampled_from(["f", "g", "bad name", ""]) | texts},
                                            optional={"parameters": schemas})}) | json_values, max_size=3)
TOOL_CHOICES = (st.sampled_from(["none", "auto", "required", None])
                | st.fixed_dictionaries({"type": st.just("function"),
                                         "function": st.fixed_dictionaries({"name": st.sampled_from("fgh")})})
                | json_values)
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


@pytest.mark.parametrize("case", ["structured_outputs", "response_format", "tools"])
def test_generated_grammars_and_tools_never_get_a_5xx(http, case):
    bodies = {
        "structured_outputs": st.builds(lambda s, stream: {**VALID_COMPLETION, "max_tokens": 8, "stream": stream,
                                                           "structured_outputs": s}, STRUCTURED, st.booleans()),
        "response_format": st.builds(lambda s, strict: {**CHAT, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": s, "strict": strict}}}, schemas, st.booleans()),
        "tools": st.builds(lambda tools, choice, stream: {**CHAT, "tools": tools, "tool_choice": choice,
                                                          "stream": stream}, TOOLS, TOOL_CHOICES, st.booleans()),
    }[case]
    path = "/v1/completions" if case == "structured_outputs" else "/v1/chat/completions"

    @bounded(60)
    @given(bodies)
    def check(body: dict) -> None:
        check_answer(http, path, body)

    check()
