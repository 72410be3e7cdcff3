"""Architecture name (config.json `architectures[0]`) -> model class."""

from __future__ import annotations

from torch import nn

from pagedserve.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM, GemmaForCausalLM
from pagedserve.models.llama import (GraniteForCausalLM, LlamaForCausalLM, MixtralForCausalLM, Phi3ForCausalLM,
                                     Qwen2ForCausalLM, Qwen2MoeForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM,
                                     SmolLM3ForCausalLM)

CAUSAL_LM_ARCHITECTURES: dict[str, type[nn.Module]] = {
    "GemmaForCausalLM": GemmaForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "GraniteForCausalLM": GraniteForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "SmolLM3ForCausalLM": SmolLM3ForCausalLM,
}


def model_class(architecture: str, task: str = "generate") -> type[nn.Module]:
    """The class for `architecture`; task "embed" gives the embedding variant (models/embedding.py)."""
    if task == "embed":
        from pagedserve.models.embedding import EMBEDDING_ARCHITECTURES

        table = EMBEDDING_ARCHITECTURES
    else:
        table = CAUSAL_LM_ARCHITECTURES
    try:
        return table[architecture]
    except KeyError:
        hint = " (an embedding model: use --task embed)" if task != "embed" and architecture.endswith("Model") else ""
        raise ValueError(f"architecture {architecture!r} is not supported for task {task!r}{hint}; supported: "
                         f"{', '.join(sorted(table))}") from None
