"""Which cores each tensor-parallel rank runs on (the idea of vLLM's VLLM_CPU_OMP_THREADS_BIND).

`--cpu-binding "0-7|8-15"`: rank r's threads on the r-th '|'-separated list ("0-3,8-11" style ranges).
Default: one NUMA node per rank where the usable cores span exactly that many nodes (each rank then streams
its weights from its own node's memory channels), else the usable cores split into equal contiguous groups.
Each rank runs one torch thread per core it is bound to (unless --num-threads says otherwise).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from pagedserve.memory.probe import parse_cpu_list

logger = logging.getLogger(__name__)


def parse_cpu_binding(text: str, world_size: int) -> list[list[int]]:
    """--cpu-binding's value: one core list per rank, separated by '|'."""
    groups = [parse_cpu_list(part) for part in text.split("|")]
    if len(groups) != world_size:
        raise ValueError(f"--cpu-binding {text!r} gives {len(groups)} core lists for --tensor-parallel-size "
                         f"{world_size}: give one per rank, separated by '|'")
    flat = [core for group in groups for core in group]
    if len(set(flat)) != len(flat):
        raise ValueError(f"--cpu-binding {text!r} gives a core to two ranks")
    return groups


def numa_nodes(root: str | Path = "/sys/devices/system/node") -> list[list[int]]:
    """The cores of each NUMA node (empty where the system does not say)."""
    nodes = []
    for path in sorted(Path(root).glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        try:
            text = (path / "cpulist").read_text().strip()
        except OSError:
            continue
        if text:
            nodes.append(parse_cpu_list(text))
    return nodes


def default_binding(usable: list[int], world_size: int, nodes: list[list[int]] | None = None) -> list[list[int]]:
    """One NUMA node per rank where the usable cores span exactly world_size nodes; else equal contiguous
    groups of the usable cores (fewer cores than ranks: ranks share cores, one each, round-robin)."""
    nodes = numa_nodes() if nodes is None else nodes
    per_node = [[c for c in node if c in set(usable)] for node in nodes]
    per_node = [node for node in per_node if node]
    if len(per_node) == world_size > 1:
        return per_node
    if len(usable) < world_size:
        return [[usable[r % len(usable)]] for r in range(world_size)]
    size = len(usable) // world_size
    return [usable[r * size:(r + 1) * size] for r in range(world_size)]


def bind_this_thread(cores: list[int]) -> set[int] | None:
    """Bind the calling thread (and the threads it starts, OpenMP's among them) to `cores`; returns the
    affinity it had, or None where affinity cannot be set."""
    try:
        previous = os.sched_getaffinity(0)
        os.sched_setaffinity(0, cores)
    except (AttributeError, OSError) as exc:
        logger.warning("could not bind to cores %s: %s", cores, exc)
        return None
    return previous


def restore_thread_affinity(thread_id: int, cores: set[int]) -> None:
    """Give a thread (by its native id) the affinity bind_this_thread returned; nothing where it is gone."""
    try:
        os.sched_setaffinity(thread_id, cores)
    except OSError:  # the thread is gone: nothing to give back
        pass


def format_cores(cores: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    parts, start = [], None
    for i, core in enumerate(cores):
        if start is None:
            start = core
        if i + 1 == len(cores) or cores[i + 1] != core + 1:
            parts.append(str(start) if start == core else f"{start}-{core}")
            start = None
    return ",".join(parts)
