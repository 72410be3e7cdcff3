"""Tensor parallelism in the engine's set-up: the flags checked, the ranks' cores resolved, and the memory
plan made per rank (each rank holds 1/N of the weights and of the KV heads, and the N ranks share this
host's free memory). Pure Python: it runs before anything loads."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from pagedserve.config import ParallelConfig
from pagedserve.distributed.binding import default_binding, format_cores, parse_cpu_binding
from pagedserve.distributed.sharding import ShardLayout, check_tensor_parallel, valid_sizes
from pagedserve.memory.probe import Cores

logger = logging.getLogger(__name__)

ALL_REDUCE_KINDS = ("auto", "shm", "gloo")
# --cpu-binding's words (vLLM's VLLM_CPU_OMP_THREADS_BIND values): auto, the default binding; nobind, every rank
# may run on every usable core.
SPECIAL_BINDINGS = ("auto", "nobind")


def check_parallel_args(tensor_parallel_size: int, cpu_binding: str | None, all_reduce: str) -> None:
    """ValueError naming the flag, before the port opens."""
    if tensor_parallel_size < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1, got {tensor_parallel_size}")
    if all_reduce not in ALL_REDUCE_KINDS:
        raise ValueError(f"--tp-all-reduce must be one of {', '.join(ALL_REDUCE_KINDS)}, got {all_reduce!r}")
    if cpu_binding is not None and cpu_binding.strip().lower() not in SPECIAL_BINDINGS:
        parse_cpu_binding(cpu_binding, tensor_parallel_size)


def resolve_parallel(args: Any, hf_config: Any, task: str, architecture: str, cores: Cores
                     ) -> tuple[ParallelConfig, int | None]:
    """(ParallelConfig, torch threads per rank or None to keep the single-process default). By default the
    ranks split `cores.thread_cpus` (one logical CPU per physical core), so no two ranks share a core."""
    size = args.tensor_parallel_size
    word = (args.cpu_binding or "auto").strip().lower()
    if size == 1:  # one process: bound where cores are named (vLLM's VLLM_CPU_OMP_THREADS_BIND does it too)
        if word in SPECIAL_BINDINGS:
            return ParallelConfig(), None
        cores = named_cores(args.cpu_binding, 1, cores)[0]
        return ParallelConfig(cpu_binding=(tuple(cores),)), args.num_threads or len(cores)
    if task != "generate":
        raise ValueError(f"--tensor-parallel-size {size}: tensor parallelism serves text generation; this "
                         f"model embeds (task {task}). Serve it with --tensor-parallel-size 1")
    if not hasattr(hf_config, "num_attention_heads") or "ForCausalLM" not in architecture:
        raise ValueError(f"--tensor-parallel-size {size}: {architecture} cannot be split; use 1")
    check_tensor_parallel(hf_config, size)
    if word == "nobind":
        binding = [list(cores.logical)] * size
    elif word != "auto":
        binding = named_cores(args.cpu_binding, size, cores)
    else:
        binding = default_binding(cores.thread_cpus, size)
        if len(cores.thread_cpus) < size:
            logger.warning("%d tensor-parallel ranks share %d cores: ranks on one core take turns, which is slower "
                           "than %s", size, len(cores.thread_cpus), _fewer_ranks(hf_config, len(cores.thread_cpus)))
    threads = args.num_threads or (max(1, len(cores.thread_cpus) // size) if word == "nobind"
                                   else min(len(cores) for cores in binding))
    return ParallelConfig(tensor_parallel_size=size, cpu_binding=tuple(tuple(c) for c in binding),
                          all_reduce=args.tp_all_reduce), threads


def _fewer_ranks(hf_config: Any, cores: int) -> str:
    """The flag to suggest where the ranks outnumber the cores: the largest size this model splits into that
    the cores hold (the core count itself may not split it: SmolLM2's 9 heads on 2 cores)."""
    size = max(valid_sizes(hf_config, limit=max(1, cores)))  # 1 always splits
    return f"--tensor-parallel-size {size}" + (" (one process)" if size == 1 else "")


def named_cores(cpu_binding: str, size: int, cores: Cores) -> list[list[int]]:
    """--cpu-binding's lists, each rank's, within the cores this process may run on (ValueError naming the others)."""
    binding = parse_cpu_binding(cpu_binding, size)
    allowed = cores.logical  # every CPU of this process's affinity
    outside = sorted({c for rank in binding for c in rank} - set(allowed))
    if outside:
        raise ValueError(f"--cpu-binding {cpu_binding!r} names cores this process may not run on "
                         f"({format_cores(outside)}); usable: {format_cores(allowed)}")
    return binding


def per_rank_shape(shape: Any, hf_config: Any, world_size: int) -> Any:
    """memory/plan.py's ModelShape of one rank's shard: its heads, KV heads, MLP width and vocabulary rows,
    and the checkpoint bytes it holds (the split tensors' share; norms are replicated)."""
    if world_size == 1:
        return shape
    layout = ShardLayout.for_config(hf_config, 0, world_size)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    rank = replace(shape, num_attention_heads=layout.local_heads, num_kv_heads=layout.local_kv_heads,
                   intermediate_size=layout.local_intermediate, vocab_size=layout.vocab_per_rank)

    def split_params(s: Any) -> int:
        return s.num_linear_params + (1 if tied else 2) * s.vocab_size * s.hidden_size

    bytes_per_param = shape.weight_bytes / max(1, split_params(shape) + _replicated_params(shape))
    weight_bytes = shape.weight_bytes - round((split_params(shape) - split_params(rank)) * bytes_per_param)
    return replace(rank, weight_bytes=weight_bytes)


def _replicated_params(shape: Any) -> int:
    return (2 * shape.num_layers + 1) * shape.hidden_size  # the norms


def per_rank_available(available: Any, world_size: int) -> Any:
    """The free memory each of `world_size` ranks on this host may plan with (an equal share)."""
    if world_size == 1:
        return available
    return replace(available, num_bytes=available.num_bytes // world_size,
                   reason=f"{available.reason}; 1/{world_size} of it per tensor-parallel rank")
