"""pagedserve serving real packaged GGUF models (downloaded once into the cache)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.gguf_to_hf import save_as_hf_dir
from pagedserve import LLM, SamplingParams
from tests.models.real_models import QWEN_CODER, packaged_model
from tests.models.test_correctness import assert_greedy_close, assert_logprobs_close, hf_logprobs

# 30 fp32 layers: summation-order differences grow with depth; observed max 2.4e-5, so 2e-4 keeps an
# 8x margin while a wrong dequantization or q/k permutation moves logprobs by whole units.
GGUF_FP32_TOLERANCE = 2e-4
# The native block and int8 kernels round each matrix's x to 15 bits of its row's largest value, and a real model's
# hidden states carry outliers far above their typical values, which then keep fewer bits: on SmolLM2 that rounding
# alone (emulated in transformers) moved logprobs by up to 5e-3 over one 17-token prompt, and a rounding decision
# flips on float32 summation-order noise, so our run differs from the emulation by as much again (observed up to
# 0.013 over 24 generated tokens; tiny random models: 3e-5). A wrong block moves logprobs by whole units.
GGUF_BLOCKS_TOLERANCE = 0.03


@pytest.fixture(scope="module")
def smollm2() -> LLM:
    return LLM(dtype="float32", max_model_len=1024)  # no model given: the default, SmolLM2-135M-Instruct


def test_default_model_knows_paris(smollm2):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    output = smollm2.chat(messages, SamplingParams(temperature=0.0, max_tokens=30))[0]
    assert "Paris" in output.outputs[0].text
    assert smollm2.engine.config.model.served_model_name == "smollm2-135m-instruct"


def test_a_quantized_gguf_serves_from_its_blocks_under_dtype_auto(smollm2):
    """The default model is a Q4_1 GGUF: with --quantization gguf (--dtype auto's choice on AVX-512 CPUs) it is served
    from its own 4-bit blocks (~5 bits a weight; its Q8_0 embedding's logits head as int8) where the native kernels
    run, as GGUF runners serve their files; an explicit dtype dequantizes to it (the fixture's float32)."""
    from pagedserve.kernels import cpu_kernels
    from pagedserve.layers.linear import BlockLinear
    from pagedserve.memory.weight_format import default_file_quantization
    from pagedserve.platform import native_kernels_class

    assert smollm2.engine.config.model.quantization is None
    llm = LLM(max_model_len=256, quantization=None if cpu_kernels() is None else "gguf")
    native = cpu_kernels() is not None
    assert llm.engine.config.model.quantization == ("gguf" if native else None)
    blocks = [m for m in llm.engine.runner.model.modules() if isinstance(m, BlockLinear)]
    assert len(blocks) == (4 * 30 if native else 0) and {m.bits for m in blocks} <= {4}
    auto = LLM(max_model_len=256).engine.config.model.quantization  # the class's rule (BLOCK_CLASSES: blocks)
    assert auto == (None if not native else default_file_quantization(native_kernels_class()))
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert "Paris" in llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=30))[0].outputs[0].text


@pytest.mark.parametrize("quantization", [None, "gguf"])
def test_gguf_matches_transformers_on_dequantized_weights(smollm2, tmp_path, quantization):
    """float32 activations on the values the file's blocks stand for: dequantized to float32, or kept as blocks
    (--quantization gguf). There the logits head, the tied Q8_0 embedding, is requantized per row to int8 (as in int8
    mode; its rounding alone moves logprobs by up to ~0.3 here), so transformers' model gets that head's values."""
    llm = smollm2 if quantization is None else LLM(dtype="float32", quantization="gguf", max_model_len=1024)
    gguf_path = packaged_model("smollm2-135m-instruct")
    hf_dir = save_as_hf_dir(gguf_path, tmp_path / "smollm2-hf", dtype=torch.float32)
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    if quantization is not None:  # the int8 head's values, untied from the embedding
        head = llm.engine.runner.model.logits_proj.dequantized().float()
        hf_model.lm_head.weight = torch.nn.Parameter(head.clone(), requires_grad=False)
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.encode(t) for t in ("The capital of France is", "def fibonacci(n):",
                                             "Once upon a time, in a small village,")]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, output in zip(prompts, outputs):
        with torch.no_grad():
            expected = hf_model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                         eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        completion = output.outputs[0]
        reference = hf_logprobs(hf_model, prompt, completion.token_ids)
        if quantization is None:
            assert completion.token_ids == expected
            assert_logprobs_close(completion.logprobs, reference, GGUF_FP32_TOLERANCE)
        else:
            assert_logprobs_close(completion.logprobs, reference, GGUF_BLOCKS_TOLERANCE)
            assert_greedy_close(completion.token_ids, expected, reference, GGUF_BLOCKS_TOLERANCE)


@pytest.mark.slow
def test_qwen_coder_writes_a_function():
    llm = LLM(QWEN_CODER, dtype="bfloat16", max_model_len=1024)
    messages = [{"role": "user", "content": "Write a Python function that squares a number."}]
    output = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=120))[0]
    assert "def " in output.outputs[0].text
