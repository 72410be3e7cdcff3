"""Tool calling with the official openai client against real models: the default SmolLM2-135M (its template has
no tool format: "required" and named functions, enforced by a grammar) and, slow, Qwen2.5-Coder-0.5B with the
hermes parser ("auto": the calls the model writes are extracted)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.server.server_utils import openai_client, start_server

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city",
        "parameters": {"type": "object", "required": ["city", "unit"], "properties": {
            "city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}}}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two integers",
        "parameters": {"type": "object", "required": ["a", "b"], "properties": {
            "a": {"type": "integer"}, "b": {"type": "integer"}}}}},
]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
WEATHER = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]


def check_calls(message) -> list:
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])
    return message.tool_calls


def streamed_calls(stream) -> tuple[list[tuple[str, str]], str | None]:
    """(name, arguments) per call as the openai client's chunks add up, and the finish reason."""
    calls: dict[int, list] = {}
    finish = None
    for number, chunk in enumerate(stream):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        # after the opening role chunk, every chunk carries something (no empty deltas while a call is read)
        assert number == 0 or choice.delta.content or choice.delta.tool_calls or choice.finish_reason, chunk
        for delta in choice.delta.tool_calls or []:
            entry = calls.setdefault(delta.index, [None, ""])
            if delta.id is not None:
                assert delta.id.startswith("call_") and entry[0] is None  # the id and name come once, first
                entry[0] = delta.function.name
            entry[1] += delta.function.arguments or ""
        finish = choice.finish_reason or finish
    return [tuple(calls[i]) for i in sorted(calls)], finish


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    srv = start_server("smollm2-135m-instruct", "--max-model-len", "2048", "--enable-auto-tool-choice",
                       "--tool-call-parser", "hermes", log_dir=tmp_path_factory.mktemp("logs"))
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture
def client(smollm2):
    return openai_client(smollm2)


def model_id(client) -> str:
    return client.models.list().data[0].id


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}},
                                         {"type": "function", "function": {"name": "add"}}])
def test_forced_calls_validate_and_stream_the_same(client, tool_choice):
    kwargs = dict(model=model_id(client), messages=WEATHER, tools=TOOLS, tool_choice=tool_choice, max_tokens=200,
                  temperature=0.0)
    response = client.chat.completions.create(**kwargs)
    choice = response.choices[0]
    calls = check_calls(choice.message)
    expected = "stop" if isinstance(tool_choice, dict) else "tool_calls"  # a call forced by name: "stop" (OpenAI)
    assert choice.finish_reason == expected and choice.message.content is None
    if isinstance(tool_choice, dict):
        assert [c.function.name for c in calls] == [tool_choice["function"]["name"]]
    got, finish = streamed_calls(client.chat.completions.create(stream=True, **kwargs))
    assert got == [(c.function.name, c.function.arguments) for c in calls] and finish == expected


def test_a_stop_string_inside_a_required_call_keeps_finish_reason_stop(client):
    """The request's stop string cuts the call's arguments short: the answer says "stop" (it asked for the cut),
    not "tool_calls", which promises complete calls; streamed the same."""
    kwargs = dict(model=model_id(client), messages=WEATHER, tools=TOOLS, tool_choice="required", max_tokens=200,
                  temperature=0.0, stop=["city"])
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.message.tool_calls and choice.finish_reason == "stop"
    with pytest.raises(ValueError):
        json.loads(choice.message.tool_calls[0].function.arguments)
    got, finish = streamed_calls(client.chat.completions.create(stream=True, **kwargs))
    assert got == [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] and finish == "stop"


def test_sampled_required_calls_always_validate(client):
    """At temperature 1 every sampled call parses and matches its schema (one call each: a free-running model can
    add calls to the array until max_tokens cuts it)."""
    response = client.chat.completions.create(model=model_id(client), messages=WEATHER, tools=TOOLS,
                                              tool_choice="required", parallel_tool_calls=False, max_tokens=300,
                                              temperature=1.0, n=8, seed=5)
    names = set()
    for choice in response.choices:
        assert choice.finish_reason == "tool_calls"
        calls = check_calls(choice.message)
        assert len(calls) == 1
        names.add(calls[0].function.name)
    assert names <= set(PARAMETERS)


def test_tool_result_round_trips_into_an_answer(client):
    first = client.chat.completions.create(model=model_id(client), messages=WEATHER, tools=TOOLS,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           max_tokens=200, temperature=0.0)
    call = check_calls(first.choices[0].message)[0]
    conversation = WEATHER + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "sky": "clear"})}]
    final = client.chat.completions.create(model=model_id(client), messages=conversation, tools=TOOLS,
                                           tool_choice="none", max_tokens=60, temperature=0.0)
    answer = final.choices[0].message
    assert answer.tool_calls is None and answer.content and "18" in answer.content


def test_auto_is_refused_when_the_template_has_no_tool_format(client):
    with pytest.raises(openai.BadRequestError, match="no tool-call format") as info:
        client.chat.completions.create(model=model_id(client), messages=WEATHER, tools=TOOLS, max_tokens=20)
    assert info.value.body["param"] == "tool_choice"


def test_json_object_on_the_default_model(client):
    response = client.chat.completions.create(
        model=model_id(client), max_tokens=200, temperature=0.0, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Describe a cat as a JSON object with a name and an age."}])
    assert response.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(response.choices[0].message.content), dict)


@pytest.mark.slow
def test_qwen_auto_calls_with_the_hermes_parser(tmp_path_factory):
    srv = start_server("qwen2.5-coder-0.5b-instruct", "--max-model-len", "4096", "--enable-auto-tool-choice",
                       "--tool-call-parser", "hermes", log_dir=tmp_path_factory.mktemp("logs"), ready_timeout=600)
    try:
        client = openai_client(srv)
        kwargs = dict(model=model_id(client), messages=WEATHER, tools=TOOLS, max_tokens=120, temperature=0.0)
        response = client.chat.completions.create(**kwargs)  # tool_choice defaults to "auto"
        calls = check_calls(response.choices[0].message)
        assert calls[0].function.name == "get_weather" and response.choices[0].finish_reason == "tool_calls"
        got, finish = streamed_calls(client.chat.completions.create(stream=True, **kwargs))
        assert got == [(c.function.name, c.function.arguments) for c in calls] and finish == "tool_calls"
        conversation = WEATHER + [
            {"role": "assistant", "content": None, "tool_calls": [calls[0].model_dump()]},
            {"role": "tool", "tool_call_id": calls[0].id, "content": json.dumps({"temperature": 18})}]
        rendered = httpx.post(f"{srv.url}/tokenize", json={"messages": conversation}, timeout=30).json()
        text = httpx.post(f"{srv.url}/detokenize", json={"tokens": rendered["tokens"]}, timeout=30).json()["prompt"]
        assert "<tool_response>" in text and '"temperature": 18' in text and '"city": "Paris"' in text
        final = client.chat.completions.create(model=model_id(client), messages=conversation, tools=TOOLS,
                                               tool_choice="none", max_tokens=60, temperature=0.0)
        assert final.choices[0].message.content and final.choices[0].message.tool_calls is None
    finally:
        assert srv.stop() == 0, srv.log()


# A Mistral-style template: it refuses a tool call id that is not 9 letters and digits (Mistral-7B-Instruct-v0.3's
# does), and writes the calls after [TOOL_CALLS].
MISTRAL_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'assistant' and m.tool_calls %}[TOOL_CALLS] ["
    "{% for c in m.tool_calls %}{% if c.id is not defined or c.id|length != 9 %}"
    "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}"
    "{{ c.function | tojson }}{% endfor %}]</s>{% else %}[INST] {{ m.content }} [/INST]{% endif %}{% endfor %}"
    "{% if tools %}[AVAILABLE_TOOLS] {{ tools | map(attribute='function') | map(attribute='name') | join(' ') }}"
    "[/AVAILABLE_TOOLS]{% endif %}")


def test_mistral_parser_ids_round_trip_through_a_mistral_template(tiny_model_dir, tmp_path_factory):
    """--tool-call-parser mistral: the calls' ids are ones Mistral's templates take back (any other id is the
    template's 400); "auto" reads what a model writes without calls as content."""
    srv = start_server(tiny_model_dir("mistral"), "--served-model-name", "tiny-mistral", "--max-model-len", "512",
                       "--enable-auto-tool-choice", "--tool-call-parser", "mistral", "--chat-template",
                       MISTRAL_TEMPLATE, log_dir=tmp_path_factory.mktemp("logs"))
    try:
        client = openai_client(srv)
        first = client.chat.completions.create(model="tiny-mistral", messages=WEATHER, tools=TOOLS, max_tokens=200,
                                               tool_choice={"type": "function", "function": {"name": "add"}})
        call = first.choices[0].message.tool_calls[0]
        assert len(call.id) == 9 and call.id.isalnum()
        history = WEATHER + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                             {"role": "tool", "tool_call_id": call.id, "content": "3"}]
        again = client.chat.completions.create(model="tiny-mistral", messages=history, tools=TOOLS, max_tokens=8,
                                               temperature=0.0)
        assert again.choices[0].message.tool_calls is None and again.choices[0].message.content is not None
        history[1]["tool_calls"][0]["id"] = "call_0123456789abcdef"
        with pytest.raises(openai.BadRequestError, match="length 9"):
            client.chat.completions.create(model="tiny-mistral", messages=history, max_tokens=8)
    finally:
        assert srv.stop() == 0, srv.log()
