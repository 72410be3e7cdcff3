"""The tokenizer serving needs, on the `tokenizers` library (and chat_template.py's jinja2) alone.

Importing transformers costs ~0.8 s of every start-up, and serving needs only encode, decode, the special
tokens and the chat template. `Tokenizer` gives exactly what transformers' PreTrainedTokenizerFast gives for
the same backend (tests/models/test_tokenizer.py compares them): a GGUF's tokenizer (built from its metadata)
is always one, and a model directory is one when its tokenizer_config.json names a class that is
tokenizer.json as written (`PLAIN_TOKENIZER_CLASSES`) and asks for nothing transformers would rebuild;
`load_plain_tokenizer` returns None for every other directory, which then loads through AutoTokenizer.
`to_transformers()` builds the transformers tokenizer on demand, for the libraries that need one (xgrammar).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as BackendTokenizer

from pagedserve.chat_template import render_chat, select_template
from pagedserve.exceptions import check_text
from pagedserve.formats import is_gguf_path

# transformers' named special tokens, in its order (SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# tokenizer_config.json classes whose transformers tokenizer is tokenizer.json plus the config's special tokens.
# Model-specific classes (LlamaTokenizer, Qwen2Tokenizer, BertTokenizer, ...) may rebuild parts of it in
# transformers 5, so they load through AutoTokenizer until a test shows ours equal.
PLAIN_TOKENIZER_CLASSES = frozenset({"PreTrainedTokenizerFast", "TokenizersBackend"})
# tokenizer_config.json keys that change what transformers builds (post-processor, regex patches, ...).
_REBUILDING_KEYS = ("add_bos_token", "add_eos_token", "add_prefix_space", "split_special_tokens", "legacy",
                    "fix_mistral_regex", "post_processor", "auto_map")


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    """encode / decode / chat template over a `tokenizers.Tokenizer`, as transformers does them."""

    def __init__(self, backend: BackendTokenizer, *, special_tokens: dict[str, str] | None = None,
                 extra_special_tokens: list[str] | tuple[str, ...] = (), chat_template: str | dict | None = None,
                 truncation_side: str = "right", model_max_length: int | None = None, name_or_path: str = "",
                 added_tokens: list[AddedToken] | tuple[AddedToken, ...] = ()) -> None:
        backend.no_truncation()
        backend.no_padding()
        self._backend = backend
        self.special_tokens_map = {name: token for name, token in (special_tokens or {}).items() if token is not None}
        self.extra_special_tokens = list(extra_special_tokens)
        self.chat_template = chat_template
        self.truncation_side = truncation_side
        self.model_max_length = model_max_length if model_max_length is not None else int(1e30)
        self.name_or_path = name_or_path
        # As transformers' __init__: the config's added tokens, then special tokens the backend lacks.
        present = set(backend.get_added_tokens_decoder()[i].content for i in backend.get_added_tokens_decoder())
        missing = [token for token in added_tokens if token.content not in present]
        present.update(token.content for token in missing)
        for token in [*self.special_tokens_map.values(), *self.extra_special_tokens]:
            if token not in present:
                missing.append(AddedToken(token, special=True))
                present.add(token)
        if missing:
            backend.add_tokens(missing)
        self._transformers: Any = None
        self._transformers_lock = threading.Lock()

    # ---- what transformers' tokenizer offers, for the parts pagedserve uses ---------------------------------
    @property
    def backend_tokenizer(self) -> BackendTokenizer:
        return self._backend

    def __len__(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=False)

    def __getattr__(self, name: str) -> Any:
        """bos_token, eos_token, ... and their ids (bos_token_id, ...), as transformers names them."""
        if name in SPECIAL_TOKEN_NAMES:
            return self.__dict__.get("special_tokens_map", {}).get(name)
        if name.endswith("_id") and name[:-3] in SPECIAL_TOKEN_NAMES:
            token = self.__dict__.get("special_tokens_map", {}).get(name[:-3])
            return None if token is None else self._backend.token_to_id(token)
        if name.startswith("_") or "_backend" not in self.__dict__:
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")
        # Anything else a caller of transformers' tokenizer reaches for (batch_decode, tokenize, padding_side,
        # ...: what vLLM's get_tokenizer() users call) is transformers' own, over this same backend.
        return getattr(self.to_transformers(), name)

    @property
    def all_special_tokens(self) -> list[str]:
        tokens = [self.special_tokens_map[name] for name in SPECIAL_TOKEN_NAMES if name in self.special_tokens_map]
        return list(dict.fromkeys([*tokens, *self.extra_special_tokens]))

    @property
    def all_special_ids(self) -> list[int]:
        return [i for i in (self._backend.token_to_id(t) for t in self.all_special_tokens) if i is not None]

    def get_vocab(self) -> dict[str, int]:
        return self._backend.get_vocab(with_added_tokens=True)

    def convert_ids_to_tokens(self, ids: int | list[int]) -> str | None | list[str | None]:
        if isinstance(ids, int):
            return self._backend.id_to_token(ids)
        return [self._backend.id_to_token(i) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            return self._backend.token_to_id(tokens)
        return [self._backend.token_to_id(t) for t in tokens]

    def _encode(self, text: str, add_special_tokens: bool) -> Any:
        """The backend's Encoding of one text. Through encode_batch, which lets go of the GIL while it works
        (encode holds it: a megabyte prompt froze the server's event loop for seconds); as fast for one text."""
        check_text(text)
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]

    def encode(self, text: str, add_special_tokens: bool = True, truncation: bool = False,
               max_length: int | None = None) -> list[int]:
        if not truncation or max_length is None:
            return self._encode(text, add_special_tokens).ids
        # As the backend's own truncation: the text's tokens are cut to leave room for the special ones (none
        # are cut when max_length cannot even hold those), then the special tokens are added.
        encoding = self._encode(text, add_special_tokens=False)
        num_special = self._backend.num_special_tokens_to_add(False) if add_special_tokens else 0
        if max_length >= num_special:
            encoding.truncate(max_length - num_special, direction=self.truncation_side)
        if add_special_tokens:
            encoding = self._backend.post_process(encoding)
        return encoding.ids

    def __call__(self, text: str | list[str], add_special_tokens: bool = True, truncation: bool = False,
                 max_length: int | None = None, **kwargs: Any) -> dict[str, Any]:
        """transformers' `tokenizer(text)` for what serving uses: {"input_ids": ids, or a list of them for a
        list of texts (encoded together, in the backend's threads)}, readable as `.input_ids` too. Other options
        (return_tensors, padding, ...) are transformers' own."""
        if kwargs:
            return self.to_transformers()(text, add_special_tokens=add_special_tokens, truncation=truncation,
                                          max_length=max_length, **kwargs)
        if isinstance(text, str):
            return _Encoding(input_ids=self.encode(text, add_special_tokens, truncation, max_length))
        if not truncation or max_length is None:
            for one in text:
                check_text(one)
            encodings = self._backend.encode_batch(list(text), add_special_tokens=add_special_tokens)
            return _Encoding(input_ids=[encoding.ids for encoding in encodings])
        return _Encoding(input_ids=[self.encode(t, add_special_tokens, truncation, max_length) for t in text])

    def decode(self, token_ids: int | list[int], skip_special_tokens: bool = False, **kwargs: Any) -> str:
        if kwargs:  # clean_up_tokenization_spaces, ...: transformers' own
            return self.to_transformers().decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs)
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, conversation: list[dict], tools: list[dict] | None = None,
                            documents: list[dict] | None = None, chat_template: str | None = None,
                            add_generation_prompt: bool = False, continue_final_message: bool | str = False,
                            tokenize: bool = True, **kwargs: Any) -> str | list[int]:
        if any(key in kwargs for key in _TRANSFORMERS_CHAT_OPTIONS):  # return_dict, return_tensors, padding, ...
            transformers_tokenizer = self.to_transformers()
            transformers_tokenizer.chat_template = self.chat_template
            return transformers_tokenizer.apply_chat_template(
                conversation, tools=tools, documents=documents, chat_template=chat_template,
                add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                tokenize=tokenize, **kwargs)
        template = chat_template or select_template(self.chat_template, tools)
        text = render_chat(template, conversation, tools=tools, documents=documents,
                           add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                           special_tokens=self.special_tokens_map, **kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def save_pretrained(self, directory: str | Path) -> Any:
        """A transformers tokenizer directory (tokenizer.json, tokenizer_config.json, chat template)."""
        return self.to_transformers().save_pretrained(str(directory))

    # ---- for libraries that need transformers' object ----------------------------------------------------------
    def to_transformers(self) -> Any:
        """transformers' PreTrainedTokenizerFast over this backend (imports transformers, once)."""
        with self._transformers_lock:
            if self._transformers is None:
                extra = {"extra_special_tokens": self.extra_special_tokens} if self.extra_special_tokens else {}
                self._transformers = wrap_backend_tokenizer(
                    self._backend, clean_up_tokenization_spaces=False, truncation_side=self.truncation_side,
                    model_max_length=self.model_max_length, **self.special_tokens_map, **extra)
                # (no name_or_path: transformers would take a path for a Hub id and ask the Hub about it)
                self._transformers.chat_template = self.chat_template
            return self._transformers


# apply_chat_template options about the returned object, not the template: transformers' to honour.
_TRANSFORMERS_CHAT_OPTIONS = ("return_dict", "return_tensors", "padding", "truncation", "max_length",
                              "return_assistant_tokens_mask")


class _Encoding(dict):
    """`tokenizer(text)`'s result: {"input_ids": ...}, also read as `.input_ids` (transformers' BatchEncoding)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def _byte_level_bytes() -> dict[str, int]:
    """GPT-2's bytes_to_unicode inverted: the printable character a byte-level BPE vocabulary writes for each byte
    (printable Latin-1 bytes as themselves, the others as the characters from U+0100 on, in byte order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


class TokenBytes:
    """A token's raw bytes, as OpenAI's logprobs give them (`bytes`: joined, they rebuild a character that spans
    tokens, whose pieces decode to U+FFFD alone). Read from the vocabulary entry for the two byte encodings
    tokenizers use: byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM2: one printable character per byte) and
    SentencePiece's byte fallback (<0xNN> tokens, U+2581 for a space). Added tokens, and tokens of other
    tokenizers, are their decoded text's UTF-8. For transformers' tokenizers too (through their backend)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        backend = getattr(tokenizer, "_backend", None) or getattr(tokenizer, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None)
        state = json.dumps(json.loads(decoder.__getstate__())) if decoder is not None else ""
        self._byte_level = _byte_level_bytes() if '"ByteLevel"' in state else None
        self._byte_fallback = '"ByteFallback"' in state
        self._added = set(backend.get_added_tokens_decoder()) if backend is not None else set()
        self._cache: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        found = self._cache.get(token_id)
        if found is None:
            found = self._cache[token_id] = self._read(token_id)
        return found

    def _read(self, token_id: int) -> bytes:
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if piece is not None and token_id not in self._added:
            if self._byte_level is not None and all(c in self._byte_level for c in piece):
                return bytes(self._byte_level[c] for c in piece)
            if self._byte_fallback:
                if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                    return bytes([int(piece[3:5], 16)])
                return piece.replace("\u2581", " ").encode()
        return self._tokenizer.decode([token_id]).encode()


def wrap_backend_tokenizer(backend: BackendTokenizer, **kwargs: Any) -> Any:
    """PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs) without its deep copy of `backend`.

    The copy is a pickle round trip of the whole vocabulary (0.7 s for a 150k-token one, more than building
    it); `backend` is a Tokenizer's own, and transformers' __init__ keeps a backend already set on the
    instance (it adds the same special tokens Tokenizer did). Should a transformers version not, the
    documented constructor is used instead.
    """
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.__new__(PreTrainedTokenizerFast)
    tokenizer._tokenizer = backend
    try:
        tokenizer.__init__(**kwargs)
    except (TypeError, ValueError, AttributeError):
        return PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs)
    if tokenizer.backend_tokenizer is not backend:
        return PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs)
    return tokenizer


def as_transformers(tokenizer: Any) -> Any:
    """transformers' tokenizer for `tokenizer` (ours converted, transformers' own as is)."""
    convert = getattr(tokenizer, "to_transformers", None)
    return convert() if convert is not None else tokenizer


def loads_without_transformers(path: str | Path) -> bool:
    """Whether engine/setup.py's load_tokenizer gives our Tokenizer for `path` (a GGUF, or a plain directory),
    from its files alone (the memory plan counts transformers' memory otherwise)."""
    return is_gguf_path(path) or _plain_tokenizer_files(Path(path)) is not None


def _plain_tokenizer_files(path: Path) -> dict[str, Any] | None:
    """tokenizer_config.json of a directory whose transformers tokenizer is tokenizer.json as written, else None."""
    tokenizer_file, config_file = path / "tokenizer.json", path / "tokenizer_config.json"
    if not tokenizer_file.is_file() or not config_file.is_file():
        return None
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return None
    if config.get("tokenizer_class") not in PLAIN_TOKENIZER_CLASSES or any(k in config for k in _REBUILDING_KEYS):
        return None
    if config.get("clean_up_tokenization_spaces"):  # transformers' WordPiece clean-up: not ours to copy
        return None
    if (path / "special_tokens_map.json").is_file() or _model_type(path).startswith("mistral"):
        return None  # special tokens in two places, or a model transformers patches the regex of
    extra = config.get("extra_special_tokens", config.get("additional_special_tokens")) or []
    if isinstance(extra, dict) or any(_token_text(t) is None for t in extra):
        return None  # named extra tokens (multimodal models) are not needed here
    return config


def load_plain_tokenizer(path: str | Path) -> Tokenizer | None:
    """Our Tokenizer for a model directory whose transformers tokenizer is tokenizer.json as written, else None."""
    path = Path(path)
    config = _plain_tokenizer_files(path)
    if config is None:
        return None
    special = {name: _token_text(config.get(name)) for name in SPECIAL_TOKEN_NAMES}
    extra = config.get("extra_special_tokens", config.get("additional_special_tokens")) or []
    added = []
    for entry in (config.get("added_tokens_decoder") or {}).values():
        added.append(AddedToken(entry["content"], single_word=entry.get("single_word", False),
                                lstrip=entry.get("lstrip", False), rstrip=entry.get("rstrip", False),
                                normalized=entry.get("normalized", True), special=entry.get("special", False)))
    template: Any = config.get("chat_template")
    if isinstance(template, list):
        template = {entry["name"]: entry["template"] for entry in template}
    template_file = path / "chat_template.jinja"
    if template_file.is_file():
        template = template_file.read_text()
    return Tokenizer(BackendTokenizer.from_file(str(path / "tokenizer.json")), special_tokens=special,
                     extra_special_tokens=[_token_text(t) for t in extra], chat_template=template,
                     truncation_side=config.get("truncation_side", "right"),
                     model_max_length=config.get("model_max_length"), name_or_path=str(path), added_tokens=added)


def _model_type(path: Path) -> str:
    try:
        return str(json.loads((path / "config.json").read_text()).get("model_type") or "")
    except (OSError, ValueError):
        return ""
