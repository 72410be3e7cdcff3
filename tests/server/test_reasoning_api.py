"""--reasoning-parser over HTTP, on the default SmolLM2-135M with a chat template whose generation prompt opens a
think block when the request's chat_template_kwargs ask (as Qwen3.5's and Qwen3-Thinking-2507's do): the model
does not know the tags, so what it writes after an opened block is all reasoning (an output cut at max_tokens
inside the block), and without the block all content. Each is checked against /v1/completions on the same
prompt tokens (greedy: the same text), streamed and not, over chat completions and the Responses API. The splitting
itself (tags, split pieces, tool calls after the reasoning) is tests/unit/test_reasoning.py's."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.server_utils import module_server, openai_client

MODEL = "smollm2-135m-instruct"
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% if think %}<think>\n{% endif %}{% endif %}")
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from module_server(MODEL, "--max-model-len", "1024", "--reasoning-parser", "qwen3", "--chat-template",
                             TEMPLATE, tmp_path_factory=tmp_path_factory)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json={"model": MODEL, **body}, timeout=60)


def plain_text(server, think: bool) -> str:
    """What the model writes after the rendered chat prompt, through /v1/completions (no parsing there)."""
    ids = post(server, "/tokenize", {"messages": MESSAGES, "chat_template_kwargs": {"think": think}}).json()["tokens"]
    reply = post(server, "/v1/completions", {"prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0,
                                             "ignore_eos": True})
    return reply.json()["choices"][0]["text"]


def chat(server, think: bool, **extra) -> httpx.Response:
    return post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0,
                                                  "ignore_eos": True, "chat_template_kwargs": {"think": think},
                                                  **extra})


def streamed_chat(server, think: bool) -> tuple[str, str, list[dict]]:
    """(reasoning, content) the chunks add up to, and the chunks."""
    chunks = []
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "ignore_eos": True, "chat_template_kwargs": {"think": think}}) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    reasoning = "".join(d.get("reasoning") or "" for d in deltas)
    assert reasoning == "".join(d.get("reasoning_content") or "" for d in deltas)  # both names, the same text
    return reasoning, "".join(d.get("content") or "" for d in deltas), chunks


def test_an_output_inside_an_opened_block_is_reasoning(server):
    text = plain_text(server, think=True)
    assert text.strip(), "the model wrote nothing to read"
    reply = chat(server, think=True).json()
    message = reply["choices"][0]["message"]
    assert message["reasoning"] == message["reasoning_content"] == text
    assert message["content"] is None  # vLLM's: no content where the reply was all reasoning
    assert reply["choices"][0]["finish_reason"] == "length"
    reasoning, content, chunks = streamed_chat(server, think=True)
    assert (reasoning, content) == (text, "")
    assert all("content" not in c["choices"][0]["delta"] for c in chunks[1:] if c["choices"]), chunks


def test_an_output_without_a_block_is_content(server):
    text = plain_text(server, think=False)
    message = chat(server, think=False).json()["choices"][0]["message"]
    assert message["content"] == text
    assert message["reasoning"] is None and message["reasoning_content"] is None
    assert streamed_chat(server, think=False)[:2] == ("", text)


def test_the_openai_client_reads_the_reasoning(server):
    client = openai_client(server)
    message = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"chat_template_kwargs": {"think": True}, "ignore_eos": True}).choices[0].message
    assert message.model_extra["reasoning"] == plain_text(server, think=True) and message.content is None


def test_a_grammar_constrained_reply_is_content(server):
    """SmolLM2's vocabulary has no `<think>` token: response_format's grammar writes the output from its first
    token, so no think block and no reasoning (a vocabulary with the tags: test_reasoning_grammar.py)."""
    message = chat(server, think=True, max_tokens=40, response_format={"type": "json_object"}).json()[
        "choices"][0]["message"]
    assert message["reasoning"] is None and message["content"].lstrip().startswith("{")


def test_the_responses_api_gives_a_reasoning_item(server):
    text = plain_text(server, think=True)
    body = {"input": MESSAGES[0]["content"], "max_output_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    extra = {"chat_template_kwargs": {"think": True}}
    reply = post(server, "/v1/responses", {**body, **extra}).json()
    assert [item["type"] for item in reply["output"]] == ["reasoning"], reply
    usage = reply["usage"]
    assert usage["output_tokens_details"]["reasoning_tokens"] == usage["output_tokens"] == MAX_TOKENS  # all of it
    assert reply["output"][0]["content"] == [{"type": "reasoning_text", "text": text}]
    assert reply["status"] == "incomplete" and reply["output"][0]["status"] == "incomplete"
    events = []
    with httpx.stream("POST", f"{server.url}/v1/responses", timeout=60,
                      json={"model": MODEL, **body, **extra, "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    kinds = [e["type"] for e in events]
    assert events[-1]["response"]["usage"] == usage
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == text
    done = [e for e in events if e["type"] == "response.reasoning_text.done"]
    assert len(done) == 1 and done[0]["text"] == text
    assert kinds[-1] == "response.incomplete"
    final = events[-1]["response"]["output"]
    assert [(i["type"], i["status"], i["content"]) for i in final] == [
        (i["type"], i["status"], i["content"]) for i in reply["output"]]


def test_a_reasoning_the_client_began_is_continued_as_reasoning(server):
    """continue_final_message with an assistant message "<think>\nThe capital": the block is open (QA: the reply
    went to content); the assistant's own text is the prompt's, so the reply is what the model writes after it."""
    messages = MESSAGES + [{"role": "assistant", "content": "<think>\nThe capital"}]
    flags = {"add_generation_prompt": False, "continue_final_message": True}
    ids = post(server, "/tokenize", {"messages": messages, **flags}).json()["tokens"]
    text = post(server, "/v1/completions", {"prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0,
                                            "ignore_eos": True}).json()["choices"][0]["text"]
    message = post(server, "/v1/chat/completions", {"messages": messages, **flags, "max_tokens": MAX_TOKENS,
                                                     "temperature": 0, "ignore_eos": True}).json()["choices"][0][
        "message"]
    assert (message["reasoning"], message["content"]) == (text, None)


def test_a_responses_reasoning_item_goes_back_in_as_input(server):
    """The Responses API without storage: the reply's output items sent back with the next question (a 400
    before: the reasoning item was an unknown input type)."""
    body = {"max_output_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "chat_template_kwargs": {"think": True}}
    first = post(server, "/v1/responses", {**body, "input": MESSAGES}).json()
    assert first["output"][0]["type"] == "reasoning"
    second = post(server, "/v1/responses", {**body, "input": MESSAGES + first["output"] + [
        {"role": "user", "content": "And of Spain?"}]})
    assert second.status_code == 200, second.text
    assert second.json()["output"][0]["type"] == "reasoning"


def test_a_reply_without_reasoning_counts_no_reasoning_tokens(server):
    reply = post(server, "/v1/responses", {"input": MESSAGES[0]["content"], "max_output_tokens": MAX_TOKENS,
                                           "temperature": 0, "ignore_eos": True}).json()
    assert reply["output"][0]["type"] == "message"
    assert reply["usage"]["output_tokens_details"]["reasoning_tokens"] == 0
