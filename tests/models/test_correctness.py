"""pagedserve vs Hugging Face transformers on the same tiny random weights.

Greedy tokens must be equal (in bfloat16: equal up to a first divergence that is a near-tie, i.e. HF's
own logprobs of the two candidate tokens differ by less than the tolerance; rounding noise can flip a
tie, a bug cannot hide behind it). Top-5 logprobs, with HF teacher-forced along our tokens, must agree
at every position within a tolerance:
- float32: 5e-5. Both sides compute in fp32; the only differences are summation order (batched vs
  single-sequence matmuls, SDPA over a gathered paged context) — observed max 7e-6 on these models.
- bfloat16: 0.15. bf16 keeps 8 mantissa bits (relative step 2^-8 = 0.4 %); both sides round every
  matmul output to bf16 but in different orders and batch shapes, so logits of magnitude ~5-20 differ
  by a few bf16 steps after two layers (observed max 0.063); 0.15 leaves margin while still catching
  any real bug (a wrong rope/mask/norm changes logprobs by whole units).
"""

from __future__ import annotations

import pytest
import torch

from pagedserve import LLM, SamplingParams

ARCHS = ["llama", "qwen2", "qwen3", "granite", "phi3", "gemma", "gemma2", "gemma3", "smollm3", "qwen2_moe", "qwen3_moe",
         "mixtral"]
TOLERANCE = {"float32": 5e-5, "bfloat16": 0.15}
NUM_TOKENS = 32
TOP_K = 5


def make_prompts(tokenizer) -> list[list[int]]:
    """8 prompts of different lengths (3 .. 70 tokens)."""
    text = ("The quick brown fox jumps over the lazy dog. Paris is the capital of France. def square(x): "
            "return x * x. 你好，世界！ In the beginning the Universe was created. ") * 3
    ids = tokenizer.encode(text)
    lengths = [3, 9, 17, 24, 33, 41, 56, 70]
    return [ids[i:i + n] for i, n in enumerate(lengths)]


def hf_reference(model_dir: str, dtype: str, prompts: list[list[int]]):
    """Greedy tokens of each prompt alone, and HF's logprobs along our generated continuation."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    tokens = []
    for prompt in prompts:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=NUM_TOKENS, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
        tokens.append(out[0, len(prompt):].tolist())
    return model, tokens


def hf_logprobs(model, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """[len(generated), V] logprobs HF assigns at each generated position (teacher-forced)."""
    ids = torch.tensor([prompt + generated])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)


def prompt_logprob_error(prompt_logprobs, model, prompt: list[int]) -> float:
    """The largest difference between our prompt logprobs (RequestOutput.prompt_logprobs, prompt_logprobs=0) and
    those `model` (a transformers causal LM) gives the same prompt."""
    with torch.no_grad():
        reference = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    return max(abs(prompt_logprobs[i][t].logprob - reference[i - 1, t].item()) for i, t in enumerate(prompt) if i)


def assert_logprobs_close(ours, reference: torch.Tensor, tol: float) -> None:
    for position, (step, ref) in enumerate(zip(ours, reference)):
        top_ids = [t for t, lp in sorted(step.items(), key=lambda kv: kv[1].rank) if lp.rank <= TOP_K]
        assert len(top_ids) == TOP_K
        ref_top = ref.topk(TOP_K).indices.tolist()
        for token_id in top_ids:
            diff = abs(step[token_id].logprob - ref[token_id].item())
            assert diff <= tol, f"position {position} token {token_id}: |{diff:.4g}| > {tol}"
        # The sets may swap only tokens whose logprobs are within the tolerance of each other.
        for token_id in set(ref_top) ^ set(top_ids):
            kth = ref[ref_top[-1]].item()
            assert abs(ref[token_id].item() - kth) <= 2 * tol


def assert_greedy_close(ours: list[int], expected: list[int], reference: torch.Tensor, tol: float) -> None:
    """Equal up to the first divergence, which must be a near-tie under HF's own logprobs."""
    for position, (a, b) in enumerate(zip(ours, expected)):
        if a != b:
            gap = abs(reference[position, a].item() - reference[position, b].item())
            assert gap <= tol, f"position {position}: we chose {a}, HF chose {b}, HF logprob gap {gap:.3g}"
            return


def check_against_transformers(model_dir: str, dtype: str, prompts: list[list[int]], **engine_kwargs) -> LLM:
    """Greedy tokens and top-5 logprobs of `prompts` in one batch against transformers' (as the test below checks
    its batch, a near-tie allowed to flip in bfloat16); the engine, for the caller's further checks."""
    llm, outputs = generate(model_dir, dtype, prompts, max_model_len=256, **engine_kwargs)
    hf_model, hf_tokens = hf_reference(model_dir, dtype, prompts)
    for prompt, output, expected in zip(prompts, outputs, hf_tokens):
        completion = output.outputs[0]
        reference = hf_logprobs(hf_model, prompt, completion.token_ids)
        assert_logprobs_close(completion.logprobs, reference, TOLERANCE[dtype])
        assert_greedy_close(completion.token_ids, expected, reference, TOLERANCE[dtype])
    return llm


def generate(model_dir, dtype, prompts, logprobs=TOP_K, **engine_kwargs):
    llm = LLM(model_dir, dtype=dtype, **engine_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=logprobs)
    return llm, llm.generate([{"prompt_token_ids": p} for p in prompts], params)


# A top-k choice of experts is discontinuous: in bfloat16 a near-tie of router scores flips an expert of transformers'
# own run against its float32 one as often as ours (tiny Mixtral: median |logprob difference| from float32 0.0237
# for transformers' bfloat16, 0.0233 for ours), and the flipped token's sequence goes its own way. So bfloat16 runs
# them with every expert (weighted, gathered and summed as always) and float32 checks the top-k choice token for token.
BF16_OVERRIDES = {arch: {"num_experts_per_tok": 4} for arch in ("qwen2_moe", "qwen3_moe", "mixtral")}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_batch_matches_transformers(tiny_model_dir, arch, dtype):
    model_dir = tiny_model_dir(arch, dtype, **(BF16_OVERRIDES.get(arch, {}) if dtype == "bfloat16" else {}))
    llm, outputs = generate(model_dir, dtype, [[1]], max_model_len=256)  # warm the tokenizer path
    prompts = make_prompts(llm.get_tokenizer())
    _, outputs = generate(model_dir, dtype, prompts, max_model_len=256)
    hf_model, hf_tokens = hf_reference(model_dir, dtype, prompts)
    num_exact = 0
    for prompt, output, expected in zip(prompts, outputs, hf_tokens):
        completion = output.outputs[0]
        assert completion.finish_reason == "length"
        assert len(completion.logprobs) == NUM_TOKENS
        reference = hf_logprobs(hf_model, prompt, completion.token_ids)
        assert_logprobs_close(completion.logprobs, reference, TOLERANCE[dtype])
        if dtype == "float32":
            assert completion.token_ids == expected
        else:
            assert_greedy_close(completion.token_ids, expected, reference, TOLERANCE[dtype])
        num_exact += completion.token_ids == expected
    if num_exact < len(prompts) // 2:  # near-ties are the exception, not the rule, unless this model is full of them
        assert_as_close_as_transformers_bf16(model_dir, prompts, outputs, hf_model)


def assert_as_close_as_transformers_bf16(model_dir: str, prompts, outputs, hf_bf16) -> None:
    """Our bfloat16 logprobs are no further from transformers' float32 run than its own bfloat16 run is.

    Some tiny random models are full of near-ties in bfloat16 (phi3's parted from transformers' bfloat16 greedy tokens
    in 5 of 8 prompts on a Zen 3's AVX2 kernels, transformers' bfloat16 from its own float32 in 6 of 8), so fewer than
    half exact says nothing there; how far each side's logprobs of the same tokens lie from float32 does: the median
    over every generated position of |ours - float32| was 0.0159 against transformers' 0.0163 there. A bug that adds
    error beside bfloat16's rounding moves ours and fails; 1.25x leaves room for rounding in another order."""
    from transformers import AutoModelForCausalLM

    hf_float32 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ours_error, hf_error = [], []
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        positions, tokens = torch.arange(len(completion.token_ids)), torch.tensor(completion.token_ids)
        exact = hf_logprobs(hf_float32, prompt, completion.token_ids)[positions, tokens]
        ours = torch.tensor([step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids)])
        ours_error.append((ours - exact).abs())
        hf_error.append((hf_logprobs(hf_bf16, prompt, completion.token_ids)[positions, tokens] - exact).abs())
    ours_median, hf_median = torch.cat(ours_error).median().item(), torch.cat(hf_error).median().item()
    assert ours_median <= 1.25 * hf_median, (
        f"fewer than half the prompts match transformers' bfloat16 tokens, and our logprobs lie further from its "
        f"float32 ones (median {ours_median:.4g}) than its bfloat16 ones do ({hf_median:.4g})")


@pytest.fixture(scope="module")
def llama_reference(tiny_model_dir):
    """Greedy tokens of the tiny llama, computed by pagedserve in a plain configuration."""
    model_dir = tiny_model_dir("llama")
    llm, _ = generate(model_dir, "float32", [[1]], max_model_len=256)
    prompts = make_prompts(llm.get_tokenizer())
    _, outputs = generate(model_dir, "float32", prompts, logprobs=None, max_model_len=256)
    _, hf_tokens = hf_reference(model_dir, "float32", prompts)
    assert [o.outputs[0].token_ids for o in outputs] == hf_tokens
    return model_dir, prompts, hf_tokens


def test_chunked_prefill_of_7_tokens(llama_reference):
    model_dir, prompts, expected = llama_reference
    llm, outputs = generate(model_dir, "float32", prompts, logprobs=None, max_model_len=256,
                            max_num_batched_tokens=7)
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_preemption_keeps_outputs(llama_reference):
    model_dir, prompts, expected = llama_reference
    # 8 requests need up to 7 blocks of 16 each at the end; 20 usable blocks force preemption.
    llm, outputs = generate(model_dir, "float32", prompts, logprobs=None, max_model_len=256,
                            num_gpu_blocks_override=21)
    assert llm.engine.scheduler.num_preemptions_total > 0
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_shared_prefix_hits_cache(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    llm = LLM(model_dir, dtype="float32", max_model_len=256)
    prefix = list(range(10, 60))  # 50 tokens: 3 full blocks
    prompts = [{"prompt_token_ids": prefix + [100 + i, 200 + i]} for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    first = llm.generate(prompts[:1], params)
    rest = llm.generate(prompts[1:], params)
    stats = llm.engine.scheduler.kv.stats
    assert stats.num_hits >= 3 * 48
    assert all(o.num_cached_tokens == 48 for o in rest)
    # vLLM's keywords that have no effect here are taken (engine/vllm_compat.py), as a vLLM script passes them
    fresh = LLM(model_dir, dtype="float32", max_model_len=256, enable_prefix_caching=False, trust_remote_code=True,
                swap_space=4)
    expected = fresh.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in first + rest] == [o.outputs[0].token_ids for o in expected]


def test_requests_added_mid_generation(llama_reference):
    model_dir, prompts, expected = llama_reference
    llm = LLM(model_dir, dtype="float32", max_model_len=256)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    engine = llm.engine
    finished = {}
    pending = list(enumerate(prompts))
    steps = 0
    while pending or engine.has_unfinished_requests():
        if pending and steps % 3 == 0:  # one new request every third step
            index, prompt = pending.pop(0)
            engine.add_request(str(index), {"prompt_token_ids": prompt}, params)
        for output in engine.step():
            if output.finished:
                finished[int(output.request_id)] = output.outputs[0].token_ids
        steps += 1
    assert [finished[i] for i in range(len(prompts))] == expected
    assert engine.scheduler.kv.pool.num_free_blocks == engine.scheduler.kv.pool.num_blocks - 1


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_head_dim_32_takes_the_fused_rotary_path_and_matches_transformers(tiny_model_dir, kernel_build_of, dtype):
    """The tiny models above have head_dim 16; with 32 the native rotary + KV-write kernel runs (each ISA's
    kernels this CPU runs, see conftest.py; the torch path where it runs none), and must still agree with
    transformers."""
    from pagedserve.memory.probe import cpu_flags, native_kernel_isa

    isa, kernels, why = kernel_build_of
    if kernels is None and native_kernel_isa(cpu_flags()) is not None:
        pytest.skip(f"{isa}: {why}")
    model_dir = tiny_model_dir("llama", dtype, hidden_size=128, intermediate_size=256)  # 4 heads of 32
    llm, _ = generate(model_dir, dtype, [[1]], max_model_len=256)
    attention = llm.engine.runner.model.model.layers[0].self_attn
    assert attention.head_dim == 32 and attention.fused_rope == (kernels is not None)
    prompts = make_prompts(llm.get_tokenizer())
    _, outputs = generate(model_dir, dtype, prompts, max_model_len=256)
    hf_model, hf_tokens = hf_reference(model_dir, dtype, prompts)
    for prompt, output, expected in zip(prompts, outputs, hf_tokens):
        reference = hf_logprobs(hf_model, prompt, output.outputs[0].token_ids)
        assert_logprobs_close(output.outputs[0].logprobs, reference, TOLERANCE[dtype])
        if dtype == "float32":
            assert output.outputs[0].token_ids == expected
        else:
            assert_greedy_close(output.outputs[0].token_ids, expected, reference, TOLERANCE[dtype])


ROPE_SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
}


@pytest.mark.parametrize("scaling", sorted(ROPE_SCALINGS))
def test_rope_scaled_models_match_transformers(tmp_path, scaling):
    """Llama 3.x and long-context Qwen configs scale rope: they crashed while loading (transformers' rope init
    ran under the loader's meta device). Prompts and outputs run past the 64 positions trained without scaling."""
    from tests.tiny_models import make_tiny_model

    model_dir = str(make_tiny_model("llama", tmp_path, rope_parameters={**ROPE_SCALINGS[scaling],
                                                                        "rope_theta": 10000.0}))
    llm, _ = generate(model_dir, "float32", [[1]], max_model_len=256)
    prompts = make_prompts(llm.get_tokenizer())
    _, outputs = generate(model_dir, "float32", prompts, max_model_len=256)
    hf_model, hf_tokens = hf_reference(model_dir, "float32", prompts)
    for prompt, output, expected in zip(prompts, outputs, hf_tokens):
        completion = output.outputs[0]
        assert completion.token_ids == expected
        assert_logprobs_close(completion.logprobs, hf_logprobs(hf_model, prompt, completion.token_ids),
                              TOLERANCE["float32"])


def test_dynamic_ntk_rope_is_fixed_as_vllm_fixes_it_past_the_trained_context():
    """transformers rescales dynamic NTK rope for each sequence's length; no fixed table can follow it. Within the
    trained context it is plain rope (as transformers' is there); past it, the base scaled for factor x the
    trained positions, vLLM's rule (it was plain rope at any length: outputs past 64 positions parted from both)."""
    import transformers

    from pagedserve.layers.rotary import inverse_frequencies

    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=2, max_position_embeddings=64,
                                      rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0})
    dim = 32
    plain = 1.0 / (10000.0 ** (torch.arange(0, dim, 2).float() / dim))
    within, _ = inverse_frequencies(config, dim, max_position=64)
    torch.testing.assert_close(within, plain)
    base = 10000.0 * (4.0 * 4.0 - 3.0) ** (dim / (dim - 2))
    past, _ = inverse_frequencies(config, dim, max_position=256)
    torch.testing.assert_close(past, 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim)))
