"""Host probes: how much memory and how many cores this process may really use, and what the CPU can do.

Every reader takes the paths it reads as arguments (defaulting to the real /proc and /sys files), so tests
feed fake trees. Nothing here reads environment variables. torch is imported lazily, only by the CUDA probe.

A container sees the whole host in /proc/meminfo and os.cpu_count(); its real limits are in the cgroup:
the binding memory figure is min(MemAvailable, cgroup limit - cgroup usage), and the binding core count
is min(CPU affinity, cgroup CPU quota); the engine runs a thread per physical core of those (`Cores`).
"""

from __future__ import annotations

import math
import os
import platform
import time
from dataclasses import dataclass, replace
from pathlib import Path

from pagedserve import envs
from pagedserve.memory.sizes import GIB

# cgroup v1 writes "no limit" as a page-rounded LONG_MAX (9223372036854771712); anything this large is no limit.
_V1_NO_LIMIT_THRESHOLD = 1 << 60


@dataclass(frozen=True)
class CgroupMemory:
    """Memory limit and usage of the cgroup that binds this process (the ancestor with the least headroom)."""

    limit_bytes: int | None  # None: no limit anywhere on the path to the root
    usage_bytes: int | None  # working set: usage minus inactive file cache (reclaimable without I/O stalls)
    version: int | None  # 1, 2, or None when no memory cgroup was found
    path: str | None = None  # the cgroup directory the numbers come from

    @property
    def headroom_bytes(self) -> int | None:
        if self.limit_bytes is None:
            return None
        return max(0, self.limit_bytes - (self.usage_bytes or 0))


@dataclass(frozen=True)
class MemInfo:
    """The fields of /proc/meminfo that matter here, in bytes."""

    total: int
    available: int  # MemAvailable (estimated as MemFree + Buffers + Cached on kernels older than 3.14)
    free: int
    cached: int
    swap_total: int
    swap_free: int


@dataclass(frozen=True)
class AvailableMemory:
    """Memory this process can use now, which limit binds, and why (for messages)."""

    num_bytes: int
    bound_by: str  # "MemAvailable", "cgroup" or "cuda"
    reason: str
    total_bytes: int | None = None  # size of the bound's pool (MemTotal, cgroup limit, GPU memory)


# ----------------------------------------------------------------------------------------------- cgroups


def _v1_mount_candidates(cgroup_root: Path, controller: str, listed: str | None = None) -> list[Path]:
    # v1 controllers may be co-mounted ("cpu,cpuacct"); the mount dir is named after one or all of them.
    names = [controller]
    if listed and listed != controller:
        names += [listed, ",".join(reversed(listed.split(",")))]
    return [cgroup_root / name for name in names if (cgroup_root / name).is_dir()]


def _own_cgroup_path(proc_self_cgroup: Path, version: int, controller: str) -> tuple[str, str | None]:
    """(path of this process's cgroup, controller list of that line) from /proc/self/cgroup."""
    try:
        lines = proc_self_cgroup.read_text().splitlines()
    except OSError:
        return "/", None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy_id, controllers, path = parts
        if version == 2 and hierarchy_id == "0" and controllers == "":
            return path or "/", None
        if version == 1 and controller in controllers.split(","):
            return path or "/", controllers
    return "/", None


def _cgroup_dirs(cgroup_root: Path, proc_self_cgroup: Path, controller: str) -> tuple[int | None, list[Path]]:
    """Directories from this process's own cgroup up to the hierarchy's root, deepest first."""
    # A unified (v2) hierarchy has cgroup.controllers at its root; v1 mounts one dir per controller.
    version = 2 if (cgroup_root / "cgroup.controllers").exists() else 1
    own_path, listed = _own_cgroup_path(proc_self_cgroup, version, controller)
    mounts = [cgroup_root] if version == 2 else _v1_mount_candidates(cgroup_root, controller, listed)
    if not mounts:
        return None, []
    mount = mounts[0]
    parts = [p for p in own_path.split("/") if p]
    # Inside a container without a cgroup namespace, /proc/self/cgroup shows the host path
    # (/docker/<id>) while the mount already is that directory: drop leading components until it exists.
    deepest = mount
    for start in range(len(parts) + 1):
        candidate = mount.joinpath(*parts[start:])
        if candidate.is_dir():
            deepest = candidate
            break
    dirs = [deepest]
    while dirs[-1] != mount and mount in dirs[-1].parents:
        dirs.append(dirs[-1].parent)
    return version, dirs


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _read_stat_field(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _working_set(directory: Path, version: int) -> int | None:
    # Usage counts page cache; inactive file pages are dropped without stalling, so subtract them
    # (the same "working set" that docker stats and cadvisor report).
    usage_file, inactive_key = (
        ("memory.current", "inactive_file") if version == 2 else ("memory.usage_in_bytes", "total_inactive_file")
    )
    usage = _read_int(directory / usage_file)
    if usage is None:
        return None
    return max(0, usage - _read_stat_field(directory / "memory.stat", inactive_key))


def read_cgroup_memory(
    cgroup_root: str | Path = "/sys/fs/cgroup", proc_self_cgroup: str | Path = "/proc/self/cgroup"
) -> CgroupMemory:
    """Memory limit and working set of the cgroup level that leaves this process the least headroom."""
    version, dirs = _cgroup_dirs(Path(cgroup_root), Path(proc_self_cgroup), "memory")
    if version is None:
        return CgroupMemory(limit_bytes=None, usage_bytes=None, version=None)
    limit_file = "memory.max" if version == 2 else "memory.limit_in_bytes"
    own_usage = _working_set(dirs[0], version)
    best: CgroupMemory | None = None
    for directory in dirs:  # limits are hierarchical: any ancestor's limit binds too
        limit = _read_int(directory / limit_file)
        if limit is None or (version == 1 and limit >= _V1_NO_LIMIT_THRESHOLD):
            continue
        usage = _working_set(directory, version)
        level = CgroupMemory(limit, usage if usage is not None else own_usage, version, str(directory))
        if best is None or level.headroom_bytes < best.headroom_bytes:
            best = level
    return best or CgroupMemory(limit_bytes=None, usage_bytes=own_usage, version=version, path=str(dirs[0]))


def cgroup_cpu_quota(
    cgroup_root: str | Path = "/sys/fs/cgroup", proc_self_cgroup: str | Path = "/proc/self/cgroup"
) -> float | None:
    """CPU quota in cores (quota / period) of the tightest level on the cgroup path, or None if unlimited."""
    version, dirs = _cgroup_dirs(Path(cgroup_root), Path(proc_self_cgroup), "cpu")
    quotas: list[float] = []
    for directory in dirs:
        if version == 2:
            try:
                quota_text, _, period_text = (directory / "cpu.max").read_text().strip().partition(" ")
            except OSError:
                continue
            if quota_text == "max" or not period_text:
                continue
            quota, period = int(quota_text), int(period_text)
        else:
            quota, period = _read_int(directory / "cpu.cfs_quota_us"), _read_int(directory / "cpu.cfs_period_us")
            if quota is None or period is None or quota < 0:  # -1: no quota
                continue
        if period > 0:
            quotas.append(quota / period)
    return min(quotas) if quotas else None


def parse_cpu_list(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11] (the kernel's cpulist format); ValueError for anything else."""
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


def _read_cpu_list(path: Path) -> list[int] | None:
    try:
        return parse_cpu_list(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _affinity() -> set[int]:
    try:
        return os.sched_getaffinity(0)
    except AttributeError:  # not Linux
        return set(range(os.cpu_count() or 1))


@dataclass(frozen=True)
class Cores:
    """The logical CPUs this process may run on, grouped into physical cores, and where the threads go.

    Parallel loops run in lockstep (a static split, ~250 regions a decode step, each waiting for its slowest
    thread), so the engine runs one thread per physical core, as torch, llama.cpp and vLLM's CPU backend do by
    default: a second thread on an SMT sibling shares the core's vector units and caches, and while it waits
    at a region's end its spinning takes issue slots from the thread doing the work. On a hybrid CPU (Intel
    P + E cores) the threads go on the performance cores only, where this process has any (llama.cpp's
    default): an efficiency core's share of each split arrives last."""

    cores: tuple[tuple[int, ...], ...]  # each physical core's usable logical CPUs, cores in order of their first
    efficiency: frozenset[int] = frozenset()  # logical CPUs of efficiency cores (hybrid CPUs); else empty
    quota: float | None = None  # the cgroup CPU quota in cores, None if unlimited

    @property
    def logical(self) -> list[int]:
        return sorted(cpu for core in self.cores for cpu in core)

    @property
    def performance_cores(self) -> list[tuple[int, ...]]:
        """The cores threads may go on: all of them, or only the performance ones of a hybrid CPU (where this
        process has any)."""
        fast = [core for core in self.cores if core[0] not in self.efficiency]
        return fast or list(self.cores)

    @property
    def thread_cpus(self) -> list[int]:
        """One logical CPU per core the threads go on (its first), at most ceil(quota) of them, at least one."""
        cpus = [core[0] for core in self.performance_cores]
        if self.quota is not None:
            cpus = cpus[:max(1, math.ceil(self.quota))]
        return cpus


def read_cores(
    affinity: set[int] | None = None,
    cpu_root: str | Path = "/sys/devices/system/cpu",
    devices_root: str | Path = "/sys/devices",
    cgroup_root: str | Path = "/sys/fs/cgroup",
    proc_self_cgroup: str | Path = "/proc/self/cgroup",
) -> Cores:
    """This process's CPUs by physical core (topology/core_cpus_list, or thread_siblings_list on older kernels;
    a CPU whose topology the system does not tell is a core of its own), the efficiency cores of an Intel
    hybrid CPU (Linux lists them in /sys/devices/cpu_atom/cpus), and the cgroup CPU quota."""
    affinity = _affinity() if affinity is None else affinity
    groups: dict[tuple[int, ...], list[int]] = {}
    for cpu in sorted(affinity):
        topology = Path(cpu_root) / f"cpu{cpu}" / "topology"
        siblings = _read_cpu_list(topology / "core_cpus_list") or _read_cpu_list(topology / "thread_siblings_list")
        key = tuple(siblings) if siblings and cpu in siblings else (cpu,)
        groups.setdefault(key, []).append(cpu)
    efficiency = _read_cpu_list(Path(devices_root) / "cpu_atom" / "cpus") or []
    return Cores(tuple(tuple(cpus) for cpus in groups.values()), frozenset(efficiency),
                 cgroup_cpu_quota(cgroup_root, proc_self_cgroup))


def usable_cpu_count(
    cgroup_root: str | Path = "/sys/fs/cgroup",
    proc_self_cgroup: str | Path = "/proc/self/cgroup",
    affinity: set[int] | None = None,
) -> int:
    """Logical CPUs this process can really keep busy: min(CPU affinity, ceil(cgroup quota)), at least 1 (what a
    CPU share is out of; the engine's threads are `default_thread_count`)."""
    count = len(_affinity() if affinity is None else affinity)
    quota = cgroup_cpu_quota(cgroup_root, proc_self_cgroup)
    if quota is not None:
        count = min(count, math.ceil(quota))
    return max(1, count)


# ----------------------------------------------------------------------------------------------- memory


def read_meminfo(path: str | Path = "/proc/meminfo") -> MemInfo:
    """Parse /proc/meminfo ("Key:  123 kB" lines) into bytes."""
    fields: dict[str, int] = {}
    for line in Path(path).read_text().splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if not parts:
            continue
        scale = 1024 if len(parts) > 1 and parts[1] == "kB" else 1
        fields[key.strip()] = int(parts[0]) * scale
    free, cached = fields.get("MemFree", 0), fields.get("Cached", 0)
    available = fields.get("MemAvailable", free + fields.get("Buffers", 0) + cached)
    return MemInfo(
        total=fields.get("MemTotal", 0),
        available=available,
        free=free,
        cached=cached,
        swap_total=fields.get("SwapTotal", 0),
        swap_free=fields.get("SwapFree", 0),
    )


def available_memory(
    meminfo_path: str | Path = "/proc/meminfo",
    cgroup_root: str | Path = "/sys/fs/cgroup",
    proc_self_cgroup: str | Path = "/proc/self/cgroup",
) -> AvailableMemory:
    """Host memory usable now: min(MemAvailable, cgroup limit - cgroup working set)."""
    meminfo = read_meminfo(meminfo_path)
    cgroup = read_cgroup_memory(cgroup_root, proc_self_cgroup)
    from_meminfo = f"MemAvailable {meminfo.available / GIB:.2f} GiB of {meminfo.total / GIB:.2f} GiB"
    headroom = cgroup.headroom_bytes
    if headroom is None:
        return AvailableMemory(meminfo.available, "MemAvailable", f"{from_meminfo}; no cgroup memory limit",
                               total_bytes=meminfo.total)
    used = cgroup.usage_bytes or 0
    from_cgroup = (
        f"cgroup v{cgroup.version} limit {cgroup.limit_bytes / GIB:.2f} GiB - used {used / GIB:.2f} GiB"
        f" = {headroom / GIB:.2f} GiB"
    )
    if headroom < meminfo.available:
        return AvailableMemory(headroom, "cgroup", f"{from_cgroup} (less than {from_meminfo})",
                               total_bytes=cgroup.limit_bytes)
    return AvailableMemory(meminfo.available, "MemAvailable", f"{from_meminfo} (less than {from_cgroup})",
                           total_bytes=meminfo.total)


def counting_own_runtime(available: AvailableMemory, cap_bytes: int,
                         status_path: str | Path = "/proc/self/status") -> AvailableMemory:
    """`available` plus what this process already holds of the runtime the plan counts in its overhead (Python,
    torch, the tokenizer; at most `cap_bytes`): the plan adds that overhead on top of what is available, so a probe
    taken after torch is imported (serve: ~0.17 GiB resident) counted it twice and refused what `plan`, probing
    from a light process, said fits. Its anonymous memory (process_anon_bytes), not VmRSS: torch's libraries are
    page cache, not counted as used (crediting them made `plan` 55 MiB stricter than serve, QA-S)."""
    own = min(process_anon_bytes(status_path) or 0, cap_bytes)
    if own <= 0:
        return available
    return replace(available, num_bytes=available.num_bytes + own,
                   reason=f"{available.reason}; + {own / GIB:.2f} GiB this process holds already (counted in the "
                          "runtime overhead)")


def cuda_free_memory(device: int = 0) -> tuple[int, int] | None:
    """(free, total) bytes on a CUDA device, or None without torch or a usable GPU."""
    try:
        import torch  # lazily: the host probes above must work without torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info(device)
    return int(free), int(total)


def cuda_available_memory(device: int = 0) -> AvailableMemory | None:
    """Free GPU memory as an AvailableMemory (for the memory plan on a GPU), or None without a GPU."""
    info = cuda_free_memory(device)
    if info is None:
        return None
    free, total = info
    return AvailableMemory(free, "cuda", f"cuda:{device} free {free / GIB:.2f} GiB of {total / GIB:.2f} GiB",
                           total_bytes=total)


def _status_bytes(status_path: str | Path, names: tuple[str, ...]) -> dict[str, int] | None:
    """The named "kB" lines of /proc/<pid>/status in bytes ("VmRSS:   123456 kB"); None where it cannot be read."""
    found: dict[str, int] = {}
    try:
        for line in Path(status_path).read_text().splitlines():
            name, _, value = line.partition(":")
            if name in names:
                found[name] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return found


def process_rss_bytes(status_path: str | Path = "/proc/self/status") -> int | None:
    """Resident set size (VmRSS) of a process, from /proc/<pid>/status; None where it cannot be read."""
    return (_status_bytes(status_path, ("VmRSS",)) or {}).get("VmRSS")


def process_anon_bytes(status_path: str | Path = "/proc/self/status") -> int | None:
    """A process's resident anonymous and shared memory (RssAnon + RssShmem): what it holds that MemAvailable and
    its cgroup count as used; its file pages (libraries) are page cache, counted as available or charged to
    whoever read them first. VmRSS where those lines are missing (kernels before 4.5); None where unreadable."""
    found = _status_bytes(status_path, ("RssAnon", "RssShmem", "VmRSS")) or {}
    if "RssAnon" in found:
        return found["RssAnon"] + found.get("RssShmem", 0)
    return found.get("VmRSS")


def process_start_time(stat_path: str | Path = "/proc/self/stat", now: float | None = None,
                       now_since_boot: float | None = None) -> float | None:
    """When a process started, on the time.time() clock, to the clock tick; None where /proc is unreadable.

    Its start in ticks since boot (/proc/<pid>/stat field 22) against CLOCK_BOOTTIME now. (psutil's
    create_time() adds /proc/stat's btime instead, which is rounded down to the second: up to 1 s early,
    which would make every "ready N s after process start" look up to a second slower than it is.)
    """
    try:
        after_comm = Path(stat_path).read_text().rsplit(")", 1)[1].split()  # comm may contain spaces
        start_ticks = int(after_comm[19])  # field 22; the fields after comm start at field 3
    except (OSError, ValueError, IndexError):
        return None
    if now_since_boot is None:
        now_since_boot = time.clock_gettime(time.CLOCK_BOOTTIME)
    age = now_since_boot - start_ticks / os.sysconf("SC_CLK_TCK")
    return (time.time() if now is None else now) - age


# ----------------------------------------------------------------------------------------------- CPU


def transparent_hugepages(path: str | Path = "/sys/kernel/mm/transparent_hugepage/enabled") -> str | None:
    """The kernel's THP mode ("always", "madvise" or "never"; the bracketed one), None where unknown."""
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def cpu_flags(path: str | Path = "/proc/cpuinfo") -> set[str]:
    """Instruction-set flags of the first CPU ("flags" on x86, "Features" on ARM)."""
    try:
        text = Path(path).read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


# The instruction sets pagedserve's C kernels (pagedserve/kernels/cpu_kernels.c) build for, best first.
NATIVE_ISA_FLAGS = (("avx512", frozenset({"avx512f", "avx512bw", "avx512_vnni"})),
                    ("avx2", frozenset({"avx2", "fma", "f16c"})))
BF16_DOT_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
AMX_BF16_FLAGS = frozenset({"amx_tile", "amx_bf16"})


def is_x86(machine: str | None = None) -> bool:
    """Whether `machine` (default: this host's, platform.machine()) is x86-64: what the native kernels and
    the shared-memory all-reduce are written for, and where CPU flags decide oneDNN's bf16 support."""
    return (platform.machine() if machine is None else machine).lower() in ("x86_64", "amd64")


def native_kernel_isa(flags: set[str]) -> str | None:
    """The instruction set the native kernels use on an x86 CPU with these flags, or None (torch ops)."""
    return next((name for name, needed in NATIVE_ISA_FLAGS if needed <= flags), None)


def cpu_class(flags: set[str]) -> str:
    """The CPU class benchmarks keep figures for: "avx512-amx" (AMX tiles: bf16 matmuls ~8x the vector
    units'), "avx512-bf16", "avx512", "avx2" or "other"."""
    isa = native_kernel_isa(flags)
    if isa == "avx512" and AMX_BF16_FLAGS <= flags:
        return "avx512-amx"
    if isa == "avx512" and flags & BF16_DOT_FLAGS:
        return "avx512-bf16"
    return isa or "other"


def bf16_attention_by_dot(flags: set[str]) -> bool:
    """Whether bf16 attention runs faster by vdpbf16ps (bf16 pairs into float32 sums) than by float32 FMAs on
    rows widened first, on a CPU with AVX512-BF16. Measured per class (benchmarks/RESULTS.md, attention_ab.py,
    one layer's decode attention): a Zen 5 (avx512-bf16) 1.2-1.55x; an Intel Xeon with AMX (avx512-amx)
    0.81-0.93x, its vdpbf16ps being slower there than two FMAs. CPUs of neither kind measured (Cooper Lake:
    AVX512-BF16 without AMX) follow their class."""
    return cpu_class(flags) == "avx512-bf16"


def sdpa_prefill(flags: set[str], dtype: str, batch_invariant: bool) -> bool:
    """Whether prefill chunks' attention runs on torch's SDPA rather than on the native kernel, which computes each
    row as a decode row (the same operations as alone, whatever the chunk). Measured per class (benchmarks/
    RESULTS.md): on the Intel Xeon with AMX (avx512-amx), bf16 prompts of 256-4096 tokens prefilled 1.04-1.46x
    faster on SDPA (oneDNN's kernels on AMX tiles; 1.38-1.62x in 512-token chunks), float32 ones level; on a Zen 5
    (avx512-bf16) the native kernel ran 3.5x SDPA (428 tokens), on a Zen 4 1.1-1.35x (1024-4000 tokens), and AVX2
    CPUs have no bf16 matmuls. Never in batch-invariant mode (SDPA's sums depend on how a prompt is chunked).
    PAGEDSERVE_CPU_SDPA_PREFILL=0/1 overrides the rule."""
    if batch_invariant:
        return False
    return envs.cpu_sdpa_prefill(default=dtype == "bfloat16" and cpu_class(flags) == "avx512-amx")


@dataclass(frozen=True)
class DtypeChoice:
    dtype: str
    reason: str


def choose_cpu_dtype(flags: set[str], native_kernels: bool) -> DtypeChoice:
    """`--dtype auto` on a CPU: the dtype that decodes and prefills fastest here, and why.

    Measured per CPU class (benchmarks/RESULTS.md keeps a table per class):
    - AVX512-BF16 / AMX-BF16: bf16 dot products in hardware; bf16 matmuls stream half the bytes of
      float32 and run ~1.4x faster at batch 1 -> bfloat16.
    - AVX2 (or AVX-512 without BF16) with pagedserve's native kernels: bf16 weights are widened to float32
      in registers and summed in float32, so bf16 storage streams half the bytes of float32 at batch 1
      and the kernel outruns oneDNN's float32 at every batch size (2x at 64-1024 rows on 9728x896,
      Zen 3); on an Ice Lake (AVX-512 without BF16) 1.8x at batch 1, and a 512-token prompt prefills as fast
      as in float32 (238 vs 235 tok/s, 0.5B shape) -> bfloat16.
    - Neither (no native kernels, e.g. no C compiler): oneDNN would emulate bf16, slower than float32 and
      up to an order of magnitude slower for batches -> float32.
    """
    if flags & BF16_DOT_FLAGS:
        return DtypeChoice("bfloat16", "the CPU has bf16 dot-product instructions (AVX512-BF16/AMX)")
    isa = native_kernel_isa(flags)
    if native_kernels and isa is not None:
        return DtypeChoice("bfloat16", f"pagedserve's {isa} kernels keep bf16 weights and compute in float32: half "
                                       "the bytes of float32 per token, batches level with oneDNN float32 or faster")
    why = "the native kernels are not used here" if isa is not None else "no AVX2/AVX-512 kernels for this CPU"
    return DtypeChoice("float32", f"{why}, and without bf16 instructions oneDNN emulates bf16 matmuls "
                                  "(slower than float32)")


def fast_cpu_dtype(flags: set[str], native_kernels: bool = True) -> str:
    """The dtype `--dtype auto` picks on a CPU with these flags (see choose_cpu_dtype)."""
    return choose_cpu_dtype(flags, native_kernels).dtype
