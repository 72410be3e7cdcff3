"""doctor and the memory plan against real (tiny, random) checkpoints written by transformers; imports torch."""

from __future__ import annotations

import argparse
import json
import socket
from pathlib import Path

import pytest

from pagedserve.cli import doctor, doctor_model
from pagedserve.memory.checkpoint import weight_bytes_from_safetensors_dir
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.memory.plan import ModelShape


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # untied and tied embeddings
def test_weight_bytes_from_headers_equal_the_parameters(tiny_model_dir, arch: str) -> None:
    import torch
    import transformers

    path = Path(tiny_model_dir(arch))
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    num_params = sum(p.numel() for p in model.parameters())  # tied weights are counted once
    assert weight_bytes_from_safetensors_dir(path, dtype_bytes=4) == num_params * 4
    assert weight_bytes_from_safetensors_dir(path, dtype_bytes=2) == num_params * 2
    config = json.loads((path / "config.json").read_text())
    shape = ModelShape.from_hf_config(config, weight_bytes=num_params * 4)
    assert shape.head_dim == model.config.hidden_size // model.config.num_attention_heads
    assert shape.num_kv_heads == model.config.num_key_value_heads


def test_doctor_command_on_a_good_model(tiny_model_dir, capsys: pytest.CaptureFixture[str]) -> None:
    args = argparse.Namespace(model=tiny_model_dir("llama"), port=free_port(), json=True)
    code = doctor.run(args)
    results = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert results["model"]["status"] == "PASS"
    assert results["memory plan"]["status"] == "PASS" and "to spare" in results["memory plan"]["detail"]
    assert results["accelerator"]["status"] in ("PASS", "WARN")  # WARN: a GPU host with a mismatched build
    assert code == (1 if any(r["status"] == "FAIL" for r in results.values()) else 0)
    assert "KV cache" not in results["memory plan"]["detail"]  # auto: the model's dtype
    fp8 = doctor_model.memory_plan_result(doctor_model.engine_config(EngineArgs(model=tiny_model_dir("llama"),
                                                                                kv_cache_dtype="fp8_e5m2")))
    assert ", KV cache fp8_e5m2:" in fp8.detail  # QA-AE: an fp8 cache was named nowhere


def test_the_model_checks_resolve_the_engine_config_once(tiny_model_dir, monkeypatch) -> None:
    calls = []
    resolve = doctor_model.engine_config
    monkeypatch.setattr(doctor_model, "engine_config", lambda *args: calls.append(args) or resolve(*args))
    checks = doctor_model.model_checks(tiny_model_dir("llama"), EngineArgs(dtype="float32"), lambda: None)
    results = [result for result in (check() for check in checks) if result]  # no draft model: no draft check
    assert [r.name for r in results] == ["model", "weights", "memory plan", "layers"] and len(calls) == 1
    assert "F.linear" in results[3].detail or "oneDNN" in results[3].detail  # float32 linears, no native isa


def test_torch_build_info_is_consistent() -> None:
    import torch

    info = doctor.torch_build_info()
    assert info.version == torch.__version__
    assert info.cuda_available == torch.cuda.is_available()
    if not info.cuda_available:
        assert info.capability is None and info.arch_list == []


@pytest.mark.parametrize("damage", ["truncated weights", "no tokenizer"])
def test_doctor_command_fails_on_a_damaged_model(tiny_model_dir, tmp_path, capsys, damage: str) -> None:
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), model)
    if damage == "truncated weights":
        weights = model / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:-1000])
    else:
        for path in model.glob("tokenizer*"):
            path.unlink()
    code = doctor.run(argparse.Namespace(model=str(model), port=free_port(), json=True))
    results = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert code == 1 and results["model"]["status"] == "FAIL"
    assert ("truncated" if damage == "truncated weights" else "tokenizer") in results["model"]["detail"]
    assert "memory plan" not in results  # planning needs readable headers: skipped, not guessed


def test_doctor_fails_on_weights_config_json_does_not_describe(tiny_model_dir, tmp_path, capsys) -> None:
    """config.json's intermediate_size edited: serve refused to load it while doctor passed it."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), model)
    config = json.loads((model / "config.json").read_text())
    config["intermediate_size"] = 96
    (model / "config.json").write_text(json.dumps(config))
    code = doctor.run(argparse.Namespace(model=str(model), port=free_port(), json=True))
    results = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert code == 1 and results["model"]["status"] == "PASS" and results["weights"]["status"] == "FAIL"
    assert "has shape (64, 128), the model expects (64, 96)" in results["weights"]["detail"]
    assert "config.json does not match the weights" in results["weights"]["detail"]
    assert "memory plan" not in results


def test_memory_plan_check_with_fake_available_memory(tiny_model_dir) -> None:
    from pagedserve.memory.probe import GIB, AvailableMemory

    args = EngineArgs(model=tiny_model_dir("llama"), max_model_len=512, dtype="float32")
    roomy = doctor_model.check_memory_plan(args, AvailableMemory(8 * GIB, "MemAvailable", "x"))
    assert roomy.status == "PASS" and "max_model_len 512" in roomy.detail, roomy
    tight = doctor_model.check_memory_plan(args, AvailableMemory(100 << 20, "cgroup", "x"))
    assert tight.status == "FAIL" and "short by" in tight.detail and tight.fix, tight


# "fits: needs 0.48 GiB, ..." / "DOES NOT FIT: needs ..." in serve's log; plan.summary() in doctor's detail.
PLAN_LINE = r"needs (\d+\.\d\d) GiB, (\d+\.\d\d) GiB available"


@pytest.mark.parametrize("flags,env", [
    (["--max-model-len", "256", "--kv-cache-memory", str(64 << 20)], {}),
    (["--max-model-len", "384", "--max-num-seqs", "4"], {"VLLM_CPU_KVCACHE_SPACE": "100000"}),  # refused
], ids=["fits", "refused"])
def test_doctor_plan_equals_serve_plan(tiny_model_dir, tmp_path, flags, env) -> None:
    """Same model, same flags and environment: doctor's verdict and figures are serve's."""
    import os
    import re
    import subprocess
    import sys

    from tests.server.server_utils import start_server

    model = tiny_model_dir("qwen2")
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", **env}
    out = subprocess.run([sys.executable, "-m", "pagedserve", "doctor", model, *flags, "--json",
                          "--port", str(free_port())], capture_output=True, text=True, env=full_env, timeout=300)
    plan = {r["name"]: r for r in json.loads(out.stdout)}["memory plan"]
    if env:
        served = subprocess.run([sys.executable, "-m", "pagedserve", "serve", model, *flags, "--port",
                                 str(free_port())], capture_output=True, text=True, env=full_env, timeout=300)
        assert served.returncode != 0
        log, serve_fits = served.stderr, False
    else:
        server = start_server(model, *flags, log_dir=tmp_path)
        log, serve_fits = server.log(), True
        assert server.stop() == 0
    assert plan["status"] == ("PASS" if serve_fits else "FAIL"), (plan, log)
    doctor_needs = re.search(PLAN_LINE, plan["detail"]).group(1)
    serve_needs = re.search(PLAN_LINE, log).group(1)
    assert doctor_needs == serve_needs, (plan["detail"], log)
    settings = re.search(r"max_model_len (\d+), max_num_seqs (\d+)", plan["detail"]).groups()
    assert settings == (flags[1], flags[3] if "--max-num-seqs" in flags else "256")


def test_a_sliding_window_model_plans_its_whole_context(tiny_model_dir, tmp_path, capsys):
    """A Mistral config with a 64-token window: `plan` (serve's own config step) takes a --max-model-len past the
    window and defaults to the model's whole context (the attention computes the window: test_sliding_window.py).
    pagedserve once refused the first and capped the second at the window (Phi-3-mini-4k served 2047 of 4096)."""
    import shutil

    from pagedserve.cli.main import main

    model = tmp_path / "tiny-mistral"
    shutil.copytree(tiny_model_dir("llama"), model)
    config = json.loads((model / "config.json").read_text())
    config.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=64)
    (model / "config.json").write_text(json.dumps(config))

    def plan(*flags: str) -> str:  # in this process: plan loads no weights
        capsys.readouterr()
        code = main(["plan", str(model), "--dtype", "float32", *flags])
        out, err = capsys.readouterr()
        assert code == 0, out + err
        return out

    assert "max_model_len 128" in plan("--max-model-len", "128")
    assert "max_model_len 512" in plan()


@pytest.mark.parametrize("flags,check,words", [
    (["--max-model-len", "0"], "flags", "--max-model-len must be >= 2"),
    (["--dtype", "nonsense"], "flags", "--dtype must be one of"),
    (["--block-size", "7"], "flags", "--block-size must be a power of two"),
    (["--max-model-len", "1024"], "memory plan", "more than the 512 positions the model was trained for"),
])
def test_doctor_fails_on_the_flags_serve_would_refuse(tiny_model_dir, capsys, flags, check, words) -> None:
    """doctor takes serve's command line: what serve refuses to start with is a FAIL (exit 1), not a pass (flags
    doctor did not check) or a warning (the model's plan)."""
    from pagedserve.cli.main import main

    code = main(["doctor", tiny_model_dir("llama"), "--port", str(free_port()), "--json", *flags])
    results = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert code == 1 and results[check]["status"] == "FAIL" and words in results[check]["detail"]
    assert [name for name, r in results.items() if r["status"] == "FAIL"] == [check]


def test_doctor_without_a_model_checks_the_one_serve_would_load(tiny_model_dir, capsys, monkeypatch) -> None:
    """`pagedserve serve` alone serves the default model: `doctor` alone skipped the model and its plan, and passed
    flags that serve then refused (QA-C: --max-model-len 100000)."""
    from pagedserve.cli.main import main
    from pagedserve.models import fetch

    monkeypatch.setattr(fetch, "DEFAULT_MODEL", tiny_model_dir("llama"))
    code = main(["doctor", "--port", str(free_port()), "--json", "--max-model-len", "1024"])
    results = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert code == 1 and results["memory plan"]["status"] == "FAIL"
    assert "more than the 512 positions the model was trained for" in results["memory plan"]["detail"]
