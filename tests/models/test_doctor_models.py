"""doctor and the memory plan against real (tiny, random) checkpoints written by transformers; imports torch."""

from __future__ import annotations

import argparse
import json
import socket
from pathlib import Path

import pytest

from pagedserve.cli import doctor
from pagedserve.memory.plan import ModelShape, weight_bytes_from_safetensors_dir


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
