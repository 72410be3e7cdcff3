"""Granite, Phi-3 and SmolLM3 GGUF files (written by tests/models/gguf_utils.write_llama_like_gguf as llama.cpp's
converter writes them, independently of the loader) against transformers on the same weights: F32 within float32
noise, Q8_0 served from its quantized weights (int8) within its 8-bit rounding of the F32 file; the config the file
stands for (Granite's scales, Phi-3's window, partial rotary and LongRoPE factors, SmolLM3's layers without
rotary); a model architecture llama.cpp writes that pagedserve does not serve is refused by name."""

from __future__ import annotations

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType as QType

from pagedserve import LLM
from pagedserve.formats.errors import ModelValidationError
from pagedserve.models.gguf_loader import GGUFCheckpoint
from pagedserve.platform import native_kernels_run
from tests.models.gguf_utils import _finish, write_llama_like_gguf
from tests.models.test_gguf_sentencepiece import gguf_matches_transformers
from tests.models.test_more_architectures import LONGROPE
from tests.tiny_models import make_tiny_model

CASES = {
    "granite": ("granite", {}),
    "phi3": ("phi3", dict(sliding_window=24)),  # a window shorter than the 60-token prompt
    "phi3-longrope": ("phi3", LONGROPE),  # Phi-4-mini's kind: partial rotary and LongRoPE
    "smollm3": ("smollm3", dict(num_hidden_layers=4, no_rope_layer_interval=4)),  # llama.cpp's rule: every 4th
}


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    """case -> (the transformers model's directory, its GGUF as F32, as Q8_0)."""
    from transformers import AutoModelForCausalLM

    files = {}
    for case, (arch, overrides) in CASES.items():
        out = tmp_path_factory.mktemp(f"gguf-{case}")
        hf_dir = make_tiny_model(arch, out / "hf", **overrides)
        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
        files[case] = (str(hf_dir), write_llama_like_gguf(model, out / "f32.gguf"),
                       write_llama_like_gguf(model, out / "q8.gguf", QType.Q8_0))
    return files


@pytest.mark.parametrize("case", list(CASES))
def test_the_gguf_computes_what_transformers_does(ggufs, case):
    llm = gguf_matches_transformers(*ggufs[case], quantization="gguf")  # Q8_0 from its quantized weights:
    assert llm.llm_engine.config.model.quantization == ("gguf" if native_kernels_run() else None)  # int8 rows


@pytest.mark.parametrize("case", list(CASES))
def test_the_config_the_gguf_stands_for(ggufs, case):
    import json
    from pathlib import Path

    hf_dir, f32, _ = ggufs[case]
    expected = json.loads((Path(hf_dir) / "config.json").read_text())
    with GGUFCheckpoint(f32) as checkpoint:
        config = checkpoint.hf_config()
    assert config["architectures"] == expected["architectures"] and config["model_type"] == expected["model_type"]
    if case == "granite":
        for key in ("attention_multiplier", "embedding_multiplier", "residual_multiplier", "logits_scaling"):
            assert config[key] == pytest.approx(expected[key], rel=1e-6), key
    elif case == "smollm3":
        assert config["no_rope_layer_interval"] == 4
    else:
        assert config["sliding_window"] == expected.get("sliding_window")
        rope = expected.get("rope_scaling") or expected.get("rope_parameters") or {}
        if rope.get("rope_type") == "longrope":
            assert config["partial_rotary_factor"] == 0.75
            assert config["original_max_position_embeddings"] == 256
            assert config["rope_scaling"]["long_factor"] == pytest.approx(rope["long_factor"])
            assert config["rope_scaling"]["short_factor"] == pytest.approx(rope["short_factor"])


def test_an_architecture_pagedserve_does_not_serve_is_refused_by_name(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "falcon")
    writer.add_block_count(1)
    with pytest.raises(ModelValidationError, match="falcon.*granite, phi3, smollm3"):
        LLM(str(_finish(writer, tmp_path / "m.gguf")))


def test_a_granite_gguf_without_an_attention_scale_reads_as_llama_cpp_does(tmp_path, monkeypatch):
    """llama.cpp scales attention by 1 / sqrt(head_dim) where the file has no granite.attention.scale."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(make_tiny_model("granite", tmp_path / "hf"), dtype=torch.float32)
    monkeypatch.setattr(gguf.GGUFWriter, "add_attention_scale", lambda self, value: None)
    with GGUFCheckpoint(write_llama_like_gguf(model, tmp_path / "m.gguf")) as checkpoint:
        config = checkpoint.hf_config()
    assert config["attention_multiplier"] == config["head_dim"] ** -0.5
    assert config["residual_multiplier"] == pytest.approx(model.config.residual_multiplier)


def test_a_gguf_with_mlp_biases_is_refused_as_a_model_pagedserve_does_not_serve(tmp_path):
    from transformers import AutoModelForCausalLM

    hf_dir = make_tiny_model("granite", tmp_path / "hf", mlp_bias=True)
    path = write_llama_like_gguf(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32), tmp_path / "m.gguf")
    for model in (hf_dir, path):  # the same words for the directory and its GGUF
        with pytest.raises(ValueError, match="mlp_bias: true"):
            LLM(str(model), dtype="float32", max_model_len=128)
