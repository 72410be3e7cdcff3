"""--reasoning-parser with structured outputs over HTTP, as vLLM's: the model thinks first and the grammar
(response_format, structured_outputs, tool_choice "required") applies after `</think>`. A tiny random model whose
vocabulary has the tags as single tokens (tests/tiny_models.py's with_think_tags) and a template that opens a block
on request; a logit_bias on `</think>`, found so that the free model closes its block a few tokens in, makes the
block end inside its own text. Each reply's reasoning is checked against the same request without a grammar."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.server_utils import module_server
from tests.tiny_models import with_think_tags

MODEL = "tiny-thinker"
MESSAGES = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog"}]
CHOICE = {"choice": ["yes", "no"]}


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    model = with_think_tags(tiny_model_dir("qwen2"), tmp_path_factory.mktemp("think"))
    yield from module_server(str(model), "--served-model-name", MODEL, "--max-model-len", "512",
                             "--reasoning-parser", "qwen3", tmp_path_factory=tmp_path_factory)


@pytest.fixture(scope="module")
def tags(server) -> tuple[int, int]:
    ids = [post(server, "/tokenize", {"prompt": tag, "add_special_tokens": False}).json()["tokens"]
           for tag in ("<think>", "</think>")]
    assert [len(i) for i in ids] == [1, 1]
    return ids[0][0], ids[1][0]


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json={"model": MODEL, **body}, timeout=60)


def chat(server, think: bool, bias: dict, **extra) -> dict:
    reply = post(server, "/v1/chat/completions", {
        "messages": MESSAGES, "max_tokens": 40, "temperature": 0, "logit_bias": bias,
        "chat_template_kwargs": {"think": think}, **extra})
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]


@pytest.fixture(scope="module")
def end_bias(server, tags) -> dict:
    """A logit_bias on `</think>` with which the free model writes a few tokens of reasoning, then some content."""
    for quarter in range(40):
        bias = {str(tags[1]): quarter / 4}
        message = chat(server, True, bias)["message"]
        if message["content"] and len(message["reasoning"] or "") >= 3:
            return bias
    pytest.fail("no bias on </think> ends the tiny model's block a few tokens in")


def test_the_grammar_applies_after_the_reasoning(server, end_bias):
    free = chat(server, True, end_bias)["message"]
    for extra in ({"structured_outputs": CHOICE},
                  {"response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
                      "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                      "additionalProperties": False}}}}):
        choice = chat(server, True, end_bias, **extra, max_tokens=120)  # room for JSON's white space
        message = choice["message"]
        assert message["reasoning"] == message["reasoning_content"] == free["reasoning"], extra
        if "structured_outputs" in extra:
            assert message["content"] in ("yes", "no")
        else:
            assert isinstance(json.loads(message["content"])["ok"], bool)
        assert choice["finish_reason"] == "stop"


def test_streamed_as_whole(server, end_bias):
    whole = chat(server, True, end_bias, structured_outputs=CHOICE)["message"]
    chunks = []
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": MESSAGES, "max_tokens": 40, "temperature": 0, "logit_bias": end_bias,
            "chat_template_kwargs": {"think": True}, "structured_outputs": CHOICE, "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning") or "" for d in deltas) == whole["reasoning"]
    assert "".join(d.get("content") or "" for d in deltas) == whole["content"]


def test_required_tool_call_after_the_reasoning(server, end_bias):
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}}}]
    free = chat(server, True, end_bias)["message"]
    choice = chat(server, True, end_bias, tools=tools, tool_choice="required", max_tokens=250,
                  parallel_tool_calls=False)  # one call: the grammar's array ends after it
    message = choice["message"]
    assert message["reasoning"] == free["reasoning"]
    [call] = message["tool_calls"]
    assert call["function"]["name"] == "lookup"
    assert json.loads(call["function"]["arguments"])["city"] in ("Paris", "Rome")
    assert choice["finish_reason"] == "tool_calls"


def test_a_block_the_model_opens_or_never_opens(server, tags):
    """The prompt opened no block: the first token is `<think>` or the grammar's."""
    start, end = (str(t) for t in tags)
    choice = chat(server, False, {start: 50, end: 100}, structured_outputs=CHOICE, return_token_ids=True)
    assert choice["token_ids"][:2] == list(tags)  # an empty block: the tags, then the grammar's text
    assert choice["message"]["content"] in ("yes", "no") and not choice["message"]["reasoning"]
    direct = chat(server, False, {start: -100}, structured_outputs=CHOICE)["message"]
    assert direct["content"] in ("yes", "no") and direct["reasoning"] is None


def test_the_responses_api(server, end_bias):
    free = chat(server, True, end_bias)["message"]
    reply = post(server, "/v1/responses", {
        "input": MESSAGES[0]["content"], "max_output_tokens": 120, "temperature": 0, "logit_bias": end_bias,
        "chat_template_kwargs": {"think": True},
        "text": {"format": {"type": "json_schema", "name": "answer", "schema": {
            "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
            "additionalProperties": False}}}}).json()
    assert [item["type"] for item in reply["output"]] == ["reasoning", "message"], reply
    assert reply["output"][0]["content"][0]["text"] == free["reasoning"]
    assert isinstance(json.loads(reply["output"][1]["content"][0]["text"])["ok"], bool)


def test_a_prompt_that_closed_the_block_gets_the_grammar_at_once(server, tags):
    """A continued assistant message whose block is closed (or a generation prompt that closes it, as
    enable_thinking false does): the reasoning is over, so the first token is the grammar's, `<think>` not allowed
    (QA-G: it opened a second block)."""
    start, end = (str(t) for t in tags)
    reply = post(server, "/v1/chat/completions", {
        "messages": MESSAGES + [{"role": "assistant", "content": "<think>\nOkay</think>"}], "max_tokens": 40,
        "temperature": 0, "logit_bias": {start: 50, end: 100}, "add_generation_prompt": False,
        "continue_final_message": True, "structured_outputs": CHOICE, "return_token_ids": True}).json()["choices"][0]
    assert tags[0] not in reply["token_ids"] and reply["message"]["content"] in ("yes", "no"), reply
    assert reply["message"]["reasoning"] is None


def test_completions_gate_the_grammar_as_chat_does(server, tags):
    """vLLM gates grammars in the engine, whatever the endpoint: /v1/completions too (its text is not split)."""
    start, end = (str(t) for t in tags)
    cases = [("Is the fox quick? <think>\n", {end: 100}, "</think>"),  # the prompt opened a block
             ("Is the fox quick?", {start: 50, end: 100}, "<think></think>"),  # the model opens one
             ("Is the fox quick? <think>\n\n</think>\n\n", {start: 50, end: 100}, "")]  # the prompt closed it
    for prompt, bias, tags_written in cases:
        for stream in (False, True):
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 40, "temperature": 0, "logit_bias": bias,
                    "structured_outputs": CHOICE, "stream": stream}
            if stream:
                with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
                    text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in response.iter_lines()
                                   if line.startswith("data: ") and line != "data: [DONE]")
            else:
                text = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
            assert text in (tags_written + "yes", tags_written + "no"), (prompt, stream, text)
