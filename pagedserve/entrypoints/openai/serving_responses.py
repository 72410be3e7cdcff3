"""OpenAI's Responses API (POST /v1/responses) on the chat route: the request becomes a chat request (input items
to messages, instructions to a system message, function tools and text.format to the chat's tools and
response_format), runs as one, and is answered as a Response object, or as the Responses stream's events
(response.created ... response.output_text.delta ... response.completed).

What a stateless text server cannot do is refused with a 400 naming the field: previous_response_id (nothing is
stored: send the conversation in `input`), background, built-in tools (web search, files, ...), images and
files in the input, logprobs (`include`, top_logprobs). `store` is accepted and changes nothing;
`reasoning.effort` reaches the chat template as chat's `reasoning_effort`.
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
from pagedserve.entrypoints.openai.errors import to_api_error
from pagedserve.entrypoints.openai.chat_format import TEXT_KEYS
from pagedserve.entrypoints.openai.serving import OpenAIServing, _collect, _PromptTally, _sse
from pagedserve.entrypoints.openai.tool_calls import ReasoningDelta, ToolCallDelta, ToolCallReader, read_all
from pagedserve.exceptions import InvalidRequestError

# Content part type -> the key of its text: chat's (text, and an earlier reply's refusal part, as vLLM's) and the
# Responses API's own input and output text parts.
_TEXT_PARTS = {**TEXT_KEYS, "input_text": "text", "output_text": "text"}
# Responses fields accepted and kept out of the chat request: they change nothing a text server generates.
_ACCEPTED = frozenset({"service_tier", "prompt_cache_key", "safety_identifier", "stream_options"})
# The chat request's field -> the Responses request's, for the errors the chat route raises.
_FIELD_NAMES = {"max_tokens": "max_output_tokens", "messages": "input", "response_format": "text",
                "structured_outputs": "text", "reasoning_effort": "reasoning"}
_TOOL_CHOICE_FORMS = '"auto", "none", "required" or {"type": "function", "name": ...}'
_FLAT_TOOL = '{"type": "function", "name": ..., "parameters": {...}}'


# Chat-route fields a Responses request may not set (through vLLM's extras, which pass through): each has a
# Responses counterpart, or no meaning here.
_CHAT_ONLY = {"n": "a response has one output", "messages": "give input", "max_tokens": "give max_output_tokens",
              "max_completion_tokens": "give max_output_tokens", "response_format": "give text.format",
              "logprobs": "logprobs are not given by /v1/responses; use /v1/chat/completions",
              "best_of": "a response has one output", "use_beam_search": "use /v1/chat/completions",
              "suffix": "use /v1/completions", "echo": "use /v1/completions", "functions": "give tools"}
# Responses fields that change what the reply holds, which a stateless text server cannot honour.
_REFUSED = {"conversation": "conversations are not stored here: send the whole conversation in input",
            "prompt": "stored prompts are not available here: send the prompt in input and instructions",
            "max_tool_calls": "not supported: bound the calls in your loop"}


def _renamed(exc: InvalidRequestError) -> InvalidRequestError:
    """A chat route's 400 in the Responses request's terms (max_tokens -> max_output_tokens, ...)."""
    if exc.param == "messages":  # the one rename that changes the verb
        exc = InvalidRequestError(exc.message.replace("the messages are", "the input is"), param=exc.param)
    return exc.renamed(_FIELD_NAMES)


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
    extra = req.model_extra or {}
    for name, why in _REFUSED.items():
        if extra.get(name) is not None:
            raise InvalidRequestError(f"{name}: {why}", param=name)
    for name, why in _CHAT_ONLY.items():
        if name in extra and not (name == "n" and extra[name] == 1):
            raise InvalidRequestError(f"{name} is a chat completions field, not a Responses one: {why}", param=name)
    _check_metadata(req.metadata)
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + _messages(req.input)
    body: dict[str, Any] = {k: v for k, v in extra.items() if k not in _ACCEPTED}
    body.update(model=req.model, messages=messages, stream=req.stream, user=req.user)
    for ours, theirs in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                         ("parallel_tool_calls", "parallel_tool_calls")):
        if getattr(req, ours) is not None:
            body[theirs] = getattr(req, ours)
    if req.tools:
        body["tools"] = [_chat_tool(tool, i) for i, tool in enumerate(req.tools)]
    if req.tool_choice is not None and (req.tools or req.tool_choice not in ("auto", "none")):
        body["tool_choice"] = _chat_tool_choice(req.tool_choice)  # "auto" (the default) needs no tools here
    if req.text is not None:
        text_format = req.text.get("format")
        if text_format is not None:
            body["response_format"] = _response_format(text_format)
    effort = (req.reasoning or {}).get("effort") if isinstance(req.reasoning, dict) else None
    if effort is not None:  # reasoning.effort reaches the chat template as chat's reasoning_effort (vLLM's)
        body.setdefault("reasoning_effort", effort)
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        error = exc.errors()[0]
        field = str(error["loc"][0]) if error.get("loc") else "input"  # the field, not pydantic's union branch
        raise _renamed(InvalidRequestError(f"{field}: {error['msg']}", param=field)) from None


def _messages(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses input items -> chat messages: messages (roles user/system/developer/assistant, text parts),
    function calls (assistant tool_calls, consecutive calls merged) and their outputs (tool messages); a
    reasoning item (a reply's, sent back) is the reasoning_content of the assistant turn it comes before, or of an
    assistant turn of its own."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    messages: list[dict[str, Any]] = []
    call_ids: set[str] = set()  # the function calls given so far: an output answers one of them (OpenAI's rule)
    reasoning: str | None = None  # a reasoning item's text, for the assistant turn that follows it
    for i, item in enumerate(value):
        kind = item.get("type", "message")
        if reasoning is not None and not (kind in ("reasoning", "function_call") or (kind == "message" and
                                                                                    item.get("role") == "assistant")):
            messages.append({"role": "assistant", "content": "", "reasoning_content": reasoning})
            reasoning = None
        if kind == "reasoning":
            text = _reasoning_text(item, i)  # one without text (an encrypted_content one: OpenAI's) adds nothing
            if text:
                reasoning = text if reasoning is None else f"{reasoning}\n{text}"
        elif kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise InvalidRequestError(f"input[{i}]: role must be user, system, developer or assistant, got "
                                          f"{role!r}", param="input")
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _text(item.get("content"), i)})
            if reasoning is not None:
                messages[-1]["reasoning_content"], reasoning = reasoning, None
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "")}}
            if not all(isinstance(v, str) and v for v in (call["id"], call["function"]["name"])) or \
                    not isinstance(call["function"]["arguments"], str):
                raise InvalidRequestError(f"input[{i}]: a function_call needs call_id and name (non-empty strings) "
                                          "and arguments (a JSON string)", param="input")
            call_ids.add(call["id"])
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None \
                    and reasoning is None:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                if reasoning is not None:
                    messages[-1]["reasoning_content"], reasoning = reasoning, None
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str) or not isinstance(item.get("call_id"), str):
                raise InvalidRequestError(f"input[{i}]: a function_call_output needs call_id and output (a string)",
                                          param="input")
            if item["call_id"] not in call_ids:
                raise InvalidRequestError(f"input[{i}]: no function_call with call_id {item['call_id']!r} comes "
                                          "before this function_call_output: give the call as an input item first",
                                          param="input")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
        else:
            raise InvalidRequestError(f"input[{i}]: item type {kind!r} is not supported (messages, function_call, "
                                      "function_call_output, reasoning)", param="input")
    if reasoning is not None:
        messages.append({"role": "assistant", "content": "", "reasoning_content": reasoning})
    if not messages:
        raise InvalidRequestError("input must not be empty", param="input")
    return messages


def _reasoning_text(item: dict[str, Any], index: int) -> str:
    """A reasoning item's text: its reasoning_text parts (as this server writes them), else its summary's
    summary_text parts (OpenAI's models give only a summary; encrypted_content means nothing here)."""
    for key, part_type in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key) or []
        if not isinstance(parts, list) or not all(isinstance(p, dict) and p.get("type") == part_type and
                                                  isinstance(p.get("text"), str) for p in parts):
            raise InvalidRequestError(f"input[{index}]: a reasoning item's {key} must be a list of "
                                      f"{{\"type\": \"{part_type}\", \"text\": ...}} parts", param="input")
        if parts:
            return "\n".join(p["text"] for p in parts)
    return ""


def _text(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"input[{index}]: content must be a string or a list of parts", param="input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise InvalidRequestError(f"input[{index}]: content part type {kind!r} is not supported (text only)",
                                      param="input")
        key = _TEXT_PARTS[kind]
        if not isinstance(part.get(key), str):
            raise InvalidRequestError(f"input[{index}]: content part {j} ({kind}) needs {key}, a string",
                                      param="input")
        texts.append(part[key])
    return "\n".join(texts)


def _check_metadata(metadata: dict[str, Any] | None) -> None:
    """OpenAI's rule: at most 16 pairs, keys of at most 64 characters, string values of at most 512."""
    if metadata is None:
        return
    if len(metadata) > 16 or not all(isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
                                     for k, v in metadata.items()):
        raise InvalidRequestError("metadata holds at most 16 pairs of strings (keys up to 64 characters, values up "
                                  "to 512)", param="metadata")


def _chat_tool(tool: dict[str, Any], index: int) -> dict[str, Any]:
    """A Responses function tool (flat) -> the chat route's {"type": "function", "function": {...}}."""
    if tool.get("type") != "function":
        raise InvalidRequestError(f"tools[{index}]: only function tools are supported, got type {tool.get('type')!r}",
                                  param="tools")
    if "function" in tool:  # the chat route's form
        raise InvalidRequestError(f"tools[{index}]: Responses tools are flat, {_FLAT_TOOL}, without a \"function\" "
                                  "object (that is the chat completions form)", param="tools")
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise InvalidRequestError(f"tools[{index}]: a function tool needs a name (a string): {_FLAT_TOOL}",
                                  param="tools")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: Any) -> Any:
    """The chat route's tool_choice for a Responses one; a 400 in the Responses request's terms."""
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        if isinstance(choice.get("function"), dict):
            return choice  # the chat route's own form
        if isinstance(choice.get("name"), str) and choice["name"]:
            return {"type": "function", "function": {"name": choice["name"]}}
        raise InvalidRequestError(f"tool_choice of type function needs the function's name: {_TOOL_CHOICE_FORMS}",
                                  param="tool_choice")
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind is not None:  # allowed_tools, hosted tools, custom, mcp
        raise InvalidRequestError(f"tool_choice of type {kind!r} is not supported: give {_TOOL_CHOICE_FORMS}",
                                  param="tool_choice")
    raise InvalidRequestError(f"tool_choice must be {_TOOL_CHOICE_FORMS}, got {choice!r}", param="tool_choice")


def _response_format(text_format: Any) -> dict[str, Any]:
    if not isinstance(text_format, dict):
        raise InvalidRequestError(f"text.format must be an object such as {{\"type\": \"json_schema\", \"name\": ..., "
                                  f"\"schema\": {{...}}}}, got {text_format!r}", param="text")
    kind = text_format.get("type")
    if kind == "json_schema":
        if not isinstance(text_format.get("name"), str) or not isinstance(text_format.get("schema"), dict):
            raise InvalidRequestError("text.format of type json_schema needs a name (a string) and a schema (an "
                                      "object)", param="text")
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
            started = await self.serving.start_chat(chat, "resp")
        except InvalidRequestError as exc:
            raise _renamed(exc) from None
        # vLLM's: the client's request_id (checked by start_chat) is the response's id
        skeleton = self._skeleton((req.model_extra or {}).get("request_id") or f"resp_{uuid.uuid4().hex}", req)
        prompt = started.prompt
        if req.stream:
            return _sse(self._events(skeleton, prompt.token_ids, started.streams, started.new_reader(),
                                     started.params.skip_special_tokens), done=False)
        tally = _PromptTally()
        finals = await _collect(started.streams, raw, 1, tally)
        choice = finals[0][0]
        reader = started.new_reader()
        read = read_all(reader, choice.text)
        output = []
        if read.reasoning:
            output.append(_reasoning_item(_item_id("rs"), read.reasoning, "completed"))
        if read.content or not (read.calls or read.reasoning):
            output.append(_message_item(_item_id("msg"), read.content, "completed"))
        output += [_function_call_item(_item_id("fc"), call["id"], call["function"]["name"],
                                       call["function"]["arguments"], "completed") for call in read.calls]
        return JSONResponse(_finish(skeleton, output, choice.finish_reason, len(prompt.token_ids),
                                    len(choice.token_ids), tally.num_cached,
                                    await self._reasoning_tokens(choice.token_ids, reader,
                                                                 started.params.skip_special_tokens)))

    def _skeleton(self, response_id: str, req: ResponsesRequest) -> dict[str, Any]:
        """The Response object's fields that echo the request, status in_progress and no output yet."""
        return {"id": response_id, "object": "response", "created_at": int(time.time()), "completed_at": None,
                "status": "in_progress",
                "error": None, "incomplete_details": None, "instructions": req.instructions,
                "max_output_tokens": req.max_output_tokens, "model": self.serving.served_model_names[0],
                "output": [], "parallel_tool_calls": req.parallel_tool_calls is not False,
                "previous_response_id": None, "reasoning": req.reasoning, "store": False,
                "temperature": self._used(req.temperature, "temperature"),
                "text": req.text or {"format": {"type": "text"}}, "tool_choice": req.tool_choice or "auto",
                "tools": req.tools or [], "top_p": self._used(req.top_p, "top_p"),
                "truncation": "disabled", "usage": None, "user": req.user, "metadata": req.metadata or {}}

    def _used(self, value: float | None, name: str) -> float:
        """The value sampling used, as OpenAI echoes it: the request's, else the model's (--generation-config),
        else 1.0 (null was echoed)."""
        return float(value if value is not None else self.serving.default_sampling.get(name, 1.0))

    async def _reasoning_tokens(self, token_ids: list[int], reader: ToolCallReader, skip_special_tokens: bool) -> int:
        """usage's reasoning_tokens: the generated tokens up to the one that ends the think block (all of them
        where it never ended). The first k tokens whose text reaches the content's first character, found by
        decoding prefixes (log2 of the output's length of them, off the event loop: a token's own bytes miss what
        the detokenizer drops, such as skipped special tokens)."""
        chars = reader.reasoning_chars
        if chars == 0 or reader.reasoning_unended:
            return len(token_ids) if chars else 0  # a block never ended: every token was in it, an EOS too

        def first_reaching() -> int:
            low, high = 1, len(token_ids)
            while low < high:
                middle = (low + high) // 2
                decoded = self.serving.tokenizer.decode(token_ids[:middle], skip_special_tokens=skip_special_tokens)
                low, high = (low, middle) if len(decoded) >= chars else (middle + 1, high)
            return low

        return await self.serving.in_tokenizer_pool(first_reaching)

    async def _events(self, skeleton: dict[str, Any], prompt_ids: list[int], streams: AsyncIterator,
                      reader: ToolCallReader, skip_special_tokens: bool = True) -> AsyncIterator[str]:
        """The Responses stream, as OpenAI's: each output item added, its text or arguments as deltas and done
        before the next item is added, then response.completed (or .incomplete); a failure is an `error` event
        and response.failed."""
        stream = _EventStream(skeleton)
        yield stream.event("response.created", response=skeleton)
        yield stream.event("response.in_progress", response=skeleton)
        tally = _PromptTally()
        finish_reason, token_ids = None, []
        try:
            async for prompt_index, output in streams:
                tally.add(prompt_index, output)
                completion = output.outputs[0]
                token_ids += completion.token_ids
                events = reader.feed(completion.text)
                if completion.finish_reason is not None:
                    finish_reason = completion.finish_reason
                    events += reader.finish()
                for piece in events:
                    for line in stream.piece(piece):
                        yield line
        except Exception as exc:  # noqa: BLE001 - after the headers went out, a failure travels as events
            error = to_api_error(exc)
            yield stream.event("error", code=str(error.code or error.status), message=error.message,
                               param=error.param)
            code = "server_error" if error.status >= 500 else "invalid_prompt"  # OpenAI's ResponseError codes
            yield stream.event("response.failed", response={**skeleton, "status": "failed", "output": stream.items,
                                                            "error": {"code": code, "message": error.message}})
            return
        if not stream.items:  # nothing written: an empty message, as the non-streamed response has
            for line in stream.text("", force=True):
                yield line
        for line in stream.close(incomplete=finish_reason == "length"):
            yield line
        reasoning_tokens = await self._reasoning_tokens(token_ids, reader, skip_special_tokens)
        final = _finish(skeleton, stream.items, finish_reason, len(prompt_ids), len(token_ids), tally.num_cached,
                        reasoning_tokens)
        yield stream.event("response.incomplete" if final["status"] == "incomplete" else "response.completed",
                           response=final)


class _EventStream:
    """The stream's output items, one open at a time (text after a function call starts a new message)."""

    def __init__(self, skeleton: dict[str, Any]) -> None:
        self.sequence = 0
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        self.calls: dict[int, dict[str, Any]] = {}  # the reader's call index -> its item

    def event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    def piece(self, piece: str | ToolCallDelta | ReasoningDelta) -> list[str]:
        """The events of one of the reader's pieces."""
        if isinstance(piece, str):
            return self.text(piece)
        return self.reasoning(piece.text) if isinstance(piece, ReasoningDelta) else self.call(piece)

    def reasoning(self, text: str) -> list[str]:
        lines = []
        if self.open is None or self.open["type"] != "reasoning":
            lines += self.close()
            self.open = _reasoning_item(_item_id("rs"), "", "in_progress")
            self.items.append(self.open)
            lines.append(self.event("response.output_item.added", output_index=len(self.items) - 1,
                                    item={**self.open, "content": []}))
        self.open["content"][0]["text"] += text
        lines.append(self.event("response.reasoning_text.delta", item_id=self.open["id"],
                                output_index=len(self.items) - 1, content_index=0, delta=text))
        return lines

    def text(self, piece: str, force: bool = False) -> list[str]:
        if not piece and not force:
            return []
        lines = []
        if self.open is None or self.open["type"] != "message":
            lines += self.close()
            self.open = _message_item(_item_id("msg"), "", "in_progress")
            self.items.append(self.open)
            index = len(self.items) - 1
            lines.append(self.event("response.output_item.added", output_index=index, item={**self.open,
                                                                                            "content": []}))
            lines.append(self.event("response.content_part.added", item_id=self.open["id"], output_index=index,
                                    content_index=0, part=_text_part("")))
        if piece:
            self.open["content"][0]["text"] += piece
            lines.append(self.event("response.output_text.delta", item_id=self.open["id"],
                                    output_index=len(self.items) - 1, content_index=0, delta=piece, logprobs=[]))
        return lines

    def call(self, piece: ToolCallDelta) -> list[str]:
        lines = []
        item = self.calls.get(piece.index)
        if item is None:
            lines += self.close()
            item = self.open = self.calls[piece.index] = _function_call_item(_item_id("fc"), piece.id, piece.name,
                                                                             "", "in_progress")
            self.items.append(item)
            lines.append(self.event("response.output_item.added", output_index=len(self.items) - 1, item=dict(item)))
        if piece.arguments:
            item["arguments"] += piece.arguments
            lines.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                    output_index=self.items.index(item), delta=piece.arguments))
        return lines

    def close(self, incomplete: bool = False) -> list[str]:
        """The open item's done events (a message cut at max_output_tokens is incomplete, as OpenAI marks it)."""
        item, self.open = self.open, None
        if item is None:
            return []
        index = self.items.index(item)
        if item["type"] == "message":
            item["status"] = "incomplete" if incomplete else "completed"
            text = item["content"][0]["text"]
            lines = [self.event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                                text=text, logprobs=[]),
                     self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                content_index=0, part=_text_part(text))]
        elif item["type"] == "reasoning":  # thinking cut at max_output_tokens is incomplete too
            item["status"] = "incomplete" if incomplete else "completed"
            lines = [self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                content_index=0, text=item["content"][0]["text"])]
        else:  # a call cut at max_output_tokens too: its arguments are not whole JSON
            item["status"] = "incomplete" if incomplete else "completed"
            lines = [self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                name=item["name"], arguments=item["arguments"])]
        return lines + [self.event("response.output_item.done", output_index=index, item=item)]


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": [_text_part(text)]}


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def _function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def _finish(skeleton: dict[str, Any], output: list[dict[str, Any]], finish_reason: str | None, num_prompt: int,
            num_output: int, num_cached: int, num_reasoning: int = 0) -> dict[str, Any]:
    """The Response object once the generation ended: completed, or incomplete at max_output_tokens."""
    incomplete = finish_reason == "length"
    if incomplete and output:
        output[-1]["status"] = "incomplete"  # the message or call cut short, as OpenAI marks it
    return {**skeleton, "status": "incomplete" if incomplete else "completed", "output": output,
            "completed_at": None if incomplete else int(time.time()),
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "usage": {"input_tokens": num_prompt,
                      "input_tokens_details": {"cached_tokens": num_cached, "cache_write_tokens": 0},
                      "output_tokens": num_output, "output_tokens_details": {"reasoning_tokens": num_reasoning},
                      "total_tokens": num_prompt + num_output}}
