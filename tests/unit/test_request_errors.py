"""Typed request errors: which exceptions become 400 (and with which param), and which are the server's 500."""

from __future__ import annotations

import math

import pytest

from pagedserve.engine.async_engine import QueueFullError
from pagedserve.entrypoints.openai.errors import to_api_error
from pagedserve.exceptions import EngineDeadError, InvalidRequestError, RequestFailedError
from pagedserve.sampling_params import SamplingParams


@pytest.mark.parametrize("kwargs,param", [
    ({"temperature": -1}, "temperature"), ({"temperature": math.nan}, "temperature"),
    ({"top_p": math.inf}, "top_p"), ({"repetition_penalty": math.inf}, "repetition_penalty"),
    ({"n": 0}, "n"), ({"seed": 2**64}, "seed"), ({"top_k": 2**70}, "top_k"),
    ({"logprobs": -2}, "logprobs"), ({"prompt_logprobs": -2}, "prompt_logprobs"),
    ({"max_tokens": 2, "min_tokens": 3}, "min_tokens"), ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"logit_bias": {"x": 1.0}}, "logit_bias"),
    ({"logit_bias": {"-3": 1.0}}, "logit_bias"), ({"logit_bias": {5: 101.0}}, "logit_bias"),
])
def test_sampling_params_raise_invalid_request_naming_the_field(kwargs, param):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param
    assert isinstance(info.value, ValueError)  # the offline API's callers catch ValueError


def test_logit_bias_string_keys_become_token_ids():
    assert SamplingParams(logit_bias={"5": 2}).logit_bias == {5: 2.0}


def test_only_invalid_request_errors_are_the_clients_fault():
    bad = to_api_error(InvalidRequestError("token id 600 is out of range", param="logit_bias"))
    assert (bad.status, bad.param) == (400, "logit_bias")
    # A plain ValueError is a bug in the server, not a bad request: 500 with an id to find the traceback by.
    bug = to_api_error(ValueError("token id 600 is out of range"))
    assert bug.status == 500 and bug.param is None
    assert bug.request_id and bug.request_id in bug.message
    failed = to_api_error(RequestFailedError("cmpl-abc-0", "RuntimeError: boom"))
    assert failed.status == 500 and failed.request_id == "cmpl-abc-0" and "cmpl-abc-0" in failed.message
    assert to_api_error(EngineDeadError("dead")).status == 503
    busy = to_api_error(QueueFullError("full"))
    assert busy.status == 429 and busy.headers == {"Retry-After": "1"}


def test_internal_error_logs_its_traceback_under_the_request_id(caplog):
    try:
        raise KeyError("missing")
    except KeyError as exc:
        error = to_api_error(exc)
    record = next(r for r in caplog.records if error.request_id in r.getMessage())
    assert record.exc_info is not None


def test_dead_engine_answers_503_with_the_reason_everywhere():
    from types import SimpleNamespace

    from fastapi.testclient import TestClient

    from pagedserve.engine.startup import StartupTracker
    from pagedserve.entrypoints.openai.api_server import ServerState, build_app

    state = ServerState(StartupTracker())
    state.engine = SimpleNamespace(is_dead=True, error=EngineDeadError("the model step failed: boom"))
    client = TestClient(build_app(state))
    health = client.get("/health")
    assert health.status_code == 503 and "boom" in health.json()["error"]
    for path, body in [("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": []}),
                       ("/tokenize", {"prompt": "x"})]:
        response = client.post(path, json=body)
        assert response.status_code == 503 and "boom" in response.json()["error"]["message"]


def test_an_error_quoting_a_lone_surrogate_can_still_be_sent():
    import json

    from pagedserve.entrypoints.openai.errors import error_response

    response = error_response("The model `\ud800` does not exist", 404, param="\udfff")
    body = json.loads(response.body)
    assert body["error"]["message"] == "The model `\\ud800` does not exist" and body["error"]["param"] == "\\udfff"


def test_an_error_is_renamed_into_another_request_s_terms():
    from pagedserve.exceptions import InvalidRequestError

    error = InvalidRequestError("logprobs must be at most 20 (--max-logprobs, LLM(max_logprobs=...)), got 21",
                                param="logprobs")
    renamed = error.renamed({"logprobs": "top_logprobs"})
    assert renamed.param == "top_logprobs"
    assert renamed.message == "top_logprobs must be at most 20 (--max-logprobs, LLM(max_logprobs=...)), got 21"
    assert error.renamed({"n": "x"}) is error


def test_a_union_s_failures_name_the_field_and_two_fields_errors_stay_apart():
    """pydantic names each union member in its errors' locations ("documents.0.str"): the 400 names the field and
    what each form wanted; errors on two fields of one object are not read as a union's."""
    from fastapi.exceptions import RequestValidationError

    from pagedserve.entrypoints.openai.errors import _validation_message

    def message(errors: list[tuple[tuple, str]]) -> tuple[str, str | None]:
        return _validation_message(RequestValidationError([{"loc": ("body", *loc), "msg": msg, "type": "x"}
                                                           for loc, msg in errors]))

    text, param = message([(("documents", 0, "str"), "Input should be a valid string"),
                           (("documents", 0, "RerankDocument", "text"), "Field required")])
    assert param == "documents.0" and "none of its forms fits" in text and "RerankDocument text" in text
    text, param = message([(("messages", 0, "role"), "Field required"), (("messages", 0, "name"), "bad")])
    assert (text, param) == ("messages.0.role: Field required", "messages.0.role")
