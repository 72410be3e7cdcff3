"""How an embedding model pools: read from its sentence-transformers files, else a default per family.

sentence-transformers describes the pipeline after the transformer in `modules.json` (Transformer ->
Pooling -> optional Normalize) and the pooling mode in `<pooling dir>/config.json`, either as
`pooling_mode` (sentence-transformers >= 5) or as legacy `pooling_mode_*_token(s)` booleans.
Without those files: BERT-style encoders pool the CLS token, decoders the last token; both normalise
(vLLM's defaults). Pure Python: no torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pagedserve.config import PoolerConfig  # the frozen result, kept with the other configs (layers read it)

# Bidirectional encoders: no KV cache, the whole input in one forward pass.
ENCODER_ARCHITECTURES = frozenset({"BertModel"})
# Decoder checkpoints saved without an LM head (e.g. Qwen3-Embedding as Qwen3Model): embedding only.
DECODER_BASE_ARCHITECTURES = frozenset({"LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model"})
# What task embed serves (models/embedding.py's EMBEDDING_ARCHITECTURES, checked equal at its import), here without
# torch so that the start-up can refuse another architecture before anything loads.
EMBEDDING_ARCHITECTURE_NAMES = frozenset({"BertModel", "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                                          "Qwen3ForCausalLM"}) | DECODER_BASE_ARCHITECTURES

POOLING_TYPES = ("cls", "mean", "max", "lasttoken", "mean_sqrt_len_tokens", "weightedmean")
_LEGACY_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
_SUPPORTED_MODULES = ("Transformer", "Pooling", "Normalize")


class PoolingConfigError(ValueError):
    """The model's sentence-transformers files ask for something pagedserve cannot do."""


def is_encoder(architecture: str) -> bool:
    return architecture in ENCODER_ARCHITECTURES


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise PoolingConfigError(f"cannot read {path}: {exc}") from None


def sentence_transformers_modules(model_path: str | Path) -> list[dict] | None:
    """modules.json's entries, or None when the model has no sentence-transformers pipeline."""
    path = Path(model_path) / "modules.json"
    if not Path(model_path).is_dir() or not path.is_file():
        return None
    modules = _read_json(path)
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise PoolingConfigError(f"{path} is not a list of modules")
    return modules


def has_sentence_transformers_pooling(model_path: str | Path) -> bool:
    modules = sentence_transformers_modules(model_path) or []
    return any(_module_kind(m) == "Pooling" for m in modules)


def _module_kind(module: dict) -> str:
    """'sentence_transformers.models.Pooling' -> 'Pooling'."""
    return str(module.get("type", "")).rsplit(".", 1)[-1]


def _pooling_mode(config: dict, path: Path) -> str:
    mode = config.get("pooling_mode")
    if mode is None:
        mode = [name for key, name in _LEGACY_POOLING_KEYS.items() if config.get(key)]
    if isinstance(mode, str):
        mode = [mode]
    if len(mode) != 1:
        raise PoolingConfigError(f"{path} asks for pooling modes {mode}; pagedserve pools with exactly one of "
                                 f"{', '.join(POOLING_TYPES)}")
    if mode[0] not in POOLING_TYPES:
        raise PoolingConfigError(f"{path}: pooling mode {mode[0]!r} is not supported; supported: "
                                 f"{', '.join(POOLING_TYPES)}")
    return mode[0]


def _matryoshka(hf_config: Any) -> tuple[int, ...] | None:
    """vLLM's rule: config.json's `matryoshka_dimensions` (a list) or `is_matryoshka: true`."""
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    if dims:
        return tuple(int(d) for d in dims)
    return () if getattr(hf_config, "is_matryoshka", False) else None


def load_pooler_config(model_path: str | Path, architecture: str, hf_config: Any) -> PoolerConfig:
    """Pooling type and normalisation from modules.json + the pooling folder, else the family default."""
    matryoshka = _matryoshka(hf_config)
    modules = sentence_transformers_modules(model_path)
    if modules is None:
        default = "cls" if is_encoder(architecture) else "lasttoken"
        return PoolerConfig(default, True, f"default for {architecture} (no modules.json)", matryoshka)
    pooling_type = None
    normalize = False
    for module in modules:
        kind = _module_kind(module)
        if kind not in _SUPPORTED_MODULES:
            raise PoolingConfigError(
                f"{Path(model_path) / 'modules.json'} lists the sentence-transformers module {module.get('type')!r}, "
                f"which pagedserve does not run (supported: {', '.join(_SUPPORTED_MODULES)})")
        if kind == "Pooling":
            config_path = Path(model_path) / str(module.get("path", "")) / "config.json"
            pooling_type = _pooling_mode(_read_json(config_path), config_path)
        elif kind == "Normalize":
            normalize = True
    if pooling_type is None:
        raise PoolingConfigError(f"{Path(model_path) / 'modules.json'} has no Pooling module")
    return PoolerConfig(pooling_type, normalize, "sentence-transformers modules.json", matryoshka)


def sentence_transformers_max_seq_length(model_path: str | Path) -> int | None:
    """sentence_bert_config.json's max_seq_length: the input length the model was trained for."""
    path = Path(model_path) / "sentence_bert_config.json"
    if not Path(model_path).is_dir() or not path.is_file():
        return None
    value = _read_json(path).get("max_seq_length")
    return int(value) if isinstance(value, int) and value > 0 else None


def default_task(architecture: str, model_path: str | Path) -> str:
    """'embed' for encoders, LM-head-less decoders and models with a sentence-transformers pooling
    module; else 'generate'."""
    if is_encoder(architecture) or architecture in DECODER_BASE_ARCHITECTURES:
        return "embed"
    return "embed" if has_sentence_transformers_pooling(model_path) else "generate"
