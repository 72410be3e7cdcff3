"""PAGEDSERVE_BATCH_INVARIANT (vLLM's VLLM_BATCH_INVARIANT): a request's greedy tokens and logprobs do not depend on
which requests share its steps. By default a prompt prefilled in a batch of 64+ rows takes the int8 linears' bf16
panels on AVX512-BF16 and AMX CPUs (float32 sums), alone the integer kernel (exact sums): near-ties then break
differently. In the mode, every batch size takes the exact sums."""

from __future__ import annotations

import pytest

from pagedserve import envs
from pagedserve.entrypoints.llm import LLM
from pagedserve.kernels import cpu_kernels
from pagedserve.sampling_params import SamplingParams

PROMPTS = [[(7 * i + 13 * j) % 250 + 3 for j in range(20)] for i in range(8)]  # 8 x 20 rows: alone < 64, batched 160


def _alone_and_batched(model_dir: str, prompts: list[list[int]] = PROMPTS, **engine: str) -> tuple[list, list]:
    llm = LLM(model_dir, dtype="bfloat16", max_model_len=256, max_num_batched_tokens=256,
              enable_prefix_caching=False, **{"quantization": "int8", **engine})  # the batch prefills all 160 rows,
    # not what the alone runs left
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, ignore_eos=True)

    def result(output) -> tuple:
        sample = output.outputs[0]
        return sample.token_ids, [{t: p.logprob for t, p in step.items()} for step in sample.logprobs]

    alone = [result(llm.generate([{"prompt_token_ids": p}], params)[0]) for p in prompts]
    batched = [result(o) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    return alone, batched


def test_alone_and_batched_agree_bit_for_bit_in_batch_invariant_mode(tiny_model_dir):
    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("no native CPU kernels here: the mode concerns their int8 linears")
    model_dir = tiny_model_dir("llama")
    was = kernels.batch_invariant
    try:
        kernels.set_batch_invariant(True)
        alone, batched = _alone_and_batched(model_dir)
        assert alone == batched  # token ids and logprobs, exactly
        kernels.set_batch_invariant(False)
        if not kernels.int8_prefill_exact:  # without the mode this CPU prefills on the panels: other bits
            alone, batched = _alone_and_batched(model_dir)
            assert [a[1] for a in alone] != [b[1] for b in batched]
    finally:
        kernels.set_batch_invariant(was)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_an_fp8_kv_cache_agrees_alone_and_batched_in_the_mode(tiny_model_dir, kv_cache_dtype):
    """An 8-bit KV pool is read by the native attention kernels (each row's bits its own), not torch's SDPA, whose
    sums follow the batch and the chunking (QA-AD: 2-7 of 8 prompts parted alone against batched, in the mode too;
    here prompts of 40-180 tokens, each one chunk alone and cut across steps of 256 tokens in a batch, where torch
    ran a masked SDPA instead of a causal one). bf16 weights, so that the linears' own batch dependence (int8 panels)
    is out of the picture."""
    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("no native CPU kernels here: the torch path's attention follows the batch")
    model_dir = tiny_model_dir("llama", "bfloat16", num_attention_heads=2)  # head_dim 32
    was = kernels.batch_invariant
    try:
        kernels.set_batch_invariant(True)
        prompts = [[(11 * i + 7 * j) % 250 + 3 for j in range(40 + 20 * i)] for i in range(8)]
        alone, batched = _alone_and_batched(model_dir, prompts, quantization=None, kv_cache_dtype=kv_cache_dtype)
        assert alone == batched  # token ids and logprobs, exactly
    finally:
        kernels.set_batch_invariant(was)


@pytest.mark.parametrize("env, on", [({}, False), ({"PAGEDSERVE_BATCH_INVARIANT": "1"}, True),
                                     ({"VLLM_BATCH_INVARIANT": "1"}, True),
                                     ({"VLLM_BATCH_INVARIANT": "1", "PAGEDSERVE_BATCH_INVARIANT": "0"}, False)])
def test_the_mode_is_read_from_pagedserve_s_or_vllm_s_variable(monkeypatch, env, on):
    for name in ("PAGEDSERVE_BATCH_INVARIANT", "VLLM_BATCH_INVARIANT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert envs.batch_invariant() is on


SLIDING, FULL = "sliding_attention", "full_attention"


GEMMA2 = {"layer_types": [SLIDING, FULL, SLIDING], "num_hidden_layers": 3, "sliding_window": 32, "head_dim": 256}


@pytest.mark.parametrize("arch, overrides, budget", [("gemma3", {"layer_types": [SLIDING, SLIDING]}, 64),
                                                     ("gemma2", GEMMA2, 16)])  # (heads of 32: alike on the old path)
def test_a_windowed_model_agrees_alone_and_batched_in_the_mode(tiny_model_dir, arch, overrides, budget):
    """Gemma 3's sliding-window layers (16 positions): chunks past the window ran torch's row blocks, whose key ranges
    follow the chunking, so a prompt prefilled alone and in a batch got other bits. In the mode such a chunk's rows run
    the native decode kernel, each over its own window. Gemma 2 caps its scores, and every one of its prefill chunks
    (within the window too) ran on torch's row blocks: in the mode they take the native kernels with the cap."""
    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("no native CPU kernels here: the torch path's rows follow the chunking")
    model_dir = tiny_model_dir(arch, "bfloat16", hidden_size=128, intermediate_size=256,
                               **{"head_dim": 32, **overrides})
    prompts = [[(7 * i + 13 * j) % 250 + 3 for j in range(40 + 9 * i)] for i in range(6)]
    prompts += [[(37 * j + 11 * n) % 500 + 3 for j in range(n)] for n in (3, 17, 33, 64, 65, 100)]
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, ignore_eos=True)

    def result(output) -> tuple:
        sample = output.outputs[0]
        return sample.token_ids, [{t: p.logprob for t, p in step.items()} for step in sample.logprobs]

    was = kernels.batch_invariant
    try:
        kernels.set_batch_invariant(True)
        llm = LLM(model_dir, dtype="bfloat16", max_model_len=256, max_num_batched_tokens=budget,
                  enable_chunked_prefill=True, enable_prefix_caching=False)
        alone = [result(llm.generate([{"prompt_token_ids": p}], params)[0]) for p in prompts]
        batched = [result(o) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    finally:
        kernels.set_batch_invariant(was)
    assert alone == batched  # token ids and logprobs, exactly
