"""GGUF files with SentencePiece vocabularies against transformers on the same weights, and their tokenizer against
SentencePiece itself: Gemma's (llama.cpp's gemma, gemma2 and gemma3 architectures, no space prefix) and Llama 2's or
Mistral's (the llama architecture with a space prefix: SentencePiece's dummy prefix).

The files are written by tests/models/gguf_utils.write_gemma_gguf the way llama.cpp's converter writes them (its own
name table, norms stored plus one, the window and softcaps as metadata, the vocabulary from a SentencePiece model
trained here as Gemma's is made), so the loader is checked against llama.cpp's conventions, not against itself.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as QType

from pagedserve import LLM, SamplingParams
from tests.models.gguf_utils import tiny_model, train_sentencepiece, write_gemma_gguf, write_test_gguf
from tests.models.test_correctness import prompt_logprob_error
from tests.tiny_models import make_tiny_model

VOCAB = 500
TEXTS = ["Hello  world 123 😀 你好\n\n  x", "The quick brown fox jumps over the lazy dog.", " leading space",
         "def square(x):\n    return x * x\n", "<start_of_turn>user\nhi<end_of_turn>\n", "tabs\tand\r\nCRLF",
         "ünïcödé", ""]
# llama.cpp's Gemma 3 rule: layers il % 6 < 5 attend within the window; its query scale is head_dim (16 here).
GEMMA3 = dict(num_hidden_layers=6, query_pre_attn_scalar=16,
              layer_types=["sliding_attention"] * 5 + ["full_attention"],
              rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
CASES = {"gemma": {}, "gemma2": dict(query_pre_attn_scalar=16), "gemma3": GEMMA3}


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory) -> Path:
    return train_sentencepiece(tmp_path_factory.mktemp("sentencepiece"), VOCAB)


@pytest.fixture(scope="module")
def gemma_ggufs(tmp_path_factory, sp_model):
    """arch -> (the transformers model's directory, its GGUF as F32, as Q8_0)."""
    from transformers import AutoModelForCausalLM

    files = {}
    for arch, overrides in CASES.items():
        out = tmp_path_factory.mktemp(f"gguf-{arch}")
        hf_dir = make_tiny_model(arch, out / "hf", vocab_size=VOCAB, **overrides)
        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
        files[arch] = (str(hf_dir), write_gemma_gguf(model, out / "f32.gguf", sp_model),
                       write_gemma_gguf(model, out / "q8.gguf", sp_model, QType.Q8_0))
    return files


@pytest.mark.parametrize("arch", list(CASES))
def test_a_gemma_gguf_computes_what_transformers_does(gemma_ggufs, arch):
    """F32 weights: prompt logprobs over 60 tokens (past the 16-token window) within float32 noise of transformers';
    Q8_0: the same model's, within its 8-bit rounding of the F32 file's."""
    gguf_matches_transformers(*gemma_ggufs[arch])


def gguf_matches_transformers(hf_dir: str, f32: Path, q8: Path, **q8_engine_kwargs) -> LLM:
    """A GGUF's prompt logprobs over 60 tokens: its F32 file's within float32 noise of transformers' on `hf_dir`,
    its Q8_0 file's (served with `q8_engine_kwargs`) within 8-bit rounding of the F32 file's; the Q8_0 engine."""
    from transformers import AutoModelForCausalLM

    prompt = [(37 * i) % 480 + 10 for i in range(60)]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    ours = LLM(str(f32), dtype="float32", max_model_len=128).generate([{"prompt_token_ids": prompt}], params)[0]
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    assert prompt_logprob_error(ours.prompt_logprobs, model, prompt) < 5e-5
    llm = LLM(str(q8), dtype="float32", max_model_len=128, **q8_engine_kwargs)
    quantized = llm.generate([{"prompt_token_ids": prompt}], params)[0]
    q8_diffs = [abs(quantized.prompt_logprobs[i][t].logprob - ours.prompt_logprobs[i][t].logprob)
                for i, t in enumerate(prompt) if i]
    assert max(q8_diffs) < 0.3  # Q8_0's rounding (observed 0.06-0.11); a wrong tensor moves them by whole units
    return llm


def test_the_sentencepiece_vocabulary_encodes_as_sentencepiece(gemma_ggufs, sp_model):
    """The rebuilt tokenizer gives SentencePiece's ids (after the BOS llama.cpp adds, as the file's flag says) and
    decodes them back to the text; the chat template reads the file's."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    llm = LLM(str(gemma_ggufs["gemma3"][1]), dtype="float32", max_model_len=128)
    tokenizer = llm.get_tokenizer()
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids == [2] + sp.encode(text), text
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                           add_generation_prompt=True)
    assert prompt == "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"
    assert llm.engine.config.model.architecture == "Gemma3ForCausalLM"


@pytest.fixture(scope="module")
def llama_sentencepiece_gguf(tmp_path_factory):
    """(a tiny Llama with a SentencePiece vocabulary as Llama 2's is made, its GGUF, the SentencePiece model)."""
    out = tmp_path_factory.mktemp("gguf-llama-spm")
    sp = train_sentencepiece(out / "sp", VOCAB, llama=True)
    model = tiny_model("llama", vocab_size=VOCAB)
    return model, write_test_gguf(model, out / "llama.gguf", sp_model=sp), sp


def test_a_llama_gguf_with_a_sentencepiece_vocabulary(llama_sentencepiece_gguf):
    """Llama 2, Mistral and TinyLlama GGUFs: the tokenizer gives SentencePiece's ids after BOS (its dummy prefix
    included: a text that starts with a space gets a second one) and decodes them back; the weights (rows
    un-permuted) give transformers' logprobs."""
    import sentencepiece as spm

    model, path, sp_model = llama_sentencepiece_gguf
    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    llm = LLM(str(path), dtype="float32", max_model_len=128)
    tokenizer = llm.get_tokenizer()
    for text in TEXTS + ["  two leading spaces", "[INST] hi [/INST]"]:
        ids = tokenizer.encode(text)
        assert ids == [1] + sp.encode(text), text
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
    prompt = [(37 * i) % 480 + 10 for i in range(40)]
    ours = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    assert prompt_logprob_error(ours.prompt_logprobs, model, prompt) < 5e-5



def test_a_character_cut_by_the_end_of_the_output_is_left_out_as_vllm_does(llama_sentencepiece_gguf):
    """Byte-fallback tokens of an incomplete character are held back, and dropped if the output ends there (vLLM's
    detokenizer does the same): max_tokens cutting through a CJK character ends the text before it, with no
    replacement character."""
    from pagedserve.engine.detokenizer import IncrementalDetokenizer

    _, path, _ = llama_sentencepiece_gguf
    tokenizer = LLM(str(path), dtype="float32", max_model_len=128).get_tokenizer()
    ids = [tokenizer.convert_tokens_to_ids(f"<0x{byte:02X}>") for byte in "a你".encode()]  # a, E4 BD A0
    for cut, expected in ((len(ids), "a你"), (len(ids) - 1, "a")):
        detokenizer = IncrementalDetokenizer(tokenizer, [1], SamplingParams())
        streamed = []
        for token_id in ids[:cut]:
            detokenizer.update([token_id])
            streamed.append(detokenizer.text_to_emit(False))
        assert "".join(streamed) + detokenizer.text_to_emit(True) == expected == detokenizer.visible_text(True)
