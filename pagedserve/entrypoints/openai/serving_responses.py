"""OpenAI's Responses API (POST /v1/responses) on the chat route: the request becomes a chat request (input items
to messages, instructions to a system message, function tools and text.format to the chat's tools and
response_format), runs as one, and is answered as a Response object, or as the Responses stream's events
(response.created ... response.output_text.delta ... response.completed).

What a stateless text server cannot do is refused with a 400 naming the field: previous_response_id (nothing is
stored: send the conversation in `input`), background, built-in tools (web search, files, ...), images and
files in the input, logprobs (`include`, top_logprobs). `store` and `reasoning` are accepted and change nothing.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest, ResponsesRequest
from pagedserve.entrypoints.openai.serving import OpenAIServing, _collect, _PromptTally, _sse
from pagedserve.entrypoints.openai.tool_calls import ToolCallDelta, make_reader, read_all
from pagedserve.exceptions import InvalidRequestError

_TEXT_PARTS = ("input_text", "output_text", "text")
# The chat request's field -> the Responses request's, for the errors the chat route raises.
_FIELD_NAMES = {"max_tokens": "max_output_tokens", "messages": "input", "response_format": "text",
                "structured_outputs": "text"}


def _renamed(exc: InvalidRequestError) -> InvalidRequestError:
    """A chat route's 400 in the Responses request's terms (max_tokens -> max_output_tokens, ...)."""
    name = _FIELD_NAMES.get(exc.param or "")
    if name is None:
        return exc
    return InvalidRequestError(exc.message.replace(exc.param, name), param=name)


def to_chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that answers `req`; a 400 naming a field the chat route cannot honour."""
    for name, refused, why in (
            ("previous_response_id", req.previous_response_id is not None,
             "responses are not stored here: send the whole conversation in input"),
            ("background", bool(req.background), "background responses are not supported"),
            ("truncation", req.truncation not in (None, "disabled"), "only 'disabled' (too long is a 400)"),
            ("include", bool(req.include), "no extra output data (logprobs, ...) is available"),
            ("top_logprobs", bool(req.top_logprobs), "logprobs are not given by /v1/responses; use "
                                                     "/v1/chat/completions")):
        if refused:
            raise InvalidRequestError(f"{name} is not supported: {why}", param=name)
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + _messages(req.input)
    body: dict[str, Any] = {k: v for k, v in (req.model_extra or {}).items()}
    body.update(model=req.model, messages=messages, stream=req.stream, user=req.user)
    for ours, theirs in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                         ("parallel_tool_calls", "parallel_tool_calls")):
        if getattr(req, ours) is not None:
            body[theirs] = getattr(req, ours)
    if req.tools:
        body["tools"] = [_chat_tool(tool, i) for i, tool in enumerate(req.tools)]
    if req.tool_choice is not None:
        body["tool_choice"] = _chat_tool_choice(req.tool_choice)
    text_format = (req.text or {}).get("format")
    if text_format is not None:
        body["response_format"] = _response_format(text_format)
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        error = exc.errors()[0]
        field = str(error["loc"][0]) if error.get("loc") else "input"
        raise _renamed(InvalidRequestError(f"{field}: {error['msg']}", param=field)) from None


def _messages(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses input items -> chat messages: messages (roles user/system/developer/assistant, text parts),
    function calls (assistant tool_calls, consecutive calls merged) and their outputs (tool messages)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise InvalidRequestError(f"input[{i}]: role must be user, system, developer or assistant, got "
                                          f"{role!r}", param="input")
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _text(item.get("content"), i)})
        elif kind == "function_call":
            call = {"id": item.get("call_id") or item.get("id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "")}}
            if not isinstance(call["function"]["name"], str) or not isinstance(call["function"]["arguments"], str):
                raise InvalidRequestError(f"input[{i}]: a function_call needs a name and arguments (a JSON string)",
                                          param="input")
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str) or not isinstance(item.get("call_id"), str):
                raise InvalidRequestError(f"input[{i}]: a function_call_output needs call_id and output (a string)",
                                          param="input")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
        else:
            raise InvalidRequestError(f"input[{i}]: item type {kind!r} is not supported (messages, function_call, "
                                      "function_call_output)", param="input")
    if not messages:
        raise InvalidRequestError("input must not be empty", param="input")
    return messages


def _text(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"input[{index}]: content must be a string or a list of parts", param="input")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise InvalidRequestError(f"input[{index}]: content part type {kind!r} is not supported (text only)",
                                      param="input")
        texts.append(part["text"])
    return "\n".join(texts)


def _chat_tool(tool: dict[str, Any], index: int) -> dict[str, Any]:
    """A Responses function tool (flat) -> the chat route's {"type": "function", "function": {...}}."""
    if tool.get("type") != "function":
        raise InvalidRequestError(f"tools[{index}]: only function tools are supported, got type {tool.get('type')!r}",
                                  param="tools")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice  # "auto", "none", "required"; anything else gets the chat route's 400


def _response_format(text_format: dict[str, Any]) -> dict[str, Any]:
    kind = text_format.get("type")
    if kind == "json_schema":
        schema = {k: text_format[k] for k in ("name", "schema", "strict", "description") if k in text_format}
        return {"type": "json_schema", "json_schema": schema}
    if kind in ("text", "json_object"):
        return {"type": kind}
    raise InvalidRequestError(f"text.format type {kind!r} is not supported (text, json_object, json_schema)",
                              param="text")


class ResponsesServing:
    """POST /v1/responses over a generative model's serving layer."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create(self, req: ResponsesRequest, raw: Request) -> Any:
        chat = to_chat_request(req)
        try:
            engine_id, prompt, streams, tool_choice = await self.serving.start_chat(chat, "resp")
        except InvalidRequestError as exc:
            raise _renamed(exc) from None
        response_id = "resp_" + engine_id.split("-", 1)[1].replace("-", "")
        skeleton = self._skeleton(response_id, req)
        if req.stream:
            return _sse(self._events(skeleton, prompt.token_ids, streams, tool_choice))
        tally = _PromptTally()
        finals = await _collect(streams, raw, 1, tally)
        choice = finals[0][0]
        read = read_all(make_reader(tool_choice, self.serving.tool_call_parser), choice.text)
        output = []
        if read.content or not read.calls:
            output.append(_message_item(_item_id("msg"), read.content, "completed"))
        output += [_function_call_item(_item_id("fc"), call["id"], call["function"]["name"],
                                       call["function"]["arguments"], "completed") for call in read.calls]
        return JSONResponse(_finish(skeleton, output, choice.finish_reason, len(prompt.token_ids),
                                    len(choice.token_ids), tally.num_cached))

    def _skeleton(self, response_id: str, req: ResponsesRequest) -> dict[str, Any]:
        """The Response object's fields that echo the request, status in_progress and no output yet."""
        return {"id": response_id, "object": "response", "created_at": int(time.time()), "status": "in_progress",
                "error": None, "incomplete_details": None, "instructions": req.instructions,
                "max_output_tokens": req.max_output_tokens, "model": self.serving.served_model_names[0],
                "output": [], "parallel_tool_calls": req.parallel_tool_calls is not False,
                "previous_response_id": None, "reasoning": req.reasoning, "store": False,
                "temperature": req.temperature, "text": req.text or {"format": {"type": "text"}},
                "tool_choice": req.tool_choice or "auto", "tools": req.tools or [], "top_p": req.top_p,
                "truncation": "disabled", "usage": None, "user": req.user, "metadata": req.metadata or {}}

    async def _events(self, skeleton: dict[str, Any], prompt_ids: list[int], streams: AsyncIterator,
                      tool_choice: Any) -> AsyncIterator[str]:
        """The Responses stream: each output item added, its text or arguments as deltas, done, then completed."""
        sequence = 0

        def event(kind: str, **fields: Any) -> str:
            nonlocal sequence
            sequence += 1
            return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': sequence - 1, **fields})}\n\n"

        yield event("response.created", response=skeleton)
        yield event("response.in_progress", response=skeleton)
        reader = make_reader(tool_choice, self.serving.tool_call_parser)
        tally = _PromptTally()
        items: list[dict[str, Any]] = []  # in output order
        message: dict[str, Any] | None = None
        calls: dict[int, dict[str, Any]] = {}  # the reader's call index -> its item
        finish_reason, num_tokens = None, 0
        async for prompt_index, output in streams:
            tally.add(prompt_index, output)
            completion = output.outputs[0]
            num_tokens += len(completion.token_ids)
            events = reader.feed(completion.text)
            if completion.finish_reason is not None:
                finish_reason = completion.finish_reason
                events += reader.finish()
            for piece in events:
                if isinstance(piece, str):
                    if not piece:
                        continue
                    if message is None:
                        message = _message_item(_item_id("msg"), "", "in_progress")
                        items.append(message)
                        yield event("response.output_item.added", output_index=len(items) - 1,
                                    item={**message, "content": []})
                        yield event("response.content_part.added", item_id=message["id"],
                                    output_index=len(items) - 1, content_index=0, part=_text_part(""))
                    message["content"][0]["text"] += piece
                    yield event("response.output_text.delta", item_id=message["id"],
                                output_index=items.index(message), content_index=0, delta=piece, logprobs=[])
                elif isinstance(piece, ToolCallDelta):
                    item = calls.get(piece.index)
                    if item is None:
                        item = _function_call_item(_item_id("fc"), piece.id, piece.name, "", "in_progress")
                        calls[piece.index] = item
                        items.append(item)
                        yield event("response.output_item.added", output_index=len(items) - 1, item=dict(item))
                    if piece.arguments:
                        item["arguments"] += piece.arguments
                        yield event("response.function_call_arguments.delta", item_id=item["id"],
                                    output_index=items.index(item), delta=piece.arguments)
        if not items:  # nothing written: an empty message, as the non-streamed response has
            message = _message_item(_item_id("msg"), "", "in_progress")
            items.append(message)
            yield event("response.output_item.added", output_index=0, item={**message, "content": []})
            yield event("response.content_part.added", item_id=message["id"], output_index=0, content_index=0,
                        part=_text_part(""))
        for index, item in enumerate(items):
            item["status"] = "completed"
            if item is message:
                text = message["content"][0]["text"]
                yield event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                            text=text, logprobs=[])
                yield event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                            part=_text_part(text))
            else:
                yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                            name=item["name"], arguments=item["arguments"])
            yield event("response.output_item.done", output_index=index, item=item)
        final = _finish(skeleton, items, finish_reason, len(prompt_ids), num_tokens, tally.num_cached)
        yield event("response.incomplete" if final["status"] == "incomplete" else "response.completed",
                    response=final)


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": [_text_part(text)]}


def _function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def _finish(skeleton: dict[str, Any], output: list[dict[str, Any]], finish_reason: str | None, num_prompt: int,
            num_output: int, num_cached: int) -> dict[str, Any]:
    """The Response object once the generation ended: completed, or incomplete at max_output_tokens."""
    incomplete = finish_reason == "length"
    return {**skeleton, "status": "incomplete" if incomplete else "completed", "output": output,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "usage": {"input_tokens": num_prompt, "input_tokens_details": {"cached_tokens": num_cached},
                      "output_tokens": num_output, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": num_prompt + num_output}}
