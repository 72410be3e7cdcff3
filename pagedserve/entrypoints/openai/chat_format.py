"""Chat messages in and out: how an API message reaches the chat template, and how a reply's pieces (text,
tool calls, logprobs, finish reason) are shaped for /v1/chat/completions."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from pagedserve.chat_template import REASONING_FIELDS
from pagedserve.entrypoints.openai.protocol import ChatMessage
from pagedserve.entrypoints.openai.tool_calls import ReasoningDelta, ToolCallDelta
from pagedserve.exceptions import InvalidRequestError, check_text
from pagedserve.outputs import LogprobsDict


# apply_chat_template arguments the server sets itself: neither a request's chat_template_kwargs nor
# --default-chat-template-kwargs may replace them.
RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "tokenize", "add_generation_prompt",
                                      "continue_final_message", "return_dict", "return_tensors", "tools", "documents",
                                      "chat_template"})
# A template that loops over a message's content takes OpenAI's list of parts (vLLM's "auto" detection).
_LOOPS_OVER_CONTENT = re.compile(r"\{%-?\s*for\s+\w+\s+in\s+[\w.]*(?:\[\s*['\"]content['\"]\s*\]|\.content)"
                                 r"\s*(?:-?%\}|\||if\b)")  # the content itself (not .content.split(...))


def render_conversation(tokenizer: Any, messages: list[ChatMessage], content_format: str = "auto",
                **template_kwargs: Any) -> str:
    """A chat's prompt text, for the server and LLM.chat alike: the messages as templates take them
    (template_message, template_messages), rendered by the tokenizer's template or template_kwargs'
    chat_template. Content format "auto" is "openai" for a template that loops over a message's content (as
    vLLM detects it), else "string". A "developer" message (OpenAI's newer name for system, which the Codex CLI
    and OpenAI's SDK guidance send) is a system message for a template that never names that role: Qwen's
    dropped it silently, others wrote a role the model never saw (llama.cpp maps it so too)."""
    template = template_kwargs.get("chat_template") or getattr(tokenizer, "chat_template", None)
    templates = list(template.values()) if isinstance(template, dict) else [template or ""]
    if content_format == "auto":
        content_format = "openai" if any(_LOOPS_OVER_CONTENT.search(t) for t in templates) else "string"
    conversation = template_messages([template_message(m, content_format) for m in messages])
    if not any("developer" in t for t in templates):
        conversation = [{**m, "role": "system"} if m["role"] == "developer" else m for m in conversation]
    return tokenizer.apply_chat_template(conversation, tokenize=False, **template_kwargs)


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as chat templates expect them: an assistant's tool_calls with arguments as objects (the
    API carries them as JSON strings; templates write them with `| tojson`). Raises InvalidRequestError for
    tool fields of the wrong shape, which a template would fail on."""
    result = []
    for index, message in enumerate(messages):
        _check_strings(message, f"messages[{index}]")
        calls = message.get("tool_calls")
        if calls == []:  # as vLLM: templates take an empty list for a call (Llama 3.1's "only single tool-calls")
            message = {key: value for key, value in message.items() if key != "tool_calls"}
        elif calls is not None:
            if not isinstance(calls, list):
                raise InvalidRequestError(f"messages[{index}].tool_calls must be a list of tool calls, got "
                                          f"{type(calls).__name__}", param="messages")
            message = {**message, "tool_calls": [_template_call(c, f"messages[{index}].tool_calls[{i}]")
                                                 for i, c in enumerate(calls)]}
        for key in ("tool_call_id", "name"):
            if message.get(key) is not None and not isinstance(message[key], str):
                raise InvalidRequestError(f"messages[{index}].{key} must be a string", param="messages")
        result.append(message)
    return result


def _check_strings(value: Any, where: str) -> None:
    """A 400 naming the message for a lone surrogate anywhere in it: the tokenizer found it in the rendered prompt,
    at a position in the template's text and with no param (QA-Z)."""
    if isinstance(value, str):
        check_text(value, where, param="messages")
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_strings(item, f"{where}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_strings(item, f"{where}[{i}]")


def _template_call(call: Any, where: str) -> dict:
    """One call as {"id", "type", "function": {"name", "arguments"}} (OpenAI's shape), arguments parsed."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InvalidRequestError(f"{where} must be {{\"id\": ..., \"type\": \"function\", \"function\": "
                                  "{\"name\": string, \"arguments\": JSON string}}", param="messages")
    function = dict(function)
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            arguments = None
    elif arguments is not None and not isinstance(arguments, dict):
        raise InvalidRequestError(f"{where}.function.arguments must be a JSON string (or an object)",
                                  param="messages")
    # Arguments that are not a JSON object reach the template as {} (vLLM's rule): written raw, they made the
    # prompt's own call JSON invalid.
    function["arguments"] = arguments if isinstance(arguments, dict) else {}
    return {**call, "function": function}


def template_message(message: ChatMessage, content_format: str = "string") -> dict:
    """A message as the chat template sees it: role, content, and the tool fields it may carry. Content is text
    (content_format string or auto), or for "openai" a list of {type: text, text} parts (a string is one part)."""
    text = message_text(message)
    content: str | list[dict] = text
    if content_format == "openai" and message.role != "tool":  # a tool's result is text (vLLM joins its parts)
        content = [{"type": "text", "text": part} for part in _text_parts(message)]
    result = {"role": message.role, "content": content}
    for key in ("tool_calls", "tool_call_id", "name", *REASONING_FIELDS):  # reasoning: templates that replay it
        value = (message.model_extra or {}).get(key)
        if value is not None:
            result[key] = value
    return result


def chat_finish_reason(finish_reason: str | None, called_tools: bool, named_tool: bool = False,
                       stop_reason: int | str | None = None) -> str | None:
    """"tool_calls" when the model stopped after calling tools on its own or under tool_choice "required"; a
    call forced by name (tool_choice {"type": "function", ...}) keeps "stop", as OpenAI and vLLM answer. One of the
    request's stop strings or stop ids (`stop_reason`) ending it keeps "stop" too: the calls may be cut short."""
    if called_tools and not named_tool and finish_reason == "stop" and stop_reason is None:
        return "tool_calls"
    return finish_reason


def chat_delta(events: list[str | ToolCallDelta | ReasoningDelta]) -> dict:
    """One chunk's delta from a reader's events: reasoning, content text, tool-call pieces, or several."""
    content = "".join(e for e in events if isinstance(e, str))
    calls = [e.to_openai() for e in events if isinstance(e, ToolCallDelta)]
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    delta: dict[str, Any] = {}
    if reasoning:
        delta.update(reasoning_fields(reasoning))
    if content or not (calls or reasoning):
        delta["content"] = content
    if calls:
        delta["tool_calls"] = calls
    return delta


def reasoning_fields(reasoning: str | None) -> dict[str, str | None]:
    """A reply's reasoning under vLLM's name and under reasoning_content (vLLM's older name, DeepSeek's API's)."""
    return {"reasoning": reasoning, "reasoning_content": reasoning}


def message_text(message: ChatMessage) -> str:
    """The message's text: its string, or its text parts joined by line breaks, as vLLM joins them for a template
    that reads strings."""
    return "\n".join(_text_parts(message))


# Content part type -> the key of its text: OpenAI's assistant messages may carry a refusal part (the SDK's
# ChatCompletionContentPartRefusalParam), which vLLM reads as text.
TEXT_KEYS = {"text": "text", "refusal": "refusal"}


def _text_parts(message: ChatMessage) -> list[str]:
    """The texts of a message's content: a string is one part; parts without text are skipped (vLLM's rule)."""
    if message.content is None:
        return []
    if isinstance(message.content, str):
        return [message.content]  # "" too: an empty assistant prefill is one empty part, as vLLM's
    parts = []
    for index, part in enumerate(message.content):
        key = TEXT_KEYS.get(part.get("type"))
        if key is None:
            raise InvalidRequestError(f"content part type {part.get('type')!r} is not supported (text and refusal "
                                      "parts only)", param="messages")
        text = part.get(key)
        if text is not None and not isinstance(text, str):
            raise InvalidRequestError(f"a {part['type']} part's {key} must be a string, got {type(text).__name__} "
                                      f"(content part {index})", param="messages")
        if text is not None:
            parts.append(text)
    return parts


def token_text(token_id: int, decoded: str | None, as_ids: bool = False) -> str:
    """A token as logprobs show it: its text, or "token_id:N" (vLLM's return_tokens_as_token_ids)."""
    return f"token_id:{token_id}" if as_ids else decoded or ""


def chat_logprobs(token_ids: list[int], logprobs: list[LogprobsDict], num_top: int,
                  token_bytes: Callable[[int], bytes], as_ids: bool = False) -> dict:
    """OpenAI's chat logprobs. `bytes` are each token's raw bytes (tokenizer.TokenBytes): joined, they rebuild a
    character split across tokens, whose pieces read U+FFFD as text."""
    def item(token_id: int, lp) -> dict:
        return {"token": token_text(token_id, lp.decoded_token, as_ids), "logprob": lp.logprob,
                "bytes": list(token_bytes(token_id))}

    content = []
    for token_id, step in zip(token_ids, logprobs):
        # num_top at most: a sampled token outside the top ones that ties one shares its rank (the top one is kept)
        top = sorted(((i, lp) for i, lp in step.items() if lp.rank <= num_top),
                     key=lambda pair: (pair[1].rank, pair[0] == token_id))[:num_top]
        content.append({**item(token_id, step[token_id]), "top_logprobs": [item(i, lp) for i, lp in top]})
    return {"content": content}
