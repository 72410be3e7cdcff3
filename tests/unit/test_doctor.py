"""`pagedserve doctor`: each check on fake inputs (no torch import), the report and its exit code."""

from __future__ import annotations

import argparse
import json
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from pagedserve.cli import doctor, doctor_model
from pagedserve.cli.doctor import FAIL, PASS, WARN, CheckResult, TorchBuildInfo
from pagedserve.memory.probe import GIB, AvailableMemory, Cores


def test_python_and_package_versions() -> None:
    assert doctor.check_python((3, 11, 7)).status == PASS
    assert doctor.check_python((3, 9, 18)).status == FAIL
    ok = doctor.check_packages({"torch": "2.13.0+cpu", "transformers": "5.24.0"})
    assert ok.status == PASS and "torch 2.13.0+cpu" in ok.detail
    old = doctor.check_packages({"torch": "2.1.2+cu118", "transformers": None})
    assert old.status == FAIL
    assert "torch 2.1.2+cu118 is older than 2.5" in old.detail and "transformers is not installed" in old.detail
    assert "pip install -U 'torch>=2.5'" in old.fix


def test_accelerator_arch_mismatch_fails_with_fix() -> None:
    # An sm_120 GPU with a torch wheel built only up to sm_90: "no kernel image is available".
    info = TorchBuildInfo(version="2.3.1+cu121", cuda_version="12.1", cuda_available=True,
                          device_name="RTX 5090", capability=(12, 0), arch_list=["sm_80", "sm_86", "sm_90"],
                          has_nvidia_gpu=True)
    result = doctor.check_accelerator(info)
    assert result.status == FAIL and "sm_120" in result.detail and "sm_120" in result.fix


@pytest.mark.parametrize("capability, arch_list", [
    ((8, 0), ["sm_80", "sm_90"]),  # exact cubin
    ((8, 6), ["sm_80"]),  # same major, older minor: binary compatible
    ((9, 0), ["sm_80", "compute_80"]),  # PTX JIT-compiles for newer GPUs
])
def test_accelerator_supported_architectures(capability: tuple[int, int], arch_list: list[str]) -> None:
    info = TorchBuildInfo(version="2.6.0+cu124", cuda_version="12.4", cuda_available=True, device_name="GPU",
                          capability=capability, arch_list=arch_list, has_nvidia_gpu=True)
    assert doctor.check_accelerator(info).status == PASS


def test_accelerator_builds_that_fall_back_to_cpu() -> None:
    cpu_build_on_gpu_host = TorchBuildInfo(version="2.13.0+cpu", cuda_version=None, cuda_available=False,
                                           has_nvidia_gpu=True)
    result = doctor.check_accelerator(cpu_build_on_gpu_host)
    assert result.status == WARN and "CUDA build" in result.fix
    cuda_build_no_driver = TorchBuildInfo(version="2.6.0+cu126", cuda_version="12.6", cuda_available=False,
                                          has_nvidia_gpu=True)
    result = doctor.check_accelerator(cuda_build_no_driver)
    assert result.status == WARN and "nvidia-smi" in result.fix and "12.6" in result.fix
    plain_cpu = TorchBuildInfo(version="2.13.0+cpu", cuda_version=None, cuda_available=False)
    assert doctor.check_accelerator(plain_cpu).status == PASS


def test_host_gpu_detection_reads_paths(tmp_path: Path) -> None:
    assert not doctor.host_has_nvidia_gpu(tmp_path / "version", tmp_path / "nvidia0")
    (tmp_path / "version").write_text("NVRM version: 550.54\n")
    assert doctor.host_has_nvidia_gpu(tmp_path / "version", tmp_path / "nvidia0")


def test_cpu_flags_decide_the_fast_dtype() -> None:
    no_bf16 = doctor.check_cpu({"avx2", "avx512f", "fma"})  # no F16C, no VNNI: no native kernels either
    assert no_bf16.status == PASS
    assert "auto picks float32" in no_bf16.detail and "no AVX512-BF16, AMX-BF16" in no_bf16.detail
    assert "--dtype float32" in no_bf16.fix
    bf16 = doctor.check_cpu({"avx2", "avx512f", "avx512_bf16", "amx_bf16"})
    assert "auto picks bfloat16" in bf16.detail and "dot-product" in bf16.detail and bf16.fix == ""
    avx2 = {"avx2", "fma", "f16c"}  # Zen 3: bf16 where the native kernels load, float32 where they cannot
    assert "auto picks bfloat16" in doctor.check_cpu(avx2).detail and "avx2 kernels" in doctor.check_cpu(avx2).detail
    without = doctor.check_cpu(avx2, native_kernels=False)
    assert "auto picks float32" in without.detail and "--dtype float32" in without.fix
    assert doctor.check_cpu(set()).status == WARN


def test_cores_and_memory() -> None:
    smt = tuple((core, core + 32) for core in range(32))  # 64 CPUs, two threads a core
    result = doctor.check_cores(Cores(smt, quota=4.0), online=64, environ={})
    assert result.status == PASS and "64 logical CPUs usable of 64 online (cgroup quota 4 cores)" in result.detail
    assert "32 physical cores (SMT); torch will use 4 threads (one per physical core within the quota" in result.detail
    assert "idle threads spin briefly, then sleep (--omp-wait-policy brief)" in result.detail
    result = doctor.check_cores(Cores(smt), online=64, environ={"OMP_WAIT_POLICY": "ACTIVE"})
    assert "torch will use 32 threads (one per physical core;" in result.detail
    assert "as the environment says (OMP_WAIT_POLICY=ACTIVE; --omp-wait-policy overrides it)" in result.detail
    hybrid = Cores(tuple((2 * i, 2 * i + 1) for i in range(6)) + tuple((c,) for c in range(12, 20)),
                   efficiency=frozenset(range(12, 20)))
    result = doctor.check_cores(hybrid, online=20)
    assert "14 physical cores (SMT), 8 of them efficiency cores (left out" in result.detail
    assert "torch will use 6 threads" in result.detail
    plain = doctor.check_cores(Cores(((0,), (1,))), online=2)
    assert "2 logical CPUs usable of 2 online (no cgroup CPU quota); torch will use 2 threads;" in plain.detail
    assert doctor.check_cores(Cores(((0,), (1,)), quota=0.5), online=8).status == WARN
    quiet = doctor.check_cores(Cores(((0,), (1,))), online=2, neighbours=0.2)
    assert quiet.status == PASS and "other processes kept 0.2 of the 2 CPUs busy just now" in quiet.detail
    busy = doctor.check_cores(Cores(((0,), (1,))), online=2, neighbours=1.1)
    assert busy.status == WARN and "serve would give way to them: 1 thread, --cpu-give-way" in busy.detail
    assert "taskset" in busy.fix
    low = AvailableMemory(GIB, "cgroup", "cgroup v2 limit 2.00 GiB - used 1.00 GiB = 1.00 GiB")
    result = doctor.check_memory(low)
    assert result.status == WARN and "1.00 GiB available, bound by cgroup" in result.detail
    assert doctor.check_memory(AvailableMemory(9 * GIB, "MemAvailable", "x")).status == PASS


def test_open_files_limit() -> None:
    result = doctor.check_open_files((1024, 4096))
    assert result.status == WARN and "ulimit -n" in result.fix
    assert doctor.check_open_files((65536, 65536)).status == PASS


def test_bytecode_that_every_start_would_compile(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    for name in ("a.py", "sub/b.py"):
        (package / name).write_text("X = 1\n")
    result = doctor.check_bytecode(package, dont_write=True)
    assert result.status == WARN and "2 of 2 modules" in result.detail and "compileall" in result.fix
    assert doctor.check_bytecode(package, dont_write=False).status == PASS  # the first import writes them
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(package)], check=True)
    result = doctor.check_bytecode(package, dont_write=True)
    assert result.status == PASS and "all 2 modules" in result.detail
    (package / "sub" / "b.py").write_text("X = 22\n")  # edited: its bytecode is stale
    result = doctor.check_bytecode(package, dont_write=True)
    assert result.status == WARN and "1 of 2 modules" in result.detail


def test_disk_space_in_cache_dir(tmp_path: Path) -> None:
    missing_dir = tmp_path / "not" / "yet"  # measured at the nearest existing parent
    seen = []

    def usage(path: Path) -> tuple[int, int, int]:
        seen.append(path)
        return (100 * GIB, 99 * GIB + GIB // 2, GIB // 2)

    result = doctor.check_disk(missing_dir, disk_usage=usage)
    assert seen == [tmp_path] and result.status == FAIL and "0.50 GiB free" in result.detail
    assert doctor.check_disk(tmp_path, disk_usage=lambda p: (0, 0, 5 * GIB)).status == WARN
    assert doctor.check_disk(tmp_path, disk_usage=lambda p: (0, 0, 50 * GIB)).status == PASS


def test_port_in_use_fails() -> None:
    with socket.socket() as listener:
        listener.bind(("0.0.0.0", 0))
        listener.listen()
        port = listener.getsockname()[1]
        result = doctor.check_port(port)
        assert result.status == FAIL and f"port {port} is in use" in result.detail and "--port" in result.fix
    assert doctor.check_port(port).status == PASS
    assert doctor.check_port(0).status == FAIL  # bind() takes 0 as any port: it said "port 0 is free"


def test_doctor_checks_serve_s_own_address(tmp_path):
    """--host that is no address here FAILs (serve exited 3 on it while doctor passed); with --uds there is no
    TCP port to check."""
    bad = doctor.check_port(8000, "256.1.1.1")
    assert bad.status == FAIL and "--host '256.1.1.1'" in bad.detail
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    assert doctor.check_port(free, "127.0.0.1").status == PASS
    if socket.has_ipv6:  # --host ::1 read as "not an address of this machine" (an IPv4 socket was bound)
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
            free6 = probe.getsockname()[1]
        assert doctor.check_port(free6, "::1").status == PASS
    uds = str(tmp_path / "s.sock")
    results = [r for r in (c() for c in doctor.default_checks(None, 8000, uds=uds)) if r and r.name == "port"]
    assert [r.detail for r in results] == [f"listens on the Unix socket {uds}"]


def test_doctor_fails_a_socket_path_serve_refuses_once(tmp_path, capsys):
    """A --uds path that is a regular file (or in a missing folder): the flags FAIL as serve's check words it, and
    no "PASS port listens on the Unix socket" line beside it (QA-P)."""
    from pagedserve.cli.main import main

    regular = tmp_path / "regular.file"
    regular.write_text("x")
    assert doctor.check_socket(str(regular)).status == FAIL
    assert "does not exist" in doctor.check_socket(str(tmp_path / "nodir" / "x.sock")).detail
    assert main(["doctor", "--uds", str(regular), "--json"]) == 1
    results = json.loads(capsys.readouterr().out)
    flags = [r for r in results if r["name"] == "flags"]
    assert len(flags) == 1 and "is not a socket" in flags[0]["detail"], results
    assert [r for r in results if r["name"] == "port"] == []
    # Another flag failing first: the flags line names that one, so the socket's own FAIL stays (QA-X)
    assert main(["doctor", "--uds", str(regular), "--max-num-seqs", "0", "--json"]) == 1
    results = json.loads(capsys.readouterr().out)
    assert [r["status"] for r in results if r["name"] == "port"] == ["FAIL"], results


def write_safetensors(path: Path, num_floats: int, truncate_by: int = 0) -> None:
    header = json.dumps({"w": {"dtype": "F32", "shape": [num_floats], "data_offsets": [0, 4 * num_floats]}})
    raw = header.encode()
    data = struct.pack("<Q", len(raw)) + raw + bytes(4 * num_floats)
    path.write_bytes(data[: len(data) - truncate_by] if truncate_by else data)


def test_model_check_names_truncated_weights_then_missing_tokenizer(tmp_path: Path) -> None:
    shape = {"hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
             "vocab_size": 512}
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], **shape}))
    write_safetensors(tmp_path / "model.safetensors", num_floats=1000, truncate_by=1500)
    result = doctor_model.check_model(tmp_path)
    assert result.status == FAIL and "truncated" in result.detail and "1,500" in result.detail

    write_safetensors(tmp_path / "model.safetensors", num_floats=1000)
    result = doctor_model.check_model(tmp_path)
    assert result.status == FAIL and "tokenizer" in result.detail

    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "tokenizer_config.json").write_text("{}")
    result = doctor_model.check_model(tmp_path)  # present, but it does not load: serve would fail
    assert result.status == FAIL and "the tokenizer in" in result.detail and "cannot be loaded" in result.detail

    from tests.tiny_models import make_tokenizer

    make_tokenizer(tmp_path)
    result = doctor_model.check_model(tmp_path)
    assert result.status == PASS and "no chat template" not in result.detail
    (tmp_path / "chat_template.jinja").unlink()  # where transformers saves it
    result = doctor_model.check_model(tmp_path)  # serves completions; chat gets a 400: said, not a failure
    assert result.status == PASS and "no chat template, so chat requests get a 400" in result.detail, result


def test_report_exit_code_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    def broken() -> CheckResult:
        raise RuntimeError("probe exploded")

    checks = [lambda: CheckResult("a", PASS, "fine"), lambda: None, broken,
              lambda: CheckResult("b", FAIL, "bad", "do this")]
    results = doctor.run_checks(checks)
    assert [r.status for r in results] == [PASS, WARN, FAIL]  # None = skipped; a crash is a WARN
    assert "probe exploded" in results[1].detail
    assert doctor.report(results, as_json=False) == 1
    text = capsys.readouterr().out
    assert "FAIL  b" in text and "fix: do this" in text and "1 failed, 1 warnings, 1 passed" in text
    assert doctor.report(results[:1], as_json=True) == 0
    assert json.loads(capsys.readouterr().out) == [{"name": "a", "status": PASS, "detail": "fine", "fix": ""}]


def test_register_parses_the_flags() -> None:
    parser = argparse.ArgumentParser()
    doctor.register(parser.add_subparsers())
    args = parser.parse_args(["doctor", "/models/x", "--json", "--port", "8011"])
    assert (args.model, args.json, args.port, args.func) == ("/models/x", True, 8011, doctor.run)



def test_a_port_out_of_range_is_one_failure_not_two(capsys) -> None:
    """serve's flag check names the bad --port; the port check would say it again (it had two FAIL lines)."""
    from pagedserve.cli.main import main

    code = main(["doctor", "--port", "99999", "--json"])
    results = json.loads(capsys.readouterr().out)
    assert code == 1
    assert [r["name"] for r in results if "99999" in r["detail"]] == ["flags"]
    assert "port" not in [r["name"] for r in results]

def test_doctor_modules_do_not_import_torch() -> None:
    code = (
        "import sys, pagedserve.cli.doctor, pagedserve.cli.watch, pagedserve.memory.plan;"
        "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_native_kernels_check_names_the_fix_when_the_cpu_could_run_them(monkeypatch):
    import platform

    import pagedserve.kernels as kernels
    from pagedserve.cli.doctor import FAIL, WARN, check_native_kernels

    real_load_status = kernels.load_status
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(kernels, "load_status", lambda: (None, "could not build or load them: no C compiler"))
    result = check_native_kernels({"avx512f", "avx512bw", "avx512_vnni"})
    assert result.status == WARN and "no C compiler" in result.detail and "gcc" in result.fix
    quiet = check_native_kernels({"avx2"})  # no FMA/F16C: a CPU that cannot run them, nothing to fix
    assert quiet.status != FAIL and quiet.fix == "" and "torch ops" in quiet.detail
    monkeypatch.setenv("PAGEDSERVE_CPU_ISA", "sve")
    monkeypatch.setattr(kernels, "load_status", real_load_status.__wrapped__)  # the real one, uncached
    bad = check_native_kernels({"avx2", "fma", "f16c"})
    assert bad.status == FAIL and "'sve' is not one of" in bad.detail and "unset PAGEDSERVE_CPU_ISA" in bad.fix


def test_doctor_says_whether_packed_weights_get_huge_pages(monkeypatch, tmp_path):
    import platform

    from pagedserve import kernels
    from pagedserve.cli.doctor import PASS, check_native_kernels
    from pagedserve.memory import probe

    setting = tmp_path / "enabled"
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    fake = type("Fake", (), {"isa": "avx512", "amx": False, "amx_int8": False, "avx_vnni": False,
                             "batch_invariant": False, "bf16_dot": False, "bf16_dot_attention": False})()
    monkeypatch.setattr(kernels, "load_status", lambda: (fake, "loaded /x.so"))
    original = probe.transparent_hugepages
    monkeypatch.setattr(probe, "transparent_hugepages", lambda: original(setting))
    setting.write_text("always [madvise] never\n")
    assert probe.transparent_hugepages() == "madvise"
    monkeypatch.delenv("PAGEDSERVE_HUGE_PAGES", raising=False)
    result = check_native_kernels({"avx512f", "avx512_vnni"})  # off by default: start-up first
    assert result.status == PASS and "4 KiB pages (PAGEDSERVE_HUGE_PAGES=1" in result.detail and result.fix == ""
    assert "batch-invariant" not in result.detail
    fake.batch_invariant = True
    assert "batch-invariant (PAGEDSERVE_BATCH_INVARIANT)" in check_native_kernels({"avx512f", "avx512_vnni"}).detail
    fake.batch_invariant = False
    monkeypatch.setenv("PAGEDSERVE_HUGE_PAGES", "1")
    result = check_native_kernels({"avx512f", "avx512_vnni"})
    assert result.status == PASS and "on transparent huge pages" in result.detail and result.fix == ""
    setting.write_text("always madvise [never]\n")
    result = check_native_kernels({"avx512f", "avx512_vnni"})
    assert "transparent huge pages never: 4 KiB pages" in result.detail and "madvise >" in result.fix
    setting.unlink()
    assert probe.transparent_hugepages() is None
    fake.amx = True  # a Xeon with AMX: doctor says the bf16 linears run on its tiles
    assert "bf16 linears on AMX tiles, int8 linears," in check_native_kernels({"avx512f", "avx512_vnni"}).detail
    fake.amx_int8 = True  # and int8 decode batches, where the library was built with AMX-INT8
    assert "int8 linears (AMX-INT8 tiles for 2-63 rows)" in check_native_kernels({"avx512f", "avx512_vnni"}).detail
    # bf16 attention: vdpbf16ps where the class runs it faster (a Zen 4/5), FMAs on a Xeon with AMX, and why
    amx_flags = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16"}
    fake.bf16_dot = True
    assert ("decode attention (bf16 by float32 FMAs, which run faster than vdpbf16ps on this CPU class)"
            in check_native_kernels(amx_flags).detail)
    assert "(bf16 by float32 FMAs: PAGEDSERVE_CPU_BF16_ATTENTION=0)" in check_native_kernels(
        amx_flags - {"amx_tile", "amx_bf16"}).detail  # a Zen 5 whose user turned vdpbf16ps off
    fake.bf16_dot_attention = True
    assert "decode attention (bf16 by vdpbf16ps);" in check_native_kernels(amx_flags - {"amx_tile"}).detail
    assert "(bf16 by vdpbf16ps: PAGEDSERVE_CPU_BF16_ATTENTION=1, though FMAs" in check_native_kernels(amx_flags).detail
    fake.bf16_dot = fake.bf16_dot_attention = False
    fake.isa, fake.amx, fake.amx_int8, fake.avx_vnni = "avx2", False, False, True  # an Alder Lake
    assert "avx2: bf16 linears, int8 linears (sums on AVX-VNNI)" in check_native_kernels({"avx2", "avx_vnni"}).detail
    assert "SiLU and GELU (tanh) gates, decode attention;" in check_native_kernels({"avx2", "avx_vnni"}).detail


def test_a_packaged_model_name_is_checked_in_the_cache_and_never_downloaded(monkeypatch, tmp_path):
    from pagedserve.models import fetch

    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(fetch, "download_wheel", lambda *a, **k: pytest.fail("doctor must not download"))
    results = [r for r in (check() for check in doctor.default_checks("smollm2-135m-instruct", 0)) if r]
    model = [r for r in results if r.name == "model"]
    assert len(model) == 1 and model[0].status == WARN and "not in the cache yet" in model[0].detail
    assert not any(r.name == "memory plan" for r in results)  # nothing to plan from
    # Once cached (and verified), its file is what is checked.
    name = fetch.KNOWN_MODELS["smollm2-135m-instruct"]
    monkeypatch.setattr(fetch, "_is_verified", lambda model, path: True)
    assert fetch.cached_model("smollm2-135m-instruct") == tmp_path / name.name / name.filename


def test_an_unknown_model_name_fails_doctor_with_the_packaged_names_as_serve_says_them(monkeypatch, tmp_path):
    """`doctor nosuchname` said "or a known model name" without naming one (serve lists them)."""
    monkeypatch.chdir(tmp_path)
    results = [r for r in (check() for check in doctor.default_checks("SmolLM2-135M-Instruct", 0)) if r]
    model = [r for r in results if r.name == "model"]
    assert len(model) == 1 and model[0].status == FAIL
    assert "Did you mean smollm2-135m-instruct" in model[0].detail
    assert "Known names: all-minilm-l6-v2, qwen2.5-coder-0.5b-instruct, smollm2-135m-instruct" in model[0].detail


def test_a_cache_that_cannot_be_written_fails_doctor_and_serve_says_which_variable(tmp_path, monkeypatch, capsys):
    """A read-only PAGEDSERVE_CACHE: serve printed a traceback while fetching, and doctor passed it."""
    import errno
    import os

    from pagedserve.models import fetch

    monkeypatch.setattr(os, "access", lambda path, mode: False)
    result = doctor.check_disk(tmp_path)
    assert result.status == FAIL and "cannot be written" in result.detail and "PAGEDSERVE_CACHE" in result.fix
    monkeypatch.undo()

    def read_only(model, root):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(fetch, "_fetch_file", read_only)
    monkeypatch.setattr(fetch, "_fetch_directory", read_only)
    with pytest.raises(fetch.ModelFetchError, match="cannot be saved in the cache .*Read-only file system.*"
                                                    "PAGEDSERVE_CACHE"):
        fetch.fetch_model("smollm2-135m-instruct", cache_dir=tmp_path)
    # A cache that cannot be created (under a file, or /proc): was a bare "[Errno 20] Not a directory" traceback.
    (tmp_path / "file").write_text("")
    with pytest.raises(fetch.ModelFetchError, match="cannot create the model cache .*PAGEDSERVE_CACHE"):
        fetch.fetch_model("smollm2-135m-instruct", cache_dir=tmp_path / "file" / "cache")
    from pagedserve.cli.main import main

    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "file" / "cache"))
    assert main(["plan"]) == 2  # `plan` on the default model said the bare errno, serve a traceback
    assert "cannot create the model cache" in capsys.readouterr().err


def test_a_cache_that_is_a_file_fails_the_doctor_by_name(tmp_path):
    """serve refuses it; doctor exited 0 with '<lambda> the check itself failed' warnings, or, given a packaged
    model's name, ended in a traceback (a QA sweep)."""
    import os
    import subprocess
    import sys

    cache = tmp_path / "cache-file"
    cache.write_text("")
    for model in ([], ["smollm2-135m-instruct"]):
        run = subprocess.run([sys.executable, "-m", "pagedserve", "doctor", *model], capture_output=True, text=True,
                             timeout=120, env={**os.environ, "PAGEDSERVE_CACHE": str(cache)})
        assert run.returncode == 1 and "Traceback" not in run.stderr + run.stdout
        assert "FAIL  cache" in run.stdout and "is a file, not a folder" in run.stdout and "<lambda>" not in run.stdout


def test_a_build_that_pagedserve_cpu_isa_asks_for_and_cannot_run_warns_in_the_log(monkeypatch, caplog):
    """Serving falls back to torch ops (a GGUF then runs dequantized, several times slower): where the user asked
    for that build by PAGEDSERVE_CPU_ISA, the log says so as a warning, as doctor does (QA-AC); where the best
    build for this CPU simply does not exist (no PAGEDSERVE_CPU_ISA), it stays information."""
    import logging

    import pagedserve.kernels as kernels

    refused = (None, "PAGEDSERVE_CPU_ISA=avx2-vnni needs the CPU flags avx_vnni, which this CPU lacks")
    monkeypatch.setattr(kernels, "load", lambda isa="native": refused)
    monkeypatch.delenv("PAGEDSERVE_CPU_KERNELS", raising=False)
    levels = {}
    for isa in ("avx2-vnni", ""):
        monkeypatch.setenv("PAGEDSERVE_CPU_ISA", isa)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="pagedserve.kernels"):
            assert kernels.load_status.__wrapped__() == refused
        [record] = [r for r in caplog.records if "not used" in r.getMessage()]
        levels[isa] = record.levelname
    assert levels == {"avx2-vnni": "WARNING", "": "INFO"}
    monkeypatch.setenv("PAGEDSERVE_CPU_ISA", "avx2-vnni")
    monkeypatch.setenv("PAGEDSERVE_CPU_KERNELS", "0")  # turned off on purpose: nothing to warn about
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pagedserve.kernels"):
        kernels.load_status.__wrapped__()
    assert [r.levelname for r in caplog.records if "not used" in r.getMessage()] == ["INFO"]
