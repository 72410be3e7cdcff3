"""Building the native kernel library once per machine, and a cache that nobody else can plant code in.

The library is `cc -O3 -march=native -fopenmp -shared` on one C file (under a second), or with
`-march=x86-64-v3` for the AVX2 kernels on any x86 CPU (ISA_MARCH). It is cached under
the pagedserve cache directory, keyed by everything that changes the binary: the source, the compiler's
version, the compile flags and the CPU's flags. Because the server then runs whatever library it finds
there, the cache is treated like code:
- the cache directory is created with mode 0700; a directory (or library) that is not owned by this user,
  is writable by group or others, or is a symbolic link is never loaded from: the library is built
  afresh in a private `mkdtemp` directory for this process, and the log says why;
- a build that failed is remembered next to where the library would be (`<name>.failed`, keyed like a
  good build), so every start does not recompile and warn again; deleting that file retries;
- the compiler runs under a time limit;
- the few most recent builds are kept (two installed versions, or one home directory shared by different
  CPUs, do not keep deleting each other's library).
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

from pagedserve import envs
from pagedserve.memory.probe import NATIVE_ISA_FLAGS

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.c")
COMPILE_FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
LINK_FLAGS = ("-lm",)
# The instruction sets a build can be asked for: "native" is the best this CPU runs (-march=native);
# "avx2" is AVX2 + FMA + F16C only (x86-64-v3, what a Zen 3 or Haswell has), also on an AVX-512 CPU, so
# that those kernels are tested and measured on any x86 machine of ours (PAGEDSERVE_CPU_ISA=avx2);
# "avx2-vnni" is that plus AVX-VNNI (Alder Lake and later Intel cores, the E-core Xeons: the AVX2 kernels' int8
# sums in one vpdpwssd instead of vpmaddwd + vpaddd; -march=native gives it there);
# "avx512-vnni" is AVX-512 F/BW/VNNI without BF16 or AMX (Cascade Lake, Ice Lake: the AVX-512 kernels with
# their float32 paths for bf16), runnable on any AVX-512 VNNI CPU (PAGEDSERVE_CPU_ISA=avx512-vnni).
ISA_MARCH = {"native": ("-march=native",), "avx2": ("-march=x86-64-v3", "-mtune=native"),
             "avx2-vnni": ("-march=x86-64-v3", "-mavxvnni", "-mtune=native"),
             "avx512-vnni": ("-march=cascadelake", "-mtune=native")}
# The kernels' ISA (ps_isa) each fixed -march build gives.
BUILD_ISA = {"avx2": "avx2", "avx2-vnni": "avx2", "avx512-vnni": "avx512"}
# The CPU flags (/proc/cpuinfo names) a fixed build's instructions need: its kernels' ISA's, plus what its -march
# adds. Without them it would die on the first instruction it lacks (SIGILL), so pagedserve.kernels.load refuses it
# and says why.
BUILD_FLAGS = {build: dict(NATIVE_ISA_FLAGS)[isa] | ({"avx_vnni"} if build == "avx2-vnni" else set())
               for build, isa in BUILD_ISA.items()}
COMPILE_TIMEOUT_S = 120.0  # one small file: seconds on a loaded 2-core box; a hung compiler must not hang start-up
# Every ISA's build of two versions: with 3 kept, the four builds of one source (the test suite builds each ISA
# its CPU runs) evicted each other, and a server started beside them compiled its own again, on a loaded box.
KEEP_BUILDS = 2 * len(ISA_MARCH)


class KernelBuildError(RuntimeError):
    """The library could not be built (no compiler, a compile error, the time limit), or not safely cached."""


def _cpu_fingerprint() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str | None:
    return shutil.which("cc") or shutil.which("gcc")


def untrusted_reason(path: Path) -> str | None:
    """Why a cache path must not be trusted (a link, another owner, writable by others), or None."""
    try:
        info = path.lstat()
    except OSError as exc:
        return f"cannot be inspected ({exc})"
    if stat.S_ISLNK(info.st_mode):
        return "is a symbolic link"
    if info.st_uid != os.geteuid():
        return f"is owned by uid {info.st_uid}, not this user ({os.geteuid()})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by group or others (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def _fresh_private_dir(why: str) -> Path:
    fresh = Path(tempfile.mkdtemp(prefix="pagedserve-kernels-"))  # mode 0700, a new name nobody could predict
    logger.warning("native kernel cache: %s; building into %s for this process", why, fresh)
    # This process's alone: removed when it exits (a loaded library stays mapped; one folder was left per run).
    atexit.register(shutil.rmtree, fresh, ignore_errors=True)
    return fresh


def cache_directory(cache_root: Path | None = None) -> Path:
    """The kernel cache (created 0700), or a fresh private directory where it cannot be trusted or made."""
    root = (cache_root or envs.cache_dir()) / "kernels"
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        return _fresh_private_dir(f"{root} cannot be created ({exc})")
    why = untrusted_reason(root)
    return root if why is None else _fresh_private_dir(f"{root} {why}")


def compile_flags(isa: str = "native") -> tuple[str, ...]:
    """The compiler flags of a build for `isa` (a key of ISA_MARCH)."""
    if isa not in ISA_MARCH:
        raise KernelBuildError(f"no build for instruction set {isa!r}; one of {sorted(ISA_MARCH)}")
    return tuple(flag for flag in COMPILE_FLAGS if flag != "-march=native") + ISA_MARCH[isa]


def library_name(source: Path, cc: str, isa: str = "native") -> str:
    """`<stem>-<key>.so`, the key covering the source, compiler version, flags and CPU flags."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False,
                             timeout=COMPILE_TIMEOUT_S).stdout
    parts = (source.read_bytes(), version.encode(), " ".join(compile_flags(isa) + LINK_FLAGS).encode(),
             _cpu_fingerprint().encode())
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    return f"{source.stem}-{key}.so"


def build(source: Path = SOURCE, cache_root: Path | None = None, isa: str = "native") -> Path:
    """The path of a trusted build of `source` for `isa`: the cached one, or a new one; raises
    KernelBuildError."""
    cc = _compiler()
    if cc is None:
        raise KernelBuildError("no C compiler (cc/gcc) on PATH")
    try:
        name = library_name(source, cc, isa)
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelBuildError(f"{cc} --version failed: {exc}") from exc
    out_dir = cache_directory(cache_root)
    target, failed = out_dir / name, out_dir / f"{name}.failed"
    if failed.exists() and untrusted_reason(failed) is None:
        raise KernelBuildError(f"an earlier build of this source with this compiler failed (see {failed}; "
                               "delete it to try again)")
    if target.exists():
        why = untrusted_reason(target)
        if why is None:
            return target
        out_dir = _fresh_private_dir(f"{target} {why}")
        target, failed = out_dir / name, out_dir / f"{name}.failed"
    _compile(cc, compile_flags(isa), source, target, failed)
    _prune(out_dir, source.stem, keep=target)
    return target


def _compile(cc: str, flags: tuple[str, ...], source: Path, target: Path, failed: Path) -> None:
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        partial = Path(tmp) / target.name
        command = [cc, *flags, str(source), "-o", str(partial), *LINK_FLAGS]
        try:
            done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=COMPILE_TIMEOUT_S)
        except subprocess.TimeoutExpired as exc:  # not remembered: a busy box may finish it next time
            raise KernelBuildError(f"{' '.join(command)} did not finish within {COMPILE_TIMEOUT_S:g} s") from exc
        if done.returncode != 0:
            report = f"{' '.join(command)} failed (exit {done.returncode}):\n{done.stderr[-2000:]}"
            failed.write_text(report)
            raise KernelBuildError(report)
        os.chmod(partial, 0o700)
        os.replace(partial, target)  # atomic: concurrent starts never load a half-written file


def _prune(out_dir: Path, stem: str, keep: Path) -> None:
    """Keep the KEEP_BUILDS most recent libraries (by modification time), `keep` among them."""
    builds = sorted(out_dir.glob(f"{stem}-*.so"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in [p for p in builds if p != keep][KEEP_BUILDS - 1:]:
        old.unlink(missing_ok=True)  # a process that has one loaded keeps its mapping
