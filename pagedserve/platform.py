"""Device handling in one place: which device, which dtype, how many threads.

torch is imported where a function needs it, not with the module: engine set-up resolves the device, dtype
and quantization here, and `pagedserve plan` does that without torch (with `kernels_from_flags`).
"""

from __future__ import annotations

import math
import mmap
import sys
from typing import TYPE_CHECKING

from pagedserve import envs

# The host probes live in memory/probe.py (torch-free, paths as arguments, cgroup v1/v2 and ARM aware);
# re-exported here so that callers keep importing them from pagedserve.platform.
from pagedserve.memory.probe import (cpu_class, cpu_flags, fast_cpu_dtype, native_kernel_isa, read_cores,
                                     usable_cpu_count)
from pagedserve.memory.weight_format import default_file_quantization, native_kernels_expected

if TYPE_CHECKING:
    import torch

__all__ = ["DTYPE_NAMES", "bind_rank_device", "canonical_dtype_name", "check_ranks_fit_device", "configure_threads",
           "cpu_flags", "default_device", "default_quantization", "distributed_backend", "lazy_zeros",
           "native_kernels_class", "native_kernels_isa", "native_kernels_run", "read_cores", "resolve_device",
           "resolve_dtype", "torch_dtype", "usable_cpu_count"]

# The dtype names accepted, each -> the torch dtype's name.
DTYPE_NAMES = {
    "float32": "float32", "float": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16", "half": "float16",
}


def default_device() -> str:
    """"cuda" where torch sees a GPU, else "cpu". A CPU-only torch wheel (version "+cpu") never does: that
    is known from its metadata, without importing torch."""
    if "torch" not in sys.modules and _torch_is_cpu_only_build():
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_device(requested: str) -> str:
    """--device: "auto" -> default_device(); "cpu" or "cuda" as given, where it exists (ValueError naming the fix
    otherwise)."""
    if requested == "auto":
        return default_device()
    if requested not in ("cpu", "cuda"):
        raise ValueError(f"--device must be auto, cpu or cuda, got {requested!r}")
    if requested == "cuda" and default_device() != "cuda":
        version = _torch_version()
        build = f"torch {version}" if version else "torch"
        raise ValueError(f"--device cuda: {build} sees no GPU here (a CPU-only build, or no driver); use --device "
                         "cpu (or auto), or install the torch build for your CUDA version")
    return requested


def _torch_version() -> str | None:
    """The installed torch's version (from its package metadata, without importing it), or None."""
    from importlib import metadata

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def _torch_is_cpu_only_build() -> bool:
    return (_torch_version() or "").endswith("+cpu")


def torch_dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, canonical_dtype_name(name))


def canonical_dtype_name(name: str) -> str:
    if not isinstance(name, str):  # a torch.dtype, as vLLM's LLM(dtype=torch.bfloat16) takes it
        name = str(name).removeprefix("torch.")
    try:
        return DTYPE_NAMES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of auto, {', '.join(sorted(DTYPE_NAMES))}; got {name!r}") from None


def native_kernels_run(kernels_from_flags: bool = False) -> bool:
    """Whether pagedserve's native CPU kernels run in this process: built (once per machine) and loaded by
    pagedserve.kernels, which imports torch; with `kernels_from_flags`, told from the CPU's flags alone
    (memory/weight_format.native_kernels_expected: nothing built, loaded or imported; it assumes the
    library builds where the CPU has an ISA it is written for). `pagedserve plan` asks the latter."""
    if kernels_from_flags:
        return native_kernels_expected(cpu_flags(), envs.cpu_kernels_enabled())
    from pagedserve.kernels import cpu_kernels

    return cpu_kernels() is not None


def native_kernels_isa(kernels_from_flags: bool = False) -> str | None:
    """The ISA of the native kernels that run in this process ("avx512", "avx2"), None where none do; with
    `kernels_from_flags`, told from the CPU's flags and PAGEDSERVE_CPU_ISA alone, as native_kernels_run."""
    if kernels_from_flags:
        if not native_kernels_run(True):
            return None
        return "avx2" if envs.cpu_isa().startswith("avx2") else native_kernel_isa(cpu_flags())
    from pagedserve.kernels import cpu_kernels

    kernels = cpu_kernels()
    return None if kernels is None else kernels.isa


def native_kernels_class(kernels_from_flags: bool = False) -> str | None:
    """The CPU class (probe.cpu_class: "avx512-amx", "avx512-bf16", "avx512", "avx2") whose kernels run in this
    process, None where none do: the CPU's own, or the one of the build PAGEDSERVE_CPU_ISA asks for (its "avx2"
    builds: "avx2"; "avx512-vnni": "avx512", no bf16 dot products). `kernels_from_flags`: see native_kernels_run."""
    isa = native_kernels_isa(kernels_from_flags)
    if isa != "avx512":
        return isa
    if kernels_from_flags:
        return "avx512" if envs.cpu_isa() == "avx512-vnni" else cpu_class(cpu_flags())
    from pagedserve.kernels import cpu_kernels

    kernels = cpu_kernels()
    return "avx512-amx" if kernels.amx else "avx512-bf16" if kernels.bf16_dot else "avx512"


def resolve_dtype(requested: str, device: str, model_dtype: str | None, kernels_from_flags: bool = False) -> str:
    """Pick the serving dtype; `auto` means the fastest one that is numerically safe here.

    On a CPU: the rule of `memory.probe.choose_cpu_dtype` (bfloat16 where the CPU has bf16 dot products
    or pagedserve's native kernels run, which compute bf16 weights in float32; else float32; measured per
    CPU class in benchmarks/RESULTS.md). On CUDA: the checkpoint's 16-bit dtype, float16 for float32
    checkpoints (bfloat16 where the device supports it). `kernels_from_flags`: see native_kernels_run.
    """
    if requested != "auto":
        return canonical_dtype_name(requested)
    if device == "cuda":
        if model_dtype in ("bfloat16", "float16"):
            return model_dtype
        import torch

        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    return fast_cpu_dtype(cpu_flags(), native_kernels=native_kernels_run(kernels_from_flags))


def default_quantization(requested_dtype: str, quantization: str | None, stores_quantized: bool,
                         device: str, kernels_from_flags: bool = False, verifies_drafts: bool = False,
                         ranks: int = 1) -> str | None:
    """The weight quantization to serve with: the user's, or for a checkpoint whose matrices are stored
    block-quantized (a Q4_0/Q8_0/Q4_K/... GGUF) under `--dtype auto` on a CPU with the native kernels "gguf" or
    "int8", as weight_format.default_file_quantization says for their CPU class.
    As every GGUF runner does, such a file is served from its quantized weights instead of being widened to bf16
    or float32 (2-4x the bytes read per token): its 4- and 5-bit matrices as stored (5-6 bits a weight), Q8_0 and
    Q6_K ones requantized per row to int8 (weight_format.FILE_QUANTIZATION). An explicit --dtype still
    dequantizes to that dtype, unless vLLM's --quantization gguf asks for the quantized weights (then "gguf" where
    the file is block-quantized, else none); --quantization int8 requantizes every matrix to int8.
    `kernels_from_flags`: see native_kernels_run; `verifies_drafts`: the model verifies speculative drafts (1 + k rows
    a step: default_file_quantization says why that matters); `ranks`: tensor-parallel ranks, which split the
    matrices by rows or columns, where a GGUF's blocks are not split: they serve the file as int8 rows instead."""
    if quantization == "gguf":  # the blocks, asked for
        if not (stores_quantized and device == "cpu" and native_kernels_run(kernels_from_flags)):
            return None
        return "gguf" if ranks == 1 else "int8"
    if quantization is not None or requested_dtype != "auto" or not stores_quantized or device != "cpu":
        return quantization
    kernels_class = native_kernels_class(kernels_from_flags)
    if kernels_class is None:
        return None
    return "int8" if ranks > 1 else default_file_quantization(kernels_class, verifies_drafts)


def distributed_backend(device: str) -> str:
    """The torch.distributed backend for tensor-parallel ranks on `device`: NCCL between GPUs, gloo on CPUs."""
    return "nccl" if device == "cuda" else "gloo"


def check_ranks_fit_device(device: str, ranks: int) -> None:
    """ValueError naming the fix when `ranks` tensor-parallel ranks need more GPUs than this machine has (each
    rank runs on its own GPU, bind_rank_device); CPU ranks split the cores and always fit."""
    if device != "cuda" or ranks <= 1:
        return
    import torch

    gpus = torch.cuda.device_count()
    if ranks > gpus:
        raise ValueError(f"--tensor-parallel-size {ranks} runs one rank per GPU and this machine has {gpus}; use "
                         f"--tensor-parallel-size {gpus} or fewer, or --device cpu to split the model over CPU cores")


def bind_rank_device(device: str, rank: int) -> str:
    """The device tensor-parallel rank `rank` runs on (on CUDA: GPU `rank`, made this process's current one)."""
    if device != "cuda":
        return device
    import torch

    torch.cuda.set_device(rank)
    return f"cuda:{rank}"


def configure_threads(num_threads: int) -> int:
    """Set torch's intra-op thread count (CPU); returns the count it had."""
    import torch

    previous = torch.get_num_threads()
    if previous != num_threads:
        torch.set_num_threads(num_threads)
    return previous


def release_free_heap() -> None:
    """Hand the C heap's free pages back to the OS (glibc `malloc_trim`; a no-op elsewhere). Loading frees
    many large temporaries (fused and unpacked copies of weights) that glibc keeps mapped otherwise:
    ~120 MB of resident memory for the Qwen2.5-0.5B-shaped bf16 model (1.50 -> 1.38 GB after start)."""
    from pagedserve.memory.rss import libc_malloc_trim

    trim = libc_malloc_trim()
    if trim is not None:
        trim()


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    """A zero tensor that costs memory only where it is written (CPU: an anonymous mmap, whose pages the
    OS zero-fills on first touch); on a GPU an ordinary torch.zeros."""
    import torch

    if device != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    num_bytes = math.prod(shape) * dtype.itemsize
    if num_bytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buffer = mmap.mmap(-1, num_bytes)  # the tensor keeps the mapping alive
    return torch.frombuffer(buffer, dtype=dtype).view(shape)
