"""pagedserve.tokenizer.Tokenizer and chat_template.render_chat against transformers on the same tokenizers:
encode, decode, special tokens, truncation and chat templates must give what transformers gives, so serving
can start without importing transformers."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import jinja2
import pytest
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import processors

from pagedserve.chat_template import render_chat
from pagedserve.engine.setup import load_tokenizer
from pagedserve.exceptions import InvalidRequestError
from pagedserve.formats.gguf import read_gguf_header
from pagedserve.models.gguf_tokenizer import build_tokenizer_from_metadata
from pagedserve.tokenizer import Tokenizer, load_plain_tokenizer, loads_without_transformers
from tests.models.real_models import packaged_model, qwen_coder_gguf_head
from tests.tiny_models import CHATML_TEMPLATE, make_tokenizer

PIECES = list("abc xyz.,!?\n\t0123456789你好😀") + ["<|im_end|>", "<|im_start|>", "<|endoftext|>", "  ", " def"]
TEXT = st.lists(st.sampled_from(PIECES), max_size=24).map("".join)
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": TEXT})
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string", "description": "Straße & <tags>"}},
                                               "required": ["city"]}}}]
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tokenizer")
    make_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def pairs(tiny_dir: Path) -> dict[str, tuple[Tokenizer, object]]:
    """name -> (ours, transformers'): a plain directory, and GGUF tokenizers (transformers' over the same backend
    is what the server used before; test_gguf_real.py checks those against the models' own tokenizer.json)."""
    result = {"tiny-dir": (load_plain_tokenizer(tiny_dir), transformers.AutoTokenizer.from_pretrained(tiny_dir))}
    for name, path in (("smollm2", packaged_model("smollm2-135m-instruct")), ("qwen-coder", qwen_coder_gguf_head())):
        # from the header's metadata: the Qwen file may be only the model's first part (real_models.py)
        ours = build_tokenizer_from_metadata(read_gguf_header(path).metadata, source=str(path))
        reference = transformers.PreTrainedTokenizerFast(tokenizer_object=ours.backend_tokenizer.__class__.from_str(
            ours.backend_tokenizer.to_str()), **ours.special_tokens_map)
        reference.chat_template = ours.chat_template
        result[name] = (ours, reference)
    return result


def test_plain_directories_load_as_ours_and_the_rest_through_transformers(tiny_dir: Path, tmp_path: Path) -> None:
    assert type(load_tokenizer(str(tiny_dir))) is Tokenizer and loads_without_transformers(tiny_dir)
    bert_dir = packaged_model("all-minilm-l6-v2")
    bert = load_tokenizer(str(bert_dir))  # BertTokenizer: a class of its own
    assert isinstance(bert, transformers.PreTrainedTokenizerBase) and not loads_without_transformers(bert_dir)
    assert loads_without_transformers(packaged_model("smollm2-135m-instruct"))
    for name, edit in (("add_bos", {"add_bos_token": True}), ("class", {"tokenizer_class": "LlamaTokenizer"}),
                       ("cleanup", {"clean_up_tokenization_spaces": True})):
        copy = tmp_path / name
        copy.mkdir()
        for file in tiny_dir.iterdir():
            (copy / file.name).write_bytes(file.read_bytes())
        config = json.loads((copy / "tokenizer_config.json").read_text())
        (copy / "tokenizer_config.json").write_text(json.dumps({**config, **edit}))
        assert load_plain_tokenizer(copy) is None and not loads_without_transformers(copy), name


@pytest.mark.parametrize("name", ["tiny-dir", "smollm2", "qwen-coder"])
def test_special_tokens_and_sizes_equal_transformers(pairs, name: str) -> None:
    ours, reference = pairs[name]
    assert ours.eos_token_id == reference.eos_token_id and ours.bos_token_id == reference.bos_token_id
    assert ours.pad_token_id == reference.pad_token_id
    assert ours.all_special_ids == reference.all_special_ids
    assert len(ours) == len(reference)
    assert ours.chat_template == reference.chat_template


@pytest.mark.parametrize("name", ["tiny-dir", "smollm2", "qwen-coder"])
@SETTINGS
@given(text=TEXT)
def test_encode_and_decode_equal_transformers(pairs, name: str, text: str) -> None:
    ours, reference = pairs[name]
    for special in (True, False):
        ids = ours.encode(text, add_special_tokens=special)
        assert ids == reference.encode(text, add_special_tokens=special)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)
    assert ours.decode(ids[:1]) == reference.decode(ids[:1])


@SETTINGS
@given(text=TEXT, max_length=st.integers(1, 12), side=st.sampled_from(["right", "left"]))
def test_truncation_keeps_the_special_tokens_as_transformers_does(pairs, text: str, max_length: int,
                                                                  side: str) -> None:
    ours, reference = pairs["tiny-dir"]
    backend = ours.backend_tokenizer.__class__.from_str(ours.backend_tokenizer.to_str())
    backend.post_processor = processors.TemplateProcessing(single="<|im_start|> $A <|endoftext|>",
                                                           special_tokens=[("<|im_start|>", 1), ("<|endoftext|>", 0)])
    ours = Tokenizer(backend, special_tokens=ours.special_tokens_map, truncation_side=side)
    reference = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, truncation_side=side,
                                                     **ours.special_tokens_map)
    assert ours.encode(text, truncation=True, max_length=max_length) == reference.encode(
        text, truncation=True, max_length=max_length)
    texts = [text, text + " xyz", ""]
    for kwargs in ({}, {"truncation": True, "max_length": max_length}):  # the batched call embeddings make
        assert ours(texts, **kwargs)["input_ids"] == reference(texts, **kwargs)["input_ids"]
        assert ours(text, **kwargs)["input_ids"] == reference(text, **kwargs)["input_ids"]


@pytest.mark.parametrize("name", ["tiny-dir", "smollm2", "qwen-coder"])
@SETTINGS
@given(messages=st.lists(MESSAGE, min_size=1, max_size=4), generation_prompt=st.booleans(),
       tools=st.sampled_from([None, TOOLS]))
def test_chat_templates_render_as_transformers(pairs, name: str, messages: list[dict], generation_prompt: bool,
                                               tools: list | None) -> None:
    ours, reference = pairs[name]
    expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                             tools=tools)
    assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                    tools=tools) == expected
    assert ours.apply_chat_template(messages, add_generation_prompt=generation_prompt, tools=tools) == \
        reference.encode(expected, add_special_tokens=False)


# Templates reaching the parts of the environment and the data preparation the shipped ones do not.
TEMPLATES = {
    "reasoning": "{% for m in messages %}[{{ m.role }}|{{ m.reasoning_content }}|{{ m.thinking }}]{{ m.content }}"
                 "{% endfor %}",
    "namespace+dict+tojson": "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
                             "{{ dict(role=m.role, i=ns.n) | tojson }}{% endfor %}{{ tools | tojson(indent=2) }}"
                             "{{ bos_token }}{{ eos_token }}",
    "loopcontrols+trim": "{% for m in messages %}\n  {% if loop.index > 2 %}{% break %}{% endif %}\n"
                         "  {{- m.content -}}\n{% endfor %}\n{% if add_generation_prompt %}<gen>{% endif %}",
    "chatml": CHATML_TEMPLATE,
}


@pytest.mark.parametrize("template", list(TEMPLATES))
@SETTINGS
@given(messages=st.lists(MESSAGE, min_size=1, max_size=4), generation_prompt=st.booleans())
def test_template_environment_matches_transformers(pairs, template: str, messages: list[dict],
                                                   generation_prompt: bool) -> None:
    _, reference = pairs["tiny-dir"]
    messages = [{**m, "reasoning": "think " + m["content"]} if i % 2 else m for i, m in enumerate(messages)]
    source = TEMPLATES[template]
    kwargs = {"add_generation_prompt": generation_prompt, "tools": TOOLS}
    special = {**reference.special_tokens_map, "bos_token": "<s>"}
    expected = transformers.utils.chat_template_utils.render_jinja_template(
        conversations=[messages], chat_template=source, **kwargs, **special)[0][0]
    assert render_chat(source, messages, special_tokens=special, **kwargs) == expected


@pytest.mark.parametrize("name", ["tiny-dir", "smollm2", "qwen-coder"])
@pytest.mark.parametrize("final", ["The answer is", "trailing space ", ""])
def test_continue_final_message_cuts_where_transformers_does(pairs, name: str, final: str) -> None:
    ours, reference = pairs[name]
    messages = [{"role": "user", "content": "Say something"}, {"role": "assistant", "content": final}]
    try:
        expected = reference.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    except ValueError as error:
        with pytest.raises(ValueError):
            ours.apply_chat_template(messages, tokenize=False, continue_final_message=True)
        assert "continue_final_message" in str(error)
        return
    assert ours.apply_chat_template(messages, tokenize=False, continue_final_message=True) == expected


def test_the_sandbox_refuses_what_transformers_refuses() -> None:
    messages = [{"role": "user", "content": "x"}]
    with pytest.raises(jinja2.exceptions.SecurityError):
        render_chat("{% set ns = namespace(_x=1) %}", messages)
    with pytest.raises(jinja2.exceptions.SecurityError):
        render_chat("{{ messages.__class__.__init__.__globals__ }}", messages)
    with pytest.raises(jinja2.exceptions.TemplateError, match="no system"):
        render_chat("{{ raise_exception('no system messages') }}", messages)
    with pytest.raises(ValueError, match="empty"):
        render_chat(CHATML_TEMPLATE, [])
    with pytest.raises(ValueError, match="not compatible"):
        render_chat(CHATML_TEMPLATE, messages, add_generation_prompt=True, continue_final_message=True)


def test_a_template_cannot_make_gigabytes() -> None:
    """A request's template ({{ 'a' * 10**9 }}) took 38 s and 4 GB before its 400; now it stops at once."""
    messages = [{"role": "user", "content": "x"}]
    for template in ("{{ 'a' * 10**9 }}", "{{ [0] * 10**8 }}", "{{ 10**9 * 'a' }}", "{{ 7 ** (10**6) }}",
                     "{{ messages | tojson(indent=10**7) }}"):
        with pytest.raises(jinja2.exceptions.SecurityError):
            render_chat(template, messages)
    assert render_chat("{{ '-' * 3 }}{{ 2 ** 10 }}{{ messages | tojson(indent=2) | length > 0 }}", messages) == \
        "---1024True"  # ordinary uses are untouched


def test_named_templates_pick_tool_use_when_tools_are_given(tiny_dir: Path) -> None:
    ours = load_plain_tokenizer(tiny_dir)
    ours.chat_template = {"default": "plain:{{ messages[0].content }}", "tool_use": "tools:{{ tools | length }}"}
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages, tokenize=False) == "plain:hi"
    assert ours.apply_chat_template(messages, tokenize=False, tools=TOOLS) == "tools:1"


def test_to_transformers_is_transformers_tokenizer_over_the_same_vocabulary(pairs) -> None:
    ours, reference = pairs["smollm2"]
    converted = ours.to_transformers()
    assert isinstance(converted, transformers.PreTrainedTokenizerFast) and converted is ours.to_transformers()
    text = "<|im_start|>user\nHello 12345<|im_end|>"
    assert converted.encode(text) == ours.encode(text) == reference.encode(text)


def test_an_engine_starts_without_importing_transformers(tiny_model_dir) -> None:
    """The point of the module: ready to serve a GGUF and a plain directory with transformers never imported."""
    code = ("import sys\nfrom pagedserve.engine.arg_utils import EngineArgs\n"
            "from pagedserve.engine.llm_engine import LLMEngine\n"
            "for model in sys.argv[1:]:\n"
            "    engine = LLMEngine.from_engine_args(EngineArgs(model=model, max_model_len=128))\n"
            "    engine.tokenizer.apply_chat_template([{'role': 'user', 'content': 'hi'}], tokenize=False)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))\n")
    models = [str(packaged_model("smollm2-135m-instruct")), tiny_model_dir("qwen2")]
    result = subprocess.run([sys.executable, "-c", code, *models], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_encoding_a_long_text_lets_other_threads_run(pairs) -> None:
    """The server tokenizes on a thread pool: the event loop must keep running while a large prompt is encoded
    (the backend's encode holds the GIL throughout; a 4 MB prompt froze every request for seconds)."""
    ours, _ = pairs["smollm2"]
    text = "The quick brown fox jumps over the lazy dog. " * 20_000
    finished = threading.Event()
    ticks = 0
    worker = threading.Thread(target=lambda: (ours.encode(text), finished.set()))
    worker.start()
    while not finished.is_set():
        time.sleep(0.001)
        ticks += 1
    worker.join()
    assert ticks >= 20, f"the main thread ran {ticks} times while the text was encoded"


@pytest.mark.parametrize("text", ["\ud800", "ok \udfff then", "a\ud83d"])
def test_lone_surrogates_are_the_callers_error(pairs, text: str) -> None:
    """JSON can carry a lone surrogate ("\\ud800"), which is not Unicode: a 400 naming it, not the backend's
    TypeError (a 500); a surrogate pair is one character and encodes as it."""
    ours, reference = pairs["smollm2"]
    for encode in (ours.encode, lambda t: ours(t), lambda t: ours([t, "fine"])):
        with pytest.raises(InvalidRequestError, match="lone surrogate"):
            encode(text)
    paired = "\ud83d\ude00".encode("utf-16", "surrogatepass").decode("utf-16")
    assert ours.encode(paired) == reference.encode(paired)


@pytest.mark.parametrize("name", ["tiny-dir", "smollm2", "qwen-coder"])
@pytest.mark.parametrize("side", [0, 1], ids=["ours", "transformers"])
def test_token_bytes_rebuild_text_whose_characters_span_tokens(pairs, name: str, side: int) -> None:
    """Logprobs' `bytes` (OpenAI): each token's raw bytes, joined, give the text back, though a token holding part
    of a character decodes to U+FFFD alone; from ours and from transformers' tokenizer alike."""
    from pagedserve.tokenizer import TokenBytes

    tokenizer = pairs[name][side]
    token_bytes = TokenBytes(tokenizer)
    text = "日本語 🐶 test\r\n\tcafé  ẞ 😀😀 x"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(token_bytes(i) for i in ids) == text.encode()
    assert any(tokenizer.decode([i]) == "\ufffd" for i in ids)  # the case that needs the bytes: a split character
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert token_bytes(eos) == b"<|im_end|>"  # an added token: its text


def test_token_bytes_of_a_byte_fallback_tokenizer() -> None:
    """SentencePiece-style vocabularies (Llama 2, Mistral, Gemma): <0xNN> pieces for bytes, U+2581 for spaces."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, normalizers

    from pagedserve.tokenizer import TokenBytes

    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}, "\u2581hi": 257, "\u2581": 258, "x": 259}
    backend = Backend(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    tokenizer = Tokenizer(backend)
    ids = tokenizer.encode("hi 🐶x", add_special_tokens=False)
    pieces = [tokenizer.convert_ids_to_tokens(i) for i in ids]
    assert "\u2581" in pieces and "<0xF0>" in pieces  # a space piece, and the emoji's bytes
    token_bytes = TokenBytes(tokenizer)
    assert b"".join(token_bytes(i) for i in ids) == " hi 🐶x".encode()
