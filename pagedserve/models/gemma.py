"""Gemma, Gemma 2 and Gemma 3 (text) decoders: Llama layers (models/llama.py) with Gemma's parts.

- Norms scale by 1 + weight, in float32, rounded to the model dtype once (GemmaRMSNorm); Gemma 2/3 norm the
  attention and MLP outputs too before they join the residual stream (DecoderSpec.sandwich_norms).
- A GELU-gated MLP (tanh approximation); token embeddings scaled by sqrt(hidden_size) rounded to the model dtype.
- Attention scaled by query_pre_attn_scalar ** -0.5; sliding-window layers as config.layer_types says (Gemma 2:
  every other layer, Gemma 3: five of six); Gemma 2 caps attention scores and logits with tanh (softcapping);
  Gemma 3 has per-head q/k norms and a rotary base of its own for its sliding-window layers.

The linears, norms (ps_rms_norm_gain: Gemma's float32 gain), the GELU gate (ps_gate_mul) and attention (Gemma 2's
scores capped in it) run the backend's kernels as every model's do; Gemma 3's q/k norms run inside the fused rotary.
Decode steps take the native decode stack
(models/llama.py, NativeDecodeStack: gain norms and sandwich norms are its table's flags and columns, the
sliding-window layers a step view of their own). A multimodal Gemma 3 checkpoint is served as its Gemma3ForCausalLM
(formats/multimodal.py).
"""

from __future__ import annotations

from typing import Any

import torch

from pagedserve.distributed.group import TPGroup
from pagedserve.layers.backend import KernelBackend
from pagedserve.layers.norm import RMSNorm
from pagedserve.models.llama import DecoderSpec, LlamaForCausalLM


class GemmaRMSNorm(RMSNorm):
    """transformers' Gemma norm: normalise in float32, scale by 1 + weight in float32, round once (Llama's rounds
    before it scales; the native kernels have both, ps_rms_norm_gain here). The checkpoint holds the weight;
    1 + weight is computed once after loading (prepare)."""

    gain_in_float32 = True

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__(hidden_size, eps)
        self.register_buffer("gain", None, persistent=False)  # a buffer: it moves with the model (.to)

    def prepare(self) -> None:
        self.gain = 1.0 + self.weight.detach().float()

    def native_weight(self) -> torch.Tensor:
        return self.gain

    def torch_forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True).add_(self.eps))
        return normed.mul_(self.gain).to(x.dtype)


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma (1): Llama layers with Gemma's norms, GELU and embedding scale."""

    sandwich_norms = False
    local_rotary = False

    def __init__(self, cfg: Any, max_position: int, tp: TPGroup | None = None) -> None:
        super().__init__(cfg, max_position, tp)
        self.model.embedding_multiplier = cfg.hidden_size ** 0.5
        self.model.embedding_multiplier_rounded = True  # as transformers: sqrt(hidden) in the model dtype
        self.final_softcap: float | None = None

    @classmethod
    def decoder_spec(cls, cfg: Any) -> DecoderSpec:
        bias = bool(getattr(cfg, "attention_bias", False))
        return DecoderSpec(qkv_bias=bias, o_bias=bias, qk_norm=cls.qk_norm, norm=GemmaRMSNorm,
                           activation=cls.activation(cfg), sandwich_norms=cls.sandwich_norms,
                           local_rotary=cls.local_rotary)

    @staticmethod
    def activation(cfg: Any) -> str:
        """The MLP's gate as transformers 5 reads it: Gemma's hidden_act (a legacy "gelu" already turned into the
        tanh GELU by its config), Gemma 2/3's hidden_activation."""
        return getattr(cfg, "hidden_act", None) or "gelu_pytorch_tanh"

    def prepare(self, backend: KernelBackend) -> None:
        super().prepare(backend)
        for module in self.modules():
            if isinstance(module, GemmaRMSNorm):
                module.prepare()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)  # with tensor parallelism: gathered on rank 0, None elsewhere
        if self.final_softcap is not None and logits is not None:
            logits = torch.tanh(logits / self.final_softcap).mul_(self.final_softcap)
        return logits


class Gemma2ForCausalLM(GemmaForCausalLM):
    """Gemma 2: sandwich norms, attention scaled by query_pre_attn_scalar, sliding-window layers, attention and
    final logit softcapping."""

    sandwich_norms = True

    def __init__(self, cfg: Any, max_position: int, tp: TPGroup | None = None) -> None:
        super().__init__(cfg, max_position, tp)
        for layer in self.model.layers:
            layer.self_attn.scale = float(cfg.query_pre_attn_scalar) ** -0.5
            layer.self_attn.softcap = self.attention_softcap(cfg)
        self.final_softcap = getattr(cfg, "final_logit_softcapping", None)

    @staticmethod
    def attention_softcap(cfg: Any) -> float | None:
        return getattr(cfg, "attn_logit_softcapping", None)

    @staticmethod
    def activation(cfg: Any) -> str:
        return getattr(cfg, "hidden_activation", None) or "gelu_pytorch_tanh"


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 (text: the 1B model, and the language model of the larger, multimodal ones): Gemma 2's layers with q/k
    norms, no attention softcapping (transformers passes none whatever the config says), and a rotary of its own
    for the sliding-window layers."""

    qk_norm = True
    local_rotary = True

    @staticmethod
    def attention_softcap(cfg: Any) -> float | None:
        return None
