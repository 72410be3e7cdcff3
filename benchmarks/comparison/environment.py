"""Where a run happened: the machine, the versions, the commit, and how much CPU other processes took meanwhile."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

from . import REPO


class ContentionMeter:
    """CPU time used by OTHER processes while we measure: system busy CPU time minus this process's own
    (itself plus every child it has waited for, whose times the kernel adds to ours). The load average
    cannot tell: it counts the benchmarked program's own threads too."""

    def __init__(self) -> None:
        self.start_wall = time.monotonic()
        self.start_busy = self._system_busy()
        self.start_own = self._own()

    @staticmethod
    def _system_busy() -> float:
        import psutil

        times = psutil.cpu_times()
        # Time this machine's processes ran (guest time is already inside user; steal is the hypervisor's).
        return sum(getattr(times, name, 0.0) for name in ("user", "nice", "system", "irq", "softirq"))

    @staticmethod
    def _own() -> float:
        times = os.times()
        return times.user + times.system + times.children_user + times.children_system

    def stop(self) -> dict[str, float]:
        """Call after every child has been waited for. Shares are of the whole machine (all cores)."""
        wall = time.monotonic() - self.start_wall
        capacity = wall * (os.cpu_count() or 1)
        busy = self._system_busy() - self.start_busy
        own = self._own() - self.start_own
        return {"wall_s": wall, "own_cpu_share": own / capacity, "others_cpu_share": max(0.0, busy - own) / capacity}


def this_cpu_class() -> str:
    from pagedserve.memory.probe import cpu_class, cpu_flags

    return cpu_class(cpu_flags())


def machine_info() -> dict[str, Any]:
    from pagedserve.platform import cpu_flags, usable_cpu_count

    model_name = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model_name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    interesting = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16",
                   "amx_tile", "amx_bf16", "amx_int8")
    flags = cpu_flags()
    try:
        import psutil

        memory_gib = psutil.virtual_memory().total / 2**30
    except ImportError:
        memory_gib = None
    return {"cpu": model_name, "cpu_class": this_cpu_class(), "logical_cpus": os.cpu_count(), "usable_cores": usable_cpu_count(),
            "flags": [f for f in interesting if f in flags], "memory_gib": memory_gib,
            "kernel": platform.release(), "hypervisor": "hypervisor" in flags}


def versions() -> dict[str, str]:
    import importlib.metadata as metadata

    found = {"python": platform.python_version()}
    for package in ("pagedserve", "torch", "transformers", "tokenizers", "safetensors", "numpy"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = "not installed"
    return found


def git_state() -> dict[str, Any]:
    def git(*argv: str) -> str:
        try:
            return subprocess.run(["git", "-C", str(REPO), *argv], capture_output=True, text=True,
                                  timeout=30).stdout
        except (OSError, subprocess.TimeoutExpired):
            return ""

    # Porcelain lines are "XY path": do not strip the output, X may be a space.
    dirty = [line[3:] for line in git("status", "--porcelain", "--", "pagedserve").splitlines() if len(line) > 3]
    return {"commit": git("rev-parse", "HEAD").strip(), "subject": git("log", "-1", "--format=%s").strip(),
            "uncommitted_engine_files": dirty}
