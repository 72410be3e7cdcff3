"""Which kernels a model runs: chosen once per model at load, held by one object that every layer consults.

- Linears (`linear_kind`, the vocabulary the memory plan sizes weights by): "packed" (bf16 on pagedserve's
  native kernel where it runs, else oneDNN's blocked layout), "int8" (weight-only int8: the native kernel
  where it runs, else torch's `_weight_int8pack_mm`), "plain" (`F.linear`: the reference path, GPUs). The
  rule is memory/weight_format.py's, which the memory plan applies too, without torch.
- `native`: pagedserve's C kernels for this CPU's ISA (pagedserve/kernels), or None (torch ops). Besides
  the linears they run RMSNorm (+ residual), SiLU or GELU (tanh) x up, rotary + KV write, paged decode attention
  and the decode stack, for models whose sizes their vectors fit (`decoder_kernels`); prefill chunks' attention
  too, but where torch's SDPA measured faster (`sdpa_prefill`).
Layers receive what they run from here (`make_linear`, `decoder_kernels`); none of them decides again.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from pagedserve.kernels import CpuKernels, cpu_kernels
from pagedserve.layers.linear import (BlockLinear, BlockWeight, Int8Linear, PackedLinear, PlainLinear, QuantizedWeight,
                                     fuse_biases, fuse_rows, packing_supported, weight_of)
from pagedserve.memory import probe, weight_format


@dataclass(frozen=True)
class KernelBackend:
    device: str
    dtype: torch.dtype
    linear_kind: str  # "packed", "int8" or "plain"
    native: CpuKernels | None  # the native kernels where they run for this device and dtype
    # called with each weight's element count as a linear is made from it (the loader's progress while packing)
    on_weight: Callable[[int], None] | None = field(default=None, compare=False)

    @classmethod
    def choose(cls, device: str, dtype: torch.dtype, quantization: str | None = None,
               reference: bool = False) -> KernelBackend:
        """The backend for weights on `device` in `dtype`; `reference` forces torch ops with F.linear.
        memory/weight_format.py's rule, on the kernels this process loads and oneDNN's probe."""
        weight_format.check_quantization(quantization)
        name = _dtype_name(dtype)
        native = cpu_kernels() if weight_format.wants_native_kernels(device, name, reference) else None
        kind = weight_format.linear_kind(name, quantization, reference, native is not None,
                                         lambda: onednn_packs(device, dtype))
        return cls(device, dtype, kind, native)

    @property
    def native_bf16_linears(self) -> bool:
        """bf16 linears run pagedserve's kernel (its packed layout; a tied embedding reads rows from it)."""
        return weight_format.native_bf16_linears(self.linear_kind, self.native is not None, _dtype_name(self.dtype))

    def _implementation(self, in_features: int) -> tuple[str, bool]:
        """(what a linear with `in_features` runs, whether that is the native kernel)."""
        runs_native = weight_format.native_linear(self.linear_kind, self.native_bf16_linears, self.native is not None,
                                                  in_features)
        return weight_format.linear_implementation(self.linear_kind, runs_native,
                                                   lambda: onednn_packs(self.device, self.dtype)), runs_native

    def make_linear(self, weight: torch.Tensor | QuantizedWeight | BlockWeight, bias: torch.Tensor | None
                    ) -> nn.Module:
        """The linear layer this backend runs for `weight` [out, in] (+ bias). GGUF blocks (BlockWeight) run the
        native block kernel where the native int8 kernels run, else become int8."""
        bias = None if bias is None else bias.detach()
        if isinstance(weight, (QuantizedWeight, BlockWeight)) and self.linear_kind != "int8":
            raise ValueError(f"an int8 weight cannot back a {self.linear_kind!r} linear")
        implementation, runs_native = self._implementation(weight.shape[1])
        native = self.native if runs_native else None
        if isinstance(weight, BlockWeight):  # any in_features (a multiple of 32) on the block kernel
            if self.native is not None:
                self._made(weight.shape[0] * weight.shape[1])
                return BlockLinear(weight, bias, self.native)
            weight = weight.to_int8()
        if self.linear_kind == "int8":
            linear = Int8Linear(weight, bias, native)
        elif implementation == "plain":
            linear = PlainLinear(weight.detach(), bias)
        else:
            linear = PackedLinear(weight.detach(), bias, native)
        self._made(weight.shape[0] * weight.shape[1])
        return linear

    def _made(self, elements: int) -> None:
        if self.on_weight is not None:
            self.on_weight(elements)

    def make_fused_linear(self, *linears: nn.Linear) -> nn.Module:
        """One linear for several that read the same input (q/k/v, gate/up), their rows stacked as fuse_rows
        stacks them. The native bf16 kernel packs the parts straight into one packed weight: a stacked copy
        in between cost ~0.6 s of a 0.5B model's start on the AVX2 box (fresh pages, written twice)."""
        weights = [weight_of(linear) for linear in linears]  # "native-bf16": bf16 tensors, native kernels
        if (self._implementation(weights[0].shape[1])[0] == "native-bf16"
                and self.native.can_pack_parts([w.shape[0] for w in weights])):
            bias = fuse_biases(*linears)
            linear = PackedLinear([w.detach() for w in weights], None if bias is None else bias.detach(), self.native)
            self._made(sum(w.shape[0] * w.shape[1] for w in weights))
            return linear
        return self.make_linear(*fuse_rows(*linears, native=self.native))

    @functools.cached_property
    def sdpa_prefill(self) -> bool:
        """Prefill chunks' attention on torch's SDPA though the native kernels run (probe.sdpa_prefill: measured
        faster for this CPU class and dtype). Decided once per backend (every attention layer reads it)."""
        return self.native is not None and probe.sdpa_prefill(probe.cpu_flags(), _dtype_name(self.dtype),
                                                              self.native.batch_invariant)

    def decoder_kernels(self, hidden: int, intermediate: int, head_dim: int) -> CpuKernels | None:
        """The native kernels for a decoder's norms, MLP gate, rotary and attention, where its sizes fit them
        (weight_format.decoder_kernels_fit); the reference path ("plain") uses none."""
        if self.native is None or self.linear_kind == "plain":
            return None
        return self.native if weight_format.decoder_kernels_fit(hidden, intermediate, head_dim) else None

    def describe(self) -> str:
        """One line for the start-up log and doctor."""
        where = "torch ops"
        if self.native is not None:
            where = f"native {self.native.isa} kernels" + kernel_note(self.native)
        return f"{where}, {self.linear_kind} linears, {_dtype_name(self.dtype)} on {self.device}"


def kernel_note(native: CpuKernels) -> str:
    """What of the linears runs on AMX tiles or AVX-VNNI, for the start-up log ("" where none does)."""
    if native.avx_vnni:
        return " (int8 linears on AVX-VNNI)"
    if not native.amx:
        return ""
    return " (bf16 and int8 linears on AMX tiles)" if native.amx_int8 else " (bf16 linears on AMX tiles)"


@functools.cache
def onednn_packs(device: str, dtype: torch.dtype) -> bool:
    """packing_supported, probed once per process for each device and dtype."""
    return packing_supported(device, dtype)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
