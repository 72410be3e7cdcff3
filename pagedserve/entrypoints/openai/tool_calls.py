"""Tool calling for /v1/chat/completions: what `tools` + `tool_choice` ask of the engine, and the tool calls
read back out of the generated text, streamed or not.

tool_choice:
- "none": tools reach the chat template, the model writes text, nothing is parsed.
- "auto" (the default when tools are given): the model writes freely; the parser chosen with
  `--enable-auto-tool-choice --tool-call-parser NAME` extracts the calls it made (hermes: `<tool_call>{json}
  </tool_call>` as Qwen2.5/Qwen3 write; llama3_json: `{"name": ..., "parameters": {...}}` as Llama 3 writes).
- "required": a grammar forces a JSON array of calls [{"name": one of the tools, "parameters": its schema}].
- {"type": "function", "function": {"name": N}}: a grammar forces the arguments of N (its parameter schema).
So with "required" and a named function the arguments always parse and match the schema; under "auto" with
hermes, so do a `"strict": true` tool's (ToolChoice.strict_schemas).

One ToolCallReader per choice turns the text deltas of a generation into events (content text, tool-call
pieces). The non-streamed response is the same reader fed the whole text at once and its events
accumulated, so a streamed response always adds up to the non-streamed one.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagedserve.exceptions import InvalidRequestError
from pagedserve.structured.params import StructuredOutputsParams
from pagedserve.structured.schema import check_json_schema, dialect_of

PARSERS = ("granite", "hermes", "llama3_json", "mistral", "phi4_mini_json", "pythonic")
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


@dataclass
class ToolChoice:
    mode: str  # none | auto | required | named
    tools: list[dict]  # the request's tools (OpenAI shape)
    function_name: str | None = None  # mode "named"
    parallel: bool = True
    parser: str | None = None  # --tool-call-parser (mode "auto")

    @property
    def strict_schemas(self) -> dict[str, dict]:
        """auto under hermes: the parameters of each `"strict": true` tool, by name, which its calls are held to
        (OpenAI's promise; the model wrote arguments that broke them, QA-F): a tagged call by a grammar that
        starts at the tag (the text around calls stays free), calls written without tags by a check at the end
        (those that break it are text)."""
        if self.mode != "auto" or self.parser != "hermes":
            return {}
        return {t["function"]["name"]: _parameters(t["function"]) for t in self.tools
                if t["function"].get("strict") is True}

    @property
    def grammar(self) -> StructuredOutputsParams | None:
        """The grammar that enforces this choice (required, named, auto's strict tools under hermes), else None. A
        parameters schema it cannot enforce is named where the request has it (tools[i].function.parameters),
        not inside the grammar's."""
        strict = self.strict_schemas
        for index, tool in enumerate(self.tools):
            if self.mode == "required" or (self.mode == "named" and tool["function"]["name"] == self.function_name) \
                    or tool["function"]["name"] in strict:
                check_json_schema(_parameters(tool["function"]), "tools", root=f"tools[{index}].function.parameters#")
        if strict:  # xgrammar's structural tag: free text until the tag, then a call as Qwen's template shows it
            structures = [{"begin": f'{HermesReader.OPEN}\n{{"name": {json.dumps(name)}, "arguments": ',
                           "schema": strict.get(name, {"type": "object", "additionalProperties": True}),
                           "end": f"}}\n{HermesReader.CLOSE}"} for name in (t["function"]["name"] for t in self.tools)]
            return StructuredOutputsParams(structural_tag={"structures": structures, "triggers": [HermesReader.OPEN]},
                                           param="tools")
        if self.mode == "named":
            return StructuredOutputsParams(json=_parameters(self._function(self.function_name)), param="tool_choice")
        if self.mode == "required":
            # Each tool's parameters schema under $defs, its local references ("#", "#/$defs/...") re-rooted there:
            # inside the array of calls they would resolve against the array's schema.
            defs = {_tool_def(i): _rerooted(_parameters(f["function"]), f"#/$defs/{_tool_def(i)}")
                    for i, f in enumerate(self.tools)}
            calls = [{"type": "object", "properties": {"name": {"const": f["function"]["name"]},
                                                       "parameters": {"$ref": f"#/$defs/{_tool_def(i)}"}},
                      "required": ["name", "parameters"], "additionalProperties": False}
                     for i, f in enumerate(self.tools)]
            schema: dict[str, Any] = {"type": "array", "minItems": 1,
                                      "items": calls[0] if len(calls) == 1 else {"anyOf": calls}, "$defs": defs}
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
    choice = ToolChoice("auto" if tool_choice is None else "", tools, parallel=parallel is not False, parser=parser)
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


def _tool_def(index: int) -> str:
    return f"tool_{index}_parameters"


# Keywords whose values are data, not schemas: a "$ref" key inside them is not a reference.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
# Keywords whose values map names to schemas.
_NAMED_SCHEMAS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def _rerooted(schema: Any, root: str) -> Any:
    """`schema` with its local references ("#" and "#/...") pointing into it where it sits at `root`."""
    if isinstance(schema, list):
        return [_rerooted(item, root) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = root + value[1:]
        elif key in _DATA_KEYWORDS:
            out[key] = value
        elif key in _NAMED_SCHEMAS and isinstance(value, dict):  # names there are names, not keywords
            out[key] = {name: _rerooted(sub, root) for name, sub in value.items()}
        else:
            out[key] = _rerooted(value, root)
    return out


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
class ReasoningDelta:
    """A piece of the model's reasoning (reasoning.py's reader, in front of the tool-call readers)."""

    text: str


@dataclass
class ReadResult:
    """Accumulated events of a ToolCallReader: the non-streamed message."""

    content: str = ""
    calls: list[dict] = field(default_factory=list)  # OpenAI tool_calls entries
    reasoning: str | None = None  # with a reasoning parser: the reasoning it read, if any

    def add(self, events: list[str | ToolCallDelta | ReasoningDelta]) -> None:
        for event in events:
            if isinstance(event, str):
                self.content += event
            elif isinstance(event, ReasoningDelta):
                self.reasoning = (self.reasoning or "") + event.text
            elif event.id is not None:
                self.calls.append({"id": event.id, "type": "function",
                                   "function": {"name": event.name, "arguments": event.arguments}})
            else:
                self.calls[event.index]["function"]["arguments"] += event.arguments


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def mistral_call_id() -> str:
    """Mistral's templates refuse a tool call id that is not 9 letters and digits (vLLM's mistral parser makes
    such ids too)."""
    return uuid.uuid4().hex[:9]


class ToolCallReader:
    """Base: text passes through as content."""

    # Every token's text leaves as it comes (a stream sends a chunk per token, even an empty one, as vLLM); readers
    # that may hold text back until they know what it is set False, and their streams skip the empty deltas.
    passes_text_through = True
    reasoning_chars = 0  # how many of the text's first characters were reasoning (reasoning.py's reader)
    reasoning_unended = False  # the text ended inside a think block (reasoning.py's reader)

    def __init__(self) -> None:
        self.num_calls = 0
        self.new_id: Callable[[], str] = new_call_id  # the calls' ids (make_reader: mistral's for that parser)

    def feed(self, text: str) -> list[str | ToolCallDelta]:
        return [text] if text else []

    def finish(self) -> list[str | ToolCallDelta]:
        return []

    def _call(self, name: str, arguments: Any) -> ToolCallDelta:
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        delta = ToolCallDelta(self.num_calls, text, self.new_id(), name)
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


class CallScanner:
    """Reads one call object, `{"name": ..., "arguments": {...}}` ("parameters" too), a piece at a time, whatever the
    pieces: its name once the string is complete, and the arguments object's own characters as they arrive, so a
    stream can send them as they are generated (the text sent is the text written, so the pieces add up to the
    arguments of the call read whole). Arguments that are not an object (a JSON string of them) are kept raw and
    given at the end. Anything that is not such an object sets `failed`."""

    ARGUMENT_KEYS = ("arguments", "parameters")

    def __init__(self) -> None:
        self.state = "start"  # start | key_or_end | key | colon | value | after_value | done | failed
        self.key = ""
        # The current key's and value's characters, and the arguments object's: lists, as text grown a character
        # at a time (an attribute's `+=` copies the whole string each time: quadratic in a long argument).
        self._key: list[str] = []
        self._raw: list[str] = []
        self._arguments: list[str] = []
        self.name: str | None = None
        self.arguments_open = False  # the arguments object has begun (and streams)
        self.arguments_other: str | None = None  # arguments of another JSON kind, raw, once complete
        self._depth, self._in_string, self._escape = 0, False, False
        self.consumed = 0

    @property
    def done(self) -> bool:
        return self.state == "done"

    @property
    def failed(self) -> bool:
        return self.state == "failed"

    @property
    def value_start(self) -> str:
        """The first character of the value being read ("" before it begins)."""
        return self._raw[0] if self.state == "value" and self._raw else ""

    @property
    def arguments(self) -> str:
        """The arguments object's text so far."""
        return "".join(self._arguments)

    def feed(self, text: str) -> str:
        """Consume `text`; returns the characters of it that belong to the arguments object."""
        out: list[str] = []
        self.consumed = 0  # how much of `text` was this object's (it may end inside)
        for char in text:
            if self.state in ("done", "failed"):
                break
            self._step(char, out)
            if self.state != "failed":  # the character that failed it is not the object's (it may be "</tool_call>")
                self.consumed += 1
        return "".join(out)

    def _step(self, char: str, out: list[str]) -> None:
        state = self.state
        if state == "value":
            self._value(char, out)
        elif state == "key":
            self._string(char)
            self._key.append(char)
            if not self._in_string:
                self.key = _json_string("".join(self._key))
                self.state = "colon"
        elif char in " \t\r\n":
            return
        elif state == "start":
            self.state = "key_or_end" if char == "{" else "failed"
        elif state == "key_or_end" and char == '"':
            self._key, self._in_string, self.state = [char], True, "key"
        elif state in ("key_or_end", "after_value") and char == "}":
            self.state = "done"
        elif state == "colon" and char == ":":
            self.state, self._raw = "value", []
        elif state == "after_value" and char == ",":
            self.state = "key_or_end"
        else:
            self.state = "failed"

    def _value(self, char: str, out: list[str]) -> None:
        raw = self._raw
        if not raw and char in " \t\r\n":
            return
        if raw and raw[0] not in '{["' and char in ",} \t\r\n":  # a number, true, false or null ends at the
            self._end_value()  # character after it
            self._step(char, out)
            return
        raw.append(char)
        if self._in_string or char == '"':
            self._string(char)
        elif char in "{[":
            self._depth += 1
        elif char in "}]":
            self._depth -= 1
        if raw[0] == "{" and self.key in self.ARGUMENT_KEYS:  # the arguments object: it streams
            self.arguments_open = True
            self._arguments.append(char)
            out.append(char)
        if self._depth == 0 and not self._in_string and (raw[0] in "{[" or len(raw) > 1 and raw[0] == '"'):
            self._end_value()

    def _end_value(self) -> None:
        if self.key == "name":
            try:
                value = json.loads("".join(self._raw))
            except ValueError:
                value = None
            if not isinstance(value, str):
                self.state = "failed"
                return
            self.name = value
        elif self.key in self.ARGUMENT_KEYS and self._raw[0] != "{":
            self.arguments_other = "".join(self._raw)
        self.state = "after_value"

    def _string(self, char: str) -> None:
        """Track a JSON string: opened by `"`, closed by an unescaped `"`."""
        if not self._in_string:
            self._in_string = True
        elif self._escape:
            self._escape = False
        elif char == "\\":
            self._escape = True
        elif char == '"':
            self._in_string = False


def _json_string(text: str) -> str:
    try:
        value = json.loads(text)
    except ValueError:
        return ""
    return value if isinstance(value, str) else ""


class StreamedCall:
    """One call being read by a CallScanner: its deltas as they can be sent (the first, with id and name, once the
    name is known and the arguments object has begun)."""

    def __init__(self, reader: ToolCallReader) -> None:
        self.reader = reader
        self.scanner = CallScanner()
        self.delta: ToolCallDelta | None = None  # the first delta, once sent

    def feed(self, text: str) -> list[ToolCallDelta]:
        piece = self.scanner.feed(text)
        scanner = self.scanner
        if self.delta is None:
            if scanner.name is None or not scanner.arguments_open:
                return []
            self.delta = self.reader._call(scanner.name, scanner.arguments)
            return [self.delta]
        return [ToolCallDelta(self.delta.index, piece)] if piece else []

    def finish(self) -> list[ToolCallDelta]:
        """At the end of the call's text: a call whose arguments are not an object, sent whole."""
        scanner = self.scanner
        if self.delta is not None or not scanner.done or scanner.name is None:
            return []
        other = scanner.arguments_other
        try:
            arguments = {} if other is None else json.loads(other)
        except ValueError:
            return []
        self.delta = self.reader._call(scanner.name, arguments)
        return [self.delta]


class RequiredReader(ToolCallReader):
    """tool_choice "required": the grammar makes the output `[{"name": ..., "parameters": {...}}, ...]`. Each call
    is sent once its name is known, its arguments as they are generated. Output cut short by max_tokens before
    the first call began is text; a call it cuts keeps the arguments written."""

    passes_text_through = False

    def __init__(self) -> None:
        super().__init__()
        self.text = ""
        self.state = "start"  # start | element | call | after | end
        self.call: StreamedCall | None = None

    def feed(self, text: str) -> list[str | ToolCallDelta]:
        if not self.num_calls:
            self.text += text  # what finish() gives as text when no call began (cut short)
        events: list[str | ToolCallDelta] = []
        position = 0
        while position < len(text) and self.state != "end":
            if self.state == "call":
                events += self.call.feed(text[position:])
                position += self.call.scanner.consumed
                if self.call.scanner.done or self.call.scanner.failed:
                    events += self.call.finish()
                    self.state = "after" if self.call.scanner.done else "end"
                continue
            char = text[position]
            position += 1
            if char in " \t\r\n":
                continue
            if self.state == "start":
                self.state = "element" if char == "[" else "end"
            elif self.state == "element" and char == "{":
                self.call, self.state = StreamedCall(self), "call"
                events += self.call.feed("{")
            elif self.state == "after" and char == ",":
                self.state = "element"
            else:
                self.state = "end"
        return events

    def finish(self) -> list[str | ToolCallDelta]:
        if self.num_calls == 0:
            return [self.text] if self.text else []  # no call began (cut short): what there is, as text
        return []


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


class MarkedCallsReader(ToolCallReader):
    """Formats whose calls come after a marker, following any content: the content streams until the marker (held
    back only while the text may be its beginning); what follows the marker is read whole at the end (`calls`).
    Where that is not calls, the marker and all after it are content (as vLLM's parsers keep it)."""

    MARKER = ""
    passes_text_through = False

    def __init__(self) -> None:
        super().__init__()
        self.pending = ""
        self.after: list[str] | None = None  # the text after the marker, once it was seen

    def feed(self, text: str) -> list[str | ToolCallDelta]:
        if self.after is not None:
            self.after.append(text)
            return []
        self.pending += text
        start = self.pending.find(self.MARKER)
        if start >= 0:
            content, self.after, self.pending = self.pending[:start], [self.pending[start + len(self.MARKER):]], ""
        else:
            cut = len(self.pending) - partial_suffix(self.pending, self.MARKER)
            content, self.pending = self.pending[:cut], self.pending[cut:]
        return [content] if content else []

    def finish(self) -> list[str | ToolCallDelta]:
        if self.after is None:
            held, self.pending = self.pending, ""
            return [held] if held else []
        body = "".join(self.after)
        calls = self.calls(body)
        if calls is None:
            return [self.MARKER + body]
        return [self._call(name, arguments) for name, arguments in calls]

    def calls(self, body: str) -> list[tuple[str, Any]] | None:
        """(name, arguments) of each call in the text after the marker; None if it is not calls."""
        return _call_objects(_json_values(body, " \n\t\r"))


class MistralReader(MarkedCallsReader):
    """mistral: `[TOOL_CALLS]` then a JSON array of `{"name", "arguments"}` objects (Mistral-7B-Instruct-v0.3 and
    tokenizers before v11), or `[TOOL_CALLS]name[ARGS]{...}` for each call (v11 and later: Mistral-Small-3.1+,
    Ministral, Devstral; a `[CALL_ID]id` after the name is dropped)."""

    MARKER = "[TOOL_CALLS]"

    def calls(self, body: str) -> list[tuple[str, Any]] | None:
        if body.lstrip()[:1] in ("[", "{"):
            return super().calls(body)
        calls = []
        for part in body.split(self.MARKER):
            name, sep, arguments = part.partition("[ARGS]")
            name = name.split("[CALL_ID]")[0].strip()
            if not sep or not _NAME.match(name):
                return None
            values = _json_values(arguments, " \n\t\r")
            if not values or len(values) != 1 or not isinstance(values[0], dict):
                return None
            calls.append((name, values[0]))
        return calls


class GraniteReader(MarkedCallsReader):
    """granite: `<|tool_call|>` then a JSON array of `{"name", "arguments"}` objects (IBM Granite 3.x)."""

    MARKER = "<|tool_call|>"


class Phi4MiniReader(MarkedCallsReader):
    """phi4_mini_json: `functools` then a JSON array of `{"name", "arguments"}` objects (Phi-4-mini-instruct)."""

    MARKER = "functools"


class PythonicReader(BufferedReader):
    """pythonic: the output is a Python list of calls with keyword arguments, `[get_weather(city="Paris"), add(a=1,
    b=2)]` (Llama 3.2 and Llama 4 with a pythonic template; `<|python_start|>` ... `<|python_end|>` around it
    allowed); the values are Python literals (strings, numbers, True/False/None, lists, dicts). Any other output is
    content, as in vLLM."""

    def parse(self, text: str) -> list[str | ToolCallDelta]:
        import ast

        body = text.strip().removeprefix("<|python_start|>").removesuffix("<|python_end|>").strip()
        calls = []
        try:
            tree = ast.parse(body, mode="eval").body if body.startswith("[") and body.endswith("]") else None
            if not isinstance(tree, ast.List) or not tree.elts:
                return [text] if text else []
            for node in tree.elts:
                if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args or any(
                        k.arg is None for k in node.keywords):
                    return [text]
                calls.append((node.func.id, {k.arg: ast.literal_eval(k.value) for k in node.keywords}))
            arguments = [json.dumps(a, ensure_ascii=False, allow_nan=False) for _, a in calls]  # else: text
        except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
            return [text]
        return [self._call(name, args) for (name, _), args in zip(calls, arguments)]


def _call_objects(values: list | None) -> list[tuple[str, Any]] | None:
    """(name, arguments) of JSON call objects (`{"name", "arguments"}`, or "parameters"), given one by one or in
    arrays; None where any value is something else."""
    if not values:
        return None
    objects = [item for value in values for item in (value if isinstance(value, list) else [value])]
    calls = []
    for item in objects:
        arguments = item.get("arguments", item.get("parameters", {})) if isinstance(item, dict) else None
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not isinstance(arguments,
                                                                                                 (dict, str)):
            return None
        calls.append((item["name"], arguments))
    return calls or None


def _json_values(text: str, separators: str, decoder: json.JSONDecoder | None = None) -> list | None:
    """The JSON values `text` consists of, with only `separators` characters around them; None if it is not."""
    decoder, values, position = decoder or json.JSONDecoder(), [], _skip(text, 0, separators)
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
    Content streams as it comes, holding back only what may be the start of a tag. Inside a block, call objects
    (one or more, whitespace between them) are read by a CallScanner: a call is sent once its name is known and its
    arguments object has begun, the arguments then as they are generated; a "</tool_call>" inside one of their
    strings is the string's. The block ends at the "</tool_call>" after its objects (what else stands before it is
    dropped once a call was sent). A block whose first object is not a call stays content, up to its first
    "</tool_call>". Content is the text before the first call (vLLM's rule): what follows a call is dropped.
    Small models often write the call's JSON without the tags: an output that is nothing but
    `{"name": <one of the tools>, "arguments": {...}}` objects ("parameters" too, as inside tags; possibly in a
    ``` code fence) is those calls too (held until the end, as it may turn out to be text). Every decision depends
    on the text alone, so a stream adds up to the text read whole."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    passes_text_through = False

    def __init__(self, tool_names: list[str], strict_schemas: dict[str, dict] | None = None) -> None:
        super().__init__()
        self.tool_names = tool_names
        self.strict_schemas = strict_schemas or {}  # ToolChoice.strict_schemas: bare calls must match them
        self.pending = ""
        self.bare: BareCallCheck | None = BareCallCheck(tool_names)  # until the output can no longer be bare calls
        self.block: StreamedCall | None = None  # inside <tool_call>: the call object being read (or the last one)
        self.block_text = ""  # the block's text read so far (it is content if the block holds no call)
        self.block_calls = 0  # calls the block sent
        self.text_block = False  # the block's first object is no call: the block is content, up to its close tag
        self.junk = False  # something other than whitespace or an object came after the block's objects

    def feed(self, text: str) -> list[str | ToolCallDelta]:
        self.pending += text
        if self.bare is not None:
            if self.bare.feed(text):
                return []  # it may still be calls written without tags: held
            self.bare = None  # it is not: what was held goes out, read as tagged output
        events: list[str | ToolCallDelta] = []
        while True:
            if self.block is None and not self.text_block:
                start = self.pending.find(self.OPEN)
                if start < 0:
                    keep = partial_suffix(self.pending, self.OPEN)
                    self._emit(events, self.pending[:len(self.pending) - keep])
                    self.pending = self.pending[len(self.pending) - keep:]
                    return events
                self._emit(events, self.pending[:start])
                self.pending = self.pending[start + len(self.OPEN):]
                self.block, self.block_text, self.block_calls, self.junk = StreamedCall(self), "", 0, False
            if not self._read_block(events):
                return events

    def _read_block(self, events: list) -> bool:
        """Go on reading the open block from `pending`; False when more text is needed, True when it closed."""
        if self.text_block:  # content: as it comes, up to the close tag
            end = self.pending.find(self.CLOSE)
            cut = end + len(self.CLOSE) if end >= 0 else len(self.pending) - partial_suffix(self.pending, self.CLOSE)
            self._emit(events, self.pending[:cut])
            self.pending = self.pending[cut:]
            self.text_block = end < 0
            return end >= 0
        call = self.block
        scanner = call.scanner
        if not scanner.done and not scanner.failed:
            sent = call.delta is not None
            events += call.feed(self.pending)
            self._take(scanner.consumed)
            if scanner.done:
                events += call.finish()  # arguments given as a JSON string: the call goes out whole now
            self.block_calls += not sent and call.delta is not None  # counted as it goes out
            if not scanner.done and not scanner.failed:
                return False
        if scanner.failed and not self.block_calls:
            self._to_text()  # its first object is no call: the block is content
            return True
        while self.pending:  # between objects (or after a broken one that was sent): up to the close tag
            if self.pending.startswith(self.CLOSE):
                self.pending = self.pending[len(self.CLOSE):]
                events += self._close_block()
                return True
            if self.CLOSE.startswith(self.pending):
                return False  # maybe the close tag: wait
            char = self.pending[0]
            if char == "{" and scanner.done and not self.junk:
                self.block = StreamedCall(self)  # another call object in the same block
                return self._read_block(events)
            self.junk = self.junk or char not in " \t\r\n"
            self._take(1)
        return False

    def _take(self, count: int) -> None:
        self.block_text += self.pending[:count]
        self.pending = self.pending[count:]

    def _to_text(self) -> None:
        """The block is content: read again from its open tag as text, up to its first close tag (vLLM's rule)."""
        self.pending = self.OPEN + self.block_text + self.pending
        self.block, self.text_block = None, True

    def _close_block(self) -> list[str | ToolCallDelta]:
        self.block = None
        events: list[str | ToolCallDelta] = []
        if not self.block_calls:  # no call in it: content (its calls went out as they came; the rest is dropped)
            self._emit(events, self.OPEN + self.block_text + self.CLOSE)
        return events

    def finish(self) -> list[str | ToolCallDelta]:
        if self.bare is not None:
            calls = self._bare_calls(self.pending)
            if calls:
                self.pending = ""
                return calls
        self.bare = None
        events = self.feed("")
        if self.block is not None:  # a block cut by max_tokens: its calls keep what they have, else it is text
            self.block = None
            if not self.block_calls:
                self._emit(events, self.OPEN + self.block_text)
            else:
                self.pending = ""
        self.text_block = False
        self._emit(events, self.pending)
        self.pending = ""
        return events

    def _bare_calls(self, text: str) -> list[ToolCallDelta]:
        """The calls, if `text` is nothing but JSON call objects of known tools (whitespace between them)."""
        values = _json_values(_strip_code_fence(text), " \n\t\r", _UNIQUE_KEYS)
        if not values or not all(isinstance(v, dict) and next(iter(v), None) in BareCallCheck.FIRST_KEYS
                                 and v.get("name") in self.tool_names and isinstance(_bare_arguments(v), dict)
                                 and self._meets_strict_schema(v["name"], _bare_arguments(v)) for v in values):
            return []
        return [self._call(v["name"], _bare_arguments(v)) for v in values]

    def _meets_strict_schema(self, name: str, arguments: dict) -> bool:
        """A strict tool's arguments match its schema (no grammar held a call written without tags)."""
        schema = self.strict_schemas.get(name)
        return schema is None or dialect_of(schema)(schema).is_valid(arguments)

    def _emit(self, events: list, text: str) -> None:
        """Content: the text before the first call; once a call was sent, the text between and after calls is dropped,
        as vLLM's hermes parser answers (a reply of two blocks on two lines had content "\n", not null)."""
        if text and not self.num_calls:
            events.append(text)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    """An object whose keys all differ (json.loads keeps the last of a repeated key; a call read a piece at a time
    has seen the first)."""
    if len({key for key, _ in pairs}) < len(pairs):
        raise ValueError("a key appears twice")
    return dict(pairs)


_UNIQUE_KEYS = json.JSONDecoder(object_pairs_hook=_unique_keys)


class BareCallCheck:
    """Whether an output read so far may still be calls written without tags, as HermesReader._bare_calls takes them:
    optional whitespace, optionally a ``` fence whose language is json or none, objects each of whose first key is
    "name", "arguments" or "parameters", whose name is one of the tools and whose arguments are an object, whitespace
    between them (and the fence's close). `feed` says False from the first character that rules it out, and for
    ever after: a code answer (```python, "Sure", {"answer": ...}) then streams at once instead of being held to the
    end. It reads characters, not pieces, so a stream and the text read whole decide alike."""

    FIRST_KEYS = ("name", "arguments", "parameters")
    _LANGUAGE = re.compile(r"[ \t\r]*(j(s(o(n[ \t\r]*)?)?)?)?", re.IGNORECASE)  # a prefix of "json"'s fence line

    def __init__(self, tool_names: list[str]) -> None:
        self.tool_names = tool_names
        self.state = "lead"  # lead | fence | language | values | object | close | tail | no
        self.fenced = False
        self.ticks = 0  # backticks of the fence being read
        self.language: list[str] = []
        self.call: CallScanner | None = None
        self.first_key: str | None = None  # the object's first key, once read
        self.calls = 0

    def feed(self, text: str) -> bool:
        for char in text:
            if self.state == "no":
                return False
            self._step(char)
        return self.state != "no"

    def _step(self, char: str) -> None:
        state = self.state
        if state == "object":
            self._object(char)
        elif state == "language":
            if char == "\n":
                self.state = "values"
            else:
                self.language.append(char)
                if not self._LANGUAGE.fullmatch("".join(self.language)):
                    self.state = "no"
        elif state in ("fence", "close"):
            if char != "`":
                self.state = "no"
            else:
                self.ticks += 1
                if self.ticks == 3:
                    self.state = "language" if state == "fence" else "tail"
        elif char in " \t\r\n":
            return
        elif state in ("lead", "values") and char == "{":
            self.call, self.first_key, self.state = CallScanner(), None, "object"
            self.call.feed(char)
        elif state == "lead" and char == "`":
            self.fenced, self.ticks, self.state = True, 1, "fence"
        elif state == "values" and self.fenced and self.calls and char == "`":
            self.ticks, self.state = 1, "close"
        else:
            self.state = "no"

    def _object(self, char: str) -> None:
        call = self.call
        call.feed(char)
        if self.first_key is None and call.state not in ("key_or_end", "key"):
            self.first_key = call.key if call.state == "colon" else ""
            if self.first_key not in self.FIRST_KEYS:
                self.state = "no"
                return
        if call.failed or (call.name is not None and call.name not in self.tool_names):
            self.state = "no"
        elif call.key in call.ARGUMENT_KEYS and call.value_start not in ("", "{"):
            self.state = "no"  # arguments that are not an object, from their first character
        elif call.done:
            if call.name is None or not call.arguments_open or call.arguments_other is not None:
                self.state = "no"  # a call of no tool, or its arguments are not an object
            else:
                self.calls += 1
                self.state = "values"


def _bare_arguments(call: dict) -> Any:
    """A bare call's arguments: "arguments", else "parameters" (Llama-style), as a tagged call's (CallScanner)."""
    return call["arguments"] if "arguments" in call else call.get("parameters")


def _strip_code_fence(text: str) -> str:
    """The inside of a markdown code fence (```json ... ``` or ``` ... ```) that is the whole text, else the text."""
    body = text.strip()
    if not (body.startswith("```") and body.endswith("```") and len(body) > 6):
        return text
    first_line_end = body.find("\n")
    if first_line_end < 0 or body[3:first_line_end].strip().lower() not in ("", "json"):
        return text
    return body[first_line_end + 1:-3]


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


def make_reader(choice: ToolChoice | None, parser: str | None) -> ToolCallReader:
    if choice is None or choice.mode == "none":
        return ToolCallReader()
    if choice.mode == "named":
        reader: ToolCallReader = NamedFunctionReader(choice.function_name)
    elif choice.mode == "required":
        reader = RequiredReader()
    elif parser == "hermes":
        reader = HermesReader([t["function"]["name"] for t in choice.tools], choice.strict_schemas)
    else:
        reader = _AUTO_READERS.get(parser, Llama3JsonReader)()
    if parser == "mistral":
        reader.new_id = mistral_call_id
    return reader if choice.mode != "auto" or choice.parallel else FirstCallReader(reader)


_AUTO_READERS: dict[str, type[ToolCallReader]] = {"granite": GraniteReader, "mistral": MistralReader,
                                                    "phi4_mini_json": Phi4MiniReader, "pythonic": PythonicReader}


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

    def _first(self, events: list[str | ToolCallDelta]) -> list[str | ToolCallDelta]:
        self.num_calls = min(self.reader.num_calls, 1)  # what a stream's finish_reason reads
        return [e for e in events if not isinstance(e, ToolCallDelta) or e.index == 0]


def read_all(reader: ToolCallReader, text: str) -> ReadResult:
    result = ReadResult()
    result.add(reader.feed(text))
    result.add(reader.finish())
    return result
