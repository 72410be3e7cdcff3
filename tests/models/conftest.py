"""The native kernel build a test runs: each kernel test runs once per ISA the kernels are written for.

The AVX-512 tests need an AVX-512 CPU (F, BW, VNNI); the AVX2 ones run on any CPU with AVX2 + FMA + F16C,
AVX-512 CPUs included (the library is then built for x86-64-v3), so a CI run on either kind of machine
compiles and checks the AVX2 C, and an AVX-512 machine checks both. An AVX-512 CPU with BF16 or AMX also runs
the AVX-512 kernels built without them ("avx512-vnni", -march=cascadelake: the float32 paths of a Cascade Lake
or Ice Lake), and a CPU with AVX-VNNI runs the AVX2 kernels both with and without it ("avx2-vnni"). A test of a
build this CPU cannot run skips with a message naming the flags it lacks. The fixtures
load that build's library (pagedserve.kernels.load) once per module and, while a test that asks for it runs, make
`cpu_kernels()` answer with it, so models built in that test (layers, decode stack) run that build too.
"""

from __future__ import annotations

import pytest

import pagedserve.kernels
from pagedserve import envs
from pagedserve.kernels import builder
from pagedserve.memory.probe import (AMX_BF16_FLAGS, BF16_DOT_FLAGS, NATIVE_ISA_FLAGS, cpu_flags, is_x86,
                                     native_kernel_isa)

# The builds each kernel test runs: the kernels' two ISAs, the AVX-512 kernels built without BF16 and AMX
# (the paths of a Cascade Lake or Ice Lake), which an AVX-512 CPU with them also checks, and the AVX2 kernels with
# AVX-VNNI's int8 sums, wherever the CPU has it.
BUILD_ISA = {"avx512": "avx512", **builder.BUILD_ISA}  # build -> the kernels' ISA
BUILDS = tuple(BUILD_ISA)


def kernel_build(build: str) -> tuple[str | None, str]:
    """(the pagedserve.kernels.load build that runs `build` here, or None; why not)."""
    if not is_x86():
        return None, "the native kernels are written for x86-64"
    isa, flags = BUILD_ISA[build], cpu_flags()
    missing = sorted(builder.BUILD_FLAGS.get(build, dict(NATIVE_ISA_FLAGS)[isa]) - flags)
    if missing:
        return None, f"the {build} kernels need the CPU flags {', '.join(missing)}, which this CPU lacks"
    chosen = envs.cpu_isa()
    if chosen != "native":  # a build PAGEDSERVE_CPU_ISA asks for runs its own tests, and only those
        if chosen != build:
            return None, f"PAGEDSERVE_CPU_ISA={chosen} runs the {chosen} build only"
        return chosen, ""
    native = native_kernel_isa(flags) == isa
    if build == "avx512-vnni":
        if not flags & (BF16_DOT_FLAGS | AMX_BF16_FLAGS):
            return None, "this CPU has no BF16 or AMX: its avx512 build is this one"
        return build, ""
    if build == "avx2" and native and "avx_vnni" in flags:
        return build, ""  # x86-64-v3: the native build is the avx2-vnni one
    return ("native" if native else build), ""


@pytest.fixture(scope="module", params=BUILDS)
def kernel_build_loaded(request):
    """(isa, its native kernels or None where this CPU cannot run them, why not), loaded once per module."""
    build, why = kernel_build(request.param)
    kernels = None
    if build is not None:
        kernels, why = pagedserve.kernels.load(build)
    return request.param, kernels, why


@pytest.fixture
def kernel_build_of(kernel_build_loaded, monkeypatch):
    """kernel_build_loaded, with `cpu_kernels()` answering with those kernels for this test only: the module's
    tests that do not ask for a build see the machine's own (a module-scoped patch leaked the last build's
    answer, None where this CPU cannot run it, into them, and `--dtype auto` became float32 there)."""
    build, kernels, why = kernel_build_loaded
    monkeypatch.setattr(pagedserve.kernels, "load_status", lambda: (kernels, why))
    return kernel_build_loaded


@pytest.fixture
def kernels(kernel_build_of):
    """The native kernels of one ISA; the test skips where this CPU cannot run that ISA (naming the flags)."""
    build, kernels, why = kernel_build_of
    if kernels is None:
        pytest.skip(f"{build}: {why}")
    assert kernels.isa == BUILD_ISA[build]
    return kernels
