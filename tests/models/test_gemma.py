"""Gemma's parts beyond test_correctness.py's batch (which runs Gemma 1-3 against transformers in float32 and bfloat16,
and test_sliding_window.py their windows): the config fields transformers reads for one Gemma and ignores for
another, the norm's float32 scale, the plan's count of softcapped attention scores, the activations, and a
multimodal Gemma 3 checkpoint served as its language model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.engine.memory_plan import softcapped_attention
from pagedserve.exceptions import InvalidRequestError
from pagedserve.memory.checkpoint import read_checkpoint_info
from pagedserve.formats.errors import ModelValidationError
from pagedserve.models.gemma import GemmaRMSNorm
from pagedserve.models.llama import ACTIVATIONS, NativeDecodeStack
from pagedserve.models.validate import DECODER_ACTIVATIONS, validate_hf_dir
from tests.models.test_correctness import prompt_logprob_error


def _prompt_logprobs_against_transformers(model_dir: str, model_class=None) -> float:
    """The largest difference of our prompt logprobs from transformers' over a 60-token prompt (float32)."""
    from transformers import AutoModelForCausalLM

    prompt = [(37 * i) % 500 + 3 for i in range(60)]
    llm = LLM(model_dir, dtype="float32", max_model_len=128)
    ours = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    model = (model_class or AutoModelForCausalLM).from_pretrained(model_dir, dtype=torch.float32).eval()
    return prompt_logprob_error(ours.prompt_logprobs, model, prompt)


def test_gemma3_caps_its_logits_but_not_its_attention_scores(tiny_model_dir):
    """transformers' Gemma 3 applies final_logit_softcapping and passes no attn_logit_softcapping to its attention
    (Gemma 2 applies both): a config setting both must be computed as that."""
    model_dir = tiny_model_dir("gemma3", final_logit_softcapping=3.0, attn_logit_softcapping=0.5)
    assert _prompt_logprobs_against_transformers(model_dir) < 5e-5
    llm = LLM(model_dir, dtype="float32", max_model_len=128)
    model = llm.engine.runner.model
    assert model.final_softcap == 3.0 and {layer.self_attn.softcap for layer in model.model.layers} == {None}


def test_gemma2_caps_both(tiny_model_dir):
    model = LLM(tiny_model_dir("gemma2"), dtype="float32", max_model_len=128).engine.runner.model
    assert model.final_softcap == 4.0 and {layer.self_attn.softcap for layer in model.model.layers} == {2.0}
    assert [layer.self_attn.window for layer in model.model.layers] == [16, None]  # layer_types


def test_the_norm_scales_by_one_plus_its_weight_in_float32():
    """transformers' Gemma norm multiplies by 1 + weight in float32 and rounds once; 1 + weight rounded to bf16
    first (a Llama norm over a folded weight) differs."""
    torch.manual_seed(0)
    norm = GemmaRMSNorm(64, 1e-6)
    norm.weight = torch.nn.Parameter((torch.randn(64) * 0.3).to(torch.bfloat16), requires_grad=False)
    norm.prepare()
    x = torch.randn(8, 64).to(torch.bfloat16)
    x32 = x.float()
    expected = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + norm.weight.float()))
    assert torch.equal(norm(x), expected.to(torch.bfloat16))
    folded = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16) * (1 + norm.weight)
    assert not torch.equal(norm(x), folded)


def test_the_plan_counts_softcapped_scores(tiny_model_dir):
    from pagedserve.models.loader import load_hf_config

    assert softcapped_attention("Gemma2ForCausalLM", load_hf_config(tiny_model_dir("gemma2")))
    assert not softcapped_attention("Gemma3ForCausalLM", load_hf_config(tiny_model_dir("gemma3")))
    gemma2 = LLM(tiny_model_dir("gemma2"), dtype="float32", max_model_len=128).engine.config.memory_plan
    no_cap = LLM(tiny_model_dir("gemma2", attn_logit_softcapping=None), dtype="float32",
                 max_model_len=128).engine.config.memory_plan
    heads, pairs = 4, 128 * 128  # one SDPA call's query x key pairs: min(T, M) x M
    assert gemma2.activation_bytes - no_cap.activation_bytes == heads * pairs * (4 + 3 * 4)


def test_the_activations_validation_accepts_are_the_models(tiny_model_dir, tmp_path):
    assert tuple(ACTIVATIONS) == DECODER_ACTIVATIONS
    model = Path(shutil.copytree(tiny_model_dir("gemma2"), tmp_path / "gemma2"))
    config = json.loads((model / "config.json").read_text())
    validate_hf_dir(model)
    config["hidden_activation"] = "relu"
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelValidationError, match="hidden_activation 'relu'"):
        validate_hf_dir(model)


def test_a_multimodal_gemma3_checkpoint_serves_its_language_model(tiny_model_dir):
    """Gemma3ForConditionalGeneration (gemma-3-4b-it and up): its text_config under Gemma3ForCausalLM, its
    language_model.* tensors, the vision tower neither loaded nor counted in the plan, images refused."""
    from transformers import Gemma3ForConditionalGeneration

    model_dir = tiny_model_dir("gemma3-multimodal")
    assert _prompt_logprobs_against_transformers(model_dir, Gemma3ForConditionalGeneration) < 5e-5
    llm = LLM(model_dir, dtype="float32", max_model_len=128)
    assert llm.engine.config.model.architecture == "Gemma3ForCausalLM"
    text_only = read_checkpoint_info(tiny_model_dir("gemma3")).weight_bytes(4)  # the same text model, alone
    assert read_checkpoint_info(model_dir).weight_bytes(4) == text_only
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with pytest.raises(InvalidRequestError, match="image_url"):
        llm.chat([{"role": "user", "content": [image, {"type": "text", "text": "What is this?"}]}])


@pytest.mark.parametrize("arch, fields", [("gemma", dict(hidden_act="gelu_pytorch_tanh", hidden_activation="gelu")),
                                          ("gemma2", dict(hidden_act="gelu_pytorch_tanh", hidden_activation="gelu"))])
def test_the_gelu_each_gemma_reads(tiny_model_dir, tmp_path, arch, fields):
    """transformers 5's Gemma gates by hidden_act, Gemma 2/3 by hidden_activation: a config naming two GELUs is
    computed by the one its class reads (exact GELU and tanh's differ by ~1e-3 in the logprobs)."""
    model = Path(shutil.copytree(tiny_model_dir(arch), tmp_path / arch))
    config = json.loads((model / "config.json").read_text())
    config.update(fields)
    (model / "config.json").write_text(json.dumps(config))
    assert _prompt_logprobs_against_transformers(str(model)) < 5e-5


def test_a_gemma2_gguf_without_its_window_is_refused_as_a_file_problem(tmp_path):
    import gguf

    from pagedserve.formats.gguf import read_gguf_header
    from pagedserve.models.validate import validate_gguf_header

    writer = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "gemma2")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelValidationError, match="lacks metadata key gemma2.attention.sliding_window"):
        validate_gguf_header(read_gguf_header(tmp_path / "g.gguf"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["gemma", "gemma2", "gemma3"])
def test_gemma_on_the_native_kernels_and_the_decode_stack(kernels, tiny_model_dir, monkeypatch, dtype, arch):
    """head_dim 32: Gemma's rotary runs fused into the KV write (Gemma 3's q/k norms, a float32 gain, in it), its norms,
    GELU gate and attention (Gemma 2's capped scores) on the native kernels, and in bf16 (native linears) its decode
    steps on the decode stack (Gemma 2/3: sandwich norms, windowed layers, Gemma 3's with their own rotary), over
    prompts of 5 to 80 tokens (past the 16-token window) and their decodes, against transformers."""
    from tests.models.test_sliding_window import _check

    # Gemma 3 at the tiny models' usual weight scale (0.2) is off transformers by 0.156 in bf16 with torch ops alone
    # (PAGEDSERVE_CPU_KERNELS=0, as with the native kernels): its sandwich norms amplify bf16 rounding past the
    # tolerance. At 0.1 torch ops are off by 0.044, the native kernels and the stack by 0.033.
    scale = {"weight_std": 0.1} if arch == "gemma3" else {}
    model_dir = tiny_model_dir(arch, dtype, head_dim=32, hidden_size=128, intermediate_size=256, **scale)
    calls = []
    original = NativeDecodeStack.forward

    def counted(self, *args):
        calls.append(1)
        return original(self, *args)

    monkeypatch.setattr(NativeDecodeStack, "forward", counted)
    llm = _check(model_dir, dtype)
    layers = llm.engine.runner.model.layer_kernels()
    assert layers.attention_native and layers.rotary_fused and layers.decoder_native and layers.activation_native
    assert layers.stack == (dtype == "bfloat16") and (len(calls) > 0) == layers.stack
    assert "GELU (tanh) x up native" in layers.lines()[1]
