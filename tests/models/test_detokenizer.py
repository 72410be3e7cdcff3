"""Incremental detokenization: no half UTF-8 characters, stop strings across token boundaries."""

from __future__ import annotations

import pytest

from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.sampling_params import SamplingParams
from tests.tiny_models import make_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


# The first strings are in the tokenizer's training corpus (whole characters are tokens); the last uses
# characters it never saw, so each is split into byte tokens.
RARE = "unseen: 龍 🦄 ☃ ü"
TEXTS = ["你好，世界！ 北京是中国的首都。", "Emoji test: 😀 🚀 ✨ done", "plain ascii words and code: x * x", RARE]


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_never_emits_half_a_character(tokenizer, text):
    ids = tokenizer.encode(text)
    assert len(ids) > 3
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    deltas = []
    for token_id in ids:
        assert detok.update([token_id]) is None
        deltas.append(detok.text_to_emit(finished=False))
    deltas.append(detok.text_to_emit(finished=True))
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text
    if text == RARE:  # byte-split characters: some steps must emit nothing until the character is whole
        assert len(ids) > len(text)
        assert any(d == "" for d in deltas[:-1])


def test_stop_string_spanning_tokens_is_cut_and_never_streamed(tokenizer):
    text = "The quick brown fox jumps over the lazy dog."
    ids = tokenizer.encode(text)
    stop = "fox jumps"
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=[stop]))
    streamed, found = "", None
    for token_id in ids:
        found = detok.update([token_id])
        streamed += detok.text_to_emit(finished=found is not None)
        if found:
            break
    assert found == stop
    assert streamed == "The quick brown "
    assert detok.output_text == "The quick brown "
