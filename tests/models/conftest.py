"""The native kernel build a test runs: each kernel test runs once per ISA this machine can run.

An AVX-512 CPU also runs the AVX2 kernels (x86-64-v3), so a CI run on either kind of machine compiles and
checks the AVX2 C; on an AVX-512 machine the AVX-512 C is checked as well. The fixture loads that ISA's
library (pagedserve.kernels.load) and, while the tests of a module run, makes `cpu_kernels()` answer with
it, so models built in those tests (layers, decode stack) run that ISA too.
"""

from __future__ import annotations

import pytest

import pagedserve.kernels
from pagedserve import envs
from pagedserve.memory.probe import NATIVE_ISA_FLAGS, cpu_flags, is_x86

NO_KERNELS = ("neither AVX-512 (F, BW, VNNI) nor AVX2 + FMA + F16C on this CPU: the torch path is used "
              "(covered by the other tests)")


def kernel_isas() -> list[str]:
    """The kernel builds to test here: the one PAGEDSERVE_CPU_ISA selects ("native" unless set), plus the
    AVX2 build where the native one is AVX-512 (such a CPU runs AVX2 code too)."""
    chosen = envs.cpu_isa()
    flags = dict(NATIVE_ISA_FLAGS)
    if chosen == "native" and is_x86() and flags["avx512"] <= cpu_flags() and flags["avx2"] <= cpu_flags():
        return ["native", "avx2"]
    return [chosen]


@pytest.fixture(scope="module", params=kernel_isas())
def kernel_build(request):
    """The native kernels of one ISA build (None where they cannot load here), also what `cpu_kernels()`
    returns for the rest of the module's tests that use this fixture."""
    kernels, why = pagedserve.kernels.load(request.param)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pagedserve.kernels, "load_status", lambda: (kernels, why))
        yield kernels


@pytest.fixture(scope="module")
def kernels(kernel_build):
    """The native kernels of one ISA build; the test skips where none can run on this CPU."""
    if kernel_build is None:
        pytest.skip(NO_KERNELS)
    return kernel_build
