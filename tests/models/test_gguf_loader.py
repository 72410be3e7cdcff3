"""GGUF loader round trips on tiny random Llama / Qwen2 / Qwen3 models written like llama.cpp does."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as QType
from gguf.quants import dequantize

from benchmarks.gguf_to_hf import save_as_hf_dir
from pagedserve.formats.gguf_hf import GGUFTensorSpec, unpermute_rows
from pagedserve.models.gguf_loader import GGUFCheckpoint
from pagedserve.models.gguf_tokenizer import PRE_TOKENIZER_FAMILY
from pagedserve.models.validate import ModelValidationError
from tests.models.gguf_utils import llama_permute, tiny_model, write_test_gguf

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ARCHS = ("llama", "qwen2", "qwen3")

# Worst-case error of one dequantized value, as a fraction of its 32-value block's largest magnitude.
# Q8_0: step absmax/127, error <= step/2. Q4_0/Q5_0: step d = absmax/8 (/16), and the value of sign
# opposite to the block's extreme can be clamped, so error <= d. Q4_1/Q5_1: step (max-min)/15 (/31)
# <= 2*absmax/15 (/31), error <= step/2. Plus slack for the fp16 scale (2^-11 relative).
BLOCK_ERROR_BOUND = {
    QType.Q8_0: 1 / 254 + 2e-3,
    QType.Q5_0: 1 / 16 + 2e-3,
    QType.Q5_1: 1 / 31 + 2e-3,
    QType.Q4_0: 1 / 8 + 2e-3,
    QType.Q4_1: 1 / 15 + 2e-3,
}
# Float encodings: relative rounding error per value (half a unit in the last place), and the
# absolute one for fp16 subnormals (|x| < 2^-14, spacing 2^-24).
FLOAT_RTOL = {QType.F16: 2**-11, QType.BF16: 2**-8}
FLOAT_ATOL = {QType.F16: 2**-25, QType.BF16: 1e-38}


@pytest.fixture(scope="module")
def models() -> dict[str, torch.nn.Module]:
    return {arch: tiny_model(arch) for arch in ARCHS}


def _logits(model: torch.nn.Module, input_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([input_ids])).logits[0]


def _model_from_tensors(reference: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    clone = type(reference)(reference.config).eval()
    clone.load_state_dict(tensors, strict=True)
    return clone


def _stored_rows(checkpoint: GGUFCheckpoint) -> list[tuple[GGUFTensorSpec, np.ndarray]]:
    """Every tensor as stored (quantized blocks, uint8 [rows, bytes], or floats) with its rows in Hugging Face
    order: the llama q/k permutation undone on whole rows of blocks, which is exact."""
    rows = []
    for spec in checkpoint.tensor_specs():
        stored, num_heads = checkpoint.stored(spec), checkpoint.permute_heads(spec)
        rows.append((spec, np.array(unpermute_rows(stored, num_heads) if num_heads else stored)))
    return rows


@pytest.mark.parametrize("arch", ARCHS)
def test_f32_round_trip_is_exact(models: dict, arch: str, tmp_path: Path) -> None:
    model = models[arch]
    path = write_test_gguf(model, tmp_path / f"{arch}.gguf", QType.F32)
    with GGUFCheckpoint(path) as checkpoint:
        loaded = dict(checkpoint.iter_tensors(torch.float32))
    original = model.state_dict()
    assert list(loaded) == [name for name in original if name in loaded]
    assert set(loaded) == set(original)
    for name, tensor in original.items():
        assert loaded[name].shape == tensor.shape, name
        assert torch.equal(loaded[name], tensor), name


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_config_describes_the_model(models: dict, arch: str, tmp_path: Path) -> None:
    model = models[arch]
    with GGUFCheckpoint(write_test_gguf(model, tmp_path / "m.gguf")) as checkpoint:
        config = checkpoint.hf_config()
        assert checkpoint.architecture == arch
    expected_arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]
    assert config["architectures"] == [expected_arch]
    assert config["model_type"] == arch
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "vocab_size", "rms_norm_eps",
                "bos_token_id", "eos_token_id", "tie_word_embeddings"):
        assert config[key] == getattr(model.config, key), key
    assert config["head_dim"] == (32 if arch == "qwen3" else 16)
    assert config["rope_theta"] == model.config.rope_parameters["rope_theta"]
    assert config["attention_bias"] is (arch == "qwen2")
    assert "rope_scaling" not in config


def test_llama_attention_biases_are_unpermuted_too(tmp_path: Path) -> None:
    model = tiny_model("llama", attention_bias=True)
    path = write_test_gguf(model, tmp_path / "bias.gguf", QType.F32)
    with GGUFCheckpoint(path) as checkpoint:
        assert checkpoint.hf_config()["attention_bias"] is True
        loaded = dict(checkpoint.iter_tensors(torch.float32))
        raw = {spec.name: data for spec, data in _stored_rows(checkpoint)}
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded[name], tensor), name
        np.testing.assert_array_equal(raw[name], tensor.numpy(), err_msg=name)


def test_tied_embeddings_are_detected(tmp_path: Path) -> None:
    model = tiny_model("qwen2", tie_word_embeddings=True)
    with GGUFCheckpoint(write_test_gguf(model, tmp_path / "tied.gguf")) as checkpoint:
        assert checkpoint.hf_config()["tie_word_embeddings"] is True
        names = [name for name, _ in checkpoint.iter_tensors()]
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names


@pytest.mark.parametrize("qtype", [QType.F16, QType.BF16, *BLOCK_ERROR_BOUND], ids=lambda qtype: qtype.name)
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_quantized_round_trip_within_quantisation_error(models: dict, arch: str, qtype: QType, tmp_path: Path) -> None:
    model = models[arch]
    path = write_test_gguf(model, tmp_path / "q.gguf", qtype)
    with GGUFCheckpoint(path) as checkpoint:
        loaded = dict(checkpoint.iter_tensors(torch.float32))
    for name, original in model.state_dict().items():
        got = loaded[name]
        if original.ndim == 1:  # norms and biases stay F32, as llama.cpp stores them
            assert torch.equal(got, original), name
        elif qtype in FLOAT_RTOL:
            torch.testing.assert_close(got, original, rtol=FLOAT_RTOL[qtype], atol=FLOAT_ATOL[qtype], msg=name)
        else:
            blocks, got_blocks = original.reshape(-1, 32), got.reshape(-1, 32)
            error = (got_blocks - blocks).abs()
            bound = BLOCK_ERROR_BOUND[qtype] * blocks.abs().amax(dim=1, keepdim=True)
            assert bool((error <= bound).all()), f"{name}: max error {float((error - bound).max())} above bound"
            assert float(error.max()) > 0, f"{name} was not quantized"


def test_llama_qk_permutation_is_undone(tmp_path: Path) -> None:
    # Larger weights than the default 0.02 so that attention (hence q/k row order) shapes the logits.
    model = tiny_model("llama", initializer_range=0.1)
    path = write_test_gguf(model, tmp_path / "llama.gguf", QType.Q8_0)
    with GGUFCheckpoint(path) as checkpoint:
        loaded = dict(checkpoint.iter_tensors(torch.float32))
    input_ids = [5, 77, 140, 3, 9, 250, 31, 8]
    expected = _logits(model, input_ids)
    # Q8_0 moves these logits (max |logit| ~3) by ~0.07; a wrong row order moves them by ~2.
    torch.testing.assert_close(_logits(_model_from_tensors(model, loaded), input_ids), expected, atol=0.2, rtol=0)
    # Control: leaving llama.cpp's permutation in place changes the output well beyond that tolerance.
    permuted = dict(loaded)
    for name in permuted:
        if ".q_proj.weight" in name or ".k_proj.weight" in name:
            heads = model.config.num_attention_heads if ".q_proj" in name else model.config.num_key_value_heads
            permuted[name] = torch.from_numpy(llama_permute(permuted[name].numpy(), heads))
    wrong = _logits(_model_from_tensors(model, permuted), input_ids)
    assert float((wrong - expected).abs().max()) > 1.0


@pytest.mark.parametrize("arch", ARCHS + ("qwen2_moe", "qwen3_moe", "mixtral"))
def test_save_as_hf_dir_loads_in_transformers(models: dict, arch: str, tmp_path: Path) -> None:
    """The exported directory is the model: benchmarks and tests use it as the GGUF's transformers reference (Mixtral's
    experts under its own names: under the Qwen-MoE ones transformers left them random, 0.19 off)."""
    model = models[arch] if arch in models else tiny_model(arch)
    out = save_as_hf_dir(write_test_gguf(model, tmp_path / "m.gguf"), tmp_path / "hf")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(reloaded) is type(model)
    input_ids = [1, 42, 7, 199, 13, 2]
    torch.testing.assert_close(_logits(reloaded, input_ids), _logits(model, input_ids), rtol=0, atol=1e-5)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer.encode("<|im_start|>user") == [1, *tokenizer.encode("user")]


def test_raw_tensors_are_stored_blocks_in_hf_row_order(models: dict, tmp_path: Path) -> None:
    path = write_test_gguf(models["llama"], tmp_path / "q8.gguf", QType.Q8_0)
    with GGUFCheckpoint(path) as checkpoint:
        dequantized = dict(checkpoint.iter_tensors(torch.float32))
        stored_rows = _stored_rows(checkpoint)
    assert [spec.name for spec, _ in stored_rows] == list(dequantized)
    for spec, data in stored_rows:
        assert spec.shape == tuple(dequantized[spec.name].shape)
        if spec.qtype == QType.Q8_0:
            assert data.dtype == np.uint8 and data.shape == (spec.shape[0], spec.shape[1] // 32 * 34)
            values = dequantize(data, spec.qtype)
        else:
            assert spec.qtype == QType.F32 and data.shape == spec.shape
            values = data
        np.testing.assert_array_equal(values.reshape(spec.shape), dequantized[spec.name].numpy())


def test_tensor_sizes_and_mixed_types(models: dict, tmp_path: Path) -> None:
    model = models["qwen2"]
    per_tensor = {"model.embed_tokens.weight": QType.Q8_0, "lm_head.weight": QType.F16}
    path = write_test_gguf(model, tmp_path / "mixed.gguf", QType.Q4_0, qtype_per_tensor=per_tensor)
    with GGUFCheckpoint(path) as checkpoint:
        specs = {spec.name: spec for spec in checkpoint.tensor_specs()}
        nbytes = {name: spec.nbytes for name, spec in specs.items()}
        assert checkpoint.num_parameters() == sum(p.numel() for p in model.parameters())
        assert checkpoint.num_tensors == len(model.state_dict())
        data_offset = checkpoint.header.data_offset
    assert specs["model.embed_tokens.weight"].qtype == QType.Q8_0
    assert specs["lm_head.weight"].qtype == QType.F16
    assert specs["model.layers.0.mlp.up_proj.weight"].qtype == QType.Q4_0
    assert specs["model.norm.weight"].qtype == QType.F32
    embed = model.model.embed_tokens.weight
    assert nbytes["model.embed_tokens.weight"] == embed.numel() // 32 * 34
    assert nbytes["lm_head.weight"] == embed.numel() * 2
    assert nbytes["model.layers.0.mlp.up_proj.weight"] == 96 * 64 // 32 * 18
    assert nbytes["model.norm.weight"] == 64 * 4
    # every byte of the data section is a tensor or alignment padding (< 32 bytes per tensor)
    data_bytes = path.stat().st_size - data_offset
    assert sum(nbytes.values()) <= data_bytes < sum(nbytes.values()) + 32 * len(nbytes)


def test_llama3_rope_scaling_is_recovered(tmp_path: Path) -> None:
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    model = tiny_model("llama", rope_parameters=rope, max_position_embeddings=16384, head_dim=64)
    with GGUFCheckpoint(write_test_gguf(model, tmp_path / "l3.gguf")) as checkpoint:
        config = checkpoint.hf_config()
        names = {name for name, _ in checkpoint.iter_tensors()}
    assert config["rope_scaling"] == {key: value for key, value in rope.items() if key != "rope_theta"}
    assert config["rope_theta"] == 500000.0
    assert not any("rope" in name for name in names)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(save_as_hf_dir(tmp_path / "l3.gguf", tmp_path / "hf"))
    input_ids = list(range(3, 40))
    torch.testing.assert_close(_logits(reloaded.eval(), input_ids), _logits(model, input_ids), rtol=0, atol=1e-5)


@pytest.mark.parametrize("rope_type", ["linear", "yarn"])
def test_rope_scaling_metadata_becomes_rope_scaling(rope_type: str, tmp_path: Path) -> None:
    rope = {"rope_type": rope_type, "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 256}
    model = tiny_model("qwen2", rope_parameters=rope, max_position_embeddings=1024)
    with GGUFCheckpoint(write_test_gguf(model, tmp_path / "rope.gguf")) as checkpoint:
        config = checkpoint.hf_config()
    assert config["rope_scaling"] == {"rope_type": rope_type, "factor": 4.0, "original_max_position_embeddings": 256}
    assert config["rope_theta"] == 1e6 and config["max_position_embeddings"] == 1024


def test_nonstandard_rope_factors_are_refused(tmp_path: Path) -> None:
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 2.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    model = tiny_model("llama", rope_parameters=rope, max_position_embeddings=16384, head_dim=64)
    with GGUFCheckpoint(write_test_gguf(model, tmp_path / "odd.gguf")) as checkpoint:
        with pytest.raises(ModelValidationError, match="rope_freqs"):
            checkpoint.hf_config()


def test_truncated_gguf_is_refused_before_reading_tensors(models: dict, tmp_path: Path) -> None:
    path = write_test_gguf(models["qwen3"], tmp_path / "cut.gguf", QType.Q8_0)
    full_size = path.stat().st_size
    os.truncate(path, full_size - 1000)
    with pytest.raises(ModelValidationError) as info:
        GGUFCheckpoint(path)
    message = str(info.value)
    assert "truncated" in message and f"{full_size:,}" in message and f"{full_size - 1000:,}" in message


def test_tiny_tokenizer_keeps_special_tokens_whole(models: dict, tmp_path: Path) -> None:
    with GGUFCheckpoint(write_test_gguf(models["qwen2"], tmp_path / "t.gguf")) as checkpoint:
        tokenizer = checkpoint.build_tokenizer()
    assert tokenizer.encode("<|im_start|>") == [1] and tokenizer.encode("<|im_end|>") == [2]
    assert tokenizer.encode(" the") == [tokenizer.convert_tokens_to_ids("Ġthe")]  # merges applied in order
    text = "<|im_start|>user\n the weather in Zürich 🌧<|im_end|>"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.bos_token == "<|im_start|>"
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                             add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_the_rebuilt_tokenizer_is_cached_per_file_and_rebuilt_when_stale(models: dict, tmp_path: Path,
                                                                           monkeypatch) -> None:
    """The first build writes the tokenizer to the cache; the next one reads it (no string arrays decoded)
    and behaves the same; a changed file or a damaged entry is rebuilt, never read wrongly."""
    from pagedserve.models import gguf_loader

    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    path = write_test_gguf(models["qwen2"], tmp_path / "t.gguf")
    builds = []
    real_read = gguf_loader.read_gguf_header
    monkeypatch.setattr(gguf_loader, "read_gguf_header", lambda *a, **k: builds.append(a) or real_read(*a, **k))

    def tokenizer():
        with GGUFCheckpoint(path) as checkpoint:
            return checkpoint.build_tokenizer()

    text = "<|im_start|>user\n the weather in Zürich 🌧<|im_end|>"
    built = tokenizer()
    entries = list((tmp_path / "cache" / "tokenizers").glob("*.json"))
    assert len(builds) == 1 and len(entries) == 1
    cached = tokenizer()
    assert len(builds) == 1  # read from the cache
    assert cached.encode(text) == built.encode(text) and cached.decode(cached.encode(text)) == text
    assert (cached.eos_token, cached.bos_token, cached.chat_template) == (built.eos_token, built.bos_token,
                                                                         built.chat_template)
    assert cached.model_max_length == built.model_max_length and cached.name_or_path == built.name_or_path
    entries[0].write_text("{not json")
    assert tokenizer().encode(text) == built.encode(text) and len(builds) == 2  # damaged: rebuilt
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))  # the file changed
    assert tokenizer().encode(text) == built.encode(text) and len(builds) == 3


def test_every_known_pre_tokenizer_has_a_split_rule() -> None:
    """Each family in the table (which validate.py accepts) is one _pre_tokenizer builds by name (any other
    name would fall through to Llama 3's split)."""
    assert set(PRE_TOKENIZER_FAMILY.values()) == {"gpt2", "digits+gpt2", "qwen2", "llama3"}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # llama: q/k rows are un-permuted after quantization
def test_int8_serving_requantizes_gguf_blocks_without_a_bf16_copy(arch: str, tmp_path: Path) -> None:
    """`--quantization int8` on a Q8_0 GGUF: every matmul weight is quantized per row from the float32
    values of its blocks (the int8 weights equal quantize(float32 dequantized) exactly), not from a bf16
    copy (which rounds first and lands on other int8 values), and the model generates."""
    from pagedserve import LLM, SamplingParams
    from pagedserve.layers.linear import Int8Linear, quantize_int8_per_channel

    model = tiny_model(arch, tie_word_embeddings=False)
    path = write_test_gguf(model, tmp_path / "q8.gguf", QType.Q8_0)
    with GGUFCheckpoint(path) as checkpoint:
        exact = dict(checkpoint.iter_tensors(torch.float32))
    llm = LLM(str(path), dtype="bfloat16", quantization="int8", max_model_len=64)
    decoder = llm.engine.runner.model
    layer = decoder.model.layers[0]

    def expected(*names: str, from_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        qweight, scales = quantize_int8_per_channel(torch.cat([exact[n].to(from_dtype) for n in names]))
        return qweight, scales.to(torch.bfloat16)  # the layer keeps its scales in the model dtype

    def same(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> bool:
        return torch.equal(a[0].cpu(), b[0]) and torch.equal(a[1].cpu(), b[1])  # the engine's may be on a GPU

    prefix = "model.layers.0."
    qkv = [f"{prefix}self_attn.{p}_proj.weight" for p in "qkv"]
    checks = [(layer.self_attn.qkv_proj, qkv), (layer.self_attn.o_proj, [f"{prefix}self_attn.o_proj.weight"]),
              (layer.mlp.gate_up_proj, [f"{prefix}mlp.gate_proj.weight", f"{prefix}mlp.up_proj.weight"]),
              (layer.mlp.down_proj, [f"{prefix}mlp.down_proj.weight"]), (decoder.logits_proj, ["lm_head.weight"])]
    detour_differs = False
    for linear, names in checks:
        assert isinstance(linear, Int8Linear), names
        got = linear.int8_weight()
        assert same(got, expected(*names)), names
        detour_differs |= not same(got, expected(*names, from_dtype=torch.bfloat16))
    assert detour_differs  # the check above can tell the two routes apart
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 8


def test_the_memory_plan_reads_a_gguf_without_torch(models: dict, tmp_path: Path) -> None:
    """read_checkpoint_info (config, weight bytes, stored types) goes through formats/, never the loader."""
    import subprocess
    import sys

    path = write_test_gguf(models["llama"], tmp_path / "m.gguf", QType.Q8_0)
    code = ("import sys; from pagedserve.memory.checkpoint import read_checkpoint_info; "
            f"info = read_checkpoint_info({str(path)!r}); "
            "print(info.config['architectures'][0], info.weight_bytes(4), info.stores_quantized_matmuls(), "
            "*(m for m in ('torch', 'transformers', 'pagedserve.models') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    num_params = sum(p.numel() for p in models["llama"].parameters())
    assert done.stdout.split() == ["LlamaForCausalLM", str(num_params * 4), "True"]  # and none of those imported


def test_a_gguf_is_known_by_its_magic_not_its_name(models: dict, tmp_path: Path) -> None:
    """Ollama keeps GGUFs as sha256-... blobs without a suffix; a file may also be NAME.GGUF. Both load and
    generate exactly what the .gguf file does (they were taken for directories: config.json not found)."""
    import shutil

    from pagedserve import LLM, SamplingParams
    from pagedserve.formats import is_gguf_path

    path = write_test_gguf(models["qwen2"], tmp_path / "m.gguf")
    blob, upper = tmp_path / "sha256-0123abcd", tmp_path / "M.GGUF"
    shutil.copy(path, blob)
    shutil.copy(path, upper)
    (tmp_path / "plain").write_bytes(b"not a model")
    assert is_gguf_path(blob) and is_gguf_path(upper) and not is_gguf_path(tmp_path / "plain")
    assert not is_gguf_path(tmp_path)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompt = [{"prompt_token_ids": [5, 6, 7]}]
    expected = LLM(str(path), dtype="float32", max_model_len=64).generate(prompt, params)[0].outputs[0].token_ids
    for other in (blob, upper):
        got = LLM(str(other), dtype="float32", max_model_len=64).generate(prompt, params)[0].outputs[0].token_ids
        assert got == expected, other


@pytest.mark.parametrize("eot", [None, 2])
def test_a_gguf_s_end_of_turn_tokens_end_a_generation(models: dict, tmp_path: Path, eot: int | None) -> None:
    """llama.cpp's rule: besides tokenizer.ggml.eos_token_id, the eot/eom ids and the control tokens named as
    end-of-turn tokens (here <|im_end|>, id 2, with the eos moved to <|endoftext|>, id 0) stop a generation; a
    GGUF has no generation_config.json to list them (the reply ran to max_tokens)."""
    from pagedserve import LLM, SamplingParams

    path = write_test_gguf(models["qwen2"], tmp_path / "m.gguf", eos_token_id=0, eot_token_id=eot)
    llm = LLM(str(path), dtype="float32", max_model_len=64)
    assert llm.engine.tokenizer.convert_ids_to_tokens([0, 2]) == ["<|endoftext|>", "<|im_end|>"]
    assert llm.engine.eos_token_ids == {0, 2}
    for token in (2, 0):
        params = SamplingParams(temperature=0.0, max_tokens=5, logit_bias={token: 100.0})
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params)[0].outputs[0]
        assert (out.token_ids, out.finish_reason) == ([token], "stop"), token
        # ignore_eos ignores every one of them (vLLM's): the extra ones were still added as stop ids
        ignoring = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params.clone(ignore_eos=True))[0].outputs[0]
        assert (ignoring.token_ids, ignoring.finish_reason) == ([token] * 5, "length"), token


def test_damaged_gguf_metadata_is_refused_by_name_in_serve_and_doctor(models: dict, tmp_path: Path) -> None:
    """Each of these crashed with a traceback (IndexError building the tokenizer, a reshape of the q rows) or
    passed doctor while serve refused it; now both refuse with one line naming the file's fault."""
    import copy

    from pagedserve import LLM
    from pagedserve.cli.doctor_model import model_checks
    from pagedserve.engine.arg_utils import EngineArgs
    from pagedserve.models.validate import ModelValidationError, validate_model_path

    bad_eos = write_test_gguf(models["qwen2"], tmp_path / "eos.gguf", eos_token_id=5000)
    with pytest.raises(ModelValidationError, match="eos_token_id is 5000, outside its vocabulary of 288"):
        validate_model_path(bad_eos)
    split = write_test_gguf(models["qwen2"], tmp_path / "m-00001-of-00003.gguf", extra_metadata=lambda w: (
        w.add_uint16("split.no", 0), w.add_uint16("split.count", 3)))
    with pytest.raises(ModelValidationError, match="part 1 of a model split into 3 files.*llama-gguf-split --merge"):
        validate_model_path(split)
    big_endian = tmp_path / "be.gguf"
    big_endian.write_bytes(b"GGUF" + (3).to_bytes(4, "big") + bytes(32))
    with pytest.raises(ModelValidationError, match="big-endian GGUF"):
        validate_model_path(big_endian)
    five_heads = copy.deepcopy(models["qwen2"])
    five_heads.config.num_attention_heads = 5  # the header says 5 heads; the q rows are 4 heads' worth
    heads = write_test_gguf(five_heads, tmp_path / "heads.gguf")
    with pytest.raises(ModelValidationError, match=r"q_proj.weight' has shape \(64, 64\), the model expects \(60, 64\)"
                                                   ".*GGUF file's metadata does not match its tensors"):
        LLM(str(heads), dtype="float32", max_model_len=64)
    results = [check() for check in model_checks(str(heads), EngineArgs(max_model_len=64), lambda: None)]
    failed = [r for r in results if r is not None and r.status == "FAIL"]
    assert [r.name for r in failed] == ["weights"] and "expects (60, 64)" in failed[0].detail
    good = write_test_gguf(models["qwen2"], tmp_path / "good.gguf")
    results = [check() for check in model_checks(str(good), EngineArgs(max_model_len=64), lambda: None)]
    assert [r.status for r in results if r is not None and r.name == "weights"] == ["PASS"]


def test_vllm_s_quantization_gguf_serves_the_quantized_weights(models: dict, tmp_path: Path, tiny_model_dir) -> None:
    """--quantization gguf (vLLM's for a GGUF) keeps a block-quantized GGUF's weights quantized even with an explicit
    --dtype; a float GGUF has none to keep; a directory is refused (it was refused for every model)."""
    from pagedserve import LLM
    from pagedserve.platform import default_quantization, native_kernels_run

    q8 = write_test_gguf(models["qwen2"], tmp_path / "q8.gguf", QType.Q8_0)
    expected = "gguf" if native_kernels_run() else None  # its blocks: Q8_0 as int8 rows
    assert default_quantization("bfloat16", "gguf", True, "cpu") == expected
    assert default_quantization("bfloat16", None, True, "cpu") is None  # an explicit dtype widens them
    assert default_quantization("auto", "gguf", False, "cpu") is None
    llm = LLM(str(q8), dtype="float32", quantization="gguf", max_model_len=64)
    assert llm.engine.config.model.quantization == expected
    with pytest.raises(ValueError, match="--quantization gguf applies to GGUF files"):
        LLM(tiny_model_dir("qwen2"), quantization="gguf")
