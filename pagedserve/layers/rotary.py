"""Rotary position embedding with the cos/sin table precomputed once for every position."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def rope_parameters(hf_config: Any) -> dict:
    """rope settings from transformers-5 `rope_parameters` or the older `rope_theta` + `rope_scaling`."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = getattr(hf_config, "rope_scaling", None)
    if scaling and not params.get("rope_type"):
        params.update(scaling)
        params.setdefault("rope_type", scaling.get("type"))
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
    params.setdefault("rope_type", "default")
    return params


def inverse_frequencies(hf_config: Any, head_dim: int, max_position: int | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim/2] float32, attention scaling), computed as transformers does. Dynamic NTK scaling,
    which transformers recomputes for each sequence's length, is fixed as vLLM fixes it where `max_position`
    (the served context) goes past the trained one: the base scaled for factor x the trained positions; within
    the trained context it is plain rope, as transformers' is there."""
    params = rope_parameters(hf_config)
    rope_type = params.get("rope_type") or "default"
    if rope_type == "default":
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
        return 1.0 / (params["rope_theta"] ** exponents), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope type {rope_type!r} is not supported; supported: default, "
                         f"{', '.join(sorted(ROPE_INIT_FUNCTIONS))}")
    extra = {}
    trained = getattr(hf_config, "max_position_embeddings", None)
    if rope_type == "dynamic" and max_position is not None and trained and max_position > trained:
        extra["seq_len"] = int(trained * float(params.get("factor", 1.0)))
    with torch.device("cpu"):  # the loader builds the model under a meta-device context; these must be real
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"), **extra)
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    def __init__(self, hf_config: Any, head_dim: int, max_position: int) -> None:
        super().__init__()
        inv_freq, scaling = inverse_frequencies(hf_config, head_dim, max_position)
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
    """x: [T, H, D] (query and key heads may be stacked); cos/sin: [T, 1, D]."""
    return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
