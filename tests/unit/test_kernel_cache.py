"""The native kernel cache (pagedserve/kernels/builder.py): nobody else can plant a library the server loads;
failed builds are remembered; the compiler has a time limit; recent builds are kept.

A tiny C file stands in for cpu_kernels.c, so these tests build in milliseconds; they need a C compiler,
which the kernel build itself needs (the README's install has one).
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from pagedserve.kernels import builder as kb

pytestmark = pytest.mark.skipif(kb._compiler() is None, reason="no C compiler: the kernels are never built here")


def source(tmp_path: Path, body: str = "int ps_answer(void) { return 42; }\n", name: str = "k.c") -> Path:
    path = tmp_path / name
    path.write_text(body)
    return path


def test_cache_directory_is_private(tmp_path):
    built = kb.build(source(tmp_path), cache_root=tmp_path / "cache")
    assert built.parent == tmp_path / "cache" / "kernels"
    assert stat.S_IMODE(built.parent.stat().st_mode) == 0o700
    assert kb.untrusted_reason(built) is None


def test_a_library_planted_in_a_world_writable_cache_is_refused(tmp_path):
    src = source(tmp_path)
    cache = tmp_path / "cache" / "kernels"
    cache.mkdir(parents=True)
    os.chmod(cache, 0o777)  # e.g. a shared /tmp-style directory: anyone could have written here
    planted = cache / kb.library_name(src, kb._compiler())
    planted.write_bytes(b"not what pagedserve built")
    built = kb.build(src, cache_root=tmp_path / "cache")
    assert built != planted and built.parent != cache  # built afresh in a private directory
    assert kb.untrusted_reason(built.parent) is None and stat.S_IMODE(built.parent.stat().st_mode) == 0o700
    assert planted.read_bytes() == b"not what pagedserve built"  # never loaded nor overwritten
    shutil.rmtree(built.parent)


def test_a_group_writable_library_in_a_private_cache_is_refused(tmp_path):
    src = source(tmp_path)
    first = kb.build(src, cache_root=tmp_path)
    os.chmod(first, 0o775)
    second = kb.build(src, cache_root=tmp_path)
    assert second != first and "writable by group or others" in kb.untrusted_reason(first)
    shutil.rmtree(second.parent)


def test_a_symlinked_library_is_refused(tmp_path):
    src = source(tmp_path)
    first = kb.build(src, cache_root=tmp_path)
    elsewhere = tmp_path / "elsewhere.so"
    first.rename(elsewhere)
    first.symlink_to(elsewhere)
    rebuilt = kb.build(src, cache_root=tmp_path)
    assert rebuilt.parent != first.parent and kb.untrusted_reason(first) == "is a symbolic link"
    shutil.rmtree(rebuilt.parent)


def test_a_failed_build_is_remembered_and_not_retried(tmp_path, monkeypatch):
    broken = source(tmp_path, "this is not C;\n")
    with pytest.raises(kb.KernelBuildError, match="failed"):
        kb.build(broken, cache_root=tmp_path)
    markers = list((tmp_path / "kernels").glob("*.failed"))
    assert len(markers) == 1 and "error" in markers[0].read_text()
    compiles = []
    real_run = subprocess.run
    monkeypatch.setattr(kb.subprocess, "run",
                        lambda cmd, **kw: compiles.append(cmd) if "-shared" in cmd else real_run(cmd, **kw))
    with pytest.raises(kb.KernelBuildError, match="earlier build .* failed .*delete it"):
        kb.build(broken, cache_root=tmp_path)
    assert compiles == []  # the compiler was not run again
    markers[0].unlink()  # deleting the marker retries (and fails again, loudly)
    monkeypatch.undo()
    with pytest.raises(kb.KernelBuildError, match="failed \\(exit"):
        kb.build(broken, cache_root=tmp_path)


def test_the_compiler_has_a_time_limit(tmp_path, monkeypatch):
    slow = tmp_path / "slow-cc"
    slow.write_text("#!/bin/sh\n[ \"$1\" = --version ] && { echo slow-cc 1.0; exit 0; }\nsleep 30\n")
    slow.chmod(0o755)
    monkeypatch.setattr(kb, "_compiler", lambda: str(slow))
    monkeypatch.setattr(kb, "COMPILE_TIMEOUT_S", 0.5)
    with pytest.raises(kb.KernelBuildError, match="did not finish within 0.5 s"):
        kb.build(source(tmp_path), cache_root=tmp_path)
    assert not list((tmp_path / "kernels").glob("*.failed"))  # a busy box may finish it next time


def test_flags_are_part_of_the_cache_key(tmp_path, monkeypatch):
    src = source(tmp_path)
    plain = kb.library_name(src, kb._compiler())
    monkeypatch.setattr(kb, "COMPILE_FLAGS", kb.COMPILE_FLAGS + ("-DPS_EXTRA=1",))
    assert kb.library_name(src, kb._compiler()) != plain


def test_an_avx2_build_is_its_own_library_for_x86_64_v3(tmp_path):
    """PAGEDSERVE_CPU_ISA=avx2 builds the AVX2 kernels on any x86 CPU: AVX2 + FMA + F16C (x86-64-v3) instead of
    -march=native, cached under its own name beside the native build."""
    src = source(tmp_path)
    flags = kb.compile_flags("avx2")
    assert "-march=x86-64-v3" in flags and "-march=native" not in flags
    assert "-march=native" in kb.compile_flags("native")
    assert kb.library_name(src, kb._compiler(), "avx2") != kb.library_name(src, kb._compiler())
    with pytest.raises(kb.KernelBuildError, match="avx1024"):
        kb.compile_flags("avx1024")


def test_the_isa_variable_takes_native_or_a_fixed_build_and_names_the_fix(monkeypatch):
    from pagedserve import envs

    assert set(envs.CPU_ISAS) == set(kb.ISA_MARCH) == {"native", *kb.BUILD_ISA} == {"native", *kb.BUILD_FLAGS}
    for value, isa in (("", "native"), ("AVX2", "avx2"), ("native", "native"), ("avx512-VNNI", "avx512-vnni"),
                       ("avx2-vnni", "avx2-vnni")):
        monkeypatch.setenv("PAGEDSERVE_CPU_ISA", value)
        assert envs.cpu_isa() == isa
    monkeypatch.setenv("PAGEDSERVE_CPU_ISA", "avx512")  # the best ISA is what "native" already picks
    with pytest.raises(ValueError, match="PAGEDSERVE_CPU_ISA='avx512' is not one of native, avx2, avx2-vnni, "
                                         "avx512-vnni; unset it"):
        envs.cpu_isa()


def test_a_fixed_build_this_cpu_cannot_run_is_refused_before_it_is_built(monkeypatch):
    """It would die (SIGILL) on its first instruction the CPU lacks; the torch path runs instead, and the reason
    names the missing flags and the fix."""
    import pagedserve.kernels as kernels_module

    monkeypatch.setattr(kernels_module, "is_x86", lambda: True)
    monkeypatch.setattr(kernels_module, "cpu_flags", lambda: {"avx2", "fma", "f16c", "sse4_2"})  # a Zen 3
    monkeypatch.setattr(kernels_module, "build", lambda **_: pytest.fail("built a library this CPU cannot run"))
    for isa, missing in (("avx2-vnni", "avx_vnni"), ("avx512-vnni", "avx512_vnni, avx512bw, avx512f")):
        kernels, why = kernels_module.load.__wrapped__(isa)
        assert kernels is None
        assert why == (f"PAGEDSERVE_CPU_ISA={isa} needs the CPU flags {missing}, which this CPU lacks; unset it for "
                       "the best build this CPU runs")


def test_the_most_recent_builds_are_kept(tmp_path):
    built = []
    for i in range(kb.KEEP_BUILDS + 2):
        path = kb.build(source(tmp_path, f"int ps_answer(void) {{ return {i}; }}\n"), cache_root=tmp_path)
        os.utime(path, (1000 + i, 1000 + i))  # distinct, increasing modification times
        built.append(path)
    kept = sorted((tmp_path / "kernels").glob("k-*.so"))
    assert kept == sorted(built[-kb.KEEP_BUILDS:])
