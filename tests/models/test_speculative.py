"""Speculative decoding (n-gram prompt lookup, and a draft model) changes nothing a user sees: greedy tokens equal
transformers' and the plain path's, logprobs agree, stops land where they would, sampling keeps its distribution.

The tiny random models here have small weights (std 0.06), which makes them fall into loops within a few tokens
(with the default std they rarely repeat), so n-gram drafts get proposed, accepted and rejected. The draft model
is the target with a little noise on its weights (DRAFT_NOISE), whose greedy tokens are the target's about 60 %
of the time. Every test checks that speculation really ran (accepted drafts > 0) so that it cannot pass by never
speculating; the tests that `method` parametrizes run with both proposers.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch

from pagedserve import LLM, SamplingParams
from tests.models.test_correctness import (NUM_TOKENS, TOLERANCE, assert_logprobs_close, hf_logprobs,
                                           hf_reference, make_prompts)

# prompt_lookup_min 1 proposes as often as possible; a batch of any size speculates.
WEIGHT_STD = 0.06
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
        "disable_by_batch_size": 10_000}


DRAFT_NOISE = 0.003


def draft_spec(draft_dir: str) -> dict:
    return {"model": draft_dir, "num_speculative_tokens": 4, "disable_by_batch_size": 10_000}


def spec_llm(model_dir: str, dtype: str = "float32", spec: dict | None = None, **kwargs) -> LLM:
    return LLM(model_dir, dtype=dtype, max_model_len=256, speculative_config=spec or SPEC, **kwargs)


def holding_finished_states(llm: LLM) -> LLM:
    """For tests that read a finished request's runner state and draft K/V: the engine drops them when it goes idle
    (LLMEngine._release_finished); held here until the next step reports the finish, as while busy."""
    llm.engine._release_finished = lambda: None
    return llm


def make_draft(model_dir: str, tmp_path_factory) -> str:
    from tests.tiny_models import make_draft_model

    return str(make_draft_model(Path(model_dir), tmp_path_factory.mktemp("draft"), DRAFT_NOISE))


def totals(llm: LLM):
    return llm.engine.scheduler.proposer.totals


def assert_no_leaks(llm: LLM) -> None:
    pool = llm.engine.scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_blocks - 1  # block 0 is the null block
    proposer = llm.engine.scheduler.proposer  # per-request proposer state dropped at finish
    assert not getattr(proposer, "_index", None) and not getattr(proposer, "_drafts", None)


def greedy(max_tokens: int = NUM_TOKENS, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def assert_greedy_tokens(llm: LLM, prompts: list[list[int]], expected: list[list[int]]) -> None:
    """The batch's greedy tokens are `expected`, drafts were accepted, and nothing leaked."""
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy())
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert totals(llm).num_accepted_tokens > 0
    assert_no_leaks(llm)


@pytest.mark.parametrize("proposer", ["ngram", "draft_model"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])  # speculation is the same for every architecture
def test_greedy_batch_matches_transformers(tiny_model_dir, tmp_path_factory, arch, proposer):
    model_dir = tiny_model_dir(arch, weight_std=WEIGHT_STD)
    spec = SPEC if proposer == "ngram" else draft_spec(make_draft(model_dir, tmp_path_factory))
    llm = spec_llm(model_dir, spec=spec)
    prompts = make_prompts(llm.get_tokenizer())
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(logprobs=5))
    hf_model, hf_tokens = hf_reference(model_dir, "float32", prompts)
    for prompt, output, expected in zip(prompts, outputs, hf_tokens):
        completion = output.outputs[0]
        assert completion.token_ids == expected
        assert len(completion.logprobs) == NUM_TOKENS
        assert_logprobs_close(completion.logprobs, hf_logprobs(hf_model, prompt, completion.token_ids),
                              TOLERANCE["float32"])
    stats = totals(llm)
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # drafts both accepted and rejected
    assert sum(stats.accepted_per_pos) == stats.num_accepted_tokens
    if proposer == "draft_model":
        assert len(llm.engine.runner.draft.kv_caches) == 2  # the draft model's own pools
    assert_no_leaks(llm)


def test_bfloat16_greedy_equals_plain_path(tiny_model_dir):
    """bf16 rounds differently with the batch shape, so the reference is the plain path on the same engine
    settings, position by position up to a first divergence that must be a near-tie of the plain path's own
    logprobs (as test_correctness allows against transformers)."""
    model_dir = tiny_model_dir("llama", "bfloat16", weight_std=WEIGHT_STD)
    plain = LLM(model_dir, dtype="bfloat16", max_model_len=256)
    prompts = [{"prompt_token_ids": p} for p in make_prompts(plain.get_tokenizer())]
    expected = plain.generate(prompts, greedy(logprobs=5))
    llm = spec_llm(model_dir, "bfloat16")
    outputs = llm.generate(prompts, greedy(logprobs=5))
    num_exact = 0
    for ours, ref in zip(outputs, expected):
        a, b = ours.outputs[0], ref.outputs[0]
        for position, (x, y) in enumerate(zip(a.token_ids, b.token_ids)):
            assert abs(a.logprobs[position][x].logprob - b.logprobs[position][x].logprob) <= TOLERANCE["bfloat16"]
            if x != y:
                gap = abs(b.logprobs[position][y].logprob - b.logprobs[position].get(x, b.logprobs[position][y]).logprob)
                assert x in b.logprobs[position] and gap <= TOLERANCE["bfloat16"], f"position {position}"
                break
        num_exact += a.token_ids == b.token_ids
    assert num_exact >= len(prompts) // 2
    assert totals(llm).num_accepted_tokens > 0


@pytest.fixture(scope="module")
def llama(tiny_model_dir):
    """The tiny llama's prompts and its plain-path greedy tokens (which equal transformers', test_correctness)."""
    model_dir = tiny_model_dir("llama", weight_std=WEIGHT_STD)
    plain = LLM(model_dir, dtype="float32", max_model_len=256)
    prompts = make_prompts(plain.get_tokenizer())
    outputs = plain.generate([{"prompt_token_ids": p} for p in prompts], greedy())
    return model_dir, prompts, [o.outputs[0].token_ids for o in outputs], plain


@pytest.fixture(scope="module", params=["ngram", "draft_model"])
def method(request, llama, tmp_path_factory):
    """The speculative config of each proposer for the tiny llama (a draft model: its noisy copy)."""
    return SPEC if request.param == "ngram" else draft_spec(make_draft(llama[0], tmp_path_factory))


def test_the_target_as_its_own_draft_model_has_every_draft_accepted(llama):
    """Its K/V follow the target's exactly (prefill chunks, verification rows, its own proposals' slots), so it
    proposes the target's own greedy tokens: a draft K/V written to a wrong slot or skipped would show here."""
    model_dir, prompts, expected, _ = llama
    llm = spec_llm(model_dir, spec=draft_spec(model_dir), max_num_batched_tokens=7)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy())
    assert [o.outputs[0].token_ids for o in outputs] == expected
    stats = totals(llm)
    assert stats.num_draft_tokens > 100 and stats.num_accepted_tokens >= 0.98 * stats.num_draft_tokens, stats
    assert_no_leaks(llm)


def test_decode_steps_follow_only_the_rows_the_proposal_did_not_write(llama):
    """In a decode-only step the draft model runs only the rows whose K/V its last proposal did not write (the
    last draft of each verification, a plain decode's token): the rest were fed the same tokens at the same
    positions. With the target as its own draft model every draft is still accepted, and its K/V at every valid
    position are the target's."""
    model_dir, prompts, expected, plain = llama
    llm = holding_finished_states(spec_llm(model_dir, spec=draft_spec(model_dir)))
    longest = plain.generate([{"prompt_token_ids": prompts[0]}], greedy(96))[0].outputs[0].token_ids
    assert _run_staggered(llm, [(prompts[0], 96)]) == [longest]
    kv = llm.engine.runner.draft.kv
    _assert_every_draft_accepted(llm)
    # k = 4 drafts a verification, 4 of its 5 rows held: most of what the steps computed was left out
    assert kv.num_held_tokens > 0.6 * (96 - 1), kv
    _assert_draft_kv_is_the_targets(llm, "0")
    assert_no_leaks(llm)


def test_after_a_partial_acceptance_the_follow_runs_nothing_and_the_draft_kv_stay_right(llama, tmp_path_factory):
    """A draft that is often wrong: after a verification that rejects a draft, the row of the last draft is not
    followed (the next step starts at or before it). Outputs stay the target's, and the draft's K/V at every
    position it counts as valid are what the draft model computes for those tokens from scratch."""
    model_dir, prompts, _, plain = llama
    draft_dir = make_draft(model_dir, tmp_path_factory)
    llm = holding_finished_states(spec_llm(model_dir, spec=draft_spec(draft_dir)))
    want = plain.generate([{"prompt_token_ids": prompts[0]}], greedy(96))[0].outputs[0].token_ids
    engine = llm.engine
    engine.add_request("0", {"prompt_token_ids": prompts[0]}, greedy(96))
    tokens = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                tokens = output.outputs[0].token_ids
        runner = engine.runner
        if "0" in runner.states and runner.draft.kv.num_dropped_tokens and runner.draft.kv.valid["0"] > 64:
            valid = runner.draft.kv.valid["0"]
            known = runner.draft.kv.tokens["0"][:valid]
            block_ids = list(runner.states["0"].block_ids)
            break
    stats = totals(llm)
    assert runner.draft.kv.num_dropped_tokens > 0 and stats.num_accepted_tokens < stats.num_draft_tokens, stats
    # the draft model alone, prefilling the same tokens: its K/V at each position
    alone = holding_finished_states(LLM(draft_dir, dtype="float32", max_model_len=256))
    alone.engine.add_request("ref", {"prompt_token_ids": known}, greedy(1))
    alone.engine.step()
    ref_state = alone.engine.runner.states["ref"]
    size = runner.block_size
    ours = torch.tensor([block_ids[p // size] * size + p % size for p in range(valid)])
    theirs = torch.tensor([ref_state.block_ids[p // size] * size + p % size for p in range(valid)])
    for mine, ref in zip(runner.draft.kv_caches, alone.engine.runner.kv_caches):
        torch.testing.assert_close(mine.k[ours], ref.k[theirs], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(mine.v[ours], ref.v[theirs], atol=1e-4, rtol=1e-4)
    while engine.has_unfinished_requests():  # and the outputs are the target's
        for output in engine.step():
            if output.finished:
                tokens = output.outputs[0].token_ids
    assert tokens == want
    assert_no_leaks(llm)


def test_draft_lengths_differ_per_request_in_one_batch(llama, monkeypatch):
    """The draft model proposes as many tokens as the scheduler gave each request lookahead slots (fewer after
    misses): here 1, 2, 3 or 4 by request, in one batch whose draft steps shrink as the short ones finish. With
    the target as its own draft model every draft must still be accepted: a row given another request's token
    or position would be rejected."""
    model_dir, prompts, expected, _ = llama
    llm = spec_llm(model_dir, spec=draft_spec(model_dir))
    proposer = llm.engine.scheduler.proposer
    monkeypatch.setattr(proposer, "draft_length", lambda request_id: 1 + int(request_id) % 4)
    assert _run_staggered(llm, [(p, NUM_TOKENS) for p in prompts]) == expected
    _assert_every_draft_accepted(llm)
    per_pos = totals(llm).accepted_per_pos  # drafts at position i come from the requests given more than i
    assert per_pos[0] > per_pos[1] > per_pos[2] > per_pos[3] > 0, per_pos
    assert_no_leaks(llm)


def _run_staggered(llm: LLM, requests: list[tuple[list[int], int]]) -> list[list[int]]:
    """Greedy tokens of (prompt, max_tokens) requests added together: the batch shrinks as they end."""
    for index, (prompt, max_tokens) in enumerate(requests):
        llm.engine.add_request(str(index), {"prompt_token_ids": prompt}, greedy(max_tokens))
    finished = {}
    while llm.engine.has_unfinished_requests():
        for output in llm.engine.step():
            if output.finished:
                finished[int(output.request_id)] = output.outputs[0].token_ids
    return [finished[i] for i in range(len(requests))]


def _assert_every_draft_accepted(llm: LLM) -> None:
    stats = totals(llm)
    assert stats.num_draft_tokens > 30 and stats.num_accepted_tokens >= 0.98 * stats.num_draft_tokens, stats


def _assert_draft_kv_is_the_targets(llm: LLM, request_id: str) -> None:
    """With the target as its own draft model, the draft's K/V at every position it counts as valid are the
    target's (within float32 rounding: a catch-up runs them as prefill, the target may have run them as decodes)."""
    runner = llm.engine.runner
    state, valid = runner.states[request_id], runner.draft.kv.valid[request_id]
    block_size = runner.block_size
    slots = torch.tensor([state.block_ids[p // block_size] * block_size + p % block_size for p in range(valid)])
    assert valid > 64
    for target, draft in zip(runner.kv_caches, runner.draft.kv_caches):
        torch.testing.assert_close(draft.k[slots], target.k[slots], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(draft.v[slots], target.v[slots], atol=1e-4, rtol=1e-4)


def test_steps_nobody_speculates_in_skip_the_draft_model_and_lagging_requests_catch_up(llama):
    """Above disable_by_batch_size (2) the draft model does not run; as requests end and the batch shrinks,
    speculation resumes and each request's missing draft K/V are computed first: with the target as its own
    draft model, a position left out or computed from a wrong token would cost accepted drafts."""
    model_dir, prompts, _, plain = llama
    spec = {**draft_spec(model_dir), "disable_by_batch_size": 2}
    # max_num_batched_tokens: catch-ups longer than one chunk
    llm = holding_finished_states(spec_llm(model_dir, spec=spec, max_num_batched_tokens=16))
    lengths = [4 + 8 * i for i in range(len(prompts) - 1)] + [96]  # one ends every few steps; the last alone
    longest = plain.generate([{"prompt_token_ids": p} for p in prompts], greedy(max(lengths)))
    expected = [o.outputs[0].token_ids[:n] for o, n in zip(longest, lengths)]  # greedy: a prefix of the longest
    assert _run_staggered(llm, list(zip(prompts, lengths))) == expected
    kv = llm.engine.runner.draft.kv
    assert kv.num_skipped_tokens > 100 and kv.num_followed_tokens > 0, kv
    _assert_every_draft_accepted(llm)
    assert_no_leaks(llm)
    _assert_draft_kv_is_the_targets(llm, "7")  # the last to finish: the runner still holds it
    runner_states = set(llm.engine.runner.states)  # dropped when the next schedule reports the finish
    assert set(kv.valid) == set(kv.tokens) == runner_states and len(runner_states) <= 1


def test_cached_blocks_the_draft_model_did_not_follow_are_recomputed_for_it(llama):
    """Four requests with one long prefix run beside three others, above disable_by_batch_size (2), so the draft
    model never follows them; a request that comes later alone finds that prefix cached for the target, but
    the draft model's K/V there were never written: they are computed before it speculates."""
    model_dir, prompts, _, plain = llama
    spec = {**draft_spec(model_dir), "disable_by_batch_size": 2}
    llm = holding_finished_states(spec_llm(model_dir, spec=spec, enable_prefix_caching=True, max_num_batched_tokens=16))
    engine = llm.engine
    for index in range(3):  # the crowd around them
        engine.add_request(f"filler-{index}", {"prompt_token_ids": prompts[index]}, greedy(40))
    for _ in range(3):
        engine.step()
    prefix = prompts[-1][:64]
    for index in range(4):
        engine.add_request(f"shared-{index}", {"prompt_token_ids": prefix + [7 + index]}, greedy(2))
    while engine.has_unfinished_requests():
        engine.step()
    assert totals(llm).num_draft_tokens == 0  # nobody speculated
    alone = prefix + [3]
    want = plain.generate([{"prompt_token_ids": alone}], greedy(48))[0].outputs[0].token_ids
    hits = engine.scheduler.kv.stats.num_hits
    assert _run_staggered(llm, [(alone, 48)]) == [want]
    assert engine.scheduler.kv.stats.num_hits - hits >= 48  # the target found the prefix cached
    _assert_every_draft_accepted(llm)
    _assert_draft_kv_is_the_targets(llm, "0")


def test_a_draft_model_of_another_shape_and_architecture(llama, tiny_model_dir):
    """A one-layer Qwen2 (tied embeddings, other weights) drafting for the Llama: few drafts survive, the
    tokens are the plain path's."""
    model_dir, prompts, expected, _ = llama
    draft = tiny_model_dir("qwen2", weight_std=WEIGHT_STD, seed=3, num_hidden_layers=1, num_key_value_heads=4)
    assert_greedy_tokens(spec_llm(model_dir, spec=draft_spec(draft)), prompts, expected)


def test_chunked_prefill_with_a_7_token_budget(llama, method):
    model_dir, prompts, expected, _ = llama
    # drafts share the budget with prefill chunks
    assert_greedy_tokens(spec_llm(model_dir, spec=method, max_num_batched_tokens=7), prompts, expected)


def test_forced_preemption(llama, method):
    model_dir, prompts, expected, _ = llama
    llm = spec_llm(model_dir, spec=method, num_gpu_blocks_override=21)
    assert_greedy_tokens(llm, prompts, expected)
    assert llm.engine.scheduler.num_preemptions_total > 0


def test_requests_joining_mid_flight(llama, method):
    model_dir, prompts, expected, _ = llama
    llm = spec_llm(model_dir, spec=method)
    engine = llm.engine
    finished, pending, steps = {}, list(enumerate(prompts)), 0
    while pending or engine.has_unfinished_requests():
        if pending and steps % 3 == 0:
            index, prompt = pending.pop(0)
            engine.add_request(str(index), {"prompt_token_ids": prompt}, greedy())
        for output in engine.step():
            if output.finished:
                finished[int(output.request_id)] = output.outputs[0].token_ids
        steps += 1
    assert [finished[i] for i in range(len(prompts))] == expected
    assert totals(llm).num_accepted_tokens > 0
    assert_no_leaks(llm)


def _same(outputs, expected) -> None:
    for ours, ref in zip(outputs, expected):
        a, b = ours.outputs[0], ref.outputs[0]
        assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == (b.token_ids, b.text, b.finish_reason,
                                                                         b.stop_reason)


def test_stops_inside_accepted_runs_cut_where_the_plain_path_does(llama, method):
    """max_tokens, stop token ids (with and without min_tokens), EOS and stop strings at every position of the
    looping outputs, where most tokens arrive several per step."""
    model_dir, prompts, expected, plain = llama
    llm = spec_llm(model_dir, spec=method)
    requests = [{"prompt_token_ids": p} for p in prompts]
    cases = [greedy(max_tokens=n) for n in (1, 2, 3, 5, 8, 13, 21)]
    for tokens in expected[:4]:
        for token_id in list(dict.fromkeys(tokens))[:6]:
            cases.append(greedy(stop_token_ids=[token_id]))
            cases.append(greedy(stop_token_ids=[token_id], min_tokens=7))
    tokenizer = plain.get_tokenizer()
    for tokens in expected[:4]:
        text = tokenizer.decode(tokens)
        for start in (3, 10, 20):
            if len(text) > start + 2:
                cases.append(greedy(stop=[text[start:start + 2]]))
                cases.append(greedy(stop=[text[start:start + 2]], include_stop_str_in_output=True))
    if method is not SPEC:  # the draft model: every third case of each kind (the cut is the proposers' shared
        cases = cases[::3]  # code; all of them doubled this test's ~17 s)
    for params in cases:
        _same(llm.generate(requests, params), plain.generate(requests, params))
    # EOS: make a token of the loops the end-of-sequence token of both engines.
    eos, saved = expected[1][-1], plain.engine.eos_token_id
    try:
        for engine in (llm.engine, plain.engine):
            engine.eos_token_id = engine.runner.eos_token_id = eos
        for params in (SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS),
                       SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, min_tokens=9)):
            ours, ref = llm.generate(requests, params), plain.generate(requests, params)
            _same(ours, ref)
            assert any(o.outputs[0].finish_reason == "stop" for o in ref)
    finally:
        plain.engine.eos_token_id = plain.engine.runner.eos_token_id = saved  # the fixture's engine is shared
    assert totals(llm).num_accepted_tokens > 100
    assert_no_leaks(llm)


def test_penalties_and_logit_bias(llama, method):
    model_dir, prompts, _, plain = llama
    llm = spec_llm(model_dir, spec=method)
    requests = [{"prompt_token_ids": p} for p in prompts]
    for params in (greedy(repetition_penalty=1.05), greedy(frequency_penalty=0.02, presence_penalty=0.01),
                   greedy(logit_bias={7: 0.5, 11: -2.0}, logprobs=3)):
        before = totals(llm).num_accepted_tokens
        ours, ref = llm.generate(requests, params), plain.generate(requests, params)
        _same(ours, ref)
        assert totals(llm).num_accepted_tokens > before
        if params.logprobs:
            for a, b in zip(ours, ref):
                for x, y, token_id in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, a.outputs[0].token_ids):
                    assert abs(x[token_id].logprob - y[token_id].logprob) <= TOLERANCE["float32"]


def test_structured_outputs_mask_every_verification_row(llama, method):
    """A regex whose text repeats: drafts are proposed inside the grammar and each verification row is masked
    by the grammar state after the drafts before it (the matcher rolled back afterwards)."""
    import re

    from pagedserve.structured.params import StructuredOutputsParams

    model_dir, prompts, _, plain = llama
    llm = spec_llm(model_dir, spec=method)
    requests = [{"prompt_token_ids": p} for p in prompts]
    pattern = r"(ab|cd|the ){3,40}!"
    for structured in (StructuredOutputsParams(regex=pattern), StructuredOutputsParams(choice=["yes", "no"]),
                       StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "string"}},
                                                     "required": ["a"]})):
        params = SamplingParams(temperature=0.0, max_tokens=48, structured_outputs=structured)
        before = totals(llm).num_drafts
        ours, ref = llm.generate(requests, params), plain.generate(requests, params)
        _same(ours, ref)
        if structured.regex:
            assert all(re.fullmatch(pattern, o.outputs[0].text) or o.outputs[0].finish_reason == "length"
                       for o in ours)
            assert totals(llm).num_drafts > before
    assert totals(llm).num_accepted_tokens > 0
    assert_no_leaks(llm)


def test_seeded_sampling_draws_as_without_speculation(llama, method):
    """A seeded request's generator is rewound to its last emitted row, so it yields exactly the plain path's
    tokens (float32: logits equal to rounding, far from the exponential race's ties)."""
    model_dir, prompts, _, plain = llama
    llm = spec_llm(model_dir, spec=method)
    requests = [{"prompt_token_ids": p} for p in prompts]
    params = [SamplingParams(temperature=0.8, top_k=3, max_tokens=NUM_TOKENS, ignore_eos=True, seed=100 + i)
              for i in range(len(prompts))]
    _same(llm.generate(requests, params), plain.generate(requests, params))
    assert totals(llm).num_accepted_tokens > 0


def _chi_square_p(a: dict, b: dict) -> float:
    """p-value of Pearson's chi-square test that two samples of categories come from one distribution."""
    from scipy.stats import chi2_contingency

    keys = sorted(set(a) | set(b))
    # Pool categories rarer than 5 expected counts, as the test needs.
    common = [k for k in keys if a.get(k, 0) + b.get(k, 0) >= 10]
    rare = [k for k in keys if k not in common]
    table = [[a.get(k, 0) for k in common], [b.get(k, 0) for k in common]]
    if rare:
        table[0].append(sum(a.get(k, 0) for k in rare))
        table[1].append(sum(b.get(k, 0) for k in rare))
    return float(chi2_contingency(table)[1])


SIGNIFICANCE = 0.001  # a correct rule fails this test once in a thousand runs


def _continuations(llm: LLM, prompt: list[int], num: int, seed0: int) -> dict:
    params = [SamplingParams(temperature=1.0, top_k=4, max_tokens=3, ignore_eos=True, seed=seed0 + i)
              for i in range(num)]
    counts: dict = {}
    for output in llm.generate([{"prompt_token_ids": prompt}] * num, params):
        key = tuple(output.outputs[0].token_ids)
        counts[key] = counts.get(key, 0) + 1
    return counts


@pytest.fixture(scope="module")
def sampling_setup(llama):
    """A prompt that makes the n-gram drafts plausible: text the model itself sampled (top-4), so the token
    that followed a token in the prompt is often among the model's top 4 after it."""
    model_dir, _, _, plain = llama
    params = SamplingParams(temperature=1.0, top_k=4, max_tokens=150, ignore_eos=True, seed=7)
    prompt = [1] + plain.generate([{"prompt_token_ids": [1]}], params)[0].outputs[0].token_ids
    return model_dir, prompt, plain


def test_sampled_distribution_is_unchanged(sampling_setup, monkeypatch):
    """Many seeds, a 3-token continuation: the counts with and without speculation pass a chi-square test at
    SIGNIFICANCE; the same test rejects a biased acceptance rule (one that keeps the first draft whenever it is
    among the top-k), so it has the power to see a wrong rule."""
    from pagedserve.spec_decode import acceptance
    from pagedserve.worker import model_runner

    model_dir, prompt, plain = sampling_setup
    num = 1500
    llm = spec_llm(model_dir)
    without = _continuations(plain, prompt, num, seed0=0)
    # Other seeds for the speculative run: with the same seeds its tokens would be identical (see above).
    with_spec = _continuations(llm, prompt, num, seed0=10 * num)
    stats = totals(llm)
    assert stats.num_accepted_tokens > num // 10, stats  # drafts accepted often: the rule is exercised
    assert stats.num_draft_tokens > stats.num_accepted_tokens  # and rejected often
    assert _chi_square_p(with_spec, without) > SIGNIFICANCE

    allowed: set[int] = set()  # the top-k tokens after the prompt, where the biased rule keeps a draft

    def biased(sampled: list[int], drafts: list[int]) -> list[int]:
        if drafts and sampled[0] != drafts[0] and drafts[0] in allowed:
            return [drafts[0], sampled[1]]  # keeps d1 though the target sampled something else
        return acceptance.accepted_tokens(sampled, drafts)

    allowed.update(k[0] for k in without)
    monkeypatch.setattr(model_runner, "accepted_tokens", biased)
    biased_llm = spec_llm(model_dir)
    assert _chi_square_p(_continuations(biased_llm, prompt, num, seed0=20 * num), without) < SIGNIFICANCE


def test_draft_model_sampled_distribution_is_unchanged(sampling_setup, tmp_path_factory):
    """As above with a draft model's (greedy, one-hot) drafts."""
    model_dir, prompt, plain = sampling_setup
    num = 1500
    llm = spec_llm(model_dir, spec=draft_spec(make_draft(model_dir, tmp_path_factory)))
    without = _continuations(plain, prompt, num, seed0=0)
    with_spec = _continuations(llm, prompt, num, seed0=10 * num)
    stats = totals(llm)
    assert stats.num_accepted_tokens > num // 10 and stats.num_draft_tokens > stats.num_accepted_tokens, stats
    assert _chi_square_p(with_spec, without) > SIGNIFICANCE


def test_acceptance_rule_is_rejection_sampling():
    """The rule on its own, against the exact distribution: p over 3 tokens, one-hot draft d; the first emitted
    token must be distributed as p (accepting d with probability p(d), else the residual)."""
    from pagedserve.spec_decode.acceptance import accepted_tokens

    rng = random.Random(0)
    p = [0.5, 0.3, 0.2]
    for draft in range(3):
        counts = [0, 0, 0]
        num = 20_000
        for _ in range(num):
            sampled = rng.choices(range(3), p, k=2)
            counts[accepted_tokens(sampled, [draft])[0]] += 1
        for token in range(3):
            sigma = math.sqrt(num * p[token] * (1 - p[token]))
            assert abs(counts[token] - num * p[token]) < 5 * sigma


def test_a_verification_step_runs_the_decode_kernels(tiny_model_dir):
    """Drafts are decode rows: a verification step never becomes a prefill span (it stays on the decode
    attention kernel and, where it exists, the native decode stack)."""
    from pagedserve.worker.model_runner import ModelRunner

    model_dir = tiny_model_dir("llama", weight_std=WEIGHT_STD)
    llm = spec_llm(model_dir)
    seen = []
    original = ModelRunner._prepare

    def spy(self, sched):
        batch = original(self, sched)
        if sched.spec_token_ids:
            seen.append((batch.meta.num_decodes, len(batch.meta.prefills), sched.total_num_scheduled_tokens))
        return batch

    ModelRunner._prepare = spy
    try:
        llm.generate([{"prompt_token_ids": [5, 6, 7, 5, 6, 7, 5, 6]}], greedy())
    finally:
        ModelRunner._prepare = original
    assert seen and all(prefills == 0 and decodes == total for decodes, prefills, total in seen)


def test_abort_while_verifying_frees_everything_and_the_others_go_on(llama, method):
    model_dir, prompts, expected, _ = llama
    llm = spec_llm(model_dir, spec=method)
    engine = llm.engine
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), {"prompt_token_ids": prompt}, greedy())
    verified: set[str] = set()  # requests whose drafts the last step verified
    execute = engine.runner.execute

    def spy(sched):
        verified.clear()
        verified.update(sched.spec_token_ids)
        return execute(sched)

    engine.runner.execute = spy
    finished, aborted = {}, False
    while engine.has_unfinished_requests():  # abort request 0 right after a step that verified its drafts
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0].token_ids
        if not aborted and "0" in verified and "0" not in finished:
            engine.abort_request(["0"])
            aborted = True
    assert aborted
    assert [finished[str(i)] for i in range(1, len(prompts))] == expected[1:]
    assert_no_leaks(llm)


def test_finished_requests_cache_drafts_repeated_requests_and_outputs_stay_the_same(llama):
    model_dir, prompts, expected, _ = llama
    spec = {**SPEC, "prompt_lookup_min": 2, "ngram_cache_requests": 16}
    llm = LLM(model_dir, dtype="float32", max_model_len=256, speculative_config=spec)
    requests = [{"prompt_token_ids": p} for p in prompts]
    assert [o.outputs[0].token_ids for o in llm.generate(requests, greedy())] == expected
    first = totals(llm).num_accepted_tokens
    assert len(llm.engine.scheduler.proposer.finished.sequences) == len(prompts)  # warm-up's are forgotten
    assert [o.outputs[0].token_ids for o in llm.generate(requests, greedy())] == expected
    second = totals(llm).num_accepted_tokens - first
    assert second > first  # the same requests again: their earlier runs propose what follows
    assert_no_leaks(llm)


def test_memory_pressure_releases_the_draft_models_pages_too(llama, method):
    """Under memory pressure the free blocks' pages go back to the OS in every pool their ids index: the draft
    model's K/V (same block ids) read back as zeros like the target's, and generation afterwards is unchanged."""
    from pagedserve.memory.pressure import MemoryPressure, PressureThresholds
    from pagedserve.memory.probe import AvailableMemory

    model_dir, prompts, expected, _ = llama
    llm = spec_llm(model_dir, spec=method, block_size=128)  # 128 tokens x 2 heads x 16 x 4 B: whole pages
    assert llm.generate([{"prompt_token_ids": p} for p in prompts], greedy())[0].outputs[0].token_ids == expected[0]
    pools = llm.engine.runner.kv_pools()
    assert len(pools) == (4 if "model" in method else 2)  # 2 layers each, target first
    assert all(bool(pool.k.abs().sum() > 0) for pool in pools)  # every pool was written
    available, now = [AvailableMemory(1 << 20, "MemAvailable", "simulated", total_bytes=1 << 34)], [0.0]
    llm.engine.give_way_under(MemoryPressure(lambda: available[0], PressureThresholds.for_memory(1 << 34),
                                             clock=lambda: now[0]))
    llm.engine.step()  # gives way before scheduling: every block is free, so every whole page goes
    for pool in pools:
        assert not bool(pool.k.any()) and not bool(pool.v.any())
    available[0], now[0] = AvailableMemory(1 << 33, "MemAvailable", "simulated", total_bytes=1 << 34), 1.0
    assert_greedy_tokens(llm, prompts, expected)


# ---- a draft model's configuration ------------------------------------------------------------------------
def test_the_memory_plan_holds_the_draft_models_weights_and_kv(llama, tiny_model_dir, tmp_path, capsys):
    """`pagedserve plan` with a draft model: its weights on top of the target's, and each token's K/V bytes
    both models' (the two pools share the blocks), so the pool holds fewer tokens in the same memory."""
    import json

    from pagedserve.cli.main import main
    from tests.models.test_memory_plan_engine import fake_host

    model_dir = llama[0]
    draft = tiny_model_dir("qwen2", weight_std=WEIGHT_STD, seed=3, num_hidden_layers=1, num_key_value_heads=4)
    common = ["--dtype", "float32", "--max-model-len", "64", "--max-num-seqs", "4", "--kv-cache-memory", "1048576",
              *fake_host(tmp_path, available_kib=1 << 20), "--json"]

    def plan(model: str, *extra: str) -> dict:
        assert main(["plan", model, *common, *extra]) == 0
        return json.loads(capsys.readouterr().out)

    target, alone = plan(model_dir), plan(draft)
    both = plan(model_dir, "--speculative-config", json.dumps(draft_spec(draft)))
    assert both["weight_bytes"] == target["weight_bytes"] + alone["weight_bytes"]
    # Qwen2 draft: 1 layer x 4 KV heads x 16 dims x K and V x 4 B = 512; the Llama's 2 x 2 x 16 x 2 x 4 = 512.
    assert both["kv_bytes_per_token"] == target["kv_bytes_per_token"] + alone["kv_bytes_per_token"] == 1024
    assert both["num_kv_blocks"] * 2 <= target["num_kv_blocks"] + 1


def test_a_draft_padded_otherwise_is_served_and_another_tokenizer_refused(llama, tiny_model_dir, tmp_path):
    """One tokenizer, embedding tables padded to other sizes (Qwen2.5-0.5B's 151936 rows, its 7B's 152064): served,
    the target's output unchanged (they were refused for the sizes). A draft of the same size whose tokenizer splits
    text otherwise is refused before any weight is read (it was taken, and every draft lost)."""
    import shutil

    from tests.tiny_models import make_tokenizer

    model_dir, prompts, expected, _ = llama
    padded = tiny_model_dir("llama", weight_std=WEIGHT_STD, vocab_size=640, seed=5)  # the same 512-token tokenizer
    llm = LLM(model_dir, dtype="float32", max_model_len=256, speculative_config=draft_spec(padded))
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy())
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert totals(llm).num_draft_tokens > 0  # (it proposed)
    # max_tokens None (up to max_model_len) with a draft model: every request failed (a None compared with an int)
    open_ended = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    assert llm.generate([{"prompt_token_ids": prompts[0]}], open_ended)[0].outputs[0].token_ids == \
        llama[3].generate([{"prompt_token_ids": prompts[0]}], open_ended)[0].outputs[0].token_ids
    other = Path(shutil.copytree(tiny_model_dir("llama", weight_std=WEIGHT_STD, seed=5), tmp_path / "other"))
    make_tokenizer(other, vocab_size=300)  # another BPE: the same texts split into other ids
    with pytest.raises(ValueError, match="tokenizes text differently from the target"):
        LLM(model_dir, dtype="float32", max_model_len=256, speculative_config=draft_spec(str(other)))
    # plan and doctor refuse it as serve does (both passed it)
    from pagedserve.cli.doctor_model import model_checks
    from pagedserve.cli.main import main
    from pagedserve.engine.arg_utils import EngineArgs

    flags = ["--max-model-len", "256", "--dtype", "float32", "--speculative-config", json.dumps(draft_spec(str(other)))]
    assert main(["plan", model_dir, *flags]) == 2
    args = EngineArgs(max_model_len=256, dtype="float32", speculative_config=draft_spec(str(other)))
    results = [r for r in (check() for check in model_checks(model_dir, args, lambda: None)) if r]
    draft = [r for r in results if r.name == "draft model"]
    assert len(draft) == 1 and draft[0].status == "FAIL" and "tokenizes text differently" in draft[0].detail
    args = EngineArgs(max_model_len=256, dtype="float32", speculative_config=draft_spec(padded))
    assert [r.status for r in (check() for check in model_checks(model_dir, args, lambda: None))
            if r and r.name == "draft model"] == ["PASS"]


def test_draft_model_errors_name_the_problem_and_the_fix(llama, tiny_model_dir):
    model_dir = llama[0]
    with pytest.raises(ValueError, match="a draft model runs with one rank"):
        LLM(model_dir, dtype="float32", max_model_len=256, tensor_parallel_size=2,
            speculative_config=draft_spec(model_dir))
    with pytest.raises(ValueError, match="--speculative-config: the draft model: unknown model '/tmp/no-such-draft'"
                                         r".*works too: \"model\": \"/path"):  # it read as the target's, "--model"
        LLM(model_dir, dtype="float32", max_model_len=256, speculative_config=draft_spec("/tmp/no-such-draft"))
    not_a_model = tiny_model_dir("llama") + "/.."  # a directory without config.json: validation's hint (QA-AB)
    with pytest.raises(ValueError, match=r"the draft model: .* has no config.json") as refused:
        LLM(model_dir, dtype="float32", max_model_len=256, speculative_config=draft_spec(not_a_model))
    assert 'Give "model" a Hugging Face model directory' in str(refused.value)
    assert "--model" not in str(refused.value)


def test_a_draft_model_is_read_inside_its_targets_planning(tiny_model_dir, caplog):
    """The draft's headers are read while the target plans: its resolving/validating/planning are not phases of
    their own (they were logged again, in the middle of the target's planning, by a tracker of the draft's). Its
    weights are: they load and are prepared after the target's (the test below)."""
    import logging

    from pagedserve.engine.startup import PHASES

    draft = tiny_model_dir("llama", weight_std=WEIGHT_STD, vocab_size=640, seed=5)
    with caplog.at_level(logging.INFO, logger="pagedserve.startup"):
        LLM(tiny_model_dir("llama", weight_std=WEIGHT_STD), dtype="float32", max_model_len=128,
            speculative_config=draft_spec(draft))
    entered = [r.getMessage().split()[1] for r in caplog.records if r.getMessage().startswith("phase ")
               and "after process start" in r.getMessage()]
    first, last = PHASES.index("loading_weights"), PHASES.index("preparing_weights") + 1
    assert entered == list(PHASES[1:first] + PHASES[first:last] * 2 + PHASES[last:-1])


def test_the_start_up_log_names_n_gram_speculation(tiny_model_dir, caplog):
    """A draft model's server logged its speculation; an n-gram one said nothing until the first stats line. The
    line is the engine's, once: building the config (up to three times under --max-model-len auto, and in plan
    and doctor) logs none."""
    import logging

    from pagedserve.engine.arg_utils import EngineArgs
    from pagedserve.engine.setup import create_engine_config, log_speculation

    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 3}
    line = "speculative decoding: n-gram prompt lookup (suffixes of 2-3 tokens), up to 4 tokens a step"
    with caplog.at_level(logging.INFO, logger="pagedserve.engine.setup"):
        config = create_engine_config(EngineArgs(model=tiny_model_dir("llama"), dtype="float32", max_model_len=128,
                                                 speculative_config=spec), check_memory=False)
        assert line not in caplog.messages
        log_speculation(config)
    assert caplog.messages.count(line) == 1


def test_a_draft_models_weights_report_their_loading_as_the_targets_do(llama):
    """/health and the start-up log go through loading_weights and preparing_weights again for the draft model's
    weights (seconds for a large draft), instead of sitting at the target's 100 %; each pass reaches 100 %."""
    from pagedserve.engine.arg_utils import EngineArgs
    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.engine.startup import StartupTracker

    model_dir = llama[0]
    startup = StartupTracker()
    reports: list[tuple[str, float]] = []
    set_progress = startup.set_progress

    def recorded(fraction: float, phase: str | None = None) -> None:
        set_progress(fraction, phase)
        reports.append((startup.phase, startup.progress))

    startup.set_progress = recorded
    args = EngineArgs(model=model_dir, max_model_len=256, dtype="float32", speculative_config=draft_spec(model_dir))
    engine = LLMEngine.from_engine_args(args, startup)
    names = [record.name for record in startup.history]
    weights = names[names.index("loading_weights"):names.index("allocating_kv")]
    assert weights == ["loading_weights", "preparing_weights"] * 2, names
    passes, current = [], None
    for phase, fraction in reports:  # the reports grouped by pass (a phase entered starts one)
        if phase != current:
            passes.append([])
            current = phase
        passes[-1].append(fraction)
    assert [p[-1] for p in passes] == [1.0] * 4 and all(p == sorted(p) for p in passes), passes
    assert engine.runner.draft is not None
