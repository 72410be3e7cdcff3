"""RMSNorm with transformers' Llama/Qwen rounding: normalise in float32, round to the model dtype,
then scale by the weight in the model dtype (bit for bit: tests/models/test_layers.py)."""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.kernels import CpuKernels


class RMSNorm(nn.Module):
    gain_in_float32 = False  # the native kernel's weight is a float32 gain applied before the rounding (Gemma's)

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.kernels: CpuKernels | None = None  # set by the model's prepare() where the native kernels run

    def native_weight(self) -> torch.Tensor:
        """What the native kernel scales by: the weight (Gemma's norm: its float32 1 + weight)."""
        return self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None and x.dim() == 2 and x.is_contiguous():
            return self.kernels.rms_norm(x, self.native_weight(), self.eps, gain=self.gain_in_float32)[0]
        return self.torch_forward(x)

    def torch_forward(self, x: torch.Tensor) -> torch.Tensor:
        # Written out with in-place steps: torch's rms_norm is a composite op on CPU with more dispatches.
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True).add_(self.eps))
        if x.dtype != torch.float32:
            normed = normed.to(x.dtype)
        return normed.mul_(self.weight)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual), the sum rounded to the model dtype as transformers does;
        with no residual yet (the first layer): (norm(x), x)."""
        if residual is None:
            return self.forward(x), x
        if self.kernels is not None and x.is_contiguous() and residual.is_contiguous():
            return self.kernels.rms_norm(x, self.native_weight(), self.eps, residual, gain=self.gain_in_float32)
        residual = x + residual
        return self.forward(residual), residual
