"""Reference formulas the native kernels and layers are compared against (test-only code)."""

from __future__ import annotations

import torch


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The explicit formula transformers uses."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def unpack_bf16(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The inverse of CpuKernels.pack_bf16: [N/NB, K/2, NB, 2] -> [N, K]."""
    blocks, pairs, nb = packed.shape[:3]
    return packed.permute(0, 2, 1, 3).reshape(blocks * nb, pairs * 2)[:out_features]
