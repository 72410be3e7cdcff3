"""Host probes against fake /sys/fs/cgroup and /proc trees."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedserve.memory.probe import (
    GIB,
    available_memory,
    bf16_attention_by_dot,
    cgroup_cpu_quota,
    cpu_flags,
    choose_cpu_dtype,
    cpu_class,
    fast_cpu_dtype,
    native_kernel_isa,
    read_cgroup_memory,
    read_cores,
    read_meminfo,
    usable_cpu_count,
)

MEMINFO = """\
MemTotal:       24684084 kB
MemFree:         1000000 kB
MemAvailable:   20000000 kB
Buffers:          100000 kB
Cached:          5000000 kB
SwapCached:            0 kB
SwapTotal:       2097148 kB
SwapFree:        2097148 kB
HugePages_Total:       0
"""


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def cgroup_v2(tmp_path: Path, own: str = "/user.slice/app.scope") -> tuple[Path, Path]:
    root = tmp_path / "cgroup"
    write(root / "cgroup.controllers", "cpu memory io pids\n")
    proc_self = write(tmp_path / "proc_self_cgroup", f"0::{own}\n")
    return root, proc_self


def cgroup_v1(tmp_path: Path, memory_path: str = "/docker/abc", cpu_path: str = "/docker/abc") -> tuple[Path, Path]:
    root = tmp_path / "cgroup"
    (root / "memory").mkdir(parents=True)
    (root / "cpu,cpuacct").mkdir(parents=True)
    proc_self = write(
        tmp_path / "proc_self_cgroup",
        f"12:pids:/\n4:memory:{memory_path}\n3:cpu,cpuacct:{cpu_path}\n1:name=systemd:/\n",
    )
    return root, proc_self


def test_v2_limit_of_own_cgroup_minus_inactive_file(tmp_path: Path) -> None:
    root, proc_self = cgroup_v2(tmp_path)
    own = root / "user.slice" / "app.scope"
    write(own / "memory.max", f"{8 * GIB}\n")
    write(own / "memory.current", f"{3 * GIB}\n")
    write(own / "memory.stat", f"anon 100\ninactive_file {GIB}\nactive_file 5\n")
    write(root / "user.slice" / "memory.max", "max\n")
    memory = read_cgroup_memory(root, proc_self)
    assert memory.version == 2
    assert memory.limit_bytes == 8 * GIB
    assert memory.usage_bytes == 2 * GIB  # the reclaimable inactive file cache is not counted
    assert memory.headroom_bytes == 6 * GIB


def test_v2_tighter_ancestor_binds(tmp_path: Path) -> None:
    root, proc_self = cgroup_v2(tmp_path)
    own = root / "user.slice" / "app.scope"
    write(own / "memory.max", f"{8 * GIB}\n")
    write(own / "memory.current", f"{1 * GIB}\n")
    write(root / "user.slice" / "memory.max", f"{4 * GIB}\n")
    write(root / "user.slice" / "memory.current", f"{3 * GIB}\n")
    memory = read_cgroup_memory(root, proc_self)
    assert (memory.limit_bytes, memory.usage_bytes) == (4 * GIB, 3 * GIB)
    assert memory.path == str(root / "user.slice")


def test_v2_no_limit(tmp_path: Path) -> None:
    root, proc_self = cgroup_v2(tmp_path)
    own = root / "user.slice" / "app.scope"
    write(own / "memory.max", "max\n")
    write(own / "memory.current", "12345\n")
    memory = read_cgroup_memory(root, proc_self)
    assert memory.limit_bytes is None and memory.headroom_bytes is None
    assert memory.usage_bytes == 12345


def test_v2_inside_cgroup_namespace_reads_root_files(tmp_path: Path) -> None:
    root, proc_self = cgroup_v2(tmp_path, own="/")
    write(root / "memory.max", f"{2 * GIB}\n")
    write(root / "memory.current", f"{GIB}\n")
    assert read_cgroup_memory(root, proc_self).headroom_bytes == GIB


def test_v1_host_path_not_mounted_falls_back_to_mount_root(tmp_path: Path) -> None:
    # Docker without a cgroup namespace: /proc/self/cgroup says /docker/abc, the mount is already that dir.
    root, proc_self = cgroup_v1(tmp_path)
    write(root / "memory" / "memory.limit_in_bytes", f"{9 * GIB}\n")
    write(root / "memory" / "memory.usage_in_bytes", f"{2 * GIB}\n")
    write(root / "memory" / "memory.stat", f"cache 5\ntotal_inactive_file {GIB // 2}\n")
    memory = read_cgroup_memory(root, proc_self)
    assert memory.version == 1
    assert memory.limit_bytes == 9 * GIB
    assert memory.usage_bytes == 2 * GIB - GIB // 2


def test_v1_own_subdirectory_and_huge_value_means_no_limit(tmp_path: Path) -> None:
    root, proc_self = cgroup_v1(tmp_path, memory_path="/process_api/f26d")
    own = root / "memory" / "process_api" / "f26d"
    write(own / "memory.limit_in_bytes", "9223372036854771712\n")
    write(own / "memory.usage_in_bytes", "6877184\n")
    write(root / "memory" / "memory.limit_in_bytes", "9223372036854771712\n")
    memory = read_cgroup_memory(root, proc_self)
    assert memory.limit_bytes is None
    assert memory.usage_bytes == 6877184
    write(own / "memory.limit_in_bytes", f"{3 * GIB}\n")
    assert read_cgroup_memory(root, proc_self).limit_bytes == 3 * GIB


def test_no_cgroup_at_all(tmp_path: Path) -> None:
    memory = read_cgroup_memory(tmp_path / "nothing", tmp_path / "missing")
    assert (memory.limit_bytes, memory.usage_bytes, memory.version) == (None, None, None)


def test_meminfo_parsing_in_bytes(tmp_path: Path) -> None:
    info = read_meminfo(write(tmp_path / "meminfo", MEMINFO))
    assert info.total == 24684084 * 1024
    assert info.available == 20000000 * 1024
    assert info.free == 1000000 * 1024
    assert info.cached == 5000000 * 1024
    assert info.swap_total == info.swap_free == 2097148 * 1024


def test_meminfo_without_memavailable_estimates_it(tmp_path: Path) -> None:
    text = "".join(line + "\n" for line in MEMINFO.splitlines() if not line.startswith("MemAvailable"))
    info = read_meminfo(write(tmp_path / "meminfo", text))
    assert info.available == (1000000 + 100000 + 5000000) * 1024


def test_available_memory_names_the_binding_limit(tmp_path: Path) -> None:
    meminfo = write(tmp_path / "meminfo", MEMINFO)  # MemAvailable about 19.07 GiB
    root, proc_self = cgroup_v2(tmp_path)
    own = root / "user.slice" / "app.scope"
    write(own / "memory.max", f"{9 * GIB}\n")
    write(own / "memory.current", f"{GIB}\n")
    available = available_memory(meminfo, root, proc_self)
    assert available.num_bytes == 8 * GIB
    assert available.bound_by == "cgroup"
    assert "limit 9.00 GiB" in available.reason and "8.00 GiB" in available.reason

    write(own / "memory.max", f"{64 * GIB}\n")
    available = available_memory(meminfo, root, proc_self)
    assert available.num_bytes == 20000000 * 1024
    assert available.bound_by == "MemAvailable"

    write(own / "memory.max", "max\n")
    available = available_memory(meminfo, root, proc_self)
    assert available.bound_by == "MemAvailable" and "no cgroup memory limit" in available.reason


def test_cpu_quota_v2_limits_usable_cores(tmp_path: Path) -> None:
    root, proc_self = cgroup_v2(tmp_path)
    write(root / "user.slice" / "app.scope" / "cpu.max", "250000 100000\n")
    assert cgroup_cpu_quota(root, proc_self) == 2.5
    assert usable_cpu_count(root, proc_self, affinity=set(range(16))) == 3  # ceil(2.5)
    assert usable_cpu_count(root, proc_self, affinity={0, 1}) == 2  # affinity is tighter
    write(root / "user.slice" / "app.scope" / "cpu.max", "max 100000\n")
    assert cgroup_cpu_quota(root, proc_self) is None
    assert usable_cpu_count(root, proc_self, affinity=set(range(16))) == 16


def test_cpu_quota_v1_co_mounted_controller(tmp_path: Path) -> None:
    root, proc_self = cgroup_v1(tmp_path)
    write(root / "cpu,cpuacct" / "cpu.cfs_quota_us", "400000\n")
    write(root / "cpu,cpuacct" / "cpu.cfs_period_us", "100000\n")
    assert usable_cpu_count(root, proc_self, affinity=set(range(8))) == 4
    write(root / "cpu,cpuacct" / "cpu.cfs_quota_us", "-1\n")
    assert usable_cpu_count(root, proc_self, affinity=set(range(8))) == 8


def test_tiny_quota_still_gives_one_core(tmp_path: Path) -> None:
    root, proc_self = cgroup_v2(tmp_path)
    write(root / "user.slice" / "app.scope" / "cpu.max", "10000 100000\n")
    assert usable_cpu_count(root, proc_self, affinity={0, 1, 2, 3}) == 1


def cpu_tree(tmp_path: Path, siblings: dict[int, str], efficiency: str | None = None,
             name: str = "core_cpus_list") -> tuple[Path, Path]:
    """A fake /sys/devices/system/cpu (each CPU's sibling list) and /sys/devices (cpu_atom/cpus on hybrids)."""
    cpu_root, devices = tmp_path / "cpu", tmp_path / "devices"
    for cpu, text in siblings.items():
        write(cpu_root / f"cpu{cpu}" / "topology" / name, text + "\n")
    devices.mkdir(exist_ok=True)
    if efficiency is not None:
        write(devices / "cpu_atom" / "cpus", efficiency + "\n")
    return cpu_root, devices


def cores_of(tmp_path: Path, affinity: set[int], cpu_root: Path, devices: Path, quota: str | None = None):
    root, proc_self = cgroup_v2(tmp_path)
    write(root / "user.slice" / "app.scope" / "cpu.max", (quota or "max 100000") + "\n")
    return read_cores(affinity, cpu_root, devices, root, proc_self)


def test_one_thread_per_physical_core_smt_siblings_left_out(tmp_path: Path) -> None:
    # Intel's numbering: CPU n and n + 4 are the two threads of core n
    smt = {cpu: f"{cpu % 4},{cpu % 4 + 4}" for cpu in range(8)}
    cpu_root, devices = cpu_tree(tmp_path, smt)
    cores = cores_of(tmp_path, set(range(8)), cpu_root, devices)
    assert cores.cores == ((0, 4), (1, 5), (2, 6), (3, 7)) and cores.logical == list(range(8))
    assert cores.thread_cpus == [0, 1, 2, 3]
    assert cores_of(tmp_path, {4, 5, 6, 7}, cpu_root, devices).thread_cpus == [4, 5, 6, 7]  # one of each core
    assert cores_of(tmp_path, {1, 5}, cpu_root, devices).thread_cpus == [1]  # two threads of one core
    assert cores_of(tmp_path, set(range(8)), cpu_root, devices, quota="250000 100000").thread_cpus == [0, 1, 2]
    assert cores_of(tmp_path, set(range(8)), cpu_root, devices, quota="10000 100000").thread_cpus == [0]
    # AMD's numbering (siblings adjacent), told by the older thread_siblings_list
    adjacent = {cpu: f"{cpu - cpu % 2}-{cpu - cpu % 2 + 1}" for cpu in range(8)}
    cpu_root, devices = cpu_tree(tmp_path / "amd", adjacent, name="thread_siblings_list")
    assert cores_of(tmp_path, set(range(8)), cpu_root, devices).thread_cpus == [0, 2, 4, 6]


def test_without_topology_every_cpu_is_a_core(tmp_path: Path) -> None:
    cpu_root, devices = cpu_tree(tmp_path, {0: "0"})  # CPU 1 says nothing; CPU 2 says something unreadable
    write(cpu_root / "cpu2" / "topology" / "core_cpus_list", "garbage\n")
    cores = cores_of(tmp_path, {0, 1, 2}, cpu_root, devices)
    assert cores.cores == ((0,), (1,), (2,)) and cores.thread_cpus == [0, 1, 2]


def test_hybrid_cpus_thread_on_performance_cores_only(tmp_path: Path) -> None:
    # an Alder Lake: 6 P-cores with two threads each (CPUs 0-11, siblings adjacent), 8 E-cores (12-19)
    hybrid = {cpu: (f"{cpu - cpu % 2}-{cpu - cpu % 2 + 1}" if cpu < 12 else str(cpu)) for cpu in range(20)}
    cpu_root, devices = cpu_tree(tmp_path, hybrid, efficiency="12-19")
    cores = cores_of(tmp_path, set(range(20)), cpu_root, devices)
    assert len(cores.cores) == 14 and len(cores.performance_cores) == 6
    assert cores.thread_cpus == [0, 2, 4, 6, 8, 10]
    assert cores_of(tmp_path, set(range(12, 20)), cpu_root, devices).thread_cpus == list(range(12, 20))  # only E
    assert cores_of(tmp_path, {3, 12, 13}, cpu_root, devices).thread_cpus == [3]


def test_cpu_flags_and_fast_dtype(tmp_path: Path) -> None:
    cpuinfo = write(
        tmp_path / "cpuinfo",
        "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f\n\nprocessor\t: 1\nflags\t\t: fpu sse avx2 avx512f\n",
    )
    flags = cpu_flags(cpuinfo)
    assert {"avx2", "avx512f"} <= flags
    assert fast_cpu_dtype(flags) == "float32"  # no FMA/F16C nor VNNI: no native kernels, no bf16 dot
    assert fast_cpu_dtype(flags | {"avx512_bf16"}) == "bfloat16"
    assert fast_cpu_dtype(flags | {"amx_bf16"}) == "bfloat16"
    assert cpu_flags(tmp_path / "missing") == set()


# One CPU class a row: (flags, native kernels usable) -> what `--dtype auto` picks and the kernels' ISA.
AVX512 = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni"}
AUTO_RULE_CASES = [  # flags, native kernels, --dtype auto, native ISA, CPU class of the benchmarks
    ({"avx2", "fma", "f16c"}, True, "bfloat16", "avx2", "avx2"),  # Zen 3, Haswell..: widened bf16 beats float32
    ({"avx2", "fma", "f16c"}, False, "float32", "avx2", "avx2"),  # no compiler / PAGEDSERVE_CPU_KERNELS=0
    (AVX512, True, "bfloat16", "avx512", "avx512"),  # Ice Lake
    (AVX512 | {"avx512_bf16"}, False, "bfloat16", "avx512", "avx512-bf16"),
    (AVX512 | {"avx512_bf16"}, True, "bfloat16", "avx512", "avx512-bf16"),  # Zen 4/5
    (AVX512 | {"avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"}, True, "bfloat16", "avx512", "avx512-amx"),  # SPR
    ({"avx", "sse4_2"}, True, "float32", None, "other"),  # Sandy Bridge: nothing to run the kernels on
    ({"asimd", "fp"}, True, "float32", None, "other"),  # ARM (no NEON kernels yet)
]


@pytest.mark.parametrize("flags,native,dtype,isa,cls", AUTO_RULE_CASES)
def test_auto_dtype_rule_per_cpu_class(flags, native, dtype, isa, cls) -> None:
    choice = choose_cpu_dtype(flags, native)
    assert (choice.dtype, native_kernel_isa(flags)) == (dtype, isa)
    assert cpu_class(flags) == cls
    assert choice.reason  # doctor prints it


@pytest.mark.parametrize("flags,native,dtype,isa,cls", AUTO_RULE_CASES)
def test_bf16_attention_by_vdpbf16ps_only_where_it_measured_faster(flags, native, dtype, isa, cls) -> None:
    """vdpbf16ps attention: 1.2-1.55x the FMAs a layer on a Zen 5 (avx512-bf16), 0.81-0.93x on an Intel Xeon with
    AMX, whose AVX512-BF16 is the same instruction set (benchmarks/RESULTS.md)."""
    assert bf16_attention_by_dot(flags) == (cls == "avx512-bf16")


def test_process_rss_from_proc_status(tmp_path: Path) -> None:
    from pagedserve.memory.probe import process_rss_bytes

    status = write(tmp_path / "status", "Name:\tpython\nVmPeak:\t 900 kB\nVmRSS:\t  123456 kB\nRssAnon:\t 1 kB\n")
    assert process_rss_bytes(status) == 123456 * 1024
    assert process_rss_bytes(write(tmp_path / "kernel_thread", "Name:\tkthreadd\n")) is None
    assert process_rss_bytes(tmp_path / "missing") is None
    assert process_rss_bytes() > 10 << 20  # this test process, from /proc/self/status


def test_platform_reexports_the_probes() -> None:
    import subprocess
    import sys

    # In a fresh child process: the names are the probe's, and importable from platform there.
    code = ("from pagedserve import platform; from pagedserve.memory import probe; "
            "assert platform.usable_cpu_count is probe.usable_cpu_count; assert platform.cpu_flags is probe.cpu_flags")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_process_start_time_from_proc_stat(tmp_path: Path) -> None:
    import os

    from pagedserve.memory.probe import process_start_time

    ticks = os.sysconf("SC_CLK_TCK")
    after_comm = ["S"] + ["0"] * 18 + [str(5 * ticks), "123456"]  # field 22 (start time) = 5 s after boot
    stat = write(tmp_path / "stat", f"4242 (odd ) name) {' '.join(after_comm)}\n")
    # 12 s after boot it is wall-clock 1000.0: the process started 7 s ago.
    assert process_start_time(stat, now=1000.0, now_since_boot=12.0) == 1000.0 - 7.0
    assert process_start_time(tmp_path / "missing") is None
    import time

    # This test process, from /proc/self/stat: it started before now, and no earlier than the machine booted.
    uptime_s = float(Path("/proc/uptime").read_text().split()[0])
    assert 0 <= time.time() - process_start_time() <= uptime_s + 1


def test_the_plan_counts_what_this_process_already_holds_of_its_runtime(tmp_path, monkeypatch):
    """The plan adds the runtime overhead (Python, torch, the tokenizer) on top of what is available, so the
    part of it this process already holds is added back (up to the cap): serve, probing after torch loaded,
    refused a model that `plan` (probing before) said fits (QA-O: 0.17 against 0.03 GiB counted as used)."""
    from pagedserve.engine import memory_plan
    from pagedserve.memory import probe
    from pagedserve.memory.probe import AvailableMemory, counting_own_runtime

    available = AvailableMemory(1 << 30, "cgroup", "cgroup v1 limit 1.07 GiB - used 0.17 GiB = 1.00 GiB")
    status = write(tmp_path / "status", "Name:\tpython\nVmRSS:\t  250000 kB\nRssAnon:\t  163840 kB\n"
                                        "RssFile:\t   79000 kB\nRssShmem:\t   10240 kB\n")  # 160 + 10 MiB
    counted = counting_own_runtime(available, 272 << 20, status)
    assert counted.num_bytes == (1 << 30) + (170 << 20) and counted.bound_by == "cgroup"
    assert "+ 0.17 GiB this process holds already" in counted.reason
    assert counting_own_runtime(available, 100 << 20, status).num_bytes == (1 << 30) + (100 << 20)  # the cap
    assert counting_own_runtime(available, 272 << 20, tmp_path / "missing") == available
    old_kernel = write(tmp_path / "old", "Name:\tpython\nVmRSS:\t  174080 kB\n")  # no RssAnon: VmRSS
    assert counting_own_runtime(available, 272 << 20, old_kernel).num_bytes == (1 << 30) + (170 << 20)
    monkeypatch.setattr(probe, "available_memory", lambda: available)
    monkeypatch.setattr(probe, "process_anon_bytes", lambda path="/proc/self/status": 2 << 30)  # a model loaded
    assert memory_plan._probe_available_memory("cpu").num_bytes == (1 << 30) + memory_plan.CPU_RUNTIME_BASE_BYTES
