"""Rotary position embedding with the cos/sin table precomputed once for every position."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from pagedserve.memory.weight_format import rotary_dim

logger = logging.getLogger(__name__)


def rope_parameters(hf_config: Any, layer_type: str | None = None) -> dict:
    """rope settings from transformers-5 `rope_parameters` or the older `rope_theta` + `rope_scaling`;
    `layer_type`: the settings of that kind of layer, where a model has several (Gemma 3's sliding_attention and
    full_attention)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if layer_type is not None and layer_type in params:
        params = dict(params[layer_type])
    elif layer_type == "sliding_attention":  # transformers 4's Gemma 3 config: rope_local_base_freq, no scaling
        return {"rope_type": "default", "rope_theta": float(getattr(hf_config, "rope_local_base_freq", 10000.0))}
    scaling = getattr(hf_config, "rope_scaling", None)
    if scaling and not params.get("rope_type"):
        params.update(scaling)
        params.setdefault("rope_type", scaling.get("type"))
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
    params.setdefault("rope_type", "default")
    return params


def inverse_frequencies(hf_config: Any, head_dim: int, max_position: int | None = None,
                        layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim/2] float32, attention scaling), computed as transformers does. The scalings that
    transformers recomputes for each sequence's length are fixed by `max_position` (the served context), as
    vLLM fixes them: dynamic NTK past the trained context scales the base for factor x the trained positions
    (within it, plain rope, as transformers' is there); LongRoPE (Phi-3) takes its long factors where the
    served context goes past `original_max_position_embeddings`, its short ones (transformers' for sequences
    within it) elsewhere."""
    params = rope_parameters(hf_config, layer_type)
    rope_type = params.get("rope_type") or "default"
    if rope_type == "default":
        dim = rotary_dim(hf_config, head_dim)
        exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
        return 1.0 / (params["rope_theta"] ** exponents), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope type {rope_type!r} is not supported; supported: default, "
                         f"{', '.join(sorted(ROPE_INIT_FUNCTIONS))}")
    nested = layer_type is not None and layer_type in (getattr(hf_config, "rope_parameters", None) or {})
    extra = {"layer_type": layer_type} if nested else {}  # transformers 5's settings per kind of layer
    trained = getattr(hf_config, "max_position_embeddings", None)
    if rope_type == "dynamic" and max_position is not None and trained and max_position > trained:
        extra["seq_len"] = int(trained * float(params.get("factor", 1.0)))
    original = params.get("original_max_position_embeddings") or getattr(hf_config, "original_max_position_embeddings",
                                                                         None)
    if rope_type == "longrope" and max_position is not None and original and max_position > original:
        extra["seq_len"] = max_position
    if rope_type == "longrope":
        logger.info("LongRoPE: the %s factors, as --max-model-len %s is %s original_max_position_embeddings %s "
                    "(transformers takes the long ones only for sequences past it)",
                    "long" if "seq_len" in extra else "short", max_position,
                    "past" if "seq_len" in extra else "within", original)
    with torch.device("cpu"):  # the loader builds the model under a meta-device context; these must be real
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"), **extra)
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    def __init__(self, hf_config: Any, head_dim: int, max_position: int, layer_type: str | None = None) -> None:
        super().__init__()
        inv_freq, scaling = inverse_frequencies(hf_config, head_dim, max_position, layer_type)
        # Built on the CPU even under a meta-device context; the loader moves it to the model's device.
        positions = torch.arange(max_position, dtype=torch.float32, device="cpu")
        freqs = positions[:, None] * inv_freq[None, :]  # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [T, 1, D] for these positions, rounded to the model dtype as transformers does."""
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D] (query and key heads may be stacked); cos/sin: [T, 1, R], R <= D: the first R dimensions of
    each head rotate, the rest pass through (partial rotary)."""
    dim = cos.shape[-1]
    if dim < x.shape[-1]:
        rotated, rest = x.split([dim, x.shape[-1] - dim], dim=-1)
        return torch.cat((rotated * cos + _rotate_half(rotated) * sin, rest), dim=-1)
    return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
