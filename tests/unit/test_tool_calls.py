"""Tool calling without a model: tool_choice resolution, the grammars it implies, and the readers that turn
generated text into tool calls — streamed in pieces or read whole, with the same result."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest

from pagedserve.entrypoints.openai.chat_format import template_message, template_messages
from pagedserve.entrypoints.openai.protocol import ChatMessage
from pagedserve.entrypoints.openai.serving import OpenAIServing
from pagedserve.entrypoints.openai.tool_calls import ReadResult, make_reader, read_all, resolve_tool_choice
from pagedserve.exceptions import InvalidRequestError
from pagedserve.models.gguf_tokenizer import gguf_chat_template

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}},
]


def choice(tool_choice, parser="hermes", template_has_tools=True, parallel=None):
    return resolve_tool_choice(TOOLS, tool_choice, parallel, parser, template_has_tools)


def streamed(reader, text: str, piece: int) -> ReadResult:
    result = ReadResult()
    for start in range(0, len(text), piece):
        result.add(reader.feed(text[start:start + piece]))
    result.add(reader.finish())
    return result


def test_default_with_tools_is_auto_and_needs_the_parser_flags():
    assert choice(None).mode == "auto"
    with pytest.raises(InvalidRequestError, match="--enable-auto-tool-choice"):
        choice(None, parser=None)
    with pytest.raises(InvalidRequestError, match="chat template has no tool-call format"):
        choice("auto", template_has_tools=False)
    assert choice("required", parser=None, template_has_tools=False).mode == "required"


def test_the_template_checked_for_a_tool_format_is_the_one_a_request_with_tools_renders():
    """Named templates (HF's dict; Hermes-2-Pro and Hermes-3 ship "tool_use"): the one rendered with tools is the one
    checked (the dict's keys were, and tool_choice "auto" got "no tool-call format"); a request's own template
    (--trust-request-chat-template) is checked in place of the model's."""
    serving = object.__new__(OpenAIServing)
    tool_use = "{% for t in tools %}{{ t | tojson }}{% endfor %}{{ messages }}"
    for template, expected in [({"default": "{{ messages }}", "tool_use": tool_use}, True),
                               ({"default": "{{ messages }}", "rag": "{{ documents }}"}, False),
                               ({"default": tool_use}, True), ("{{ messages }}", False), (tool_use, True),
                               (None, False)]:
        serving.tokenizer = SimpleNamespace(chat_template=template)
        assert serving.template_has_tools() is expected, template
        assert serving.template_has_tools(tool_use) is True
    assert serving.template_has_tools("{{ messages }}") is False


def test_gguf_named_chat_templates_become_hf_s_dict():
    """llama.cpp's converter writes HF's named templates as tokenizer.chat_templates (their names) and
    tokenizer.chat_template.NAME; only the default reached the tokenizer, so tools never reached a tool template."""
    metadata = {"tokenizer.chat_template": "default", "tokenizer.chat_templates": ["tool_use"],
                "tokenizer.chat_template.tool_use": "tools", "tokenizer.chat_template.rag": "rag"}
    assert gguf_chat_template(metadata) == {"default": "default", "tool_use": "tools", "rag": "rag"}
    assert gguf_chat_template({"tokenizer.chat_template": "only"}) == "only"
    assert gguf_chat_template({"tokenizer.chat_template": ""}) is None


def test_bad_tool_choices_name_the_problem():
    with pytest.raises(InvalidRequestError, match="'nope', which is not among the tools") as info:
        choice({"type": "function", "function": {"name": "nope"}})
    assert info.value.param == "tool_choice"
    with pytest.raises(InvalidRequestError, match="tool_choice must be"):
        choice("sometimes")
    with pytest.raises(InvalidRequestError, match="needs tools"):
        resolve_tool_choice(None, "required", None, "hermes", True)
    with pytest.raises(InvalidRequestError, match="appears twice"):
        resolve_tool_choice(TOOLS + TOOLS[:1], "required", None, "hermes", True)
    with pytest.raises(InvalidRequestError, match="function.name"):
        resolve_tool_choice([{"type": "function", "function": {"name": "has space"}}], "required", None, None, True)


def test_required_and_named_grammars():
    required = choice("required").grammar.json
    assert required["minItems"] == 1 and "maxItems" not in required
    assert [c["properties"]["name"]["const"] for c in required["items"]["anyOf"]] == ["get_weather", "add"]
    assert choice("required", parallel=False).grammar.json["maxItems"] == 1
    named = choice({"type": "function", "function": {"name": "add"}}).grammar.json
    assert named == TOOLS[1]["function"]["parameters"]
    assert choice("none").grammar is None and choice("auto").grammar is None


def test_required_keeps_each_tool_s_references_within_its_own_schema():
    """A tool's local references ("#" for recursion, "#/$defs/..." as pydantic writes nested models) resolve within
    that tool's parameters, as under a named tool_choice, not against the array of calls that "required" wraps
    them in: there a recursive "child" took call objects, and $defs could not be found (a 400)."""
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from pagedserve.structured.compiler import json_schema_grammar

    tree = {"type": "object", "properties": {"child": {"anyOf": [{"$ref": "#"}, {"type": "null"}]},
                                             "enum": {"const": {"$ref": "#"}}},
            "required": ["child"], "additionalProperties": False}
    user = {"$defs": {"Address": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                                  "additionalProperties": False}},
            "type": "object", "properties": {"address": {"$ref": "#/$defs/Address"}}, "required": ["address"],
            "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "tree", "parameters": tree}},
             {"type": "function", "function": {"name": "user", "parameters": user}}]
    grammar = json_schema_grammar(resolve_tool_choice(tools, "required", None, "hermes", True).grammar.json)

    def call(name: str, arguments: dict) -> str:
        return json.dumps([{"name": name, "parameters": arguments}], separators=(",", ":"))  # xgrammar's const

    assert accepts(grammar, call("tree", {"child": {"child": None}}))
    assert accepts(grammar, call("tree", {"child": None, "enum": {"$ref": "#"}}))  # data, not a reference
    assert not accepts(grammar, call("tree", {"child": [{"name": "tree", "parameters": {"child": None}}]}))
    assert not accepts(grammar, call("tree", {"child": {"child": None}, "enum": {"$ref": "#/$defs/tool_0_parameters"}}))
    assert accepts(grammar, call("user", {"address": {"city": "Paris"}}))
    assert not accepts(grammar, call("user", {"address": {"town": "Paris"}}))


HERMES_TEXT = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')


@pytest.mark.parametrize("piece", [1, 3, 7, 1000])
def test_hermes_streamed_in_any_pieces_equals_read_whole(piece):
    whole = read_all(make_reader(choice("auto"), "hermes"), HERMES_TEXT)
    assert whole.content == "Let me check.\n"  # the text before the first call (vLLM's)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole.calls] == [
        ("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]
    parts = streamed(make_reader(choice("auto"), "hermes"), HERMES_TEXT, piece)
    assert parts.content == whole.content
    assert [c["function"] for c in parts.calls] == [c["function"] for c in whole.calls]


@pytest.mark.parametrize("piece", [1, 4, 1000])
def test_hermes_takes_a_bare_call_of_a_known_tool(piece):
    bare = '  {"name": "get_weather", "arguments": {"city": "Oslo"}}\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n'
    result = streamed(make_reader(choice("auto"), "hermes"), bare, piece)
    assert result.content == "" and [c["function"]["name"] for c in result.calls] == ["get_weather", "add"]
    fenced = '```json\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n```'
    result = streamed(make_reader(choice("auto"), "hermes"), fenced, piece)
    assert result.content == "" and [c["function"]["name"] for c in result.calls] == ["add"]
    for text in ['{"name": "unknown_tool", "arguments": {}}', '{"a": 1} and more', '{"name": "add"',
                 '```python\nprint(1)\n```']:
        result = streamed(make_reader(choice("auto"), "hermes"), text, piece)
        assert result.calls == [] and result.content == text


STRICT_TOOLS = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": True, "parameters": {
    **TOOLS[0]["function"]["parameters"], "additionalProperties": False}}}, TOOLS[1]]


@pytest.mark.parametrize("piece", [1, 4, 1000])
def test_auto_holds_a_strict_tool_s_calls_to_its_schema(piece):
    """OpenAI's "strict": true under auto (hermes): the model wrote calls whose arguments broke the schema (QA-F).
    A call written with its tags is held by a grammar that starts at the tag; one written without them is a call
    only when its arguments match, else it is text. A tool that is not strict is read as before."""
    strict = resolve_tool_choice(STRICT_TOOLS, "auto", None, "hermes", True)
    assert set(strict.strict_schemas) == {"get_weather"} and choice("auto").strict_schemas == {}
    grammar = strict.grammar.structural_tag
    assert grammar["triggers"] == ["<tool_call>"]
    assert [(s["begin"], s["end"]) for s in grammar["structures"]] == [
        ('<tool_call>\n{"name": "get_weather", "arguments": ', "}\n</tool_call>"),
        ('<tool_call>\n{"name": "add", "arguments": ', "}\n</tool_call>")]
    assert grammar["structures"][0]["schema"] == STRICT_TOOLS[0]["function"]["parameters"]
    assert choice("auto").grammar is None  # no strict tool: free text, as before
    assert resolve_tool_choice(STRICT_TOOLS, "auto", None, "llama3_json", True).grammar is None
    for text in ['{"name": "get_weather", "arguments": {"city": 5}}',
                 '```json\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n```']:
        result = streamed(make_reader(strict, "hermes"), text, piece)
        assert result.calls == [] and result.content == text
    for text in ['{"name": "get_weather", "arguments": {"city": "Oslo"}}', '{"name": "add", "arguments": {"a": 1}}']:
        result = streamed(make_reader(strict, "hermes"), text, piece)
        assert len(result.calls) == 1 and result.content == "", text


def test_the_strict_call_grammar_refuses_what_the_schema_refuses(tiny_model_dir):
    """The structural tag compiled and run over a tokenizer: text before the tag is free; inside a call, a value
    of the wrong type or a property the schema does not list cannot be written."""
    from pagedserve.engine.setup import load_tokenizer
    from pagedserve.structured.compiler import GrammarCompiler
    from pagedserve.structured.matcher import RequestGrammar

    tokenizer = load_tokenizer(tiny_model_dir("llama"))
    compiled = GrammarCompiler(tokenizer, len(tokenizer)).compile(
        resolve_tool_choice(STRICT_TOOLS, "auto", None, "hermes", True).grammar)

    def accepts(text: str) -> bool:
        grammar = RequestGrammar(compiled, [tokenizer.eos_token_id])
        return all(grammar.accept(t) for t in tokenizer.encode(text, add_special_tokens=False))

    call = '<tool_call>\n{"name": "get_weather", "arguments": '
    assert accepts("Let me look that up. " + call + '{"city": "Oslo"}}\n</tool_call> Done.')
    assert not accepts(call + '{"city": 5')
    assert not accepts(call + '{"city": "Oslo", "unit"')
    assert accepts(call.replace("get_weather", "add") + '{"a": 1, "c": [true]}}')  # not strict: any object


@pytest.mark.parametrize("piece", [1, 4, 1000])
def test_hermes_takes_a_bare_call_with_parameters_as_a_tagged_one(piece):
    """Llama-style "parameters" instead of "arguments": a call inside tags, and so a call without them too."""
    for text in ['{"name": "add", "parameters": {"a": 1, "b": 2}}',
                 '<tool_call>{"name": "add", "parameters": {"a": 1, "b": 2}}</tool_call>']:
        result = streamed(make_reader(choice("auto"), "hermes"), text, piece)
        assert result.content == "", text
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in result.calls] == [
            ("add", {"a": 1, "b": 2})], text


def _first_content_at(reader, text: str) -> int | None:
    """How much text had been fed, a character at a time, when the first content came out."""
    for end in range(1, len(text) + 1):
        if any(isinstance(e, str) for e in reader.feed(text[end - 1:end])):
            return end
    return None


def test_hermes_holds_text_only_while_it_may_be_a_call_without_tags():
    """An output that begins with "{" or a ``` fence is held while it may still be a call written without tags,
    and goes out from the first character that rules that out: a code answer (```python ...) streamed as one chunk
    at the end. Held or not, the stream adds up to the text read whole."""
    code = "```python\ndef add(a, b):\n    return a + b\n```\nCall add(1, 2)."
    fenced = '```json\n{"name": "add", "arguments": {}}\n```\n'
    cases = [
        (code, len("```p")),  # the fence's language is not json
        ("```json\n[1, 2]\n```", len("```json\n[")),  # not an object
        ('{"answer": 42}', len('{"answer"')),  # the first key is no call's
        ('{"name": "Bob", "age": 3}', len('{"name": "Bob"')),  # no tool of that name
        ('{"name": "add", "arguments": [1, 2]}', len('{"name": "add", "arguments": [')),  # arguments: not an object
        ('{"name": "add", "arguments": {}} and more', len('{"name": "add", "arguments": {}} a')),
        (fenced + "Done", len(fenced) + 1),
        ('```\n{"name": "add", "arguments": {}}\n```', None),  # a call: held to the end
        ('{"arguments": {"a": 1}, "name": "add"}', None),
    ]
    for text, released_at in cases:
        assert _first_content_at(make_reader(choice("auto"), "hermes"), text) == released_at, text
        whole = read_all(make_reader(choice("auto"), "hermes"), text)
        assert (whole.content == "") == (released_at is None) and bool(whole.calls) == (released_at is None), text
        for piece in (1, 2, 5):
            parts = streamed(make_reader(choice("auto"), "hermes"), text, piece)
            assert (parts.content, parts.calls and [c["function"] for c in parts.calls]) == (
                whole.content, whole.calls and [c["function"] for c in whole.calls]), (text, piece)


def test_hermes_keeps_text_that_is_not_a_call():
    text = "a < b and <tool_call>not json</tool_call> and <tool_call>{\"name\": \"add\""
    result = streamed(make_reader(choice("auto"), "hermes"), text, 2)
    assert result.calls == [] and result.content == text


def test_llama3_json():
    text = '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "get_weather", "parameters": {"city": "Oslo"}}'
    result = read_all(make_reader(choice("auto", parser="llama3_json"), "llama3_json"), text)
    assert [c["function"]["name"] for c in result.calls] == ["add", "get_weather"]
    assert json.loads(result.calls[1]["function"]["arguments"]) == {"city": "Oslo"}
    plain = read_all(make_reader(choice("auto", parser="llama3_json"), "llama3_json"), "Just text {not a call}")
    assert plain.calls == [] and plain.content == "Just text {not a call}"


MARKED = [  # (parser, output, content, calls): the formats with a marker before their calls
    ("mistral", 'Sure.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                '{"name": "add", "arguments": {"a": 1, "b": 2}}]', "Sure.",
     [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]add[CALL_ID]a1b2c3d4e[ARGS]{"a": 1}', "",
     [("get_weather", {"city": "Paris"}), ("add", {"a": 1})]),
    ("granite", '<|tool_call|>[{"name": "add", "arguments": {"a": 3, "b": 4}}]', "", [("add", {"a": 3, "b": 4})]),
    ("phi4_mini_json", 'functools[{"name": "get_weather", "arguments": {"city": "Oslo"}}]', "",
     [("get_weather", {"city": "Oslo"})]),
    ("phi4_mini_json", 'I will look. functools[{"name": "add", "parameters": {"a": 1, "b": 2}}]', "I will look. ",
     [("add", {"a": 1, "b": 2})]),
]


@pytest.mark.parametrize("parser,text,content,calls", MARKED)
def test_marked_formats_streamed_in_any_pieces_equal_read_whole(parser, text, content, calls):
    whole = read_all(make_reader(choice("auto", parser), parser), text)
    assert whole.content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole.calls] == calls
    for piece in range(1, len(text) + 1):
        parts = streamed(make_reader(choice("auto", parser), parser), text, piece)
        assert (parts.content, [c["function"] for c in parts.calls]) == (content, [c["function"] for c in whole.calls])


@pytest.mark.parametrize("parser,marker", [("mistral", "[TOOL_CALLS]"), ("granite", "<|tool_call|>"),
                                          ("phi4_mini_json", "functools")])
def test_marked_formats_keep_what_is_not_calls_as_content(parser, marker):
    for text in ("Plain text, no calls.", f"Text {marker} and more text", f"{marker}[{{\"name\": 1}}]",
                 f"{marker}[{{\"name\": \"add\", \"arguments\": {{\"a\": 1}}", "Ends with a partial " + marker[:-1]):
        for piece in (1, 3, 1000):
            result = streamed(make_reader(choice("auto", parser), parser), text, piece)
            assert result.calls == [] and result.content == text, (text, piece)
    # content streams as it comes, held back only where it may be the marker's start
    reader = make_reader(choice("auto", parser), parser)
    assert reader.feed("Hello ") == ["Hello "] and reader.feed(marker[:2]) == []
    assert reader.feed("!") == [marker[:2] + "!"]


@pytest.mark.parametrize("piece", [1, 7, 1000])
def test_pythonic(piece):
    """A Python list of calls with literal keyword arguments; anything else (positional arguments, names, calls
    inside, values JSON has not) is content, as vLLM's."""
    text = '[get_weather(city="Paris"), add(a=1, b=-2)]'
    result = streamed(make_reader(choice("auto", "pythonic"), "pythonic"), text, piece)
    assert result.content == "" and [c["function"] for c in result.calls] == [
        {"name": "get_weather", "arguments": '{"city": "Paris"}'}, {"name": "add", "arguments": '{"a": 1, "b": -2}'}]
    wrapped = '<|python_start|>[add(a=[1, {"x": None}], b=True)]<|python_end|>'
    assert [c["function"]["arguments"] for c in read_all(make_reader(choice("auto", "pythonic"), "pythonic"),
                                                         wrapped).calls] == ['{"a": [1, {"x": null}], "b": true}']
    for other in ("Just text.", "[add(1, 2)]", '[add(a=open("f"))]', "[add(a=1e999)]", "[add(**kw)]", "[]", "[x]",
                  "[add(a={1, 2})]", "[add(a=1)] and text"):
        result = read_all(make_reader(choice("auto", "pythonic"), "pythonic"), other)
        assert result.calls == [] and result.content == other, other


def test_mistral_call_ids_are_nine_letters_and_digits():
    """Mistral's chat templates refuse other ids when the calls are sent back: every mode's ids follow the rule."""
    named = choice({"type": "function", "function": {"name": "add"}}, parser="mistral")
    for reader, text in ((make_reader(choice("auto", "mistral"), "mistral"), MARKED[0][1]),
                         (make_reader(choice("required", "mistral"), "mistral"), '[{"name": "add", "parameters": {}}]'),
                         (make_reader(named, "mistral"), '{"a": 1}')):
        ids = [c["id"] for c in read_all(reader, text).calls]
        assert ids and all(len(i) == 9 and i.isalnum() for i in ids), ids
    assert read_all(make_reader(choice("auto"), "hermes"), HERMES_TEXT).calls[0]["id"].startswith("call_")


@pytest.mark.parametrize("piece", [1, 5, 1000])
def test_required_and_named_readers(piece):
    text = '[{"name": "add", "parameters": {"a": 3, "b": 4}}]'
    result = streamed(make_reader(choice("required"), None), text, piece)
    assert result.content == "" and json.loads(result.calls[0]["function"]["arguments"]) == {"a": 3, "b": 4}
    named = choice({"type": "function", "function": {"name": "add"}})
    result = streamed(make_reader(named, None), '{"a": 3, "b": 4}', piece)
    assert [c["function"] for c in result.calls] == [{"name": "add", "arguments": '{"a": 3, "b": 4}'}]
    assert result.calls[0]["id"].startswith("call_")


def test_template_messages_turn_argument_strings_into_objects():
    messages = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    rendered = template_messages(messages)
    assert rendered[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert rendered[1] == messages[1]
    assert messages[0]["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'  # the request is not changed


def test_only_readers_that_may_hold_text_back_say_so():
    """A stream sends one chunk per token for text passed through (tool_choice "none", no tools) and skips the empty
    deltas of readers that hold text back until they know what it is."""
    assert make_reader(None, None).passes_text_through
    assert make_reader(choice("none"), "hermes").passes_text_through
    for reader in (make_reader(choice("auto"), "hermes"), make_reader(choice("auto", parser="llama3_json"),
                                                                      "llama3_json"),
                   make_reader(choice("auto", parser="mistral"), "mistral"), make_reader(choice("required"), None)):
        assert not reader.passes_text_through, type(reader).__name__


def test_content_reaches_the_template_as_text_or_as_openai_parts():
    parts = ChatMessage(role="user", content=[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}])
    plain = ChatMessage(role="user", content="a\nb")
    assert template_message(parts)["content"] == template_message(plain, "auto")["content"] == "a\nb"  # as vLLM
    assert template_message(parts, "openai")["content"] == [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert template_message(plain, "openai")["content"] == [{"type": "text", "text": "a\nb"}]
    assert template_message(ChatMessage(role="assistant", content=None), "openai")["content"] == []  # as vLLM


@pytest.mark.parametrize("parser,text", [
    ("hermes", HERMES_TEXT),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "add", "parameters": {"a": 1}}'),
    ("mistral", MARKED[0][1]), ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]add[ARGS]{}'),
])
@pytest.mark.parametrize("piece", [1, 1000])
def test_parallel_tool_calls_false_under_auto_keeps_the_first_call(parser, text, piece):
    """No grammar limits "auto": with parallel_tool_calls false the answer has the first call the model wrote
    (it had every one)."""
    assert len(streamed(make_reader(choice("auto", parser), parser), text, piece).calls) == 2
    reader = make_reader(choice("auto", parser, parallel=False), parser)
    result = streamed(reader, text, piece)
    assert [c["function"]["name"] for c in result.calls] == ["get_weather"]
    assert reader.num_calls == 1  # a stream's finish_reason ("tool_calls") reads it


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "bad"}}])
def test_an_unenforceable_parameters_schema_is_named_where_the_request_has_it(tool_choice):
    """The 400 points at tools[i].function.parameters, not into the grammar's wrapper schema (#/items/...)."""
    tools = TOOLS + [{"type": "function", "function": {"name": "bad", "parameters": {
        "type": "object", "properties": {"city": {"not": {"type": "string"}}}}}}]
    resolved = resolve_tool_choice(tools, tool_choice, None, "hermes", True)
    with pytest.raises(InvalidRequestError, match=r"'not' at tools\[2\]\.function\.parameters#/properties/city") \
            as info:
        resolved.grammar
    assert info.value.param == "tools"
    assert resolve_tool_choice(tools, {"type": "function", "function": {"name": "add"}}, None, "hermes",
                               True).grammar.json == TOOLS[1]["function"]["parameters"]  # only the named one


def _deltas(reader, text: str) -> list:
    """Every event, fed one character at a time, with how much text had been fed when it came."""
    events = []
    for end in range(1, len(text) + 1):
        events += [(end, e) for e in reader.feed(text[end - 1:end])]
    return events + [(len(text), e) for e in reader.finish()]


@pytest.mark.parametrize("tool_choice,parser,text", [
    ("required", None, '[{"name": "get_weather", "parameters": {"city": "Paris, France"}}, '
                       '{"name": "add", "parameters": {"a": 1, "b": 22}}]'),
    ("auto", "hermes", HERMES_TEXT),
])
def test_arguments_stream_as_they_are_generated(tool_choice, parser, text):
    """A call goes out once its name is known and its arguments have begun; its arguments follow piece by piece
    (not in one delta when the call is complete); the pieces add up to the call read whole, as the text written."""
    events = _deltas(make_reader(choice(tool_choice, parser), parser), text)
    calls = [(at, e) for at, e in events if not isinstance(e, str)]
    first_at, first = calls[0]
    assert first.name == "get_weather" and first_at == text.index('{"city') + 1  # at the arguments' "{"
    assert len([e for _, e in calls if e.index == 0]) >= len('{"city": "Paris"}')  # a delta per character
    whole = read_all(make_reader(choice(tool_choice, parser), parser), text)
    result = ReadResult()
    result.add([e for _, e in events])
    assert [c["function"] for c in result.calls] == [c["function"] for c in whole.calls]
    assert json.loads(whole.calls[0]["function"]["arguments"])["city"].startswith("Paris")
    assert whole.calls[0]["function"]["arguments"] in text  # the text written, not re-serialised


@pytest.mark.parametrize("piece", [1, 6, 1000])
def test_calls_cut_by_max_tokens_keep_what_was_written(piece):
    """As OpenAI's: a call cut short keeps its partial arguments (finish_reason "length"); output cut before any call
    began is text; streamed or read whole, the same."""
    for tool_choice, parser, text, expected in [
        ("required", None, '[{"name": "add", "parameters": {"a": 1, "b', [("add", '{"a": 1, "b')]),
        ("auto", "hermes", 'Hi <tool_call>\n{"name": "add", "arguments": {"a": 1', [("add", '{"a": 1')]),
        ("required", None, '[{"name": "ad', []),
    ]:
        whole = read_all(make_reader(choice(tool_choice, parser), parser), text)
        parts = streamed(make_reader(choice(tool_choice, parser), parser), text, piece)
        for result in (whole, parts):
            assert [(c["function"]["name"], c["function"]["arguments"]) for c in result.calls] == expected
            assert result.content == ("Hi " if parser else "" if expected else text)


@pytest.mark.parametrize("piece", [1, 1000])
def test_hermes_arguments_given_as_a_string_or_before_the_name(piece):
    text = ('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>'
            '<tool_call>{"arguments": {"city": "Rome"}, "name": "get_weather"}</tool_call>')
    result = streamed(make_reader(choice("auto"), "hermes"), text, piece)
    assert result.content == ""
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in result.calls] == [
        ("add", '{"a": 1}'), ("get_weather", '{"city": "Rome"}')]


@pytest.mark.parametrize("piece", [1, 3, 1000])
def test_hermes_reads_the_block_s_end_as_json_reads_its_strings(piece):
    """A "</tool_call>" inside an argument string is the string's (it ended the block: invalid arguments and the rest
    as content); several call objects in one block are several calls; a broken one after them is dropped, as is the
    text after the block."""
    code = '<tool_call>\n{"name": "add", "arguments": {"code": "print(\'</tool_call>\')"}}\n</tool_call> done'
    result = streamed(make_reader(choice("auto"), "hermes"), code, piece)
    assert result.content == ""
    assert [json.loads(c["function"]["arguments"]) for c in result.calls] == [{"code": "print('</tool_call>')"}]
    two = ('<tool_call>{"name": "add", "arguments": {"a": 1}}\n{"name": "get_weather", "arguments": {}}\n'
           '{oops</tool_call>')
    result = streamed(make_reader(choice("auto"), "hermes"), two, piece)
    assert result.content == "" and [c["function"]["name"] for c in result.calls] == ["add", "get_weather"]


@pytest.mark.parametrize("piece", [1, 3, 1000])
def test_hermes_content_is_the_text_before_the_first_call(piece):
    """vLLM's hermes parser: content is what stands before the first <tool_call>; the line breaks between and after
    Qwen's blocks (and any text there) are not content (two blocks on two lines gave content "\n", not null)."""
    cases = [
        ('<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", '
         '"arguments": {"city": "Oslo"}}\n</tool_call>\n', "", ["add", "get_weather"]),
        ('Checking.\n<tool_call>{"name": "add", "arguments": {}}</tool_call>\nDone, see above.', "Checking.\n",
         ["add"]),
        ('<tool_call>{"name": "add", "arguments": {}}</tool_call> and <tool_call>not json</tool_call> <tool', "",
         ["add"]),
    ]
    for text, content, names in cases:
        for parallel in (True, False):
            result = streamed(make_reader(choice("auto", parallel=parallel), "hermes"), text, piece)
            expected = (content, names if parallel else names[:1])
            assert (result.content, [c["function"]["name"] for c in result.calls]) == expected, text


HERMES_PIECES = ['<tool_call>', '</tool_call>', '{"name": "add", "arguments": {"a": 1}}', '\n', ' ', 'text', '{', '}',
                 '{"name": "get_weather", "arguments": {"city": "</tool_call>"}}', '"', 'x', '{"nam": "c"}', '<', ',',
                 '{"name": "add", "arguments": {"q": "\\\\"}"}}', '<tool', '```', '```json\n', '```python\n', 'json',
                 '{"name": "add", "parameters": {}}', '{"arguments": {}, "name": "get_weather"}', '{"name": "x"', '`',
                 '"name": "add"', '"arguments": ', '[1]', ': ']


@pytest.mark.parametrize("parallel", [True, False])
def test_hermes_streamed_in_any_pieces_equals_read_whole_on_random_outputs(parallel):
    """Whatever the text (calls, text, broken objects, tags inside strings, cut anywhere) and however it is split,
    the stream adds up to the text read whole (a sweep found 10 of 3000 outputs that did not)."""
    rng = random.Random(0)
    for _ in range(400):
        text = "".join(rng.choice(HERMES_PIECES) for _ in range(rng.randint(1, 10)))
        whole = read_all(make_reader(choice("auto", parallel=parallel), "hermes"), text)
        for piece in (1, 2, 5):
            parts = streamed(make_reader(choice("auto", parallel=parallel), "hermes"), text, piece)
            assert parts.content == whole.content, (text, piece)
            assert [c["function"] for c in parts.calls] == [c["function"] for c in whole.calls], (text, piece)


def test_hermes_blocks_as_vllm_reads_them():
    """A block ends at the close tag after its objects (a broken call swallowed the text and calls after it); a
    block with no call is text up to its first close tag; text between a block's objects ends its calls; text after
    the first call is dropped."""
    cases = [
        ('<tool_call>\n{"name": "add", "arguments": {"a": 1}\n</tool_call>\nThen.\n<tool_call>{"name": "get_weather",'
         ' "arguments": {}}</tool_call> end', "", ["add", "get_weather"]),
        ('<tool_call></tool_call> hi <tool_call>{"name": "add", "arguments": {}}</tool_call>',
         "<tool_call></tool_call> hi ", ["add"]),
        ('<tool_call>{"name": "add", "arguments": {}} x {"name": "get_weather", "arguments": {}}</tool_call>', "",
         ["add"]),
        ('<tool_call>{"name": "add", "arguments": {}}{"nam": "b"}</tool_call>after', "", ["add"]),
    ]
    for text, content, names in cases:
        result = read_all(make_reader(choice("auto"), "hermes"), text)
        assert (result.content, [c["function"]["name"] for c in result.calls]) == (content, names), text
