"""`pagedserve doctor` says what each kind of layer will run before anything loads, by the rule the loader
applies (memory/weight_format.py): its prediction from the config equals what the loaded model's layers run
(the start-up log's lines), and the decode stack it announces is the one the first decode step builds.
Runs on whichever ISA this machine has (without native kernels both sides say torch)."""

from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.cli.check_result import PASS, WARN
from pagedserve.cli.doctor_model import check_layer_kernels
from pagedserve.kernels import cpu_kernels
from pagedserve.engine.memory_plan import softcapped_attention
from pagedserve.memory.probe import cpu_flags, sdpa_prefill
from pagedserve.memory.weight_format import (LayerKernels, LinearKernel, expected_layer_kernels, expected_weight_format,
                                             onednn_may_pack)

HEAD_32 = {"num_attention_heads": 2}  # head_dim 32: rotary fuses into the KV write (16, the default here, does not)
CASES = [  # (arch, dtype, quantization, config overrides, what must hold where native kernels run)
    ("llama", "bfloat16", None, HEAD_32, "stack"),
    ("llama", "float32", None, HEAD_32, "oneDNN linears, native norms"),
    ("qwen2", "bfloat16", "int8", HEAD_32, "stack"),
    ("llama", "bfloat16", None, {}, "head_dim 16: rotary on torch, no stack"),
    ("qwen3", "bfloat16", None, HEAD_32, "stack"),  # q/k norms in the fused rotary kernel
    ("qwen3", "bfloat16", "int8", HEAD_32, "stack"),
    ("qwen3", "bfloat16", None, {**HEAD_32, "use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1},
     "stack"),  # a full and a sliding-window layer: a step view each
    ("qwen3", "bfloat16", None, HEAD_32, "stack, fp8 KV cache"),  # written by the fused rotary, read natively
    ("llama", "bfloat16", None, {**HEAD_32, "intermediate_size": 72}, "down off the native kernel, norms on torch"),
    ("llama", "bfloat16", "int8", {**HEAD_32, "intermediate_size": 96}, "down on torch int8"),
    ("gemma2", "bfloat16", None, {"head_dim": 32}, "stack"),  # softcapped scores in the native attention
    ("gemma3", "bfloat16", None, {"head_dim": 32}, "stack"),  # sandwich norms, gain q/k norms, GELU, windows
    ("gemma3", "bfloat16", "int8", {"head_dim": 32}, "stack"),
    ("gemma3", "bfloat16", None, {}, "head_dim 16: rotary on torch, no stack"),
    ("smollm3", "bfloat16", None, HEAD_32, "stack"),  # layers without rotary: a step view without tables
    ("llama", "bfloat16", None, {**HEAD_32, "hidden_act": "gelu"}, "gelu: the MLP gate on torch, no stack"),
    ("qwen3_moe", "bfloat16", None, {"head_dim": 32}, "experts native, no stack"),  # a sparse and a dense layer
    ("mixtral", "bfloat16", "int8", HEAD_32, "experts native, no stack"),
    ("qwen2_moe", "bfloat16", "int8", HEAD_32, "experts native, no stack"),  # a shared expert too
]


@pytest.mark.parametrize("arch,dtype,quantization,overrides,what", CASES, ids=[c[-1] for c in CASES])
def test_doctors_prediction_is_what_the_loaded_layers_run(tiny_model_dir, arch, dtype, quantization, overrides,
                                                         what):
    model_dir = tiny_model_dir(arch, dtype, **overrides)
    kv_cache_dtype = "fp8" if "fp8" in what else "auto"
    llm = LLM(model_dir, dtype=dtype, quantization=quantization, device="cpu", max_model_len=128,
              kv_cache_dtype=kv_cache_dtype)
    model, config = llm.engine.runner.model, llm.engine.config
    kernels = cpu_kernels()
    isa = kernels.isa if kernels is not None else None

    loaded = model.layer_kernels()
    fmt = expected_weight_format("cpu", dtype, quantization, False, isa is not None, cpu_flags())
    predicted = expected_layer_kernels(fmt, isa, config.model.hf_config, onednn_may_pack("cpu", dtype, cpu_flags()),
                                       activation=model.decoder_spec(config.model.hf_config).activation,
                                       sdpa_prefill=sdpa_prefill(cpu_flags(), dtype, kernels is not None
                                                                 and kernels.batch_invariant),
                                       softcapped=softcapped_attention(config.model.architecture,
                                                                       config.model.hf_config))
    assert predicted == loaded
    result = check_layer_kernels(config, isa)
    assert result.detail.endswith("; ".join(model.kernel_report()))
    assert result.status == (PASS if isa is None or loaded.stack or loaded.experts else WARN)

    llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(max_tokens=3, ignore_eos=True))
    assert (model.model.stack is not None) == loaded.stack  # the stack the report announced is the one built
    if isa is None:
        assert not loaded.decoder_native and not loaded.stack
        return
    words = {linear.name: linear.words for linear in loaded.linears}
    if what.startswith("stack"):
        assert loaded.stack and all(w.startswith("native") for w in words.values())
    elif what.startswith("oneDNN"):
        assert set(words.values()) == {"oneDNN packed"} and loaded.decoder_native and not loaded.stack
    elif what.startswith("head_dim"):
        assert loaded.decoder_native and not loaded.rotary_fused and not loaded.stack
    elif what.startswith("experts"):  # every part native; the C decoder layer has one MLP, so no stack
        assert loaded.experts == (4, 2) and all(w.startswith("native") for w in words.values()) and not loaded.stack
        assert "4 experts, 2 per token" in loaded.lines()[0] and "mixture-of-experts" in loaded.lines()[-1]
        assert result.status == PASS
    elif what.startswith("gelu"):
        assert loaded.decoder_native and loaded.rotary_fused and not loaded.activation_native and not loaded.stack
        assert "GELU x up torch" in loaded.lines()[1] and "norms native" in loaded.lines()[1]
        assert "gelu gate runs torch ops" in result.fix
    elif what.startswith("down off"):  # oneDNN where it packs bf16 (AVX-512), else F.linear (AVX2)
        onednn = onednn_may_pack("cpu", dtype, cpu_flags())
        assert words["down"] == ("oneDNN packed" if onednn else "F.linear") and words["qkv"].startswith("native")
        assert not loaded.decoder_native
    else:
        assert words["down"] == "torch int8" and words["o"].startswith("native int8") and not loaded.stack


def test_the_report_words_and_the_stack_rule():
    bf16 = LinearKernel("qkv", "native bf16 (avx2)", True)
    native = LayerKernels(2, (bf16, LinearKernel("logits", "F.linear", False)), True, True)
    assert native.stack  # the logits projection is not part of the stack
    assert native.lines()[-1].endswith(": on, one native call")
    assert not LayerKernels(2, native.linears, True, False).stack
    assert not LayerKernels(2, (LinearKernel("o", "torch int8", False),), True, True).stack
    assert "rank 1 of 2" in LayerKernels(2, native.linears, True, True, tp=(1, 2)).lines()[-1]
    assert LayerKernels(2, native.linears, True, True, activation="gelu_pytorch_tanh").stack  # Gemma's gate
    assert not LayerKernels(2, native.linears, True, True, activation="gelu").stack  # the exact GELU: torch
    assert native.lines()[1].endswith("prefill attention native")
    sdpa = LayerKernels(2, native.linears, True, True, sdpa_prefill=True)
    assert sdpa.stack and "prefill attention torch SDPA from 256 x 256 query x key pairs" in sdpa.lines()[1]
    capped = LayerKernels(2, native.linears, True, True, softcapped=True)
    assert capped.lines()[1].endswith("decode attention native; prefill attention torch (capped scores)")


def test_prefill_attention_on_sdpa_where_measured_faster(monkeypatch):
    """probe.sdpa_prefill: bf16 on the AMX Xeon's class only; never in batch-invariant mode; the variable overrides."""
    amx, zen5 = {"avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile"}, \
        {"avx512f", "avx512bw", "avx512_vnni", "avx512_bf16"}
    monkeypatch.delenv("PAGEDSERVE_CPU_SDPA_PREFILL", raising=False)
    assert sdpa_prefill(amx, "bfloat16", False) and not sdpa_prefill(amx, "float32", False)
    assert not sdpa_prefill(zen5, "bfloat16", False) and not sdpa_prefill({"avx2", "fma", "f16c"}, "bfloat16", False)
    assert not sdpa_prefill(amx, "bfloat16", True)
    monkeypatch.setenv("PAGEDSERVE_CPU_SDPA_PREFILL", "0")
    assert not sdpa_prefill(amx, "bfloat16", False)
    monkeypatch.setenv("PAGEDSERVE_CPU_SDPA_PREFILL", "1")
    assert sdpa_prefill(zen5, "float32", False) and not sdpa_prefill(zen5, "float32", True)

