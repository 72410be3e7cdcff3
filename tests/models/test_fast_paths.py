"""End-to-end: each fast path against the plain reference path on tiny models."""

from __future__ import annotations

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.kernels import cpu_kernels
from tests.models.test_correctness import make_prompts

PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=5)


def run(model_dir, **kwargs):
    llm = LLM(model_dir, max_model_len=256, **kwargs)
    prompts = make_prompts(llm.get_tokenizer())
    return llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)


def max_logprob_diff(a, b) -> float:
    diff = 0.0
    for x, y in zip(a, b):
        for sx, sy in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            for token_id in sx.keys() & sy.keys():
                diff = max(diff, abs(sx[token_id].logprob - sy[token_id].logprob))
    return diff


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_fast_kernels_match_reference_fp32(tiny_model_dir, arch):
    model_dir = tiny_model_dir(arch)
    fast = run(model_dir, dtype="float32")
    reference = run(model_dir, dtype="float32", reference_kernels=True)
    assert [o.outputs[0].token_ids for o in fast] == [o.outputs[0].token_ids for o in reference]
    assert max_logprob_diff(fast, reference) < 5e-5  # fp32: only summation order differs


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_fast_kernels_match_reference_bf16(tiny_model_dir, arch):
    """The fast path (packed matmuls, native norm/SiLU/decode-attention kernels) against torch ops.
    Both round in bf16 at the same points but sum in different orders, so logprobs agree within bf16
    noise (0.15, as against transformers) while the contexts are equal, i.e. up to the first token
    where the two greedy paths part; that token must be a near-tie under the reference's logprobs."""
    model_dir = tiny_model_dir(arch, "bfloat16")
    fast = run(model_dir, dtype="bfloat16")
    reference = run(model_dir, dtype="bfloat16", reference_kernels=True)
    identical = 0
    for f, r in zip(fast, reference):
        f_tokens, r_tokens = f.outputs[0].token_ids, r.outputs[0].token_ids
        parted = next((i for i, (a, b) in enumerate(zip(f_tokens, r_tokens)) if a != b), len(f_tokens))
        identical += parted == len(f_tokens)
        for position in range(min(parted + 1, len(f_tokens))):
            f_step, r_step = f.outputs[0].logprobs[position], r.outputs[0].logprobs[position]
            shared = f_step.keys() & r_step.keys()
            assert len(shared) >= 4, position
            assert max(abs(f_step[t].logprob - r_step[t].logprob) for t in shared) < 0.15, position
        if parted < len(f_tokens):
            r_step = r.outputs[0].logprobs[parted]
            assert f_tokens[parted] in r_step, "the fast path chose a token outside the reference's top 5"
            assert r_step[r_tokens[parted]].logprob - r_step[f_tokens[parted]].logprob < 0.15
    assert identical >= len(fast) // 2  # near-ties are the exception


def teacher_forced(llm: LLM, sequences: list[list[int]]) -> list[list[dict]]:
    """Top-5 logprobs at every position of the given sequences (prompt_logprobs, one forward each)."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": s} for s in sequences], params)
    return [o.prompt_logprobs[1:] for o in outputs]


def test_int8_weights_agree_with_bf16(tiny_model_dir):
    """Per-channel int8 keeps ~7 bits per weight. Compared teacher-forced along the same sequences (bf16's
    greedy continuations), so one near-tie flip cannot make every later position differ:
    the most likely token agrees at >= 90 % of positions and the median |logprob difference| of the
    top tokens is < 0.1 nats (observed on this model: 95 % agreement, median 0.035)."""
    model_dir = tiny_model_dir("qwen2", "bfloat16")
    bf16_llm = LLM(model_dir, dtype="bfloat16", max_model_len=256)
    int8_llm = LLM(model_dir, dtype="bfloat16", max_model_len=256, quantization="int8")
    share, median = agreement(bf16_llm, int8_llm, make_prompts(bf16_llm.get_tokenizer()))
    assert share >= 0.9, share
    assert median < 0.1, median
    kinds = {type(m).__name__ for name, m in int8_llm.engine.runner.model.named_modules() if name.endswith("_proj")}
    assert kinds == {"Int8Linear"}


def agreement(reference_llm: LLM, other_llm: LLM, prompts: list[list[int]], max_tokens: int = 24
              ) -> tuple[float, float]:
    """(share of positions whose most likely token agrees, median |logprob diff| of shared top tokens),
    teacher-forced along the reference's greedy continuations."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    greedy = reference_llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    sequences = [p + o.outputs[0].token_ids for p, o in zip(prompts, greedy)]
    agree, total, diffs = 0, 0, []
    for ref_seq, other_seq in zip(teacher_forced(reference_llm, sequences), teacher_forced(other_llm, sequences)):
        for ref, other in zip(ref_seq, other_seq):
            top = lambda d: min(d.items(), key=lambda kv: kv[1].rank)[0]
            agree += top(ref) == top(other)
            total += 1
            diffs += [abs(ref[t].logprob - other[t].logprob) for t in ref.keys() & other.keys()]
    diffs.sort()
    return agree / total, diffs[len(diffs) // 2]


# (min top-token agreement, max median |logprob diff|). Observed on this tiny random model, teacher-forced:
# e4m3 0.886 / 0.065, e5m2 0.80 / 0.12; for scale, bf16 vs fp32 weights give 0.968 / 0.015 and int8
# weights 0.947 / 0.035. Random weights with std 0.2 make this model far more sensitive than real ones
# (the real-model target, >= 95 %, is checked by the slow test below); a broken fp8 path (unscaled or
# misread K/V) gives agreement near zero.
FP8_BOUNDS = {"fp8": (0.85, 0.1), "fp8_e5m2": (0.75, 0.2)}


@pytest.mark.parametrize("kv_dtype", ["fp8", "fp8_e5m2"])
def test_fp8_kv_cache_agrees_with_full_precision(tiny_model_dir, kv_dtype):
    """fp8 K/V with a scale per token and head: e4m3 keeps 3 mantissa bits, e5m2 2 bits, on K/V only."""
    model_dir = tiny_model_dir("qwen2", "bfloat16")
    full = LLM(model_dir, dtype="bfloat16", max_model_len=256)
    fp8 = LLM(model_dir, dtype="bfloat16", max_model_len=256, kv_cache_dtype=kv_dtype)
    assert fp8.engine.runner.kv_caches[0].k.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    share, median = agreement(full, fp8, make_prompts(full.get_tokenizer()))
    min_share, max_median = FP8_BOUNDS[kv_dtype]
    assert share >= min_share, share
    assert median < max_median, median


@pytest.mark.slow
@pytest.mark.parametrize("variant", [dict(quantization="int8"), dict(kv_cache_dtype="fp8")], ids=["int8", "fp8-kv"])
def test_real_model_agreement_with_bf16(variant):
    """Issue target: >= 95 % greedy agreement with bf16 on the real Qwen2.5-Coder-0.5B over a fixed prompt set."""
    from tests.models.real_models import QWEN_CODER

    reference = LLM(QWEN_CODER, dtype="bfloat16", max_model_len=1024)
    other = LLM(QWEN_CODER, dtype="bfloat16", max_model_len=1024, **variant)
    tokenizer = reference.get_tokenizer()
    texts = ["def quicksort(arr):", "The capital of France is", "# Python: read a CSV file and print the mean\n",
             "Explain what a hash table is.", "SELECT name FROM users WHERE", "1, 1, 2, 3, 5, 8,"]
    share, median = agreement(reference, other, [tokenizer.encode(t) for t in texts], max_tokens=32)
    assert share >= 0.95, share


def test_sampling_takes_the_models_native_argmax(tiny_model_dir):
    """The sampler's argmax is the model's backend's: native where the layers are (the greedy tokens above are
    then its picks), torch's with the reference kernels."""
    model_dir = tiny_model_dir("llama")
    fast = LLM(model_dir, max_model_len=256, dtype="float32").engine.runner
    reference = LLM(model_dir, max_model_len=256, dtype="float32", reference_kernels=True).engine.runner
    assert fast.sampler.native is fast.model.kernel_backend.native
    assert (fast.sampler.native is None) == (cpu_kernels() is None)
    assert reference.sampler.native is None
