"""Device handling in one place: which device, which dtype, how many threads."""

from __future__ import annotations

import ctypes
import math
import mmap

import torch

# The host probes live in memory/probe.py (torch-free, paths as arguments, cgroup v1/v2 and ARM aware);
# re-exported here so that callers keep importing them from pagedserve.platform.
from pagedserve.memory.probe import cpu_flags, fast_cpu_dtype, usable_cpu_count

__all__ = ["DTYPES", "bind_rank_device", "canonical_dtype_name", "configure_threads", "cpu_flags", "default_device",
           "default_quantization", "distributed_backend",
           "lazy_zeros", "resolve_dtype", "torch_dtype", "usable_cpu_count"]

DTYPES = {
    "float32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16,
}


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def torch_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of auto, {', '.join(sorted(DTYPES))}; got {name!r}") from None


def canonical_dtype_name(name: str) -> str:
    return str(torch_dtype(name)).removeprefix("torch.")


def resolve_dtype(requested: str, device: str, model_dtype: str | None) -> str:
    """Pick the serving dtype; `auto` means the fastest one that is numerically safe here.

    On a CPU: the rule of `memory.probe.choose_cpu_dtype` (bfloat16 where the CPU has bf16 dot products
    or pagedserve's native kernels run, which compute bf16 weights in float32; else float32; measured per
    CPU class in benchmarks/RESULTS.md). On CUDA: the checkpoint's 16-bit dtype, float16 for float32
    checkpoints (bfloat16 where the device supports it).
    """
    if requested != "auto":
        return canonical_dtype_name(requested)
    if device == "cuda":
        if model_dtype in ("bfloat16", "float16"):
            return model_dtype
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    from pagedserve.kernels import cpu_kernels

    return fast_cpu_dtype(cpu_flags(), native_kernels=cpu_kernels() is not None)


def default_quantization(requested_dtype: str, quantization: str | None, stores_quantized: bool,
                         device: str) -> str | None:
    """The weight quantization to serve with: the user's, or "int8" for a checkpoint whose matrices are
    stored block-quantized (a Q8_0/Q4_K/... GGUF) under `--dtype auto` on a CPU with the native kernels.
    As every GGUF runner does, such a file is served from its quantized weights (requantized per row to
    int8: 1 byte a weight) instead of being widened to bf16 or float32 (2-4x the bytes read per token).
    An explicit --dtype still dequantizes to that dtype."""
    if quantization is not None or requested_dtype != "auto" or not stores_quantized or device != "cpu":
        return quantization
    from pagedserve.kernels import cpu_kernels

    return "int8" if cpu_kernels() is not None else None


def distributed_backend(device: str) -> str:
    """The torch.distributed backend for tensor-parallel ranks on `device`: NCCL between GPUs, gloo on CPUs."""
    return "nccl" if device == "cuda" else "gloo"


def bind_rank_device(device: str, rank: int) -> str:
    """The device tensor-parallel rank `rank` runs on (on CUDA: GPU `rank`, made this process's current one)."""
    if device != "cuda":
        return device
    torch.cuda.set_device(rank)
    return f"cuda:{rank}"


def configure_threads(num_threads: int) -> None:
    """Set torch's intra-op thread count (CPU) once per process."""
    if torch.get_num_threads() != num_threads:
        torch.set_num_threads(num_threads)


def release_free_heap() -> None:
    """Hand the C heap's free pages back to the OS (glibc `malloc_trim`; a no-op elsewhere). Loading frees
    many large temporaries (fused and unpacked copies of weights) that glibc keeps mapped otherwise:
    ~120 MB of resident memory for the Qwen2.5-0.5B-shaped bf16 model (1.50 -> 1.38 GB after start)."""
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim  # glibc's soname: no library search (it runs ldconfig)
    except (OSError, AttributeError):
        return
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    """A zero tensor that costs memory only where it is written (CPU: an anonymous mmap, whose pages the
    OS zero-fills on first touch); on a GPU an ordinary torch.zeros."""
    if device != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    num_bytes = math.prod(shape) * dtype.itemsize
    if num_bytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buffer = mmap.mmap(-1, num_bytes)  # the tensor keeps the mapping alive
    return torch.frombuffer(buffer, dtype=dtype).view(shape)
