"""Chat templates rendered on jinja2 alone, as transformers renders them (without importing transformers).

The environment is transformers' (`utils/chat_template_utils.py` in transformers 5): an immutable sandbox with
trim_blocks and lstrip_blocks, the loopcontrols extension, a `tojson` that does not escape HTML, the
`raise_exception` and `strftime_now` globals, and `dict` / `namespace` that refuse underscore names. The data the
template sees is prepared the same way: messages without None values, reasoning under all its names, the
tokenizer's named special tokens, and `continue_final_message` cut after the final message's text.
tests/models/test_tokenizer.py renders every template we ship or build against transformers' apply_chat_template.
Kept out: `{% generation %}` tracking (assistant token masks are for training) and callables as tools.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.exceptions
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Names a message's reasoning is passed under; the first is the one templates read (transformers' aliasing).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body (templates written for assistant masks)."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    if isinstance(indent, int) and indent > 64:  # tojson(indent=10**7) wrote gigabytes
        raise jinja2.exceptions.SecurityError(f"tojson's indent is at most 64, got {indent}")
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` in a template, without attribute access to the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja2's namespace, refusing underscore-prefixed attributes (no way to CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Namespace's signature trick: `namespace(self=...)` works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace, got {name!r}")


# The most characters (or items) one `*` in a template may make, and the largest power `**` may: a request's template
# ({{ 'a' * 10**9 }}) took 38 s and 4 GB before its 400; the chat itself is bounded by the request body's limit.
MAX_TEMPLATE_PRODUCT = 1 << 24
MAX_TEMPLATE_POWER_BITS = 4096


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The sandbox, with `*` and `**` bounded (SecurityError past the bounds: the request's 400)."""

    intercepted_binops = frozenset(["*", "**"])

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, count in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(count, int) and \
                        len(seq) * max(count, 0) > MAX_TEMPLATE_PRODUCT:
                    raise jinja2.exceptions.SecurityError(f"a chat template may repeat a value up to "
                                                          f"{MAX_TEMPLATE_PRODUCT} items, not {len(seq)} x {count}")
        elif isinstance(left, int) and isinstance(right, int) and \
                right > 0 and abs(left) > 1 and right * abs(left).bit_length() > MAX_TEMPLATE_POWER_BITS:
            raise jinja2.exceptions.SecurityError(f"a chat template's powers are bounded ({left} ** {right})")
        return super().call_binop(context, operator, left, right)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    environment = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    environment.filters["tojson"] = _tojson
    environment.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(),
                               namespace=_TemplateNamespace)
    return environment.from_string(source)


def template_problem(template: str | dict[str, str] | None) -> str | None:
    """Why a model's own chat template (or one of its named templates) does not compile, else None."""
    sources = template.items() if isinstance(template, dict) else [("", template)] if template else []
    for name, source in sources:
        try:
            compile_template(source)
        except jinja2.TemplateSyntaxError as exc:
            where = f" {name!r}" if name else ""
            return f"chat template{where} does not compile (line {exc.lineno}: {exc.message})"
    return None


def load_chat_template(value: str, name: str = "--chat-template") -> str:
    """--chat-template's value as a template (vLLM's rule): a file's path, else the template itself if it looks
    like one (holds '{' or a line break; a one-line template's \\n and \\t are read as escapes). Compiled here,
    so a broken template fails at start; ValueError naming the problem and the setting (`name`: the flag, or
    LLM.chat's keyword)."""
    path = Path(value).expanduser()
    if _is_file(path):
        source = path.read_text(encoding="utf-8")
    elif "{" in value or "\n" in value:
        source = value if "\n" in value else value.replace("\\n", "\n").replace("\\t", "\t")
    elif path.is_dir():
        raise ValueError(f"{name} {value!r} is a directory: give the template's file (e.g. "
                         f"{path / 'chat_template.jinja'}) or the template itself")
    else:
        raise ValueError(f"{name} {value!r}: no such file (a template given inline holds '{{')")
    try:
        compile_template(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"{name}: the template does not compile (line {exc.lineno}: {exc.message})") \
            from None
    return source


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # a name too long for a path: a template given inline
        return False


def plain_data(value: Any) -> Any:
    """`value` rebuilt from plain JSON types (anything else becomes a "<TypeName>" placeholder), so the sandbox
    never sees an object with methods of its own."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain_data(key): plain_data(item) for key, item in value.items()}
    if isinstance(value, list):
        return [plain_data(item) for item in value]
    if isinstance(value, tuple):
        return tuple(plain_data(item) for item in value)
    if callable(getattr(value, "model_dump", None)):
        return plain_data(value.model_dump())
    return f"<{type(value).__name__}>"


def _alias_reasoning(message: dict) -> dict:
    reasoning = next((message[key] for key in REASONING_FIELDS if message.get(key) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def select_template(templates: str | dict[str, str] | None, tools: list | None) -> str:
    """The template to render: the only one, else "tool_use" when tools are given and it exists, else "default"."""
    if isinstance(templates, dict):
        if tools is not None and "tool_use" in templates:
            return templates["tool_use"]
        if "default" in templates:
            return templates["default"]
        raise ValueError(f"this tokenizer has several chat templates and no default: {sorted(templates)}")
    if templates is None:
        raise ValueError("this tokenizer has no chat template")
    return templates


def render_chat(template: str, messages: list[dict], *, tools: list[dict] | None = None,
                documents: list[dict] | None = None, add_generation_prompt: bool = False,
                continue_final_message: bool | str = False, special_tokens: Mapping[str, str] | None = None,
                **kwargs: Any) -> str:
    """The text of one conversation, as transformers' apply_chat_template(..., tokenize=False) gives it.

    `special_tokens` are the tokenizer's named ones (bos_token, eos_token, ...); `kwargs` (chat_template_kwargs)
    override them. Raises ValueError for inputs transformers refuses, jinja2's TemplateError for a template that
    raises.
    """
    if not messages:
        raise ValueError("cannot apply a chat template to an empty conversation; give at least one message")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt are not compatible")
    if documents is not None and any(not isinstance(document, dict) for document in documents):
        raise TypeError("documents should be a list of dicts with 'title' and 'text' keys")
    chat = []
    for message in plain_data(messages):
        if not isinstance(message, dict):
            raise TypeError(f"chat messages should be dicts, got {message!r}")
        chat.append(_alias_reasoning({key: value for key, value in message.items() if value is not None}))
    final_message = None
    if continue_final_message:
        field = continue_final_message if isinstance(continue_final_message, str) else "content"
        final_message = chat[-1].get(field)
        if final_message is None:
            raise ValueError(f'continue_final_message is set but the final message has no "{field}" to continue')
        fields = [field]
        if field in REASONING_FIELDS:  # reasoning is copied under several names: tag every copy
            fields = [name for name in REASONING_FIELDS if chat[-1].get(name) == final_message]
        if not any(name in template for name in fields):
            raise ValueError(f'continue_final_message is set to "{field}", which this chat template does not read')
        if isinstance(final_message, (list, tuple)):
            for block in reversed(final_message):
                if "text" in block:
                    final_message = block["text"]
                    block["text"] = block["text"] + _CONTINUE_TAG
                    break
            else:
                raise ValueError("continue_final_message is set but the final message has no text to continue")
        else:
            for name in fields:
                chat[-1][name] = chat[-1][name] + _CONTINUE_TAG
    variables = plain_data({**(special_tokens or {}), **kwargs})
    rendered = compile_template(template).render(messages=chat, tools=plain_data(tools),
                                                  documents=plain_data(documents),
                                                  add_generation_prompt=add_generation_prompt, **variables)
    if final_message is None:
        return rendered
    if final_message.strip() not in rendered or _CONTINUE_TAG.strip() not in rendered:
        raise ValueError("continue_final_message is set but the chat template drops part of the final message")
    cut = rendered.rindex(_CONTINUE_TAG.strip())
    if rendered[cut:cut + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:cut]
    return rendered[:cut].rstrip()  # the template trimmed the message's trailing space
