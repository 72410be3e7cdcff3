"""memory/weight_format.py: the linear kind rule KernelBackend.choose and the memory plan share (the two are
compared on real kernels in tests/models/test_memory_plan_engine.py), and the prediction from CPU flags."""

from __future__ import annotations

import pytest

from pagedserve.memory.weight_format import WeightFormat, expected_weight_format, native_kernels_expected, onednn_may_pack

AVX2 = {"sse2", "avx2", "fma", "f16c", "sse4_2"}
AVX512 = {"avx512f", "avx512bw", "avx512_vnni", *AVX2}


def test_native_kernels_are_expected_where_an_isa_they_are_written_for_runs() -> None:
    assert native_kernels_expected(AVX2, machine="x86_64") and native_kernels_expected(AVX512, machine="AMD64")
    assert not native_kernels_expected(AVX2, enabled=False, machine="x86_64")  # PAGEDSERVE_CPU_KERNELS=0
    assert not native_kernels_expected({"avx2", "fma"}, machine="x86_64")  # no F16C
    assert not native_kernels_expected(set(), machine="x86_64")
    assert not native_kernels_expected({"fp", "asimd", "avx2", "fma", "f16c"}, machine="aarch64")


AVX512_DQ = {"avx512vl", "avx512dq", *AVX512}


@pytest.mark.parametrize(("device", "dtype", "quantization", "reference", "native", "flags", "expected"), [
    ("cpu", "bfloat16", None, False, True, AVX2, WeightFormat("packed", True)),  # the native bf16 kernel
    ("cpu", "bfloat16", None, False, False, AVX512_DQ, WeightFormat("packed", False)),  # oneDNN
    ("cpu", "bfloat16", None, False, False, AVX2, WeightFormat("plain", False)),  # oneDNN refuses bf16 on AVX2
    ("cpu", "float32", None, False, True, AVX2, WeightFormat("packed", False)),  # float32 linears stay on oneDNN
    ("cpu", "float16", None, False, True, AVX2, WeightFormat("plain", False)),
    ("cpu", "bfloat16", None, True, True, AVX2, WeightFormat("plain", False)),  # the reference path
    ("cpu", "bfloat16", "int8", True, True, AVX2, WeightFormat("int8", False)),
    ("cpu", "float32", "int8", False, True, AVX2, WeightFormat("int8", False)),
    ("cuda", "bfloat16", None, False, True, AVX2, WeightFormat("plain", False)),
    ("cuda", "float16", "int8", False, False, AVX2, WeightFormat("int8", False)),
])
def test_expected_weight_format(device, dtype, quantization, reference, native, flags, expected) -> None:
    assert expected_weight_format(device, dtype, quantization, reference, native, flags) == expected


def test_onednn_packs_bf16_only_where_the_cpu_converts_it() -> None:
    def packs(device: str, dtype: str, flags: set[str], machine: str = "x86_64") -> bool:
        return onednn_may_pack(device, dtype, flags, machine=machine)

    assert packs("cpu", "float32", AVX2) and packs("cpu", "bfloat16", AVX512_DQ)
    assert packs("cpu", "bfloat16", AVX2 | {"avx_ne_convert"})
    assert not packs("cpu", "bfloat16", AVX2) and not packs("cpu", "bfloat16", AVX512)
    assert packs("cpu", "bfloat16", {"fp", "asimd", "bf16"}, machine="aarch64")  # not x86: the probe decides
    assert packs("cpu", "bfloat16", set(), machine="aarch64") and not packs("cpu", "bfloat16", set())
    assert not packs("cuda", "float32", AVX2) and not packs("cpu", "float16", AVX512_DQ)


def test_unsupported_quantization_is_refused() -> None:
    with pytest.raises(ValueError, match="quantization 'int4' is not supported; supported: int8"):
        expected_weight_format("cpu", "bfloat16", "int4", False, True, AVX2)


def test_platform_and_the_plan_modules_import_without_torch() -> None:
    """`pagedserve plan` resolves device, dtype and quantization in platform.py and plans in
    engine/memory_plan.py: neither imports torch (or builds the kernels) when imported."""
    import subprocess
    import sys

    code = ("import sys; import pagedserve.platform, pagedserve.engine.memory_plan, pagedserve.engine.setup; "
            "assert 'torch' not in sys.modules and 'pagedserve.kernels' not in sys.modules, 'torch imported'; "
            "from pagedserve.platform import canonical_dtype_name; assert canonical_dtype_name('half') == 'float16'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


AVX512 = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni"}


@pytest.mark.parametrize("flags,cpu_isa,expected", [
    (AVX512, "native", "gguf"),  # Ice Lake, Cascade Lake: measured
    (AVX512, "avx2", "int8"),  # the AVX2 build asked for
    (AVX512 | {"avx512_bf16"}, "native", "gguf"),  # Zen 4/5: measured on a Zen 4
    (AVX512 | {"avx512_bf16", "amx_tile", "amx_bf16"}, "native", "int8"),  # AMX Xeons: its AMX tiles
    (AVX512 | {"avx512_bf16", "amx_tile", "amx_bf16"}, "avx512-vnni", "gguf"),  # the Ice Lake build asked for
    ({"avx2", "fma", "f16c"}, "native", "int8"),  # Zen 2/3, Haswell .. Alder Lake: the block kernel measured slower
    ({"avx2", "fma", "f16c", "avx_vnni"}, "avx2-vnni", "int8"),
    ({"sse4_2"}, "native", None),  # no native kernels: dequantized to the dtype
])
def test_a_block_quantized_gguf_keeps_its_blocks_by_default_where_they_are_faster(monkeypatch, flags, cpu_isa,
                                                                                  expected) -> None:
    """The per-class rule for `--dtype auto` on a Q4/Q5/K-quant GGUF (weight_format.default_file_quantization), told
    from the flags as `pagedserve plan` tells it; an explicit --quantization gguf keeps the blocks on every ISA."""
    from pagedserve import platform

    monkeypatch.setattr(platform, "cpu_flags", lambda: flags)
    monkeypatch.setattr(platform, "native_kernels_run",
                        lambda from_flags=False: native_kernels_expected(flags, True, "x86_64"))
    monkeypatch.setenv("PAGEDSERVE_CPU_ISA", cpu_isa)
    assert platform.default_quantization("auto", None, True, "cpu", kernels_from_flags=True) == expected
    assert platform.default_quantization("auto", "gguf", True, "cpu", kernels_from_flags=True) == (
        None if expected is None else "gguf")
    assert platform.default_quantization("bfloat16", None, True, "cpu", kernels_from_flags=True) is None
    # a model verifying speculative drafts runs 1 + k rows a step, faster on int8 on every class
    assert platform.default_quantization("auto", None, True, "cpu", kernels_from_flags=True, verifies_drafts=True) == (
        None if expected is None else "int8")
    assert platform.default_quantization("auto", "gguf", True, "cpu", kernels_from_flags=True,
                                         verifies_drafts=True) == (None if expected is None else "gguf")
    # tensor-parallel ranks split each matrix, and the blocks are not split: int8 rows, asked for or by default
    for asked in (None, "gguf"):
        assert platform.default_quantization("auto", asked, True, "cpu", kernels_from_flags=True, ranks=2) == (
            None if expected is None else "int8")
