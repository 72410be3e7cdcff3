"""Which kernels a model runs: chosen once per model at load, held by one object that every layer consults.

- Linears (`linear_kind`, the vocabulary the memory plan sizes weights by): "packed" (bf16 on pagedserve's
  native kernel where it runs, else oneDNN's blocked layout), "int8" (weight-only int8: the native kernel
  where it runs, else torch's `_weight_int8pack_mm`), "plain" (`F.linear`: the reference path, GPUs).
- `native`: pagedserve's C kernels for this CPU's ISA (pagedserve/kernels), or None (torch ops). Besides
  the linears they run RMSNorm (+ residual), SiLU x up, rotary + KV write, paged decode attention and the
  decode stack, for models whose sizes their vectors fit (`decoder_kernels`).
Layers receive what they run from here (`make_linear`, `decoder_kernels`); none of them decides again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedserve.kernels import ACTIVATION_DTYPES, CpuKernels, cpu_kernels
from pagedserve.layers.linear import Int8Linear, PackedLinear, PlainLinear, QuantizedWeight, packing_supported

SUPPORTED_QUANTIZATION = (None, "int8")


@dataclass(frozen=True)
class KernelBackend:
    device: str
    dtype: torch.dtype
    linear_kind: str  # "packed", "int8" or "plain"
    native: CpuKernels | None  # the native kernels where they run for this device and dtype

    @classmethod
    def choose(cls, device: str, dtype: torch.dtype, quantization: str | None = None,
               reference: bool = False) -> KernelBackend:
        """The backend for weights on `device` in `dtype`; `reference` forces torch ops with F.linear."""
        if quantization not in SUPPORTED_QUANTIZATION:
            raise ValueError(f"quantization {quantization!r} is not supported; supported: int8")
        native = None
        if not reference and device == "cpu" and dtype in ACTIVATION_DTYPES:
            native = cpu_kernels()
        if quantization == "int8":
            kind = "int8"
        elif reference:
            kind = "plain"
        elif (native is not None and dtype == torch.bfloat16) or packing_supported(device, dtype):
            kind = "packed"
        else:
            kind = "plain"
        return cls(device, dtype, kind, native)

    @property
    def native_bf16_linears(self) -> bool:
        """bf16 linears run pagedserve's kernel (its packed layout; a tied embedding reads rows from it)."""
        return self.linear_kind == "packed" and self.native is not None and self.dtype == torch.bfloat16

    def make_linear(self, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None) -> nn.Module:
        """The linear layer this backend runs for `weight` [out, in] (+ bias)."""
        bias = None if bias is None else bias.detach()
        in_features = weight.shape[1]
        if isinstance(weight, QuantizedWeight) and self.linear_kind != "int8":
            raise ValueError(f"an int8 weight cannot back a {self.linear_kind!r} linear")
        if self.linear_kind == "int8":
            return Int8Linear(weight, bias, self.native if in_features % 64 == 0 else None)
        weight = weight.detach()
        if self.linear_kind == "plain":
            return PlainLinear(weight, bias)
        return PackedLinear(weight, bias, self.native if self.native_bf16_linears and in_features % 16 == 0 else None)

    def decoder_kernels(self, hidden: int, intermediate: int, head_dim: int) -> CpuKernels | None:
        """The native kernels for a decoder's norms, SiLU, rotary and attention, where its sizes fit them
        (multiples of 16 for their vectors, head_dim <= 256); the reference path ("plain") uses none."""
        if self.native is None or self.linear_kind == "plain":
            return None
        if any(d % 16 for d in (hidden, intermediate, head_dim)) or head_dim > 256:
            return None
        return self.native

    def describe(self) -> str:
        """One line for the start-up log and doctor."""
        where = f"native {self.native.isa} kernels" if self.native is not None else "torch ops"
        return f"{where}, {self.linear_kind} linears, {str(self.dtype).removeprefix('torch.')} on {self.device}"
