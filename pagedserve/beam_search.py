"""Beam search, as vLLM runs it (`LLM.beam_search`, and `use_beam_search` on the completions and chat routes).

Every step, each live beam is scored by one engine request of a single token that returns the log-probabilities of
the 2 x beam_width most likely next tokens; each beam's candidates are the beam extended by one of those tokens or by
the token the request sampled (with temperature 0, the default, the most likely one anyway), its cumulative
log-probability summed. A candidate ending in an EOS token
is set aside as finished (unless ignore_eos); the best beam_width of the others go on. After max_tokens steps
(or when no beam is left) the finished and the live beams are ranked by cumulative log-probability divided by
length ** length_penalty (the length counts the prompt and leaves out a final EOS) and the best beam_width are
returned, best first. The engine's prefix cache makes each step cost about one decode step per beam: a beam's
request shares all but its last token with the previous step's.

`search` is the algorithm alone, a generator: it yields the token sequences to score and is sent back, for
each, the sampled token and the next-token log-probabilities. The offline API (several prompts' beams in one batch)
and the server (`search_async`) drive it, so both run the same rules.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Generator
from dataclasses import dataclass, field

from pagedserve.exceptions import InvalidRequestError
from pagedserve.outputs import LogprobsDict
from pagedserve.sampling_params import BeamSearchParams, SamplingParams


@dataclass
class BeamSearchSequence:
    """One beam: `tokens` holds the prompt and the generated tokens (vLLM's); `logprobs` one dict per generated
    token (the scoring step's candidates)."""

    tokens: list[int]
    logprobs: list[LogprobsDict] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (ended on EOS) or "length"


@dataclass
class BeamSearchOutput:
    """vLLM's: the best beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]


# What scoring one beam returns: the token its request sampled, and the log-probabilities of the next token (at
# least the num_candidates most likely; more where the caller asked for more top logprobs to show).
Scored = tuple[int, LogprobsDict]


def scoring_params(params: BeamSearchParams, num_logprobs: int | None = None, **fields) -> SamplingParams:
    """The engine request that scores one beam: one token and its log-probabilities (`num_logprobs`, when more
    than the candidates, for a response's top logprobs). `fields`: SamplingParams' (seed, cache_salt, priority)."""
    return SamplingParams(max_tokens=1, temperature=params.temperature, ignore_eos=True,
                          logprobs=max(params.num_candidates, num_logprobs or 0), **fields)


def check_candidates(params: BeamSearchParams, max_logprobs: int, width: str, limit: str) -> None:
    """InvalidRequestError (a ValueError) where each beam's candidates are more log-probabilities than the engine
    gives a request; `width` and `limit` name the beam width and the limit as the caller's user sets them."""
    if max_logprobs != -1 and params.num_candidates > max_logprobs:
        raise InvalidRequestError(f"{width} {params.beam_width} ranks each beam's {params.num_candidates} most likely "
                                  f"tokens; this engine allows {max_logprobs} ({limit}): lower {width}",
                                  param=width)


def beam_score(beam: BeamSearchSequence, length_penalty: float) -> float:
    """Cumulative log-probability over length ** length_penalty; the length counts the prompt, not a final EOS."""
    length = len(beam.tokens) - (1 if beam.finish_reason == "stop" else 0)
    return beam.cum_logprob / (length ** length_penalty)


def search(prompt_ids: list[int], params: BeamSearchParams, eos_token_ids: Collection[int]
           ) -> Generator[list[list[int]], list[Scored], list[BeamSearchSequence]]:
    """Yields the live beams' token sequences; is sent, per sequence, the sampled token and its step's
    log-probabilities (token id -> Logprob); returns the best beams, best first."""
    beams = [BeamSearchSequence(list(prompt_ids))]
    finished: list[BeamSearchSequence] = []
    for _ in range(params.max_tokens):
        if not beams:
            break
        scored = yield [beam.tokens for beam in beams]
        candidates: list[BeamSearchSequence] = []
        for beam, (sampled, step) in zip(beams, scored, strict=True):
            # The sampled token first: of candidates with equal log-probabilities (bf16 ties are common), the
            # stable sort below keeps it, so a width-1 search follows greedy decoding.
            order = [sampled, *(t for t in step if t != sampled)] if sampled in step else list(step)
            for token_id in order:
                logprob = step[token_id]
                if logprob.rank > params.num_candidates and token_id != sampled:
                    continue
                extended = BeamSearchSequence(beam.tokens + [token_id], beam.logprobs + [step],
                                              beam.cum_logprob + logprob.logprob)
                if token_id in eos_token_ids and not params.ignore_eos:
                    extended.finish_reason = "stop"
                    finished.append(extended)
                else:
                    candidates.append(extended)
        candidates.sort(key=lambda b: b.cum_logprob, reverse=True)  # one length: the score's order
        beams = candidates[:params.beam_width]
    for beam in beams:
        beam.finish_reason = "length"
    ranked = sorted(finished + beams, key=lambda b: beam_score(b, params.length_penalty), reverse=True)
    return ranked[:params.beam_width]


def generated_tokens(beam: BeamSearchSequence, prompt_len: int, include_stop_str_in_output: bool) -> list[int]:
    """A beam's generated tokens as its text shows them: a final EOS left out unless include_stop_str_in_output."""
    tokens = beam.tokens[prompt_len:]
    if beam.finish_reason == "stop" and not include_stop_str_in_output:
        return tokens[:-1]
    return tokens


async def search_async(prompt_ids: list[int], params: BeamSearchParams, eos_token_ids: Collection[int],
                       score: Callable[[list[list[int]]], Awaitable[list[Scored]]]) -> list[BeamSearchSequence]:
    """`search` driven by an async scorer (the server's: one engine request per beam, awaited together)."""
    steps = search(prompt_ids, params, eos_token_ids)
    sequences = next(steps)  # max_tokens >= 1: the search asks at least once
    while True:
        scored = await score(sequences)
        try:
            sequences = steps.send(scored)
        except StopIteration as done:
            return done.value
