"""`bench serve --tokenizer PATH`: token-exact text prompts from a local Hugging Face tokenizer.

Lives outside tests/unit because transformers imports torch.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from pagedserve.benchmarks.datasets import _CORPUS_WORDS, LocalTokenizer, build_random_prompts


def make_tokenizer_dir(path: Path) -> Path:
    """A word-level tokenizer over the benchmark corpus that adds BOS, saved like a model's tokenizer."""
    vocab = {"[UNK]": 0, "<s>": 1, **{word: index + 2 for index, word in enumerate(dict.fromkeys(_CORPUS_WORDS))}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", bos_token="<s>").save_pretrained(path)
    return path


def test_local_tokenizer_gives_exact_text_prompts(tmp_path: Path) -> None:
    tokenizer = LocalTokenizer(str(make_tokenizer_dir(tmp_path / "tok")))
    lengths = [16, 9, 33]
    prompts = asyncio.run(build_random_prompts(tokenizer, random.Random(0), lengths, [4, 4, 4], as_text=True))
    for prompt, length in zip(prompts, lengths):
        assert isinstance(prompt.prompt, str)
        assert prompt.planned_prompt_tokens == length
        assert len(tokenizer.tokenizer.encode(prompt.prompt)) == length + 1  # + BOS, not counted as content
    id_prompts = asyncio.run(build_random_prompts(tokenizer, random.Random(0), lengths, [4, 4, 4], as_text=False))
    assert [len(p.prompt) for p in id_prompts] == lengths
    assert all(1 not in p.prompt and 0 not in p.prompt for p in id_prompts)  # no BOS or UNK drawn
