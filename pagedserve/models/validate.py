"""Check a model path before any weight is read: fail with the problem and its fix, not a cryptic error later.

Two kinds of model are accepted: a Hugging Face directory (config.json, *.safetensors, tokenizer files)
and a single GGUF file. Only headers are read (by `pagedserve/formats/`); tensor data is never touched, so
validating a multi-GiB model costs milliseconds. This module imports no torch (unit tests run without it).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from gguf.constants import GGMLQuantizationType

from pagedserve.formats.errors import LOCAL_MODEL_HINT, ModelValidationError
from pagedserve.formats.gguf import GGUFHeader, shared_gguf_header, truncated_gguf_error
from pagedserve.formats.safetensors import read_safetensors_header, read_shard_index, safetensors_files, truncated_error
from pagedserve.formats import is_gguf_path
from pagedserve.formats.multimodal import TEXT_ONLY, language_model_name
from pagedserve.memory.sizes import moe_shape

SUPPORTED_HF_ARCHITECTURES: tuple[str, ...] = (
    "GemmaForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "GraniteForCausalLM",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "MixtralForCausalLM",
    "Phi3ForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "SmolLM3ForCausalLM",
    "BertModel",
    # Multimodal checkpoints, served as their language model (formats/multimodal.py).
    *TEXT_ONLY,
    # Decoders saved without an LM head (e.g. Qwen3-Embedding): embedding only (models/embedding.py).
    "LlamaModel",
    "MistralModel",
    "Qwen2Model",
    "Qwen3Model",
)
# The decoders' MLP gates (models/llama.py's ACTIVATIONS, which are checked equal to these).
DECODER_ACTIVATIONS: tuple[str, ...] = ("silu", "gelu", "gelu_pytorch_tanh")
SUPPORTED_GGUF_ARCHITECTURES: tuple[str, ...] = ("llama", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "granite",
                                                 "phi3", "smollm3", "qwen2moe", "qwen3moe")
# Weight encodings that gguf-py can dequantize and that we test.
SUPPORTED_GGUF_QTYPES: frozenset[GGMLQuantizationType] = frozenset(
    GGMLQuantizationType[name]
    for name in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
)
# Tokenizers that `gguf_tokenizer.py` can rebuild: byte-level BPE, with the pre-tokenizers (tokenizer.ggml.pre)
# of its PRE_TOKENIZER_FAMILY table.
SUPPORTED_GGUF_TOKENIZER_MODELS: tuple[str, ...] = ("gpt2",)
# SentencePiece vocabularies (tokenizer.ggml.model "llama"), rebuilt by transformers' converter, for these
# architectures' files.
SENTENCEPIECE_GGUF_ARCHITECTURES: tuple[str, ...] = ("llama", "gemma", "gemma2", "gemma3", "phi3")


# ---------------------------------------------------------------------------------------------------
# GGUF validation
# ---------------------------------------------------------------------------------------------------


def _qtype_name(type_id: int) -> str:
    try:
        return GGMLQuantizationType(type_id).name
    except ValueError:
        return f"unknown ggml type {type_id}"


def _check_gguf_tensors(header: GGUFHeader) -> None:
    supported_ids = {int(qtype) for qtype in SUPPORTED_GGUF_QTYPES}
    for info in header.tensors:
        if info.type_id not in supported_ids:
            type_name = _qtype_name(info.type_id)
            supported = ", ".join(sorted(q.name for q in SUPPORTED_GGUF_QTYPES))
            raise ModelValidationError(
                f"GGUF file {header.path}: tensor {info.name!r} is stored as {type_name}, which pagedserve "
                f"cannot load. Supported: {supported}. Use a GGUF quantized as Q8_0, Q4_K_M or Q4_0 instead."
            )
    if header.required_size > header.file_size:
        raise truncated_gguf_error(header.path, header.required_size, header.file_size)
    _check_gguf_offsets(header)


def _check_gguf_offsets(header: GGUFHeader) -> None:
    """Each tensor's data starts where the one before it ends, padded to the alignment (llama.cpp requires the
    same): a tensor whose type or shape was changed in the table reads the wrong bytes otherwise (QA-P: a Q8_0
    embedding retyped as Q4_0 loaded and generated empty text)."""
    expected = 0
    for info in header.tensors:
        if info.offset != expected:
            raise ModelValidationError(
                f"GGUF file {header.path} is damaged: tensor {info.name!r} ({_qtype_name(info.type_id)}, shape "
                f"{list(info.shape)}) has its data at offset {info.offset}, but the tensors before it end at {expected}"
                ": a tensor's type or shape in the header does not match its data. Re-download or re-convert it.")
        expected += -(-info.nbytes // header.alignment) * header.alignment


def _check_gguf_split(header: GGUFHeader) -> None:
    count = header.metadata.get("split.count")
    if isinstance(count, int) and count > 1:
        index = header.metadata.get("split.no", 0)
        raise ModelValidationError(
            f"GGUF file {header.path} is part {int(index) + 1} of a model split into {count} files; pagedserve "
            "serves one file: merge the parts with `llama-gguf-split --merge FIRST-PART merged.gguf` and serve "
            "merged.gguf.")


# Token ids a GGUF's tokenizer metadata names; each must be in its vocabulary.
_GGUF_TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "eot_token_id", "eom_token_id", "padding_token_id",
                       "unknown_token_id", "seperator_token_id")


def _check_gguf_tokenizer(header: GGUFHeader, need_chat_template: bool) -> None:
    # Lazily: it imports tokenizers (no torch, no transformers), which a directory's validation does not need.
    from pagedserve.models.gguf_tokenizer import PRE_TOKENIZER_FAMILY

    meta = header.metadata
    model = meta.get("tokenizer.ggml.model")
    pre = meta.get("tokenizer.ggml.pre", "default")
    fix = "Use a Hugging Face model directory with tokenizer.json instead"
    if "tokenizer.ggml.tokens" not in meta:
        raise ModelValidationError(f"GGUF file {header.path} has no tokenizer (tokenizer.ggml.tokens). {fix}.")
    sentencepiece = model == "llama" and header.architecture in SENTENCEPIECE_GGUF_ARCHITECTURES
    if model not in SUPPORTED_GGUF_TOKENIZER_MODELS and not sentencepiece:
        raise ModelValidationError(
            f"GGUF file {header.path} uses tokenizer model {model!r}; pagedserve rebuilds only "
            f"{SUPPORTED_GGUF_TOKENIZER_MODELS} (byte-level BPE) tokenizers from GGUF, and the SentencePiece ones of "
            f"{', '.join(SENTENCEPIECE_GGUF_ARCHITECTURES)} files. {fix}."
        )
    num_tokens = meta["tokenizer.ggml.tokens"]
    num_tokens = num_tokens if isinstance(num_tokens, int) else len(num_tokens)  # skipped arrays keep their length
    for key in _GGUF_TOKEN_ID_KEYS:
        token_id = meta.get(f"tokenizer.ggml.{key}")
        if isinstance(token_id, int) and not 0 <= token_id < num_tokens:
            raise ModelValidationError(
                f"GGUF file {header.path}: tokenizer.ggml.{key} is {token_id}, outside its vocabulary of "
                f"{num_tokens} tokens: the file is damaged or was converted wrongly; convert the model again.")
    if not sentencepiece and pre not in PRE_TOKENIZER_FAMILY:
        raise ModelValidationError(
            f"GGUF file {header.path} uses pre-tokenizer {pre!r}, which pagedserve does not know "
            f"(known: {', '.join(PRE_TOKENIZER_FAMILY)}). {fix}."
        )
    if need_chat_template and not _gguf_chat_template(meta):
        raise ModelValidationError(
            f"GGUF file {header.path} has no chat template (tokenizer.chat_template), so chat requests "
            "cannot be formatted. Use the completions endpoint, or a GGUF that carries a chat template."
        )


def _gguf_chat_template(metadata: dict[str, Any]) -> str | dict[str, str] | None:
    """The file's chat template, or its named ones (Hermes' "tool_use"), as serving reads them."""
    from pagedserve.models.gguf_tokenizer import gguf_chat_template  # tokenizers: only where a template is needed

    return gguf_chat_template(metadata)


def validate_gguf_header(header: GGUFHeader, *, need_chat_template: bool = False) -> None:
    """Check a parsed GGUF header: architecture, tensor types, file size, tokenizer, chat template."""
    if header.architecture not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ModelValidationError(
            f"GGUF file {header.path} holds architecture {header.architecture!r}; pagedserve supports "
            f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)}. Use a model of a supported architecture."
        )
    _check_gguf_split(header)
    experts = header.metadata.get(f"{header.architecture}.expert_count")
    used = header.metadata.get(f"{header.architecture}.expert_used_count")
    if experts and not (isinstance(used, int) and 1 <= used <= experts):
        raise ModelValidationError(f"GGUF file {header.path}: {header.architecture}.expert_used_count {used!r} must be "
                                   f"from 1 to its expert_count ({experts}). Convert the model again.")
    if experts and header.architecture not in ("llama", "qwen2moe", "qwen3moe"):
        raise ModelValidationError(f"GGUF file {header.path} holds a mixture-of-experts {header.architecture} model: "
                                   "pagedserve serves Mixtral's, Qwen2-MoE's and Qwen3-MoE's. Use a model of a "
                                   "supported architecture.")
    if header.architecture in ("gemma2", "gemma3") and f"{header.architecture}.attention.sliding_window" not in \
            header.metadata:
        raise ModelValidationError(f"GGUF file {header.path} lacks metadata key {header.architecture}.attention."
                                   "sliding_window. Convert the model again with a current llama.cpp.")
    _check_gguf_tensors(header)
    _check_gguf_tokenizer(header, need_chat_template)


def validate_gguf_file(path: Path, *, need_chat_template: bool = False) -> GGUFHeader:
    """Validate a GGUF file from its header; returns the header, parsed once for the whole start-up (the
    plan, the tokenizer and the loader read the same one)."""
    header = shared_gguf_header(Path(path))
    validate_gguf_header(header, need_chat_template=need_chat_template)
    return header


# ---------------------------------------------------------------------------------------------------
# Hugging Face directory validation
# ---------------------------------------------------------------------------------------------------


# The model's shape, which the memory plan and the loader read from config.json (text_config for a wrapper).
REQUIRED_CONFIG_KEYS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")


def _load_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelValidationError(
            f"{path} ({what}) is not valid JSON: {exc}. The file is damaged: download the model again."
        ) from None


def _check_config(model_dir: Path) -> dict[str, Any]:
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        ggufs = sorted(model_dir.glob("*.gguf"))
        hint = f" It holds a GGUF file: pass --model {ggufs[0]}." if ggufs else ""
        raise ModelValidationError(
            f"{model_dir} has no config.json, so it is not a Hugging Face model directory.{hint} "
            f"{LOCAL_MODEL_HINT}."
        )
    config = _load_json(config_path, "model config")
    if not isinstance(config, dict):
        raise ModelValidationError(f"{config_path} must hold a JSON object. Download the model again.")
    architectures = config.get("architectures") or []
    if not any(arch in SUPPORTED_HF_ARCHITECTURES for arch in architectures):
        raise ModelValidationError(
            f"{config_path} names architectures {architectures}, none of which pagedserve supports. "
            f"Supported: {', '.join(SUPPORTED_HF_ARCHITECTURES)}."
        )
    shape = config.get("text_config", config)
    if "BertModel" not in architectures:  # the decoders' MLP: gated by an activation of ACTIVATIONS, without biases
        fields = {key: shape[key] for key in ("hidden_act", "hidden_activation") if shape.get(key)}  # Gemma 2/3: the
        # second; every one given must be known
        key, act = next(((k, v) for k, v in fields.items() if v not in DECODER_ACTIVATIONS), ("hidden_act", "silu"))
        if act not in DECODER_ACTIVATIONS or shape.get("mlp_bias"):
            field = f"{key} {act!r}" if act not in DECODER_ACTIVATIONS else "mlp_bias: true"
            raise ModelValidationError(f"{config_path} sets {field}: pagedserve's {architectures[0]} runs an MLP gated "
                                       f"by {', '.join(DECODER_ACTIVATIONS)}, without biases, so this model would be "
                                       "computed wrongly. Use a model without it.")
    for key in REQUIRED_CONFIG_KEYS:
        value = shape.get(key) if isinstance(shape, dict) else None
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ModelValidationError(
                f"{config_path} has no usable {key!r} (a positive integer; got {value!r}): the file is damaged or "
                "was edited. Download the model's config.json again."
            )
    try:
        moe_shape(shape)
    except ValueError as exc:
        raise ModelValidationError(f"{config_path}: {exc}. The config does not describe a model that runs.") from None
    return config


def _check_safetensors_file(path: Path) -> dict[str, list[int]]:
    """The file's tensor shapes, once its header and size are checked."""
    header = read_safetensors_header(path)  # raises when cut inside the header or not JSON
    expected, actual = header.required_size, header.file_size
    if actual < expected:
        raise truncated_error(path, expected, actual)
    if actual > expected:
        raise ModelValidationError(
            f"{path.name} is larger than its header says ({actual:,} bytes, expected {expected:,}): "
            f"the file is damaged. Download it again ({path})."
        )
    return {name: info.get("shape", []) for name, info in header.tensors.items()}


def _check_weights(model_dir: Path) -> dict[str, list[int]]:
    """The weight files are complete; returns every tensor's shape, from the headers."""
    shards = read_shard_index(model_dir)
    missing = [name for name in shards or () if not (model_dir / name).is_file()]
    if missing:
        raise ModelValidationError(
            f"{model_dir} is missing {len(missing)} of {len(shards)} weight shards named in "
            f"model.safetensors.index.json: {', '.join(missing)}. Download the missing files."
        )
    files = safetensors_files(model_dir)  # the shards the loader reads, and only those
    if not files:
        bins = sorted(model_dir.glob("*.bin"))
        hint = " It has only PyTorch .bin weights: convert them to safetensors." if bins else ""
        raise ModelValidationError(f"{model_dir} holds no *.safetensors weight files.{hint} Download the weights.")
    shapes: dict[str, list[int]] = {}
    for path in files:
        shapes.update(_check_safetensors_file(path))
    return shapes


_LAYER_INDEX = re.compile(r"(?:^|\.)layers?\.(\d+)\.")


def _check_shape(config_path: Path, config: dict[str, Any], shapes: dict[str, list[int]]) -> None:
    """config.json's vocabulary, width and depth against the weights' headers (the loader would find the same
    mismatch only after loading part of the weights)."""
    shape = config.get("text_config", config)
    embedding = next((s for name, s in shapes.items()
                      if name.endswith(("embed_tokens.weight", "word_embeddings.weight"))), None)
    expected = [shape["vocab_size"], shape["hidden_size"]]
    if embedding is not None and list(embedding) != expected:
        raise ModelValidationError(f"{config_path} says vocab_size x hidden_size = {expected[0]} x {expected[1]}, "
                                   f"but the weights' embedding is {' x '.join(map(str, embedding))}: config.json "
                                   "does not match the weights. Download the model again.")
    names = [name for name in shapes if language_model_name(name) is not None]  # not a vision tower's layers
    layers = {int(m.group(1)) for name in names if (m := _LAYER_INDEX.search(name))}
    if layers and max(layers) + 1 != shape["num_hidden_layers"]:
        raise ModelValidationError(f"{config_path} says num_hidden_layers = {shape['num_hidden_layers']}, but the "
                                   f"weights hold {max(layers) + 1} layers: config.json does not match the weights. "
                                   "Download the model again.")


def _has_chat_template(model_dir: Path, tokenizer_config: dict[str, Any]) -> bool:
    if tokenizer_config.get("chat_template"):
        return True
    return (model_dir / "chat_template.jinja").is_file() or (model_dir / "chat_template.json").is_file()


def has_tokenizer_files(folder: Path) -> bool:
    """The folder holds a tokenizer's vocabulary (tokenizer.json, vocab.json + merges.txt, tokenizer.model or
    vocab.txt)."""
    return ((folder / "tokenizer.json").is_file()
            or ((folder / "vocab.json").is_file() and (folder / "merges.txt").is_file())
            or (folder / "tokenizer.model").is_file()
            or (folder / "vocab.txt").is_file())


def _check_tokenizer(model_dir: Path, need_chat_template: bool) -> None:
    if not has_tokenizer_files(model_dir):
        raise ModelValidationError(
            f"{model_dir} has no tokenizer: expected tokenizer.json (or vocab.json + merges.txt). "
            "Download the tokenizer files with the model."
        )
    config_path = model_dir / "tokenizer_config.json"
    if not config_path.is_file():
        raise ModelValidationError(
            f"{model_dir} has no tokenizer_config.json (special tokens, chat template). "
            "Download it with the model."
        )
    tokenizer_config = _load_json(config_path, "tokenizer config")
    if need_chat_template and not _has_chat_template(model_dir, tokenizer_config):
        raise ModelValidationError(
            f"{model_dir} has no chat template (none in tokenizer_config.json, no chat_template.jinja), so chat "
            "requests cannot be formatted. Use the completions endpoint, or add the model's template as "
            "chat_template.jinja in that directory."
        )


def validate_hf_dir(model_dir: Path, *, need_chat_template: bool = False) -> dict[str, Any]:
    """Validate a Hugging Face model directory; returns its parsed config.json."""
    config = _check_config(model_dir)
    _check_shape(model_dir / "config.json", config, _check_weights(model_dir))
    _check_tokenizer(model_dir, need_chat_template)
    return config


def validate_model_path(path: str | Path, *, need_chat_template: bool = False) -> None:
    """Raise ModelValidationError if `path` is not a complete, supported model; reads headers only."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelValidationError(f"Model path {path} does not exist. {LOCAL_MODEL_HINT}, or a known model name.")
    if path.is_dir():
        validate_hf_dir(path, need_chat_template=need_chat_template)
    elif is_gguf_path(path):
        validate_gguf_file(path, need_chat_template=need_chat_template)
    else:
        raise ModelValidationError(f"{path} is neither a model directory nor a GGUF file. {LOCAL_MODEL_HINT}.")


# Model types whose transformers class applies a config's sliding_window to every layer. Other types without
# layer_types (Llama, Granite, Gemma 1) ignore the field, whatever it says.
WINDOW_ON_EVERY_LAYER = frozenset({"mistral", "phi3", "mixtral"})


def layer_windows(cfg: Any) -> list[int | None]:
    """Each layer's sliding window (None: it attends to every earlier position), as transformers reads the config
    (a transformers config, or a config.json's values as attributes): `layer_types` says it per layer (Gemma 2/3;
    transformers derives it for Qwen2/Qwen3, which this derives as it does where a config.json has none: the
    layers from max_window_layers on, only with use_sliding_window; Qwen2-MoE's even layers below it; Qwen3-MoE's
    every layer); Mistral, Mixtral and Phi-3 window every layer; other models none."""
    layers = cfg.num_hidden_layers
    window = getattr(cfg, "sliding_window", None)
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        return [None] * layers
    model_type = getattr(cfg, "model_type", None)
    layer_types = getattr(cfg, "layer_types", None)
    if model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):  # their configs drop the window without
        if not getattr(cfg, "use_sliding_window", False):  # use_sliding_window
            return [None] * layers
        first = getattr(cfg, "max_window_layers", None)
        first = 28 if first is None else first  # the configs' default
        if model_type == "qwen3_moe":  # every layer (Qwen3MoeConfig has no max_window_layers rule)
            return [window] * layers
        if model_type == "qwen2_moe":  # Qwen2MoeConfig's rule: the even layers below max_window_layers
            windowed = [i % 2 == 0 and i < first for i in range(layers)]
        else:
            windowed = [i >= first for i in range(layers)]
        layer_types = layer_types or ["sliding_attention" if w else "full_attention" for w in windowed]
    if layer_types:
        return [window if kind == "sliding_attention" else None for kind in layer_types]
    return [window] * layers if model_type in WINDOW_ON_EVERY_LAYER else [None] * layers
