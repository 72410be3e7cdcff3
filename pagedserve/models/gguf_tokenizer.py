"""A GGUF's tokenizer rebuilt from its metadata, as a pagedserve Tokenizer equal to the model's original tokenizer:
byte-level BPE vocabularies here, without importing transformers; SentencePiece ones (Gemma) by transformers' GGUF
converter (`to_transformers()` gives transformers' tokenizer either way)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tokenizers
from gguf.constants import Keys, TokenType
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from pagedserve.formats.errors import ModelValidationError
from pagedserve.tokenizer import Tokenizer as ServingTokenizer

logger = logging.getLogger(__name__)

_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
# tokenizer.ggml.model of SentencePiece vocabularies (Gemma's), rebuilt by transformers' converter.
SENTENCEPIECE_TOKENIZER_MODELS = ("llama",)
# tokenizer.ggml.pre -> how text is split before BPE (llama.cpp llama-vocab.cpp, HF tokenizer.json): the
# pre-tokenizers pagedserve supports (models/validate.py refuses any other GGUF before loading).
PRE_TOKENIZER_FAMILY: dict[str, str] = {
    "default": "gpt2",
    "gpt2": "gpt2",
    "smollm": "digits+gpt2",
    "starcoder": "digits+gpt2",
    "refact": "digits+gpt2",
    "codeshell": "digits+gpt2",
    "qwen2": "qwen2",
    "deepseek-r1-qwen": "qwen2",
    "llama-bpe": "llama3",
    "llama3": "llama3",
    "smaug-bpe": "llama3",
    "falcon3": "llama3",
    "dbrx": "llama3",
}


def _pre_tokenizer(family: str) -> pre_tokenizers.PreTokenizer:
    if family == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if family == "digits+gpt2":
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    split = _QWEN2_SPLIT if family == "qwen2" else _LLAMA3_SPLIT
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _flagged_token(metadata: dict[str, Any], flag: str, key: str, tokens: list[str]) -> tuple[str, int] | None:
    """(token, id) of the BOS/EOS token when the GGUF asks for it to be added, else None."""
    token_id = metadata.get(f"tokenizer.ggml.{key}")
    if not metadata.get(f"tokenizer.ggml.{flag}") or token_id is None:
        return None
    return tokens[int(token_id)], int(token_id)


def _post_processor(metadata: dict[str, Any], tokens: list[str]) -> processors.PostProcessor:
    """Adds BOS/EOS as the GGUF's add_bos_token / add_eos_token flags say."""
    bos = _flagged_token(metadata, "add_bos_token", "bos_token_id", tokens)
    eos = _flagged_token(metadata, "add_eos_token", "eos_token_id", tokens)
    if bos is None and eos is None:
        return processors.ByteLevel(trim_offsets=False)
    head = [bos[0]] if bos else []
    tail = [eos[0]] if eos else []
    single = " ".join([*head, "$A", *tail])
    pair = " ".join([single, *(f"{t}:1" for t in head), "$B:1", *(f"{t}:1" for t in tail)])
    special = list(dict.fromkeys(t for t in (bos, eos) if t is not None))
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def _added_tokens(tokens: list[str], token_types: list[int]) -> list[AddedToken]:
    """Control tokens become special added tokens, user-defined ones plain added tokens."""
    added = []
    for token, token_type in zip(tokens, token_types, strict=False):
        if token_type == TokenType.CONTROL:
            added.append(AddedToken(token, special=True, normalized=False))
        elif token_type == TokenType.USER_DEFINED:
            added.append(AddedToken(token, special=False, normalized=False))
    return added


def _sentencepiece_tokenizer(metadata: dict[str, Any]) -> Tokenizer:
    """A SentencePiece vocabulary (tokenizer.ggml.model "llama": Gemma's, Llama 2's, Mistral's), rebuilt by
    transformers' GGUF converter, which recovers the merges from the vocabulary as the architecture needs; BOS/EOS
    added as the file's flags say. Where the file asks for a space prefix (SentencePiece's dummy prefix, llama.cpp's
    add_space_prefix, on unless the file says otherwise), every text segment gets one and its spaces become "▁"
    as SentencePiece does (transformers' converter adds none before a text that starts with a space)."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (GGUF_TOKENIZER_MAPPING,
                                                                           convert_gguf_tokenizer)
    except ImportError:  # transformers 4
        from transformers.integrations.ggml import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

    renames = GGUF_TOKENIZER_MAPPING["tokenizer"]
    tokenizer_dict = {name: metadata[f"tokenizer.{key}"] for key, name in renames.items()
                      if f"tokenizer.{key}" in metadata}
    tokenizer, _ = convert_gguf_tokenizer(str(metadata["general.architecture"]), tokenizer_dict)
    if metadata.get("tokenizer.ggml.add_space_prefix", True):
        tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
        tokenizer.pre_tokenizer = None
    tokens = list(metadata["tokenizer.ggml.tokens"])
    flags = {**metadata, "tokenizer.ggml.add_bos_token": metadata.get("tokenizer.ggml.add_bos_token", True)}
    processor = _post_processor(flags, tokens)  # llama.cpp adds BOS where the file does not say otherwise
    if isinstance(processor, processors.TemplateProcessing):
        tokenizer.post_processor = processor
    return tokenizer


def _backend_tokenizer(metadata: dict[str, Any], source: str) -> Tokenizer:
    if metadata.get("tokenizer.ggml.model") in SENTENCEPIECE_TOKENIZER_MODELS:
        return _sentencepiece_tokenizer(metadata)
    pre = str(metadata.get("tokenizer.ggml.pre", "default"))
    family = PRE_TOKENIZER_FAMILY.get(pre)
    if metadata.get("tokenizer.ggml.model") != "gpt2" or family is None:
        raise ModelValidationError(
            f"{source}: cannot rebuild tokenizer model {metadata.get('tokenizer.ggml.model')!r} with "
            f"pre-tokenizer {pre!r} from GGUF. Use a Hugging Face model directory with tokenizer.json instead."
        )
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    merges = [tuple(merge.split(" ", 1)) for merge in metadata.get("tokenizer.ggml.merges", [])]
    vocab = {token: index for index, token in enumerate(tokens)}
    # Llama 3's tokenizer emits a whole word that is in the vocabulary without applying merges.
    bpe = models.BPE(vocab, merges, ignore_merges=(family == "llama3"))
    tokenizer = Tokenizer(bpe)
    if family == "qwen2":
        tokenizer.normalizer = normalizers.NFC()  # as in Qwen's tokenizer.json
    tokenizer.pre_tokenizer = _pre_tokenizer(family)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = _post_processor(metadata, tokens)
    tokenizer.add_tokens(_added_tokens(tokens, list(metadata.get("tokenizer.ggml.token_type", []))))
    return tokenizer


def gguf_chat_template(metadata: dict[str, Any]) -> str | dict[str, str] | None:
    """The chat template, or HF's named templates ({"default": ..., "tool_use": ...}, as Hermes-2-Pro and Hermes-3
    ship them) where llama.cpp's converter wrote them: `tokenizer.chat_templates` names them, each under
    `tokenizer.chat_template.NAME` (gguf.Keys.Tokenizer.CHAT_TEMPLATES, CHAT_TEMPLATE_N), the default under
    `tokenizer.chat_template`. Without them a request with tools rendered the default, which has no tool format."""
    default = metadata.get(Keys.Tokenizer.CHAT_TEMPLATE) or None
    prefix = Keys.Tokenizer.CHAT_TEMPLATE_N.format(name="")
    listed = metadata.get(Keys.Tokenizer.CHAT_TEMPLATES)  # a header read without string arrays holds their count
    names = [str(n) for n in listed] if isinstance(listed, list) else []
    names += [k[len(prefix):] for k in metadata if k.startswith(prefix) and k[len(prefix):] not in names]
    named = {name: metadata[prefix + name] for name in names if metadata.get(prefix + name)}
    if not named:
        return default
    return {**({"default": default} if default else {}), **named}


def build_tokenizer_from_metadata(metadata: dict[str, Any], source: str = "GGUF metadata") -> ServingTokenizer:
    """The tokenizer of GGUF tokenizer metadata (byte-level BPE vocabularies).

    `metadata` is `GGUFHeader.metadata` read with string arrays kept; it may come from the first
    part of a split GGUF, since only metadata is used.
    """
    backend = _backend_tokenizer(metadata, source)
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    special: dict[str, str] = {}
    for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"), ("pad_token", "padding")):
        token_id = metadata.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None and 0 <= int(token_id) < len(tokens):
            special[name] = tokens[int(token_id)]
    context_length = next((v for k, v in metadata.items() if k.endswith(".context_length")), None)
    return ServingTokenizer(backend, special_tokens=special, chat_template=gguf_chat_template(metadata),
                            model_max_length=int(context_length) if context_length else None, name_or_path=source)


def cached_tokenizer(key: tuple[str, int, int], directory: Path, build: Callable[[], ServingTokenizer]
                     ) -> ServingTokenizer:
    """build(), kept as JSON in `directory` under `key` (a file's path, size and modification time; the
    tokenizers version and this module's source are part of the name, so a rebuilt rule or library never
    reads an old entry). A later start reads the JSON instead of decoding the GGUF's ~100k vocabulary and
    merge strings and rebuilding the BPE (~0.2 s of a SmolLM2 start on the AVX2 box). An unreadable or
    damaged entry is rebuilt; an unwritable directory only costs the rebuild next time."""
    digest = hashlib.sha256(repr((key, tokenizers.__version__, _SOURCE_DIGEST)).encode()).hexdigest()[:32]
    entry = directory / f"{digest}.json"
    try:
        saved = json.loads(entry.read_text(encoding="utf-8"))
        return ServingTokenizer(Tokenizer.from_str(saved["backend"]), special_tokens=saved["special_tokens"],
                                chat_template=saved["chat_template"], model_max_length=saved["model_max_length"],
                                name_or_path=saved["name_or_path"])
    except Exception as exc:  # noqa: BLE001 - missing, damaged or from another format: rebuild (tokenizers raises Exception)
        if not isinstance(exc, FileNotFoundError):
            logger.warning("tokenizer cache %s unreadable (%s): rebuilding it", entry, exc)
    tokenizer = build()
    record = {"backend": tokenizer.backend_tokenizer.to_str(), "special_tokens": tokenizer.special_tokens_map,
              "chat_template": tokenizer.chat_template, "name_or_path": tokenizer.name_or_path,
              "model_max_length": tokenizer.model_max_length if tokenizer.model_max_length < int(1e30) else None}
    try:
        directory.mkdir(parents=True, exist_ok=True)
        partial = entry.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(record), encoding="utf-8")
        partial.replace(entry)  # atomic: a concurrent start reads the old entry or the whole new one
    except OSError as exc:
        logger.warning("cannot write the tokenizer cache %s: %s", entry, exc)
    return tokenizer


_SOURCE_DIGEST = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
