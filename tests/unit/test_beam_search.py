"""The beam search rules (pagedserve/beam_search.py) on a toy language model whose next-token log-probabilities
depend on the last token only: EOS sets a beam aside, ignore_eos does not, the final ranking divides by
length ** length_penalty, candidates are the 2 x width most likely tokens plus the sampled one, and a width that
keeps every sequence finds the best one by brute force."""

from __future__ import annotations

import itertools
import math

import pytest

from pagedserve.beam_search import BeamSearchSequence, beam_score, generated_tokens, search
from pagedserve.outputs import Logprob
from pagedserve.sampling_params import BeamSearchParams

EOS = 0


def toy_step(last: int, vocab: int = 4) -> dict[int, Logprob]:
    """A fixed distribution per last token, all probabilities distinct."""
    weights = [((last * 7 + t * 3) % 11) + 1 + t / 10 for t in range(vocab)]
    total = sum(weights)
    ranked = sorted(range(vocab), key=lambda t: -weights[t])
    return {t: Logprob(math.log(weights[t] / total), ranked.index(t) + 1) for t in range(vocab)}


def run(prompt: list[int], params: BeamSearchParams, sampled=lambda step: min(step, key=lambda t: step[t].rank),
        vocab: int = 4) -> list[BeamSearchSequence]:
    steps = search(prompt, params, {EOS})
    asked = next(steps)
    while True:
        scored = []
        for tokens in asked:
            step = toy_step(tokens[-1], vocab)
            scored.append((sampled(step), step))
        try:
            asked = steps.send(scored)
        except StopIteration as done:
            return done.value


def sequence_logprob(tokens: list[int], start: int, vocab: int = 4) -> float:
    return sum(toy_step(tokens[i - 1], vocab)[tokens[i]].logprob for i in range(start, len(tokens)))


@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 2.5])
def test_a_width_that_keeps_everything_finds_the_brute_force_best(length_penalty):
    prompt, max_tokens, vocab = [3], 3, 4
    params = BeamSearchParams(beam_width=vocab ** max_tokens, max_tokens=max_tokens, length_penalty=length_penalty)
    found = run(prompt, params, vocab=vocab)
    # Every sequence the rules allow: up to max_tokens tokens, ending at the first EOS.
    everything = []
    for n in range(1, max_tokens + 1):
        for tail in itertools.product(range(vocab), repeat=n):
            if EOS in tail[:-1] or (n < max_tokens and tail[-1] != EOS):
                continue
            tokens = prompt + list(tail)
            ended = tail[-1] == EOS
            length = len(tokens) - (1 if ended else 0)
            everything.append((sequence_logprob(tokens, 1, vocab) / length ** length_penalty, tokens))
    everything.sort(key=lambda pair: pair[0], reverse=True)
    assert [b.tokens for b in found] == [tokens for _, tokens in everything][:len(found)]
    assert len(found) == len(everything)
    for beam in found:
        assert beam.cum_logprob == pytest.approx(sequence_logprob(beam.tokens, 1, vocab))
        assert beam.finish_reason == ("stop" if beam.tokens[-1] == EOS else "length")
        assert len(beam.logprobs) == len(beam.tokens) - 1


def test_eos_sets_a_beam_aside_unless_ignore_eos():
    params = BeamSearchParams(beam_width=2, max_tokens=6)
    found = run([1], params)
    assert all(EOS not in b.tokens[1:-1] for b in found)  # nothing runs past an EOS
    ignoring = run([1], BeamSearchParams(beam_width=2, max_tokens=6, ignore_eos=True))
    assert all(len(b.tokens) == 7 and b.finish_reason == "length" for b in ignoring)
    assert any(EOS in b.tokens[1:] for b in ignoring)  # EOS is an ordinary token then


def test_candidates_are_the_top_two_width_and_the_sampled_token():
    # Ranks and log-probabilities made to disagree, so that the candidate set shows: width 2 takes the tokens of
    # rank <= 4 (token 3, rank 3, has the best log-probability) and the rank-5 token 7 only when it was sampled.
    step = {1: Logprob(-1.0, 1), 2: Logprob(-2.0, 2), 3: Logprob(-0.05, 3), 4: Logprob(-4.0, 4), 7: Logprob(-0.1, 5)}

    def best(sampled: int) -> list[int]:
        steps = search([9], BeamSearchParams(beam_width=2, max_tokens=1), {EOS})
        next(steps)
        try:
            steps.send([(sampled, step)])
        except StopIteration as done:
            return [b.tokens[-1] for b in done.value]
        raise AssertionError("the search asked again after max_tokens steps")

    assert best(sampled=1) == [3, 1]
    assert best(sampled=7) == [3, 7]


def test_score_and_generated_tokens():
    ended = BeamSearchSequence([9, 9, 4, EOS], cum_logprob=-6.0, finish_reason="stop")
    running = BeamSearchSequence([9, 9, 4, 5], cum_logprob=-6.0, finish_reason="length")
    assert beam_score(ended, 1.0) == pytest.approx(-2.0)  # the EOS is not counted
    assert beam_score(running, 1.0) == pytest.approx(-1.5)
    assert beam_score(running, 0.0) == -6.0
    assert generated_tokens(ended, 2, False) == [4] and generated_tokens(ended, 2, True) == [4, EOS]
    assert generated_tokens(running, 2, False) == [4, 5]


@pytest.mark.parametrize("kwargs,words", [({"beam_width": 0, "max_tokens": 3}, "beam_width"),
                                          ({"beam_width": 2, "max_tokens": 0}, "max_tokens"),
                                          ({"beam_width": True, "max_tokens": 3}, "beam_width"),
                                          ({"beam_width": 2, "max_tokens": 3, "temperature": -1}, "temperature"),
                                          ({"beam_width": 2, "max_tokens": 3, "length_penalty": math.nan},
                                           "length_penalty")])
def test_params_are_checked(kwargs, words):
    with pytest.raises(ValueError, match=words):
        BeamSearchParams(**kwargs)


def test_of_equal_candidates_the_sampled_token_is_kept():
    """bf16 logits tie often: a width-1 search keeps the token greedy decoding sampled, whatever the ranks say."""
    step = {4: Logprob(-1.5, 1), 6: Logprob(-1.5, 2), 7: Logprob(-3.0, 3)}
    for sampled in (4, 6):
        steps = search([9], BeamSearchParams(beam_width=1, max_tokens=1), {EOS})
        next(steps)
        with pytest.raises(StopIteration) as done:
            steps.send([(sampled, step)])
        assert [b.tokens[-1] for b in done.value.value] == [sampled]
