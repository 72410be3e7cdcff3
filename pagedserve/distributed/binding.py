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

logger = logging.getLogger(__name__)


def parse_cpu_list(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11]; ValueError for anything else."""
    cores: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            raise ValueError(f"empty entry in the core list {text!r}")
        first, _, last = part.partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            raise ValueError(f"{part!r} in {text!r} is not a core number or a range like 0-7")
        low, high = int(first), int(last or first)
        if high < low:
            raise ValueError(f"the range {part!r} in {text!r} runs backwards")
        cores.extend(range(low, high + 1))
    if len(set(cores)) != len(cores):
        raise ValueError(f"the core list {text!r} names a core twice")
    return cores


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


def usable_cores(count: int) -> list[int]:
    """The first `count` cores of this process's affinity (count: after the cgroup quota)."""
    try:
        cores = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = list(range(os.cpu_count() or 1))
    return cores[:max(1, count)]


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
