"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE): what the memory plan counts, their GGUF files, and what
is refused with a reason (tensor parallelism, other architectures' experts). Their outputs against transformers are
test_correctness.py's (ARCHS), their kernels test_layer_kernels.py's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.formats.errors import ModelValidationError
from pagedserve.memory.sizes import ModelShape, MoEShape, moe_shape


def test_the_plan_counts_every_expert(tiny_model_dir):
    """The int8 plan shrinks every expert's matrices, not one MLP's: its count of linear weights is the checkpoint's
    (the decoder layers' matrices but the routers, which stay in the model dtype)."""
    from safetensors import safe_open

    for arch in ("qwen2_moe", "qwen3_moe", "mixtral"):
        path = Path(tiny_model_dir(arch))
        model = ModelShape.from_hf_config(json.loads((path / "config.json").read_text()), weight_bytes=0)
        with safe_open(path / "model.safetensors", "pt") as checkpoint:
            shapes = {name: checkpoint.get_slice(name).get_shape() for name in checkpoint.keys()}
        linear = sum(shape[0] * shape[1] for name, shape in shapes.items() if len(shape) == 2 and ".layers." in name
                     and not name.endswith((".gate.weight", ".shared_expert_gate.weight")))
        assert model.num_linear_params == linear, arch
    qwen3_moe = {"num_hidden_layers": 2, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                 "intermediate_size": 128, "mlp_only_layers": [1]}
    assert moe_shape(qwen3_moe) == MoEShape(num_experts=4, top_k=2, width=64, dense_layers=frozenset({1}))
    assert moe_shape({"num_hidden_layers": 4, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                      "decoder_sparse_step": 2}).dense_layers == {0, 2}  # every second layer sparse
    assert moe_shape({"num_hidden_layers": 2, "intermediate_size": 8}) is None


def test_tensor_parallel_is_refused_with_the_reason(tiny_model_dir):
    with pytest.raises(ValueError, match="mixture-of-experts model, whose experts are not split across processes yet"):
        LLM(tiny_model_dir("mixtral"), tensor_parallel_size=2, max_model_len=64)


@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe", "mixtral"])
def test_gguf_files_as_llama_cpp_writes_them(arch, tmp_path):
    """Qwen2-MoE's and Qwen3-MoE's GGUF (architectures qwen2moe, qwen3moe) and Mixtral's (llama with an expert
    count): the stacked expert tensors (ffn_*_exps) read as each expert's matrices, the router as ffn_gate_inp,
    Qwen2-MoE's shared expert as ffn_*_shexp; F32 equals transformers (tokens and logprobs), and Q8_0 runs every
    expert on int8 weights."""
    from tests.models.gguf_utils import QType, tiny_model, write_test_gguf
    from tests.models.test_correctness import TOLERANCE, assert_logprobs_close, hf_logprobs

    model = tiny_model(arch)
    prompts = [[5, 6, 7, 8, 9], [40, 41, 42], [100, 7, 100, 7]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5)
    llm = LLM(str(write_test_gguf(model, tmp_path / "f32.gguf")), dtype="float32", max_model_len=64)
    assert llm.engine.config.model.architecture == {"qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe":
                                                    "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}[arch]
    for prompt, output in zip(prompts, llm.generate([{"prompt_token_ids": p} for p in prompts], params)):
        completion = output.outputs[0]
        with torch.no_grad():
            expected = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                      min_new_tokens=12)[0, len(prompt):].tolist()
        assert completion.token_ids == expected
        assert_logprobs_close(completion.logprobs, hf_logprobs(model, prompt, completion.token_ids),
                              TOLERANCE["float32"])
    quantized = LLM(str(write_test_gguf(model, tmp_path / "q8.gguf", QType.Q8_0)), max_model_len=64)
    report = quantized.engine.runner.model.kernel_report()[0]
    assert "4 experts, 2 per token" in report and "gate_up torch int8" not in report, report
    assert quantized.generate([{"prompt_token_ids": prompts[0]}], params)[0].outputs[0].token_ids


def test_another_mixture_of_experts_gguf_is_refused_by_name(tmp_path):
    from tests.models.gguf_utils import tiny_model, write_test_gguf

    def experts(writer) -> None:
        writer.add_uint32("qwen3.expert_count", 8)
        writer.add_uint32("qwen3.expert_used_count", 2)

    path = write_test_gguf(tiny_model("qwen3"), tmp_path / "moe.gguf", extra_metadata=experts)
    with pytest.raises(ModelValidationError, match="holds a mixture-of-experts qwen3 model: pagedserve serves"):
        LLM(str(path), max_model_len=64)
    too_many = write_test_gguf(tiny_model("qwen3_moe", num_experts_per_tok=9), tmp_path / "k.gguf")
    with pytest.raises(ModelValidationError, match="qwen3moe.expert_used_count 9 must be from 1 to its expert_count"):
        LLM(str(too_many), max_model_len=64)


@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe", "mixtral"])
def test_batch_one_decode_matches_transformers(tiny_model_dir, arch):
    """One sequence: its decode steps take SparseMoE's one-row path (no grouping by expert), against transformers
    in float32 (test_correctness.py's batch of 8 takes the grouped path)."""
    from tests.models.test_correctness import check_against_transformers, make_prompts

    model_dir = tiny_model_dir(arch)
    prompts = make_prompts(LLM(model_dir, max_model_len=64, dtype="float32").get_tokenizer())
    check_against_transformers(model_dir, "float32", prompts[:1])


@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral"])
def test_the_one_row_path_equals_the_grouped_one_bit_for_bit(tiny_model_dir, arch):
    """bfloat16: a decode row alone (SparseMoE's one-row path) gets the same bits as beside other rows (the grouped
    path): the same products, rounded where the grouped path rounds them, summed in the same order."""
    from pagedserve.models.llama import SparseMoE

    llm = LLM(tiny_model_dir(arch, "bfloat16"), max_model_len=64, dtype="bfloat16")
    layer = next(m for m in llm.engine.runner.model.modules() if isinstance(m, SparseMoE))
    x = torch.randn(3, layer.gate.in_features, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    for row in range(3):
        alone = layer.forward(x[row:row + 1])
        assert torch.equal(alone, layer.forward(x)[row:row + 1]), row


def test_what_is_not_a_working_mixture_is_said_or_served_dense(tiny_model_dir, tmp_path):
    """QA-M: experts per token beyond the experts is a config error before loading (it failed in warm-up); a
    config whose layers are all plain MLPs (or with 0 experts) is the dense model transformers builds (it crashed);
    an expert width off the native kernels' multiples runs int8 on torch's kernel (its bfloat16 one faulted: run in
    a child process, so that a fault fails this test instead of ending the run)."""
    import shutil
    import subprocess
    import sys

    broken = Path(shutil.copytree(tiny_model_dir("qwen3_moe"), tmp_path / "broken"))
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "num_experts_per_tok": 8}))
    with pytest.raises(ModelValidationError, match="num_experts_per_tok 8 must be an integer from 1 to the number"):
        LLM(str(broken), max_model_len=64)
    for overrides in ({"mlp_only_layers": [0, 1]}, {"num_experts": 0}):
        llm = LLM(tiny_model_dir("qwen3_moe", **overrides), max_model_len=64, dtype="float32")
        kernels = llm.engine.runner.model.layer_kernels()
        assert kernels.experts is None and "experts" not in kernels.lines()[0], overrides
    narrow = tiny_model_dir("qwen3_moe", "bfloat16", moe_intermediate_size=40)
    code = (f"from pagedserve import LLM, SamplingParams\n"
            f"llm = LLM({narrow!r}, quantization='int8', max_model_len=64)\n"
            "print(llm.generate('Hello', SamplingParams(max_tokens=4, ignore_eos=True))[0].outputs[0].token_ids)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]


@pytest.mark.parametrize("arch,overrides", [
    ("mixtral", {"sliding_window": 16}),  # every layer, as Mistral
    ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1}),  # every layer still
    ("qwen2_moe", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 2}),  # the even ones
])
def test_sliding_windows_as_transformers_reads_them(tiny_model_dir, arch, overrides):
    """QA-M: Mixtral's and Qwen3-MoE's windows were ignored (full attention, silently other tokens)."""
    from pagedserve.models.validate import layer_windows
    from tests.models.test_correctness import check_against_transformers

    model_dir = tiny_model_dir(arch, **overrides)
    llm = check_against_transformers(model_dir, "float32", [[(7 * i + 3) % 400 + 20 for i in range(40)],
                                                            [(11 * i) % 300 + 30 for i in range(33)]])
    windows = layer_windows(llm.engine.config.model.hf_config)
    assert windows == {"mixtral": [16, 16], "qwen3_moe": [16, 16], "qwen2_moe": [16, None]}[arch]
