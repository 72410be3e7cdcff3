"""POST /v1/responses (OpenAI's Responses API) through the official `openai` client, on a tiny random Llama:
each answer equals the chat completion it is translated to (greedy, EOS ignored), streamed events add up to the
non-streamed response, and what a stateless text server cannot do is a 400 naming the field."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.server.server_utils import module_server, openai_client

MODEL = "tiny"
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
                         "additionalProperties": False}}]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    yield from module_server(tiny_model_dir("llama"), "--served-model-name", MODEL, "--max-model-len", "256",
                             "--dtype", "float32", tmp_path_factory=tmp_path_factory)


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def chat_text(client, messages, max_tokens, **kwargs):
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, **GREEDY, **kwargs)
    return reply.choices[0].message, reply.usage


def test_text_equals_the_chat_completion(client):
    response = client.responses.create(model=MODEL, input="Hello there", instructions="Be brief.",
                                       max_output_tokens=6, **GREEDY)
    message, usage = chat_text(client, [{"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": "Hello there"}], 6)
    assert response.output_text == message.content
    assert response.id.startswith("resp_") and response.object == "response" and response.model == MODEL
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert (response.usage.input_tokens, response.usage.output_tokens) == (usage.prompt_tokens, 6)
    assert response.output[0].type == "message" and response.output[0].role == "assistant"
    assert (response.temperature, response.top_p) == (0.0, 1.0)  # what sampling used, as OpenAI echoes (null)
    plain = client.responses.create(model=MODEL, input="Hi", max_output_tokens=1, top_p=0.5)
    assert (plain.temperature, plain.top_p) == (1.0, 0.5)
    parts = [{"type": "input_text", "text": "Hello"}, {"type": "input_text", "text": "there"}]
    as_items = client.responses.create(model=MODEL, max_output_tokens=6, **GREEDY, input=[
        {"role": "developer", "content": "Be brief."}, {"type": "message", "role": "user", "content": parts}])
    message, _ = chat_text(client, [{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "Hello\nthere"}], 6)
    assert as_items.output_text == message.content


def test_stream_events_add_up_to_the_response(client):
    with client.responses.stream(model=MODEL, input="Stream me", max_output_tokens=8, **GREEDY) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]  # max_output_tokens ended it, as OpenAI's stream says
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    plain = client.responses.create(model=MODEL, input="Stream me", max_output_tokens=8, **GREEDY)
    assert deltas == final.output[0].content[0].text == plain.output_text
    assert final.usage.output_tokens == plain.usage.output_tokens == 8
    raw = httpx.post(f"{client.base_url}responses", json={"model": MODEL, "input": "x", "stream": True,
                                                          "max_output_tokens": 200}).text
    assert "event: response.completed" in raw or "event: response.incomplete" in raw


def test_function_calls_and_their_outputs(client):
    forced = client.responses.create(model=MODEL, input="Weather in Paris?", tools=TOOLS, max_output_tokens=60,
                                     tool_choice={"type": "function", "name": "get_weather"}, temperature=0)
    call = forced.output[-1]
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert json.loads(call.arguments) in ({"city": "Paris"}, {"city": "Rome"})
    # The call and its output go back as input items: rendered as the chat route renders tool messages.
    follow = client.responses.create(model=MODEL, tools=TOOLS, tool_choice="none", max_output_tokens=5, **GREEDY,
                                     input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": "get_weather", "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    chat_tools = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS]
    message, _ = chat_text(client, [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function",
             "function": {"name": "get_weather", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}], 5, tools=chat_tools, tool_choice="none")
    assert follow.output_text == message.content


def test_text_format_json_schema(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
              "additionalProperties": False}
    response = client.responses.create(model=MODEL, input="A number", max_output_tokens=80, temperature=0,
                                       text={"format": {"type": "json_schema", "name": "num", "schema": schema}})
    assert set(json.loads(response.output_text)) == {"n"}


@pytest.mark.parametrize("body,param", [
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "include": ["message.output_text.logprobs"]}, "include"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
    ({"input": []}, "input"),
    ({"input": "x", "text": {"format": {"type": "grammar"}}}, "text"),
    ({"input": "x", "text": {"format": "json"}}, "text"),  # a 500 before
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, "text"),  # no name
    ({"input": "x", "n": 2}, "n"),  # the stream mixed two generations into one message
    ({"input": "x", "logprobs": True}, "logprobs"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "max_tool_calls": 1}, "max_tool_calls"),
    ({"input": "x", "metadata": {"a": 1}}, "metadata"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": 400}, "max_output_tokens"),  # past --max-model-len
    ({"input": "x", "reasoning": {"effort": "huge"}}, "reasoning"),  # was chat's reasoning_effort (QA-W)
    ({"input": [{"type": "function_call_output", "call_id": "call_9", "output": "x"}]}, "input"),  # no such call
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input"),  # no call_id
])
def test_what_cannot_be_honoured_is_a_400(server, body, param):
    response = httpx.post(f"{server.url}/v1/responses", json={"model": MODEL, **body}, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text


@pytest.mark.parametrize("body,words", [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "Responses tools are flat"),
    ({"tools": [{"type": "function", "parameters": {}}]}, "a function tool needs a name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"nam": "f"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "needs the function's name"),
    ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "'allowed_tools'"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, '{"type": "function", "name": ...}'),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]}, "needs text, a string"),
])
def test_400s_speak_the_responses_forms(server, body, words):
    """The messages name the Responses forms (flat tools, tool_choice {"type": "function", "name"}), not the chat
    route's, and the problem itself (a part's text that is not a string was "type not supported"; QA-W)."""
    response = httpx.post(f"{server.url}/v1/responses", json={"model": MODEL, "input": "x", **body}, timeout=30)
    assert response.status_code == 400 and words in response.json()["error"]["message"], response.text
    assert "function.name" not in response.json()["error"]["message"], response.text


def test_a_call_cut_at_max_output_tokens_is_incomplete(client, server):
    """A function call cut short has arguments that are no JSON: OpenAI marks the item incomplete (it said
    completed, and a client loop json.loads the arguments of completed calls; QA-W)."""
    named = {"tools": TOOLS, "tool_choice": {"type": "function", "name": "get_weather"}, "max_output_tokens": 2}
    cut = client.responses.create(model=MODEL, input="Weather?", temperature=0, **named)
    assert cut.status == "incomplete" and cut.completed_at is None
    assert cut.output[-1].type == "function_call" and cut.output[-1].status == "incomplete", cut.output
    raw = httpx.post(f"{server.url}/v1/responses", json={"model": MODEL, "input": "Weather?", "stream": True,
                                                         "temperature": 0, **named}, timeout=30).text
    done = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: ")]
    item_done = [e["item"] for e in done if e["type"] == "response.output_item.done"]
    assert item_done[-1]["type"] == "function_call" and item_done[-1]["status"] == "incomplete", item_done
    assert done[-1]["response"]["output"][-1]["status"] == "incomplete"
    whole = client.responses.create(model=MODEL, input="Weather?", temperature=0, **{**named,
                                                                                     "max_output_tokens": 60})
    assert whole.output[-1].status == "completed" and whole.status == "completed" and whole.completed_at > 0


def test_accepted_defaults_and_no_effect_fields(client, server):
    """tool_choice "auto" (its default) without tools, and OpenAI's service fields, are taken; a cut message is
    marked incomplete; the stream ends with its last event (no chat-style [DONE])."""
    response = client.responses.create(model=MODEL, input="Hi", tool_choice="auto", max_output_tokens=3,
                                       service_tier="auto", prompt_cache_key="k", safety_identifier="u", **GREEDY)
    assert response.status == "incomplete" and response.output[0].status == "incomplete"
    raw = httpx.post(f"{server.url}/v1/responses", json={"model": MODEL, "input": "Hi", "stream": True,
                                                         "max_output_tokens": 3, "ignore_eos": True}).text
    assert "[DONE]" not in raw and raw.rstrip().splitlines()[-1].startswith('data: {"type": "response.incomplete"')
    final = json.loads(raw.rstrip().splitlines()[-1][6:])["response"]
    assert final["output"][0]["status"] == "incomplete"
    assert set(final["usage"]["input_tokens_details"]) == {"cached_tokens", "cache_write_tokens"}  # the SDK's fields


def test_responses_are_not_stored(server):
    """Every OpenAI call on a stored response is a 404 saying so (DELETE was a 405, cancel and input_items a bare
    Not Found)."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    for call in (client.responses.retrieve, client.responses.delete, client.responses.cancel,
                 client.responses.input_items.list):
        with pytest.raises(openai.NotFoundError, match="not stored"):
            call("resp_abc")
