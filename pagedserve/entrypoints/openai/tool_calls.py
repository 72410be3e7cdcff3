"""Tool calling for /v1/chat/completions: what `tools` + `tool_choice` ask of the engine, and the tool calls
read back out of the generated text, streamed or not.

tool_choice:
- "none": tools reach the chat template, the model writes text, nothing is parsed.
- "auto" (the default when tools are given): the model writes freely; the parser chosen with
  `--enable-auto-tool-choice --tool-call-parser NAME` extracts the calls it made (hermes: `<tool_call>{json}
  </tool_call>` as Qwen2.5/Qwen3 write; llama3_json: `{"name": ..., "parameters": {...}}` as Llama 3 writes).
- "required": a grammar forces a JSON array of calls [{"name": one of the tools, "parameters": its schema}].
- {"type": "function", "function": {"name": N}}: a grammar forces the arguments of N (its parameter schema).
So with "required" and a named function the arguments always parse and match the schema.

One ToolCallReader per choice turns the text deltas of a generation into events (content text, tool-call
pieces). The non-streamed response is the same reader fed the whole text at once and its events
accumulated, so a streamed response always adds up to the non-streamed one.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from pagedserve.exceptions import InvalidRequestError
from pagedserve.structured.params import StructuredOutputsParams
from pagedserve.structured.schema import check_json_schema

PARSERS = ("hermes", "llama3_json")
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


@dataclass
class ToolChoice:
    mode: str  # none | auto | required | named
    tools: list[dict]  # the request's tools (OpenAI shape)
    function_name: str | None = None  # mode "named"
    parallel: bool = True

    @property
    def grammar(self) -> StructuredOutputsParams | None:
        """The grammar that enforces this choice (required, named), else None. A parameters schema it cannot
        enforce is named where the request has it (tools[i].function.parameters), not inside the grammar's."""
        for index, tool in enumerate(self.tools):
            if self.mode == "required" or (self.mode == "named" and tool["function"]["name"] == self.function_name):
                check_json_schema(_parameters(tool["function"]), "tools", root=f"tools[{index}].function.parameters#")
        if self.mode == "named":
            return StructuredOutputsParams(json=_parameters(self._function(self.function_name)), param="tool_choice")
        if self.mode == "required":
            calls = [{"type": "object", "properties": {"name": {"const": f["function"]["name"]},
                                                       "parameters": _parameters(f["function"])},
                      "required": ["name", "parameters"], "additionalProperties": False} for f in self.tools]
            schema: dict[str, Any] = {"type": "array", "minItems": 1,
                                      "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
            if not self.parallel:
                schema["maxItems"] = 1
            return StructuredOutputsParams(json=schema, param="tool_choice")
        return None

    def _function(self, name: str) -> dict:
        return next(t["function"] for t in self.tools if t["function"]["name"] == name)


def resolve_tool_choice(tools: list[dict] | None, tool_choice: Any, parallel: bool | None, parser: str | None,
                        template_has_tools: bool) -> ToolChoice | None:
    """The request's ToolChoice (None without tools); InvalidRequestError naming what is wrong."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise InvalidRequestError("tool_choice needs tools", param="tool_choice")
        return None
    _check_tools(tools)
    names = [t["function"]["name"] for t in tools]
    choice = ToolChoice("auto" if tool_choice is None else "", tools, parallel=parallel is not False)
    if tool_choice in ("none", "auto", "required"):
        choice.mode = tool_choice
    elif isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        if name not in names:
            raise InvalidRequestError(f"tool_choice names the function {name!r}, which is not among the tools "
                                      f"({', '.join(names)})", param="tool_choice")
        choice.mode, choice.function_name = "named", name
    elif tool_choice is not None:
        raise InvalidRequestError('tool_choice must be "none", "auto", "required" or {"type": "function", '
                                  '"function": {"name": ...}}', param="tool_choice")
    if choice.mode == "auto":
        if parser is None:
            raise InvalidRequestError('"auto" tool choice requires the server to be started with '
                                      "--enable-auto-tool-choice --tool-call-parser NAME (one of "
                                      f"{', '.join(PARSERS)}); or use tool_choice \"required\" or a named function",
                                      param="tool_choice")
        if not template_has_tools:
            raise InvalidRequestError('tool_choice "auto": this model\'s chat template has no tool-call format, so '
                                      "the model was not taught to call tools; use tool_choice \"required\" or a "
                                      "named function (enforced by a grammar)", param="tool_choice")
    return choice


def _check_tools(tools: list[dict]) -> None:
    seen = set()
    for index, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise InvalidRequestError(f"tools[{index}] must be {{\"type\": \"function\", \"function\": {{\"name\": "
                                      "..., \"parameters\": {...}}}", param="tools")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise InvalidRequestError(f"tools[{index}].function.name must be 1-64 letters, digits, _ . or -, got "
                                      f"{name!r}", param="tools")
        if name in seen:
            raise InvalidRequestError(f"tools: the function name {name!r} appears twice", param="tools")
        seen.add(name)
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise InvalidRequestError(f"tools[{index}].function.parameters must be a JSON schema object",
                                      param="tools")


def _parameters(function: dict) -> dict:
    return function.get("parameters") or {"type": "object", "properties": {}}


# ---- reading calls out of the generated text ------------------------------------------------------
@dataclass
class ToolCallDelta:
    index: int
    arguments: str
    id: str | None = None  # set in the first delta of a call, with its name
    name: str | None = None

    def to_openai(self) -> dict:
        body: dict[str, Any] = {"index": self.index, "function": {"arguments": self.arguments}}
        if self.id is not None:
            body.update(id=self.id, type="function")
            body["function"]["name"] = self.name
        return body


@dataclass
class ReadResult:
    """Accumulated events of a ToolCallReader: the non-streamed message."""

    content: str = ""
    calls: list[dict] = field(default_factory=list)  # OpenAI tool_calls entries

    def add(self, events: list[str | ToolCallDelta]) -> None:
        for event in events:
            if isinstance(event, str):
                self.content += event
            elif event.id is not None:
                self.calls.append({"id": event.id, "type": "function",
                                   "function": {"name": event.name, "arguments": event.arguments}})
            else:
                self.calls[event.index]["function"]["arguments"] += event.arguments


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallReader:
    """Base: text passes through as content."""

    # Every token's text leaves as it comes (a stream sends a chunk per token, even an empty one, as vLLM); readers
    # that may hold text back until they know what it is set False, and their streams skip the empty deltas.
    passes_text_through = True

    def __init__(self) -> None:
        self.num_calls = 0

    def feed(self, text: str) -> list[str | ToolCallDelta]:
        return [text] if text else []

    def finish(self) -> list[str | ToolCallDelta]:
        return []

    def _call(self, name: str, arguments: Any) -> ToolCallDelta:
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        delta = ToolCallDelta(self.num_calls, text, new_call_id(), name)
        self.num_calls += 1
        return delta


class NamedFunctionReader(ToolCallReader):
    """tool_choice names a function: the whole output is its arguments, streamed as they are generated."""

    passes_text_through = False

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def feed(self, text: str) -> list[str | ToolCallDelta]:
        if self.num_calls == 0:
            return [self._call(self.name, text)]
        return [ToolCallDelta(0, text)] if text else []

    def finish(self) -> list[str | ToolCallDelta]:
        return [] if self.num_calls else [self._call(self.name, "")]


class BufferedReader(ToolCallReader):
    """Formats read whole at the end (a JSON array of calls; llama3_json)."""

    passes_text_through = False

    def __init__(self) -> None:
        super().__init__()
        self.text = ""

    def feed(self, text: str) -> list[str | ToolCallDelta]:
        self.text += text
        return []

    def finish(self) -> list[str | ToolCallDelta]:
        return self.parse(self.text)

    def parse(self, text: str) -> list[str | ToolCallDelta]:
        raise NotImplementedError


class RequiredReader(BufferedReader):
    """tool_choice "required": the grammar made the output [{"name": ..., "parameters": {...}}, ...]."""

    def parse(self, text: str) -> list[str | ToolCallDelta]:
        try:
            calls = json.loads(text)
        except ValueError:
            return [text] if text else []  # cut short by max_tokens: what there is, as text
        return [self._call(c["name"], c["parameters"]) for c in calls]


class Llama3JsonReader(BufferedReader):
    """llama3_json: `{"name": ..., "parameters": {...}}` (or "arguments"), several joined by `;`, optionally
    after `<|python_tag|>`; any other output is content."""

    def parse(self, text: str) -> list[str | ToolCallDelta]:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return [text] if text else []
        calls = _json_values(body, " \n\t;")
        if calls is None or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
            return [text]
        return [self._call(c["name"], c.get("parameters", c.get("arguments", {}))) for c in calls]


def _json_values(text: str, separators: str) -> list | None:
    """The JSON values `text` consists of, with only `separators` characters around them; None if it is not."""
    decoder, values, position = json.JSONDecoder(), [], _skip(text, 0, separators)
    try:
        while position < len(text):
            value, position = decoder.raw_decode(text, position)
            values.append(value)
            position = _skip(text, position, separators)
    except ValueError:
        return None
    return values


def _skip(text: str, position: int, chars: str) -> int:
    while position < len(text) and text[position] in chars:
        position += 1
    return position


class HermesReader(ToolCallReader):
    """hermes: content, with calls as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` anywhere in it.
    Content streams as it comes, holding back only what may be the start of a tag; each call is sent whole when
    its closing tag arrives. A block that does not parse stays content. Small models often write the call's JSON
    without the tags: an output that is nothing but `{"name": <one of the tools>, "arguments": {...}}` objects
    (possibly in a ``` code fence) is those calls too (held until the end, as it may turn out to be text)."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    passes_text_through = False

    def __init__(self, tool_names: list[str]) -> None:
        super().__init__()
        self.tool_names = tool_names
        self.pending = ""
        self.bare: bool | None = None  # None until the output's first character says whether it may be a bare call

    def feed(self, text: str) -> list[str | ToolCallDelta]:
        self.pending += text
        if self.bare is None:
            head = self.pending.lstrip()
            if not head or (len(head) < 3 and "```".startswith(head)):
                return []
            self.bare = head.startswith(("{", "```"))
        if self.bare:
            return []
        events: list[str | ToolCallDelta] = []
        while True:
            start = self.pending.find(self.OPEN)
            if start < 0:
                keep = _partial_suffix(self.pending, self.OPEN)
                self._emit(events, self.pending[:len(self.pending) - keep])
                self.pending = self.pending[len(self.pending) - keep:]
                return events
            end = self.pending.find(self.CLOSE, start)
            if end < 0:
                self._emit(events, self.pending[:start])
                self.pending = self.pending[start:]
                return events
            self._emit(events, self.pending[:start])
            block = self.pending[start:end + len(self.CLOSE)]
            self.pending = self.pending[end + len(self.CLOSE):]
            events.append(self._parse_block(block))

    def finish(self) -> list[str | ToolCallDelta]:
        if self.bare:
            calls = self._bare_calls(self.pending)
            if calls:
                self.pending = ""
                return calls
        self.bare = False
        events = self.feed("")
        self._emit(events, self.pending)  # an unclosed block (cut by max_tokens) stays text
        self.pending = ""
        return events

    def _bare_calls(self, text: str) -> list[ToolCallDelta]:
        """The calls, if `text` is nothing but JSON call objects of known tools (whitespace between them)."""
        values = _json_values(_strip_code_fence(text), " \n\t\r")
        if values is None or not all(isinstance(v, dict) and v.get("name") in self.tool_names and isinstance(v.get("arguments"), dict)
                   for v in values):
            return []
        return [self._call(v["name"], v["arguments"]) for v in values]

    def _parse_block(self, block: str) -> str | ToolCallDelta:
        try:
            value = json.loads(block[len(self.OPEN):-len(self.CLOSE)])
        except ValueError:
            return block
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return block
        return self._call(value["name"], value.get("arguments", value.get("parameters", {})))

    @staticmethod
    def _emit(events: list, text: str) -> None:
        if text:
            events.append(text)


def _strip_code_fence(text: str) -> str:
    """The inside of a markdown code fence (```json ... ```) that is the whole text, else the text."""
    body = text.strip()
    if not (body.startswith("```") and body.endswith("```") and len(body) > 6):
        return text
    first_line_end = body.find("\n")
    return body[first_line_end + 1:-3] if first_line_end > 0 else text


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


def make_reader(choice: ToolChoice | None, parser: str | None) -> ToolCallReader:
    if choice is None or choice.mode == "none":
        return ToolCallReader()
    if choice.mode == "named":
        return NamedFunctionReader(choice.function_name)
    if choice.mode == "required":
        return RequiredReader()
    reader = HermesReader([t["function"]["name"] for t in choice.tools]) if parser == "hermes" else Llama3JsonReader()
    return reader if choice.parallel else FirstCallReader(reader)


class FirstCallReader(ToolCallReader):
    """parallel_tool_calls false under "auto" (where no grammar limits the calls): the first call the model wrote;
    later ones are dropped, as OpenAI answers with at most one."""

    def __init__(self, reader: ToolCallReader) -> None:
        super().__init__()
        self.reader = reader
        self.passes_text_through = reader.passes_text_through

    def feed(self, text: str) -> list[str | ToolCallDelta]:
        return self._first(self.reader.feed(text))

    def finish(self) -> list[str | ToolCallDelta]:
        return self._first(self.reader.finish())

    @staticmethod
    def _first(events: list[str | ToolCallDelta]) -> list[str | ToolCallDelta]:
        return [e for e in events if not isinstance(e, ToolCallDelta) or e.index == 0]


def read_all(reader: ToolCallReader, text: str) -> ReadResult:
    result = ReadResult()
    result.add(reader.feed(text))
    result.add(reader.finish())
    return result
