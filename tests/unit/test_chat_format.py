"""How API messages reach a chat template, as vLLM converts them: text parts (null text skipped, non-text a 400),
reasoning kept for templates that replay it, an empty tool_calls list dropped, unparseable arguments as {},
content as OpenAI parts for templates that loop over it ("auto"), a tool's result as text."""

from __future__ import annotations

import pytest

from pagedserve.chat_template import render_chat
from pagedserve.entrypoints.openai.chat_format import render_conversation
from pagedserve.entrypoints.openai.protocol import ChatMessage
from pagedserve.exceptions import InvalidRequestError

STRINGS = "{% for m in messages %}[{{ m.role }}:{{ m.content }}{{ m.reasoning_content or '' }}]{% endfor %}"
PARTS = ("{% for m in messages %}[{{ m.role }}:{% if m.content is string %}{{ m.content }}{% else %}"
         "{% for p in m.content %}<{{ p.text }}>{% endfor %}{% endif %}]{% endfor %}")
CALLS = ("{% for m in messages %}{% if m.tool_calls is defined %}{% if m.tool_calls | length != 1 %}"
         "{{ raise_exception('only single tool-calls') }}{% endif %}"
         "{% for c in m.tool_calls %}{{ c.function.arguments | tojson }}{% endfor %}{% endif %}{% endfor %}")


class Tokenizer:
    def __init__(self, template: str) -> None:
        self.chat_template = template

    def apply_chat_template(self, conversation, tokenize=False, **kwargs):
        return render_chat(kwargs.pop("chat_template", None) or self.chat_template, conversation, **kwargs)


def render(template: str, messages: list[dict], content_format: str = "auto") -> str:
    return render_conversation(Tokenizer(template), [ChatMessage(**m) for m in messages], content_format)


def test_text_parts_as_vllm_reads_them():
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": None}, {"type": "text"}, {"type": "text",
                                                                                             "text": "b"}]
    assert render(STRINGS, [{"role": "user", "content": parts}]) == "[user:a\nb]"  # null text skipped, as vLLM
    for bad in (123, ["a"], {"a": 1}):  # a 500 (TypeError in a join) before
        with pytest.raises(InvalidRequestError, match="a text part's text must be a string"):
            render(STRINGS, [{"role": "user", "content": [{"type": "text", "text": bad}]}])


def test_an_assistant_s_refusal_part_is_its_text():
    """OpenAI's SDK types an assistant message's content parts as text or refusal; vLLM reads a refusal as text (a
    400 "text only" before, QA-F). Images and the like stay refused."""
    parts = [{"type": "refusal", "refusal": "I can't help with that."}]
    assert render(STRINGS, [{"role": "assistant", "content": parts}]) == "[assistant:I can't help with that.]"
    assert render(PARTS, [{"role": "assistant", "content": parts}], "openai") == "[assistant:<I can't help with that.>]"
    with pytest.raises(InvalidRequestError, match="a refusal part's refusal must be a string"):
        render(STRINGS, [{"role": "assistant", "content": [{"type": "refusal", "refusal": 1}]}])
    with pytest.raises(InvalidRequestError, match="'image_url' is not supported"):
        render(STRINGS, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


def test_auto_gives_parts_to_a_template_that_loops_over_content():
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert render(PARTS, [{"role": "user", "content": parts}]) == "[user:<a><b>]"  # detected, as vLLM
    assert render(PARTS, [{"role": "user", "content": parts}], "string") == "[user:a\nb]"
    assert render(STRINGS, [{"role": "user", "content": parts}]) == "[user:a\nb]"
    tool = {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "sun"},
                                                               {"type": "text", "text": "ny"}]}
    assert render(PARTS, [tool], "openai") == "[tool:sun\nny]"  # a tool's result is text (it rendered empty)


def test_reasoning_reaches_the_template():
    for field in ("reasoning", "reasoning_content", "thinking"):
        message = {"role": "assistant", "content": "x", field: "because"}
        assert render(STRINGS, [message]) == "[assistant:xbecause]", field


def test_tool_calls_as_templates_take_them():
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "not json"}}
    assert render(CALLS, [{"role": "assistant", "content": "", "tool_calls": [call]}]) == "{}"  # not raw text
    # an empty list is no call (Llama 3.1's template raised "only single tool-calls")
    assert render(CALLS, [{"role": "assistant", "content": "ok", "tool_calls": []}]) == ""


def test_auto_keeps_strings_for_a_template_that_splits_the_content_and_empty_text_is_a_part():
    """`for line in message.content.split(...)` loops over the string's lines (the content was given as parts, and
    the template failed on a list); an empty assistant prefill is one empty part, as vLLM's."""
    splits = "{% for m in messages %}{% for line in m.content.split('\\n') %}<{{ line }}>{% endfor %}{% endfor %}"
    assert render(splits, [{"role": "user", "content": "a\nb"}]) == "<a><b>"
    parts = render_conversation(Tokenizer(PARTS), [ChatMessage(role="assistant", content="")], "openai")
    assert parts == "[assistant:<>]"


def test_a_developer_message_is_a_system_message_where_the_template_never_names_that_role():
    """OpenAI's "developer" role (the Codex CLI sends it): Qwen's template dropped such a message silently, others
    wrote a role the model never saw; a template that names the role gets it as it is."""
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert render(STRINGS, messages) == "[system:Be brief.][user:Hi]"
    qwen_like = ("{% for m in messages %}{% if m.role in ['system', 'user', 'assistant'] %}[{{ m.role }}:"
                 "{{ m.content }}]{% endif %}{% endfor %}")
    assert render(qwen_like, messages) == "[system:Be brief.][user:Hi]"  # was "[user:Hi]"
    knows = "{% for m in messages %}{% if m.role == 'developer' %}<dev>{% endif %}[{{ m.role }}]{% endfor %}"
    assert render(knows, messages) == "<dev>[developer][user]"


def test_a_long_inline_chat_template_is_read_as_a_template(tmp_path):
    """--chat-template's value longer than a file name may be (255 bytes) is a template, not an OSError."""
    from pagedserve.chat_template import load_chat_template

    template = "{% for m in messages %}{{ m.content }}{% endfor %}" + "{# a long comment #}" * 20
    assert len(template) > 255 and load_chat_template(template) == template
    (tmp_path / "t.jinja").write_text("{{ 1 }}")
    assert load_chat_template(str(tmp_path / "t.jinja")) == "{{ 1 }}"
