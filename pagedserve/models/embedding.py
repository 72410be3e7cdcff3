"""Models for the embed task: BERT encoders, and our decoders without their LM head (Qwen3-Embedding style).

An embedding checkpoint of a decoder is often saved from the base model (`Qwen3Model`): its tensor
names lack the `model.` prefix and there is no `lm_head`. The embedding variant accepts both layouts
and skips any LM head, so a chat checkpoint can be used as an embedder too (`--task embed`).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from pagedserve.models.bert import BertModel
from pagedserve.models.llama import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from pagedserve.models.pooling_config import EMBEDDING_ARCHITECTURE_NAMES


def as_embedding_model(cls: type[LlamaForCausalLM]) -> type[LlamaForCausalLM]:
    """`cls` minus its LM head; forward() returns the final-norm hidden states [T, hidden]."""

    class EmbeddingModel(cls):  # type: ignore[valid-type, misc]
        def __init__(self, cfg: Any, max_position: int) -> None:
            super().__init__(cfg, max_position)
            if hasattr(self, "lm_head"):
                del self.lm_head

        def prepare(self, backend: Any) -> None:
            """The decoder layers' preparation (the KernelBackend models/loader.py chose); no LM head."""
            self.prepare_decoder(backend)

        def compute_logits(self, hidden: Any) -> Any:
            raise RuntimeError("an embedding model has no LM head")

        def checkpoint_name_to_param(self, name: str) -> str | None:
            if name.startswith("lm_head.") or "rotary_emb.inv_freq" in name:
                return None
            return name if name.startswith("model.") else f"model.{name}"

    EmbeddingModel.__name__ = EmbeddingModel.__qualname__ = cls.__name__.replace("ForCausalLM", "EmbeddingModel")
    return EmbeddingModel


_LLAMA = as_embedding_model(LlamaForCausalLM)
_QWEN2 = as_embedding_model(Qwen2ForCausalLM)
_QWEN3 = as_embedding_model(Qwen3ForCausalLM)

EMBEDDING_ARCHITECTURES: dict[str, type[nn.Module]] = {
    "BertModel": BertModel,
    "LlamaForCausalLM": _LLAMA, "LlamaModel": _LLAMA,
    "MistralForCausalLM": _LLAMA, "MistralModel": _LLAMA,
    "Qwen2ForCausalLM": _QWEN2, "Qwen2Model": _QWEN2,
    "Qwen3ForCausalLM": _QWEN3, "Qwen3Model": _QWEN3,
}
if set(EMBEDDING_ARCHITECTURES) != EMBEDDING_ARCHITECTURE_NAMES:  # the names the start-up checks, torch-free
    raise AssertionError("models/pooling_config.EMBEDDING_ARCHITECTURE_NAMES must list EMBEDDING_ARCHITECTURES")
