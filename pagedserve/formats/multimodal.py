"""Multimodal checkpoints served as their language model alone: text in, text out (no images).

A checkpoint such as google/gemma-3-4b-it holds a vision tower, a projector and a language model under one
config (`text_config`) and one set of files. pagedserve serves the language model: its config is the wrapper's
`text_config` under the language model's own architecture (models/registry.py), its tensors are the wrapper's
`language_model.` ones renamed as the language model's checkpoint names them, and the vision parts are skipped
when sizing (memory/checkpoint.py), checking (models/validate.py) and loading (models/loader.py) alike. Chat
messages with image parts are refused as for any text model. Torch-free: validation and the plan read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LanguageModelOf:
    architecture: str  # the language model's class in models/registry.py
    renames: tuple[tuple[str, str], ...]  # (checkpoint-name prefix, the language model's prefix)
    skipped: tuple[str, ...]  # checkpoint-name prefixes of the parts not served


TEXT_ONLY: dict[str, LanguageModelOf] = {
    # The hub's files name the language model language_model.model.* (transformers 5 loads model.language_model.*)
    "Gemma3ForConditionalGeneration": LanguageModelOf(
        "Gemma3ForCausalLM",
        (("language_model.model.", "model."), ("model.language_model.", "model."),
         ("language_model.lm_head.", "lm_head.")),
        ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")),
}

_RENAMES = tuple(rename for wrapper in TEXT_ONLY.values() for rename in wrapper.renames)
_SKIPPED = tuple(prefix for wrapper in TEXT_ONLY.values() for prefix in wrapper.skipped)


def language_model_name(name: str) -> str | None:
    """A checkpoint tensor's name as the language model's checkpoint has it; None for a part not served. Names of
    plain (text) checkpoints come back as they are: no wrapper's prefix is one of theirs."""
    if name.startswith(_SKIPPED):
        return None
    for prefix, replacement in _RENAMES:
        if name.startswith(prefix):
            return replacement + name[len(prefix):]
    return name


def text_only_config(hf_config: Any) -> Any:
    """The language model's transformers config for a TEXT_ONLY wrapper's (the config itself for any other): its
    text_config, under the language model's architecture, in the wrapper's dtype where it names none."""
    architecture = (getattr(hf_config, "architectures", None) or [None])[0]
    if architecture not in TEXT_ONLY:
        return hf_config
    text = hf_config.text_config
    text.architectures = [TEXT_ONLY[architecture].architecture]
    if getattr(text, "dtype", None) is None:
        text.dtype = getattr(hf_config, "dtype", None)
    return text
