"""Model path validation: each broken model gives its own message, naming the problem and the fix."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from safetensors.numpy import save_file

from pagedserve.formats.gguf import read_gguf_header
from pagedserve.formats.safetensors import read_safetensors_header
from pagedserve.models.validate import ModelValidationError, validate_model_path

CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
SHAPE = {"hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2, "vocab_size": 4}


def _hf_dir(root: Path, *, architectures: tuple[str, ...] = ("LlamaForCausalLM",), chat: bool = True) -> Path:
    """A minimal, valid Hugging Face model directory (tiny safetensors, BPE tokenizer files)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({"architectures": list(architectures), **SHAPE}))
    save_file({"a": np.ones((4, 8), np.float32), "b": np.zeros(3, np.float16)}, str(root / "model.safetensors"))
    (root / "vocab.json").write_text(json.dumps({"a": 0, "b": 1}))
    (root / "merges.txt").write_text("#version: 0.2\n")
    tokenizer_config = {"chat_template": CHAT_TEMPLATE} if chat else {}
    (root / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return root


def _message(path: Path, **kwargs: bool) -> str:
    with pytest.raises(ModelValidationError) as info:
        validate_model_path(path, **kwargs)
    return str(info.value)


def _write_gguf(path: Path, *, arch: str = "llama", tokenizer: str = "gpt2", pre: str = "smollm",
                chat: bool | list[dict[str, str]] = True, raw_type: gguf.GGMLQuantizationType | None = None) -> Path:
    """A small GGUF with a tokenizer and three tensors (F32, Q8_0, and optionally `raw_type` bytes); `chat`: a
    list of named templates ({"name", "template"}) written as llama.cpp's converter writes them."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tokenizer_model(tokenizer)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(["a", "b", "<|im_end|>"])
    writer.add_token_types([1, 1, 3])
    if chat:
        writer.add_chat_template(CHAT_TEMPLATE if chat is True else chat)
    writer.add_tensor("output_norm.weight", np.ones(64, np.float32))
    weights = np.random.default_rng(0).standard_normal((16, 64)).astype(np.float32)
    q8 = gguf.quants.quantize(weights, gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("token_embd.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    if raw_type is not None:
        block_size, type_size = gguf.GGML_QUANT_SIZES[raw_type]
        writer.add_tensor("blk.0.ffn_up.weight", np.zeros((4, 256 // block_size * type_size), np.uint8),
                          raw_dtype=raw_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# --- Hugging Face directories ---------------------------------------------------------------------


def test_valid_directory_passes(tmp_path: Path) -> None:
    validate_model_path(_hf_dir(tmp_path / "m"), need_chat_template=True)


def test_missing_path(tmp_path: Path) -> None:
    message = _message(tmp_path / "nope")
    assert "does not exist" in message and str(tmp_path / "nope") in message and ".gguf" in message


def test_missing_config_points_at_gguf_inside(tmp_path: Path) -> None:
    model_dir = _hf_dir(tmp_path / "m")
    (model_dir / "config.json").unlink()
    _write_gguf(model_dir / "model-q8.gguf")
    message = _message(model_dir)
    assert "no config.json" in message and "--model" in message and "model-q8.gguf" in message


def test_config_that_is_not_json(tmp_path: Path) -> None:
    model_dir = _hf_dir(tmp_path / "m")
    (model_dir / "config.json").write_text('{"architectures": ["LlamaForCausalLM"],')
    message = _message(model_dir)
    assert "config.json" in message and "not valid JSON" in message and "download" in message


@pytest.mark.parametrize("key", ["hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size"])
@pytest.mark.parametrize("value", [None, 0, "8", True])
def test_a_config_without_the_model_s_shape_names_the_key(tmp_path: Path, key: str, value) -> None:
    root = _hf_dir(tmp_path / "m")
    config = json.loads((root / "config.json").read_text())
    config[key] = value
    (root / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    message = _message(root)
    assert f"has no usable {key!r}" in message and "config.json again" in message


def test_a_config_that_does_not_match_the_weights_is_found_from_their_headers(tmp_path: Path) -> None:
    root = _hf_dir(tmp_path / "m")
    weights = {"model.embed_tokens.weight": np.ones((4, 8), np.float32),
               **{f"model.layers.{i}.mlp.down_proj.weight": np.ones((8, 16), np.float32) for i in range(2)}}
    save_file(weights, str(root / "model.safetensors"))
    validate_model_path(root)
    for key, value, words in (("hidden_size", 16, "vocab_size x hidden_size = 4 x 16, but the weights' embedding "
                                                  "is 4 x 8"),
                              ("num_hidden_layers", 3, "num_hidden_layers = 3, but the weights hold 2 layers")):
        (root / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], **SHAPE, key: value}))
        assert words in _message(root)


def test_unsupported_architecture_names_supported_ones(tmp_path: Path) -> None:
    message = _message(_hf_dir(tmp_path / "m", architectures=("GPTNeoXForCausalLM",)))
    assert "GPTNeoXForCausalLM" in message
    for supported in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "BertModel"):
        assert supported in message


def test_truncated_safetensors(tmp_path: Path) -> None:
    model_dir = _hf_dir(tmp_path / "m")
    weights = model_dir / "model.safetensors"
    full_size = weights.stat().st_size
    assert read_safetensors_header(weights).required_size == full_size
    os.truncate(weights, full_size - 10)
    message = _message(model_dir)
    assert "model.safetensors is truncated" in message
    assert f"{full_size:,}" in message and f"{full_size - 10:,}" in message
    assert "interrupted" in message and "download it again" in message


def test_safetensors_cut_inside_its_header(tmp_path: Path) -> None:
    model_dir = _hf_dir(tmp_path / "m")
    os.truncate(model_dir / "model.safetensors", 20)
    assert "model.safetensors is truncated" in _message(model_dir)


def test_safetensors_with_trailing_bytes(tmp_path: Path) -> None:
    model_dir = _hf_dir(tmp_path / "m")
    with open(model_dir / "model.safetensors", "ab") as file:
        file.write(b"\0" * 7)
    assert "larger than its header says" in _message(model_dir)


def test_missing_shard_is_named(tmp_path: Path) -> None:
    model_dir = _hf_dir(tmp_path / "m")
    (model_dir / "model.safetensors").rename(model_dir / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    message = _message(model_dir)
    assert "missing 1 of 2 weight shards" in message and "model-00002-of-00002.safetensors" in message
    assert "model-00001-of-00002.safetensors" not in message


def test_validation_the_plan_and_the_loader_see_the_same_shards(tmp_path: Path) -> None:
    from pagedserve.formats.safetensors import safetensors_files
    from pagedserve.memory.checkpoint import weight_bytes_from_safetensors_dir

    model_dir = _hf_dir(tmp_path / "m")
    (model_dir / "model.safetensors").rename(model_dir / "model-00001-of-00001.safetensors")
    index = {"weight_map": {"a": "model-00001-of-00001.safetensors", "b": "model-00001-of-00001.safetensors"}}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    (model_dir / "stale.safetensors").write_bytes(b"\x10")  # not a shard of the index: nobody reads it
    validate_model_path(model_dir)
    assert safetensors_files(model_dir) == [model_dir / "model-00001-of-00001.safetensors"]
    assert weight_bytes_from_safetensors_dir(model_dir, dtype_bytes=4) == (32 + 3) * 4
    (model_dir / "model.safetensors.index.json").unlink()  # without an index every file is a shard
    assert "stale.safetensors is truncated" in _message(model_dir)


def test_no_weights(tmp_path: Path) -> None:
    model_dir = _hf_dir(tmp_path / "m")
    (model_dir / "model.safetensors").rename(model_dir / "pytorch_model.bin")
    message = _message(model_dir)
    assert "no *.safetensors" in message and ".bin" in message


def test_missing_tokenizer_files(tmp_path: Path) -> None:
    model_dir = _hf_dir(tmp_path / "m")
    (model_dir / "merges.txt").unlink()  # vocab.json alone is not a BPE tokenizer
    message = _message(model_dir)
    assert "no tokenizer" in message and "tokenizer.json" in message


def test_missing_tokenizer_config(tmp_path: Path) -> None:
    model_dir = _hf_dir(tmp_path / "m")
    (model_dir / "tokenizer_config.json").unlink()
    assert "no tokenizer_config.json" in _message(model_dir)


def test_chat_template_required_only_when_asked(tmp_path: Path) -> None:
    model_dir = _hf_dir(tmp_path / "m", chat=False)
    validate_model_path(model_dir)
    assert "no chat template" in _message(model_dir, need_chat_template=True)
    (model_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    validate_model_path(model_dir, need_chat_template=True)


def test_tokenizer_json_alone_is_enough(tmp_path: Path) -> None:
    model_dir = _hf_dir(tmp_path / "m")
    (model_dir / "vocab.json").unlink()
    (model_dir / "merges.txt").unlink()
    (model_dir / "tokenizer.json").write_text("{}")
    validate_model_path(model_dir)


# --- GGUF files -----------------------------------------------------------------------------------


def test_valid_gguf_passes_and_header_is_read(tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "m.gguf")
    validate_model_path(path, need_chat_template=True)
    header = read_gguf_header(path)
    assert header.architecture == "llama" and header.version == 3
    assert header.metadata["tokenizer.ggml.tokens"] == ["a", "b", "<|im_end|>"]
    assert header.metadata["tokenizer.ggml.token_type"] == [1, 1, 3]
    embed = next(t for t in header.tensors if t.name == "token_embd.weight")
    assert embed.shape == (16, 64) and embed.nbytes == 16 * 64 // 32 * 34
    assert header.required_size == path.stat().st_size
    assert read_gguf_header(path, keep_string_arrays=False).metadata["tokenizer.ggml.tokens"] == 3


def test_header_offsets_agree_with_gguf_reader(tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "m.gguf")
    reader, header = gguf.GGUFReader(path), read_gguf_header(path)
    assert header.data_offset == reader.data_offset
    assert [(t.name, header.data_offset + t.offset) for t in header.tensors] == [
        (t.name, t.data_offset) for t in reader.tensors
    ]


def test_truncated_gguf_names_sizes(tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "m.gguf")
    full_size = path.stat().st_size
    os.truncate(path, full_size - 100)
    message = _message(path)
    assert "is truncated" in message and str(path) in message
    assert f"at least {full_size:,} bytes" in message and f"has {full_size - 100:,} bytes" in message
    assert "interrupted" in message
    # the header alone still parses (as for the first part of a split download)
    assert read_gguf_header(path).required_size == full_size


def test_gguf_whose_tensor_table_does_not_match_its_data(tmp_path: Path) -> None:
    """A tensor retyped in the table (Q8_0 -> Q4_0: 576 bytes fewer) leaves the next tensor's data where the
    table's sizes do not put it: refused as damaged, as llama.cpp refuses it (it loaded and generated empty text)."""
    path = _write_gguf(tmp_path / "m.gguf", raw_type=gguf.GGMLQuantizationType.Q8_0)  # a tensor after it
    data = bytearray(path.read_bytes())
    name = b"token_embd.weight"
    at = data.index(name) + len(name) + 4 + 2 * 8  # past the name, n_dims and two dims: the type id
    assert struct.unpack_from("<I", data, at)[0] == int(gguf.GGMLQuantizationType.Q8_0)
    struct.pack_into("<I", data, at, int(gguf.GGMLQuantizationType.Q4_0))
    path.write_bytes(bytes(data))
    message = _message(path)
    assert "is damaged" in message and "the tensors before it end at" in message, message
    assert "type or shape in the header does not match its data" in message


def test_gguf_cut_inside_header(tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "m.gguf")
    os.truncate(path, 60)
    message = _message(path)
    assert "truncated inside its header" in message and "download it again" in message


def test_file_that_is_not_gguf(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"<html>rate limited</html>" * 4)
    assert "is not a GGUF file" in _message(path)
    path.write_bytes(b"not a gguf\n")  # shorter than a header: still not "truncated"
    assert "is not a GGUF file" in _message(path)
    path.write_bytes(b"GGUF\x03")  # the start of one
    assert "is truncated" in _message(path)
    other = tmp_path / "notes.txt"
    other.write_text("hello")
    assert "neither a model directory nor a GGUF file" in _message(other)


def test_unsupported_gguf_architecture(tmp_path: Path) -> None:
    message = _message(_write_gguf(tmp_path / "m.gguf", arch="falcon"))
    assert "'falcon'" in message and "llama, qwen2, qwen3, gemma" in message


def test_unsupported_tensor_type(tmp_path: Path) -> None:
    message = _message(_write_gguf(tmp_path / "m.gguf", raw_type=gguf.GGMLQuantizationType.IQ2_XXS))
    assert "blk.0.ffn_up.weight" in message and "IQ2_XXS" in message and "Q8_0" in message


def test_unsupported_gguf_tokenizers(tmp_path: Path) -> None:
    message = _message(_write_gguf(tmp_path / "t5.gguf", tokenizer="t5"))
    assert "tokenizer model 't5'" in message and "tokenizer.json" in message
    message = _message(_write_gguf(tmp_path / "spm.gguf", arch="qwen2", tokenizer="llama"))  # SentencePiece: only
    assert "tokenizer model 'llama'" in message and "llama, gemma, gemma2, gemma3, phi3 files" in message  # for these
    message = _message(_write_gguf(tmp_path / "pre.gguf", pre="chameleon"))
    assert "pre-tokenizer 'chameleon'" in message and "qwen2" in message


def test_every_pre_tokenizer_the_tokenizer_rebuilds_is_accepted_and_torch_stays_unimported(tmp_path: Path) -> None:
    """validate.py accepts exactly gguf_tokenizer.py's table (one list), and validating a GGUF imports neither
    torch nor transformers."""
    import subprocess
    import sys

    from pagedserve.models.gguf_tokenizer import PRE_TOKENIZER_FAMILY

    for pre in PRE_TOKENIZER_FAMILY:
        validate_model_path(_write_gguf(tmp_path / f"{pre}.gguf", pre=pre))
    path = _write_gguf(tmp_path / "fresh.gguf", pre="qwen2")
    code = ("import sys; from pagedserve.models.validate import validate_model_path; "
            f"validate_model_path({str(path)!r}); print(*(m for m in ('torch', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert done.stdout.split() == []


def test_gguf_without_chat_template(tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "m.gguf", chat=False)
    validate_model_path(path)
    assert "no chat template" in _message(path, need_chat_template=True)
    # Only named templates (Hermes' tool_use, no default): serving reads them, so they count (QA-P)
    named = _write_gguf(tmp_path / "named.gguf", chat=[{"name": "tool_use", "template": CHAT_TEMPLATE}])
    validate_model_path(named, need_chat_template=True)


def test_a_model_s_chat_template_that_does_not_compile_is_named():
    from pagedserve.chat_template import template_problem

    assert template_problem("{% for m in messages %}{{ m['content'] }}{% endfor %}") is None
    assert template_problem(None) is None
    assert template_problem("{% for m in messages %}{{ m['content'] }") == \
        "chat template does not compile (line 1: unexpected '}')"
    assert "chat template 'tool_use' does not compile" in template_problem({"default": "{{ 1 }}", "tool_use": "{{"})
