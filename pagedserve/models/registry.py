"""Architecture name (config.json `architectures[0]`) -> model class."""

from __future__ import annotations

from torch import nn

from pagedserve.models.llama import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM

CAUSAL_LM_ARCHITECTURES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def model_class(architecture: str) -> type[nn.Module]:
    try:
        return CAUSAL_LM_ARCHITECTURES[architecture]
    except KeyError:
        raise ValueError(f"architecture {architecture!r} is not supported; supported: "
                         f"{', '.join(sorted(CAUSAL_LM_ARCHITECTURES))}") from None
