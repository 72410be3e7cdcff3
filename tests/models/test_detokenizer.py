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


@pytest.mark.parametrize("min_tokens", [0, 3, 6])
def test_stop_strings_count_only_past_min_tokens(tokenizer, min_tokens):
    """vLLM's rule: a stop string is looked for once more than min_tokens tokens are out (in the new text, and
    the stop string's length before it), so the first "b" inside the first min_tokens tokens does not stop."""
    ids = tokenizer.encode("a b a b a b a b a b")
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["b"], min_tokens=min_tokens))
    stopped_at = next((n for n, token_id in enumerate(ids, 1) if detok.update([token_id]) is not None), None)
    text = tokenizer.decode(ids[:stopped_at])
    first_b_after = next(n for n in range(min_tokens + 1, len(ids) + 1) if tokenizer.decode(ids[:n]).endswith("b"))
    assert stopped_at == first_b_after, (stopped_at, text)
    assert detok.output_text == text[:text.rindex("b")]
    if min_tokens:
        assert detok.output_text.count("b") >= 1  # a "b" inside the first min_tokens stayed in the text


def test_a_character_begun_in_the_prompt_is_output_text(tokenizer):
    """A prompt cut inside a character (a reply cut there, sent back as token ids): the first output token completes
    it, and the character is output text, as vLLM's DecodeStream primed with the prompt gives it (it was lost; QA-Z)."""
    ids = tokenizer.encode("say 龍 then")
    cut = next(i for i in range(1, len(ids)) if tokenizer.decode(ids[:i]).endswith("\ufffd"))  # inside 龍
    assert tokenizer.decode(ids[:cut]) == "say \ufffd"
    detok = IncrementalDetokenizer(tokenizer, ids[:cut], SamplingParams())
    for token_id in ids[cut:]:
        assert detok.update([token_id]) is None
    assert detok.text_to_emit(finished=True) == "龍 then"
