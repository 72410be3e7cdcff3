"""--device and tensor-parallel ranks on GPUs: refused before anything loads, with the fix named."""

from __future__ import annotations

import pytest
import torch

from pagedserve.platform import check_ranks_fit_device, default_device, resolve_device


def test_auto_is_the_default_device_and_cpu_is_always_there():
    assert resolve_device("auto") == default_device()
    assert resolve_device("cpu") == "cpu"


def test_an_unknown_device_names_the_choices():
    with pytest.raises(ValueError, match="--device must be auto, cpu or cuda, got 'tpu'"):
        resolve_device("tpu")


def test_cuda_is_taken_only_where_torch_sees_a_gpu():
    if torch.cuda.is_available():
        assert resolve_device("cuda") == "cuda"
    else:
        with pytest.raises(ValueError, match="sees no GPU here.*--device cpu"):
            resolve_device("cuda")


def test_more_ranks_than_gpus_is_refused_naming_both_ways_out(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 2 runs one rank per GPU and this machine has 1; "
                                         r"use --tensor-parallel-size 1 or fewer, or --device cpu"):
        check_ranks_fit_device("cuda", 2)
    check_ranks_fit_device("cuda", 1)
    check_ranks_fit_device("cpu", 8)  # CPU ranks split the cores
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    check_ranks_fit_device("cuda", 4)
