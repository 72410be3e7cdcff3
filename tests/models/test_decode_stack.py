"""The native decode stack (all decoder layers of a decode-only step in one call) against the per-layer
path it replaces. Both run the same kernels in the same order, so tokens and logprobs must be equal
bit for bit: any difference is a bug in the stack (a wrong pointer, stride or residual), not rounding.
"""

from __future__ import annotations

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.layers.attention import AttentionMetadata

# head_dim 32 (4 heads over 128): the shapes where the native rotary + KV-write kernel, and so the
# stack, can run; in_features are multiples of 64 for the int8 kernel.
SHAPE = dict(hidden_size=128, intermediate_size=256)
PROMPT_LENGTHS = (3, 17, 40)  # one decode batch of 3 with different context lengths (padded slots)


def _generate(llm: LLM, stack_enabled: bool) -> tuple[list, int]:
    """(outputs, decode steps the stack ran) for the same prompts, with the stack on or off."""
    model = llm.engine.runner.model.model
    prompts = [{"prompt_token_ids": [(7 * i + n) % 500 + 3 for i in range(n)]} for n in PROMPT_LENGTHS]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2))  # the first forward builds the stack
    stack = model.stack
    assert stack is not None
    calls = []
    original = stack.forward
    stack.forward = lambda *args: calls.append(1) or original(*args)
    model.stack = stack if stack_enabled else None
    try:
        outputs = llm.generate(prompts, params)
    finally:
        model.stack = stack
        del stack.forward
    return outputs, len(calls)


# Qwen3 with its second layer windowed (max_window_layers): two step views, one rotary
QWEN3_WINDOWS = {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1}
GEMMA = {"head_dim": 32}  # the tiny Gemmas' 16 is below the fused rotary's multiple


@pytest.mark.parametrize("arch,dtype,quantization,overrides", [
    ("llama", "bfloat16", None, {}),
    ("qwen2", "bfloat16", None, {}),  # qkv bias, tied embeddings
    ("qwen2", "bfloat16", "int8", {}),
    ("llama", "float32", "int8", {}),  # int8 weights with float32 activations
    ("granite", "bfloat16", None, {}),  # scales: attention's, the residual's folded into o and down
    ("phi3", "bfloat16", "int8", {}),  # fused checkpoint matrices
    ("qwen3", "bfloat16", None, {}),  # q/k norms per head, in the fused rotary kernel
    ("qwen3", "bfloat16", "int8", {}),
    ("qwen3", "bfloat16", None, QWEN3_WINDOWS),  # a full and a sliding-window layer: contexts past the window
    ("mistral", "bfloat16", None, {"sliding_window": 16}),  # every layer windowed: one view, cut
    ("smollm3", "bfloat16", None, {}),  # a layer without rotary: a view without tables
    ("smollm3", "bfloat16", "int8", {}),
    ("gemma", "bfloat16", None, GEMMA),  # GELU gate, float32-gain norms, scaled embeddings
    ("gemma2", "bfloat16", None, GEMMA),  # + sandwich norms, windowed layers, softcapped scores
    ("gemma3", "bfloat16", None, GEMMA),  # + gain q/k norms, windowed layers with their own rotary
    ("gemma3", "bfloat16", "int8", GEMMA),
    ("gemma3", "float32", "int8", GEMMA),  # float32 activations
    ("qwen3", "bfloat16", None, {"kv_cache_dtype": "fp8"}),  # fp8 K/V written by the fused rotary, read natively
    ("llama", "float32", "int8", {"kv_cache_dtype": "fp8_e5m2"}),
    ("gemma3", "bfloat16", None, {**GEMMA, "kv_cache_dtype": "fp8"}),  # window layers' pool of their own: fp8 too
])
def test_stack_equals_the_per_layer_path(kernels, tiny_model_dir, arch, dtype, quantization, overrides):
    overrides = dict(overrides)
    kwargs = {"quantization": quantization} if quantization else {}
    kwargs["kv_cache_dtype"] = overrides.pop("kv_cache_dtype", "auto")
    model_dir = tiny_model_dir(arch, dtype, **SHAPE, **overrides)
    # No prefix caching: the second run must compute the same prefills as the first.
    llm = LLM(model_dir, dtype=dtype, device="cpu", max_model_len=256, enable_prefix_caching=False, **kwargs)
    with_stack, stack_steps = _generate(llm, stack_enabled=True)
    without, no_stack_steps = _generate(llm, stack_enabled=False)
    assert stack_steps >= 11 and no_stack_steps == 0  # 12 tokens: 1 from the prefill, the rest decoded
    for a, b in zip(with_stack, without):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs  # exact


def test_stack_points_at_the_live_parameters(kernels, tiny_model_dir):
    """The table holds raw pointers: they must be those of the tensors the model uses after loading (the
    loader replaces checkpoint-mapped norms after prepare(); a stale pointer would read freed memory)."""
    llm = LLM(tiny_model_dir("qwen2", "bfloat16", **SHAPE), dtype="bfloat16", device="cpu", max_model_len=128)
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3))
    assert f"qkv native bf16 ({kernels.isa})" in llm.engine.runner.model.kernel_report()[0]  # this ISA's build
    model = llm.engine.runner.model.model
    table = model.stack.table
    layout = kernels.layer_layout  # the columns as the C library defines them (PS_L_* in cpu_kernels.c)
    assert layout["layer_fields"] == kernels.layer_fields == table.shape[1]
    for row, layer in zip(table.tolist(), model.layers):
        assert row[layout["q_norm"]] == row[layout["k_norm"]] == 0  # Qwen2: no per-head norms
        assert row[layout["in_norm"]] == layer.input_layernorm.weight.data_ptr()
        assert row[layout["post_norm"]] == layer.post_attention_layernorm.weight.data_ptr()
        for name, linear in (("qkv", layer.self_attn.qkv_proj), ("down", layer.mlp.down_proj)):
            assert row[layout[name]:layout[name] + layout["linear_fields"]] == linear.native_fields()
    caches = llm.engine.runner.kv_caches
    assert table[:, layout["k_cache"]].tolist() == [c.k.data_ptr() for c in caches]
    assert table[:, layout["v_cache"]].tolist() == [c.v.data_ptr() for c in caches]
    assert not table[:, layout["k_scale"]].any() and not table[:, layout["v_scale"]].any()  # a bf16 pool: no scales
    assert not table[:, layout["kv_format"]].any()
    assert model.stack.final_norm.data_ptr() == model.norm.weight.data_ptr()
    fp8 = LLM(tiny_model_dir("qwen2", "bfloat16", **SHAPE), dtype="bfloat16", device="cpu", max_model_len=128,
              kv_cache_dtype="fp8_e5m2")
    fp8.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3))
    table, caches = fp8.engine.runner.model.model.stack.table, fp8.engine.runner.kv_caches
    assert table[:, layout["k_scale"]].tolist() == [c.k_scale.data_ptr() for c in caches]
    assert table[:, layout["v_scale"]].tolist() == [c.v_scale.data_ptr() for c in caches]
    assert (table[:, layout["kv_format"]] == 2).all()  # FP8_E5M2 in cpu_kernels.c


def test_stack_is_not_used_where_it_cannot_run(kernels, tiny_model_dir):
    # bf16 int8 linears run the kernel at every batch size (bf16 panels for prefill-sized ones); float32 ones
    # up to kernels.int8_max_rows (32 with AVX512-BF16, every batch on AVX2): a larger batch goes layer by layer
    int8 = LLM(tiny_model_dir("llama", "bfloat16", **SHAPE), dtype="bfloat16", device="cpu", max_model_len=128,
               quantization="int8")
    int8.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3))
    stack = int8.engine.runner.model.model.stack
    caches = int8.engine.runner.kv_caches

    def meta(rows: int) -> AttentionMetadata:
        return AttentionMetadata(slot_mapping=torch.zeros(rows, dtype=torch.int64), num_decodes=rows,
                                 decode_kv_slots=torch.zeros(rows, 1, dtype=torch.int64),
                                 decode_context_lens=torch.ones(rows, dtype=torch.int64))

    assert stack.runs(torch.zeros(32, 128), caches, meta(32))
    assert stack.runs(torch.zeros(33, 128), caches, meta(33))
    int8_f32 = LLM(tiny_model_dir("llama", "float32", **SHAPE), dtype="float32", device="cpu", max_model_len=128,
                   quantization="int8")
    int8_f32.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3))
    stack = int8_f32.engine.runner.model.model.stack
    caches = int8_f32.engine.runner.kv_caches
    assert stack.runs(torch.zeros(32, 128), caches, meta(32))
    assert stack.runs(torch.zeros(33, 128), caches, meta(33)) == (kernels.int8_max_rows(torch.float32) is None)
