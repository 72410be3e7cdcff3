"""A block-quantized GGUF served from its own Q4_0/Q4_1/Q5_0/Q5_1/Q4_K/Q5_K blocks (BlockLinear on the native kernel:
`--dtype auto`'s default for a GGUF, and vLLM's --quantization gguf) against transformers on the values those blocks
stand for (the file dequantized by benchmarks/gguf_to_hf.py): greedy tokens and top-5 logprobs.

Tolerances: float32 2e-4. The kernel's sums are exact per block of 32; what it adds is x rounded per row to 15-bit
integers (relative 2^-16 of the row's largest value, as the int8 kernel does) in every matmul: observed up to 3e-5
on these models. Requantizing the same blocks to int8 instead (what these files got before) moves logprobs by
~1e-2, so the bound tells the two apart. bfloat16: the 0.15 of tests/models/test_correctness.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as QType

from benchmarks.gguf_to_hf import save_as_hf_dir
from pagedserve import LLM, SamplingParams
from pagedserve.layers.linear import BlockLinear, Int8Linear
from tests.models.gguf_utils import tiny_model, write_test_gguf
from tests.models.test_correctness import (NUM_TOKENS, TOP_K, assert_greedy_close, assert_logprobs_close,
                                          hf_logprobs, hf_reference)

TOLERANCE = {"float32": 2e-4, "bfloat16": 0.15}
# head_dim 32 and widths of whole 64-column groups where the decode stack runs (tests/models/test_decode_stack.py)
SHAPE = dict(hidden_size=128, intermediate_size=256, vocab_size=512)  # _generate's prompts: ids up to 502
CASES = {"llama-Q4_0": ("llama", QType.Q4_0), "llama-Q4_1": ("llama", QType.Q4_1), "qwen2-Q5_0": ("qwen2", QType.Q5_0),
         "qwen3-Q5_1": ("qwen3", QType.Q5_1), "qwen2-Q4_0": ("qwen2", QType.Q4_0),
         "qwen2-Q4_K": ("qwen2", QType.Q4_K), "llama-Q5_K": ("llama", QType.Q5_K),
         "qwen3_moe-Q4_1": ("qwen3_moe", QType.Q4_1),  # each expert's matrices as blocks
         "qwen3_moe-Q5_K": ("qwen3_moe", QType.Q5_K)}
# K-quants come in superblocks of 256 columns: every matrix's input that wide (head_dim 64)
K_SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
K_MOE_SHAPE = dict(head_dim=64, moe_intermediate_size=256)  # Qwen3's o_proj and the experts' down_proj
PROMPTS = [[(37 * i + n) % 250 + 10 for i in range(n)] for n in (3, 9, 17, 33, 60)]


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """case -> (its GGUF, a transformers directory of the values its blocks stand for)."""
    out = tmp_path_factory.mktemp("gguf-blocks")
    files = {}
    for case, (arch, qtype) in CASES.items():
        shape = {**SHAPE, **(K_SHAPE if qtype.name.endswith("_K") else {}),
                 **(K_MOE_SHAPE if qtype.name.endswith("_K") and arch == "qwen3_moe" else {})}
        path = write_test_gguf(tiny_model(arch, **shape), out / f"{case}.gguf", qtype)
        files[case] = path, save_as_hf_dir(path, out / f"{case}-hf")
    return files


def _linears(llm: LLM) -> list[torch.nn.Module]:
    model = llm.engine.runner.model
    return [m for m in model.modules() if isinstance(m, (BlockLinear, Int8Linear))]


def _check(llm: LLM, hf_dir: Path, dtype: str) -> None:
    """Greedy tokens and top-5 logprobs of PROMPTS against transformers' on the blocks' values."""
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=TOP_K)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    model, hf_tokens = hf_reference(str(hf_dir), dtype, PROMPTS)
    for prompt, output, expected in zip(PROMPTS, outputs, hf_tokens):
        completion = output.outputs[0]
        reference = hf_logprobs(model, prompt, completion.token_ids)
        assert_logprobs_close(completion.logprobs, reference, TOLERANCE[dtype])
        if dtype == "float32":
            assert completion.token_ids == expected
        else:
            assert_greedy_close(completion.token_ids, expected, reference, TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", list(CASES))
def test_the_blocks_compute_what_transformers_does_on_their_values(kernels, ggufs, case, dtype):
    path, hf_dir = ggufs[case]
    llm = LLM(str(path), dtype=dtype, quantization="gguf", max_model_len=256)
    assert llm.engine.config.model.quantization == "gguf"
    linears = _linears(llm)
    # every decoder matrix keeps its blocks; the logits head is the tied embedding's (int8) or a 4/5-bit lm_head
    assert all(isinstance(m, BlockLinear) for m in linears if m is not llm.engine.runner.model.logits_proj)
    assert {m.bits for m in linears if isinstance(m, BlockLinear)} == {4 if CASES[case][1].name[1] == "4" else 5}
    _check(llm, hf_dir, dtype)


def test_auto_serves_a_4_bit_gguf_from_its_blocks_on_avx512_and_int8_requantizes_them(kernels, ggufs, monkeypatch):
    """`--dtype auto` picks the file's blocks on classes avx512 and avx512-bf16 (as vLLM's --quantization gguf; int8 on
    the other classes: weight_format.default_file_quantization); --quantization int8 turns every matrix into per-row
    int8, whose logprobs stand ~1e-2 off the blocks' values (so the float32 bound above tells the two apart)."""
    from pagedserve.cli.doctor_model import check_layer_kernels
    from pagedserve.memory.weight_format import default_file_quantization, file_quantization_reason
    from pagedserve.platform import native_kernels_class

    kernels_class = native_kernels_class()
    monkeypatch.setenv("PAGEDSERVE_CPU_ISA", kernels.build)  # this test's build, as `pagedserve plan` tells it
    planned = native_kernels_class(kernels_from_flags=True)  # "avx512-amx" where Linux grants no AMX: same choice
    assert default_file_quantization(planned) == default_file_quantization(kernels_class)
    assert kernels_class == ("avx2" if kernels.isa == "avx2" else "avx512" if not kernels.bf16_dot
                             else "avx512-amx" if kernels.amx else "avx512-bf16")
    path, hf_dir = ggufs["llama-Q4_1"]
    blocks = kernels_class in ("avx512", "avx512-bf16")  # measured faster there (BLOCK_CLASSES)
    auto = LLM(str(path), max_model_len=256)
    assert auto.engine.config.model.quantization == ("gguf" if blocks else "int8")
    assert any(isinstance(m, BlockLinear) for m in _linears(auto)) == blocks
    reason = file_quantization_reason(kernels_class)  # doctor says why --dtype auto chose it
    assert check_layer_kernels(auto.engine.config, kernels.isa, auto_quantization=True).detail.endswith(reason)
    assert ("keeps the file's" in reason) == blocks
    spec = LLM(str(path), max_model_len=256, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert spec.engine.config.model.quantization == "int8"  # a verification's rows run faster on int8
    assert spec.engine.config.model.int8_for_drafts == blocks  # start-up says so there
    assert not auto.engine.config.model.int8_for_drafts
    assert check_layer_kernels(spec.engine.config, kernels.isa, auto_quantization=True).detail.endswith(
        file_quantization_reason(kernels_class, verifies_drafts=True))
    int8 = LLM(str(path), dtype="float32", quantization="int8", max_model_len=256)
    assert int8.engine.config.model.quantization == "int8"
    assert not any(isinstance(m, BlockLinear) for m in _linears(int8))
    with pytest.raises(AssertionError):
        _check(int8, hf_dir, "float32")


def test_mixed_types_fuse_as_int8_where_the_blocks_differ(kernels, tmp_path):
    """A fused q/k/v whose parts are Q4_0, Q5_0 and Q8_0 becomes one int8 linear (the blocks requantized as the
    loader requantizes Q8_0); gate/up of one 4-bit type keep their blocks; the whole model stays within int8's
    rounding of the values (a wrong part would move logprobs by whole units)."""
    from tests.models.test_correctness import prompt_logprob_error

    model = tiny_model("qwen2", **SHAPE)
    names = {n for n in model.state_dict() if n.endswith("_proj.weight")}
    per_tensor = {n: QType.Q4_0 for n in names}
    per_tensor.update({n: QType.Q5_0 for n in names if "k_proj" in n})
    per_tensor.update({n: QType.Q8_0 for n in names if "v_proj" in n})
    path = write_test_gguf(model, tmp_path / "mixed.gguf", QType.Q4_0, qtype_per_tensor=per_tensor)
    hf_dir = save_as_hf_dir(path, tmp_path / "hf")
    llm = LLM(str(path), dtype="float32", quantization="gguf", max_model_len=256)
    layer = llm.engine.runner.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, Int8Linear)
    assert isinstance(layer.mlp.gate_up_proj, BlockLinear) and isinstance(layer.self_attn.o_proj, BlockLinear)
    from transformers import AutoModelForCausalLM

    prompt = PROMPTS[-1]
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    reference = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    assert prompt_logprob_error(out.prompt_logprobs, reference, prompt) < 0.1


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_decode_stack_runs_the_blocks_as_the_per_layer_path_does(kernels, ggufs, dtype):
    from tests.models.test_decode_stack import _generate

    path, _ = ggufs["qwen2-Q5_0"]
    llm = LLM(str(path), dtype=dtype, quantization="gguf", max_model_len=256, enable_prefix_caching=False)
    assert isinstance(llm.engine.runner.model.model.layers[0].mlp.down_proj, BlockLinear)
    with_stack, stack_steps = _generate(llm, stack_enabled=True)
    without, no_stack_steps = _generate(llm, stack_enabled=False)
    assert stack_steps >= 11 and no_stack_steps == 0
    for a, b in zip(with_stack, without):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs  # exact


@pytest.mark.parametrize("types", ["all Q4_1", "q/k/v mixed, Q4_0 lm_head", "K-quant k and down",
                                   "layers differ"])
def test_doctors_prediction_is_what_the_loaded_layers_run(kernels, tmp_path, types):
    """`pagedserve doctor` reads the file's types for each linear (weight_format.gguf_block_linears) and says what
    loads: the GGUF blocks where every part has them in one kind (width, K-quant scales or not), int8 elsewhere;
    the stack runs over both."""
    from pagedserve.cli.check_result import PASS
    from pagedserve.cli.doctor_model import check_layer_kernels

    shape = {**SHAPE, **(K_SHAPE if types.startswith("K") else {}), "num_attention_heads": 4}
    model = tiny_model("qwen2", **shape, tie_word_embeddings=types != "q/k/v mixed, Q4_0 lm_head")
    names = [n for n in model.state_dict() if n.endswith("_proj.weight")]
    per_tensor = {}
    if types.startswith("q/k/v"):
        per_tensor = {n: QType.Q8_0 for n in names if "k_proj" in n} | {"lm_head.weight": QType.Q4_0}
    elif types.startswith("K"):  # a Q4_K k beside Q4_1 q and v: one width, not one kind
        per_tensor = {n: QType.Q4_K for n in names if "k_proj" in n or "down_proj" in n}
    elif types == "layers differ":  # as Q4_K_M files: some layers' v (and down) in another type
        first = [n for n in names if n.startswith("model.layers.0.")]
        per_tensor = {n: QType.Q8_0 for n in first if "v_proj" in n or "down_proj" in n}
    path = write_test_gguf(model, tmp_path / "m.gguf", QType.Q4_1, qtype_per_tensor=per_tensor)
    llm = LLM(str(path), quantization="gguf", max_model_len=128)
    loaded = llm.engine.runner.model
    result = check_layer_kernels(llm.engine.config, kernels.isa)
    assert result.status == PASS and result.detail.endswith("; ".join(loaded.kernel_report()))
    linears = result.detail.split(": ", 2)[2].split("; ")[0]  # "qkv ..., o ..., gate_up ..., down ..., logits ..."
    words = dict(part.split(" ", 1) for part in re.split(r", (?=(?:qkv|o|gate_up|down|logits) )", linears))
    if types == "layers differ":  # layer 0: int8 for q/k/v and down; the other layers keep their blocks
        layers = model.config.num_hidden_layers
        isa = kernels.isa
        expected = f"native int8 ({isa}) in 1 of {layers} layers, native GGUF blocks ({isa}) in {layers - 1}"
        assert words["qkv"] == words["down"] == expected and words["o"].startswith("native GGUF blocks")
        return
    expected_qkv = "native GGUF blocks" if types == "all Q4_1" else "native int8"
    assert words["qkv"].startswith(expected_qkv) and words["down"].startswith("native GGUF blocks")
    assert words["logits"].startswith("native GGUF blocks" if types.startswith("q/k/v") else "native int8")
    assert "decode stack (every layer's C attention and MLP halves for decode-only steps): on" in result.detail
