"""The native kernel build a test runs: each kernel test runs once per ISA the kernels are written for.

The AVX-512 tests need an AVX-512 CPU (F, BW, VNNI); the AVX2 ones run on any CPU with AVX2 + FMA + F16C,
AVX-512 CPUs included (the library is then built for x86-64-v3), so a CI run on either kind of machine
compiles and checks the AVX2 C, and an AVX-512 machine checks both. A test of an ISA this CPU cannot run skips
with a message naming the flags it lacks. The fixture loads that ISA's library (pagedserve.kernels.load) and,
while the tests of a module run, makes `cpu_kernels()` answer with it, so models built in those tests (layers,
decode stack) run that ISA too.
"""

from __future__ import annotations

import pytest

import pagedserve.kernels
from pagedserve import envs
from pagedserve.memory.probe import NATIVE_ISA_FLAGS, cpu_flags, is_x86, native_kernel_isa

ISAS = tuple(name for name, _ in NATIVE_ISA_FLAGS)  # ("avx512", "avx2")


def kernel_build(isa: str) -> tuple[str | None, str]:
    """(the build that runs `isa`'s kernels here, or None; why not)."""
    if not is_x86():
        return None, "the native kernels are written for x86-64"
    missing = sorted(dict(NATIVE_ISA_FLAGS)[isa] - cpu_flags())
    if missing:
        return None, f"the {isa} kernels need the CPU flags {', '.join(missing)}, which this CPU lacks"
    chosen = envs.cpu_isa()
    if chosen != "native" and chosen != isa:
        return None, f"PAGEDSERVE_CPU_ISA={chosen} runs the {chosen} kernels only"
    return ("native" if native_kernel_isa(cpu_flags()) == isa else isa), ""


@pytest.fixture(scope="module", params=ISAS)
def kernel_build_of(request):
    """(isa, its native kernels or None where this CPU cannot run them, why not); `cpu_kernels()` returns
    those kernels for the rest of the module's tests that use this fixture."""
    build, why = kernel_build(request.param)
    kernels = None
    if build is not None:
        kernels, why = pagedserve.kernels.load(build)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pagedserve.kernels, "load_status", lambda: (kernels, why))
        yield request.param, kernels, why


@pytest.fixture(scope="module")
def kernels(kernel_build_of):
    """The native kernels of one ISA; the test skips where this CPU cannot run that ISA (naming the flags)."""
    isa, kernels, why = kernel_build_of
    if kernels is None:
        pytest.skip(f"{isa}: {why}")
    assert kernels.isa == isa
    return kernels
