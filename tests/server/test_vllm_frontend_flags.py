"""vLLM's front-end flags for chat prompts, usage and the access log, on one server:
--default-chat-template-kwargs, --trust-request-chat-template, --exclude-tools-when-tool-choice-none,
--enable-force-include-usage, --uvicorn-log-level info (the access log), --disable-access-log-for-endpoints and
--enable-log-outputs."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.server_utils import module_server

# Shows the flavour kwarg and how many tools reach the template, then the messages.
TEMPLATE = ("[{{ flavour | default('none') }}|tools={{ (tools or []) | length }}]"
            "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>")
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
CHAT = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    yield from module_server(
        tiny_model_dir("llama"), "--max-model-len", "256", "--dtype", "float32", "--chat-template", TEMPLATE,
        "--default-chat-template-kwargs", '{"flavour": "plain"}', "--trust-request-chat-template",
        "--exclude-tools-when-tool-choice-none", "--enable-force-include-usage", "--uvicorn-log-level", "info",
        "--disable-access-log-for-endpoints", "/health,/metrics", "--enable-log-outputs", "--max-log-len", "400",
        tmp_path_factory=tmp_path_factory)


def rendered(server, **fields) -> str:
    tokens = httpx.post(f"{server.url}/tokenize", json={"messages": CHAT, **fields}).json()["tokens"]
    return httpx.post(f"{server.url}/detokenize", json={"tokens": tokens}).json()["prompt"]


def test_default_template_kwargs_apply_and_a_request_s_own_win(server):
    assert rendered(server).startswith("[plain|tools=0]")
    assert rendered(server, chat_template_kwargs={"flavour": "spicy"}).startswith("[spicy|")


def test_a_request_s_chat_template_is_rendered_when_trusted(server):
    assert rendered(server, chat_template="{{ 'CUSTOM:' + messages[0]['content'] }}") == "CUSTOM:Hi"
    reply = httpx.post(f"{server.url}/v1/chat/completions", json={
        "messages": CHAT, "max_tokens": 1, "chat_template": "{{ 'CUSTOM:' + messages[0]['content'] }}"})
    assert reply.status_code == 200
    bad = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": CHAT, "chat_template": 5})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template"


def test_tool_choice_none_leaves_the_tools_out_of_the_prompt(server):
    assert rendered(server, tools=TOOLS).startswith("[plain|tools=1]")  # /tokenize has no tool_choice
    body = {"messages": CHAT, "max_tokens": 1, "tools": TOOLS}
    none = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "tool_choice": "none"}).json()
    plain = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1}).json()
    assert none["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]


def test_every_stream_ends_with_its_usage(server):
    for path, body in (("/v1/completions", {"prompt": "Hi"}), ("/v1/chat/completions", {"messages": CHAT})):
        streamed = httpx.post(f"{server.url}{path}", json={**body, "max_tokens": 3, "ignore_eos": True,
                                                           "stream": True})
        chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3


def test_the_access_log_has_a_line_per_request_but_the_left_out_paths(server):
    httpx.get(f"{server.url}/health")
    httpx.get(f"{server.url}/v1/models")
    log = server.log()
    assert '"GET /v1/models HTTP/1.1" 200' in log
    assert "GET /health" not in log


def test_finished_completions_are_logged_with_their_text(server):
    reply = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "n": 2,
                                                             "ignore_eos": True, "temperature": 1.0}).json()
    log = server.log()
    for choice in reply["choices"]:
        assert f"(choice {choice['index']}): output: {choice['text']!r}, 4 tokens, finish_reason: length" in log
