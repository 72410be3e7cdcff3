"""use_beam_search on the completions and chat routes (vLLM's): each prompt's beam search (pagedserve/beam_search.py)
runs as engine requests of one token per beam and step, and answers one RequestOutput with n choices, the best
beam first, when it ends (a stream gets each choice's text in one chunk)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from pagedserve.beam_search import BeamSearchSequence, Scored, generated_tokens, scoring_params, search_async
from pagedserve.engine.async_engine import AsyncEngine
from pagedserve.outputs import CompletionOutput, RequestOutput
from pagedserve.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams


def scoring_fields(sampling: SamplingParams) -> dict[str, Any]:
    """What a request's SamplingParams give each beam's scoring request: the sampled token's settings (it joins
    the candidates), its prefix-cache salt and its priority."""
    return {"top_p": sampling.top_p, "top_k": sampling.top_k, "min_p": sampling.min_p, "seed": sampling.seed,
            "cache_salt": sampling.cache_salt, "priority": sampling.priority}


async def beam_search_outputs(engine: AsyncEngine, request_id: str, prompt_text: str | None, prompt_ids: list[int],
                              params: BeamSearchParams, sampling: SamplingParams, num_logprobs: int | None
                              ) -> AsyncIterator[RequestOutput]:
    """One prompt's beam search; yields its final RequestOutput (n = beam_width choices). `num_logprobs`: the top
    logprobs the response shows per token (None: no logprobs). Leaving early aborts the step's requests."""
    scoring = scoring_params(params, num_logprobs, **scoring_fields(sampling))
    scoring.output_kind = RequestOutputKind.FINAL_ONLY
    steps = 0

    async def one(engine_id: str, tokens: list[int]) -> Scored:
        final = None
        async for output in engine.generate(engine_id, {"prompt_token_ids": tokens}, scoring, admitted=True):
            final = output
        completion = final.outputs[0]
        return completion.token_ids[0], completion.logprobs[0]

    async def score(sequences: list[list[int]]) -> list[Scored]:
        nonlocal steps
        steps += 1
        return await asyncio.gather(*(one(f"{request_id}-beam{steps}.{j}", tokens)
                                      for j, tokens in enumerate(sequences)))

    beams = await search_async(prompt_ids, params, engine.engine.eos_token_ids, score)
    outputs = [_completion(i, beam, len(prompt_ids), params, sampling, num_logprobs, engine.engine.tokenizer)
               for i, beam in enumerate(beams)]
    yield RequestOutput(request_id, prompt_text, prompt_ids, outputs, finished=True)


def _completion(index: int, beam: BeamSearchSequence, prompt_len: int, params: BeamSearchParams,
                sampling: SamplingParams, num_logprobs: int | None, tokenizer: Any) -> CompletionOutput:
    """A beam as a choice, as vLLM's beam search gives it: the generated tokens and their text without a final
    EOS unless include_stop_str_in_output (usage counts them so), stop_reason the EOS id that ended it."""
    shown = generated_tokens(beam, prompt_len, params.include_stop_str_in_output)
    text = tokenizer.decode(shown, skip_special_tokens=sampling.skip_special_tokens)
    stop_reason = beam.tokens[-1] if beam.finish_reason == "stop" else None
    return CompletionOutput(index, text, shown, beam.cum_logprob,
                            beam.logprobs[:len(shown)] if num_logprobs is not None else None, beam.finish_reason,
                            stop_reason)
