"""Granite, Phi-3 and SmolLM3 against transformers beyond what test_correctness.py's batch covers: on the native
decoder kernels and their decode stack, Phi-3's partial rotary and LongRoPE (short and long factors), SmolLM3's
layers without rotary, and a fused checkpoint matrix that does not match config.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.formats.errors import ModelValidationError
from tests.models.test_correctness import (TOLERANCE, check_against_transformers, generate, make_prompts,
                                           prompt_logprob_error)

# head_dim 32: the native rotary + KV-write kernel runs, so the decode stack does (test_decode_stack.py's shape).
NATIVE_SHAPE = dict(hidden_size=128, intermediate_size=256)
# Phi-4-mini's kind of rope: a quarter of each head unrotated, LongRoPE trained on 256 positions of 512.
ROTARY_HALF = 16 * 3 // 4 // 2  # inverse frequencies for head_dim 16 x partial_rotary_factor 0.75
LONGROPE = dict(partial_rotary_factor=0.75, max_position_embeddings=512, original_max_position_embeddings=256,
                rope_scaling={"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(ROTARY_HALF)],
                              "long_factor": [1.0 + 2.0 * i for i in range(ROTARY_HALF)]})


def _check_against_transformers(model_dir: str, dtype: str, **engine_kwargs) -> LLM:
    llm, _ = generate(model_dir, dtype, [[1]], max_model_len=256, **engine_kwargs)
    return check_against_transformers(model_dir, dtype, make_prompts(llm.get_tokenizer()), **engine_kwargs)


@pytest.mark.parametrize("arch", ["granite", "phi3"])
def test_native_kernels_and_decode_stack_match_transformers(kernels, tiny_model_dir, arch):
    llm = _check_against_transformers(tiny_model_dir(arch, "bfloat16", **NATIVE_SHAPE), "bfloat16", device="cpu")
    model = llm.engine.runner.model
    assert model.layer_kernels().stack and model.model.stack is not None  # the stack ran these decodes
    assert f"native bf16 ({kernels.isa})" in model.kernel_report()[0]


def test_smollm3_unrotated_layers_on_the_native_kernels(kernels, tiny_model_dir):
    """SmolLM3's NoPE layers (every other one here) write K/V unrotated through the fused kernel (no tables) beside
    layers whose rotary runs fused into the KV write; decode steps take the decode stack, a step view each."""
    llm = _check_against_transformers(tiny_model_dir("smollm3", "bfloat16", **NATIVE_SHAPE), "bfloat16", device="cpu")
    model = llm.engine.runner.model.model
    assert [layer.self_attn.rotary for layer in model.layers] == [True, False]
    assert all(layer.self_attn.fused_rope for layer in model.layers)
    assert model.stack is not None and model.stack.views == [(None, "global"), (None, None)]


def test_phi3_partial_rotary_with_longrope_short_factors(tiny_model_dir):
    """Served within original_max_position_embeddings: the short factors, as transformers uses for such lengths."""
    llm = _check_against_transformers(tiny_model_dir("phi3", **LONGROPE), "float32")
    assert not llm.engine.runner.model.model.layers[0].self_attn.fused_rope  # a quarter of each head passes


def test_phi3_longrope_long_factors_past_the_original_context(tiny_model_dir):
    """Served past original_max_position_embeddings: the long factors throughout, which is what transformers
    computes for a sequence longer than it (its prompt logprobs over 300 tokens equal ours)."""
    model_dir = tiny_model_dir("phi3", **LONGROPE)
    llm = LLM(model_dir, dtype="float32", max_model_len=512)
    prompt = [(37 * i) % 500 + 3 for i in range(300)]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    ours = llm.generate([{"prompt_token_ids": prompt}], params)[0].prompt_logprobs
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert prompt_logprob_error(ours, hf_model, prompt) <= TOLERANCE["float32"] * 10  # 300 positions of float32 sums
    short = LLM(model_dir, dtype="float32", max_model_len=256)  # the short factors differ past any doubt
    short_logprobs = short.generate([{"prompt_token_ids": prompt[:200]}], params)[0].prompt_logprobs
    assert max(abs(short_logprobs[i][t].logprob - ours[i][t].logprob) for i, t in enumerate(prompt[:200]) if i) > 0.1


def test_a_fused_matrix_that_does_not_match_the_config_is_named(tiny_model_dir, tmp_path):
    import shutil

    model_dir = Path(shutil.copytree(tiny_model_dir("phi3"), tmp_path / "phi3"))
    config = json.loads((model_dir / "config.json").read_text())
    config["num_key_value_heads"] = 1  # qkv_proj holds 4 + 2 + 2 heads' rows, the config now says 4 + 1 + 1
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelValidationError, match=r"qkv_proj.weight' has 128 rows, the model expects 64 \+ 16 \+ 16"):
        LLM(str(model_dir), dtype="float32", max_model_len=64)


def test_granite_scales_each_matter(tiny_model_dir):
    """Each of Granite's four scales changes the output: a model that ignored one would not match transformers
    by chance (test_correctness.py checks the match)."""
    baseline = _greedy(tiny_model_dir("granite"))
    for field, value in (("embedding_multiplier", 1.0), ("residual_multiplier", 1.0), ("attention_multiplier", 0.25),
                         ("logits_scaling", 1.0)):
        assert _greedy(tiny_model_dir("granite", **{field: value})) != baseline, field


def _greedy(model_dir: str) -> list:
    llm = LLM(model_dir, dtype="float32", max_model_len=64)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    output = llm.generate([{"prompt_token_ids": [5, 17, 33, 9]}], params)[0].outputs[0]
    return [round(step[token].logprob, 3) for step, token in zip(output.logprobs, output.token_ids)]


def test_what_these_models_cannot_serve_is_refused_before_loading(tiny_model_dir, tmp_path):
    """--task embed (no embedding variant), a config transformers rejects, mlp_bias: each a message naming it, before
    any weight is read (a traceback while loading before, and doctor passed them)."""
    import shutil

    with pytest.raises(ValueError, match="GraniteForCausalLM is served for text generation only; task embed takes"):
        LLM(tiny_model_dir("granite"), task="embed", max_model_len=64)
    broken = Path(shutil.copytree(tiny_model_dir("phi3", **LONGROPE), tmp_path / "broken"))
    config = json.loads((broken / "config.json").read_text())
    config["num_attention_heads"] = 2  # the factor lists are now the wrong length for head_dim
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelValidationError, match="the model's config cannot be read"):
        LLM(str(broken), max_model_len=64)
    biased = Path(shutil.copytree(tiny_model_dir("granite"), tmp_path / "biased"))
    config = json.loads((biased / "config.json").read_text())
    (biased / "config.json").write_text(json.dumps({**config, "mlp_bias": True}))
    with pytest.raises(ModelValidationError, match="sets mlp_bias: true"):
        LLM(str(biased), max_model_len=64)
