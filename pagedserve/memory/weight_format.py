"""Which format a model's linear weights take, the rule written once and without torch.

`layers/backend.py`'s `KernelBackend.choose` applies it to what this process has (the native kernels it
loaded, oneDNN's probe matmul); the memory plan (engine/memory_plan.py, `pagedserve plan`) applies it to what
the CPU's flags promise, before anything is built or loaded, so the two cannot follow different rules.

Linear kinds (the vocabulary of memory/sizes.prepared_weight_bytes): "packed" (bf16 on pagedserve's native
kernel where it runs, else oneDNN's blocked layout), "int8" (weight-only int8: the native kernel where it
runs, else torch's `_weight_int8pack_mm`), "plain" (`F.linear`: the reference path, GPUs).
"""

from __future__ import annotations

import platform
from collections.abc import Callable
from dataclasses import dataclass

from pagedserve.memory.probe import native_kernel_isa

SUPPORTED_QUANTIZATION = (None, "int8")
# The activation dtypes pagedserve's native kernels take (pagedserve.kernels.ACTIVATION_DTYPES, by name).
NATIVE_DTYPES = ("bfloat16", "float32")
# The dtypes oneDNN's packed linear is tried for (layers/linear.py's packing_supported).
ONEDNN_PACKED_DTYPES = ("bfloat16", "float32")


def check_quantization(quantization: str | None) -> None:
    if quantization not in SUPPORTED_QUANTIZATION:
        raise ValueError(f"quantization {quantization!r} is not supported; supported: int8")


def wants_native_kernels(device: str, dtype: str, reference: bool) -> bool:
    """Whether a model in `dtype` on `device` runs the native kernels where they load (not on the
    reference path, which is torch ops only)."""
    return not reference and device == "cpu" and dtype in NATIVE_DTYPES


def onednn_may_pack(device: str, dtype: str) -> bool:
    """Whether oneDNN's packed linear is tried at all; where it is, packing_supported probes it."""
    return device == "cpu" and dtype in ONEDNN_PACKED_DTYPES


def linear_kind(dtype: str, quantization: str | None, reference: bool, native: bool,
                onednn_packs: Callable[[], bool]) -> str:
    """"int8" when quantized; else "plain" on the reference path; else "packed" for bf16 on the native
    kernels (`native`: they run for this model) or where oneDNN packs (`onednn_packs`, asked only then)."""
    if quantization == "int8":
        return "int8"
    if reference:
        return "plain"
    if (native and dtype == "bfloat16") or onednn_packs():
        return "packed"
    return "plain"


def native_bf16_linears(kind: str, native: bool, dtype: str) -> bool:
    """bf16 linears run pagedserve's kernel (its packed layout; a tied embedding reads rows from it)."""
    return kind == "packed" and native and dtype == "bfloat16"


def native_kernels_expected(flags: set[str], enabled: bool = True, machine: str | None = None) -> bool:
    """Whether pagedserve.kernels.cpu_kernels() gives kernels on this host, told from the CPU's flags alone:
    enabled (PAGEDSERVE_CPU_KERNELS, envs.cpu_kernels_enabled()), an x86-64 machine and an ISA they are
    written for (probe.native_kernel_isa). It assumes the library then builds and loads: nothing is
    compiled or loaded here, so a host without a C compiler (or a failed build) is predicted wrongly."""
    machine = platform.machine() if machine is None else machine
    return enabled and machine.lower() in ("x86_64", "amd64") and native_kernel_isa(flags) is not None


@dataclass(frozen=True)
class WeightFormat:
    linear_kind: str  # "packed", "int8" or "plain"
    native_bf16_linears: bool


def expected_weight_format(device: str, dtype: str, quantization: str | None, reference: bool,
                           native_kernels: bool) -> WeightFormat:
    """The format KernelBackend.choose picks, for the memory plan: `native_kernels` as
    native_kernels_expected says, and oneDNN assumed to pack wherever it is tried (choose also checks a
    probe matmul, which needs torch; it fails only on a torch built without oneDNN)."""
    check_quantization(quantization)
    native = native_kernels and wants_native_kernels(device, dtype, reference)
    kind = linear_kind(dtype, quantization, reference, native, lambda: onednn_may_pack(device, dtype))
    return WeightFormat(kind, native_bf16_linears(kind, native, dtype))
