"""pagedserve serving real packaged GGUF models (downloaded once into the cache)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.gguf_to_hf import save_as_hf_dir
from pagedserve import LLM, SamplingParams
from tests.models.real_models import QWEN_CODER, packaged_model
from tests.models.test_correctness import assert_logprobs_close, hf_logprobs

# 30 fp32 layers: summation-order differences grow with depth; observed max 2.4e-5, so 2e-4 keeps an
# 8x margin while a wrong dequantization or q/k permutation moves logprobs by whole units.
GGUF_FP32_TOLERANCE = 2e-4


@pytest.fixture(scope="module")
def smollm2() -> LLM:
    return LLM(dtype="float32", max_model_len=1024)  # no model given: the default, SmolLM2-135M-Instruct


def test_default_model_knows_paris(smollm2):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    output = smollm2.chat(messages, SamplingParams(temperature=0.0, max_tokens=30))[0]
    assert "Paris" in output.outputs[0].text
    assert smollm2.engine.config.model.served_model_name == "smollm2-135m-instruct"


def test_a_quantized_gguf_serves_from_int8_weights_under_dtype_auto(smollm2):
    """The default model is a Q4_1 GGUF: with --dtype auto it is served from int8 weights (1 byte a weight)
    where the native kernels run, as GGUF runners serve their files quantized; an explicit dtype
    dequantizes to it (the fixture's float32)."""
    from pagedserve.kernels import cpu_kernels

    assert smollm2.engine.config.model.quantization is None
    llm = LLM(max_model_len=256)
    expected = "int8" if cpu_kernels() is not None else None
    assert llm.engine.config.model.quantization == expected
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert "Paris" in llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=30))[0].outputs[0].text


def test_gguf_matches_transformers_on_dequantized_weights(smollm2, tmp_path):
    gguf_path = packaged_model("smollm2-135m-instruct")
    hf_dir = save_as_hf_dir(gguf_path, tmp_path / "smollm2-hf", dtype=torch.float32)
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    tokenizer = smollm2.get_tokenizer()
    prompts = [tokenizer.encode(t) for t in ("The capital of France is", "def fibonacci(n):",
                                             "Once upon a time, in a small village,")]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=5)
    outputs = smollm2.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, output in zip(prompts, outputs):
        with torch.no_grad():
            expected = hf_model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                         eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        completion = output.outputs[0]
        assert completion.token_ids == expected
        assert_logprobs_close(completion.logprobs, hf_logprobs(hf_model, prompt, expected), GGUF_FP32_TOLERANCE)


@pytest.mark.slow
def test_qwen_coder_writes_a_function():
    llm = LLM(QWEN_CODER, dtype="bfloat16", max_model_len=1024)
    messages = [{"role": "user", "content": "Write a Python function that squares a number."}]
    output = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=120))[0]
    assert "def " in output.outputs[0].text
