"""Speculative decoding (n-gram prompt lookup) changes nothing a user sees: greedy tokens equal transformers'
and the plain path's, logprobs agree, stops land where they would, sampling keeps its distribution.

The tiny random models here have small weights (std 0.06), which makes them fall into loops within a few tokens
(with the default std they rarely repeat), so n-gram drafts get proposed, accepted and rejected; every test
checks that speculation really ran (accepted drafts > 0) so that it cannot pass by never speculating.
"""

from __future__ import annotations

import math
import random

import pytest

from pagedserve import LLM, SamplingParams
from tests.models.test_correctness import (ARCHS, NUM_TOKENS, TOLERANCE, assert_logprobs_close, hf_logprobs,
                                           hf_reference, make_prompts)

# prompt_lookup_min 1 proposes as often as possible; a batch of any size speculates.
WEIGHT_STD = 0.06
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
        "disable_by_batch_size": 10_000}


def spec_llm(model_dir: str, dtype: str = "float32", **kwargs) -> LLM:
    return LLM(model_dir, dtype=dtype, max_model_len=256, speculative_config=SPEC, **kwargs)


def totals(llm: LLM):
    return llm.engine.scheduler.proposer.totals


def assert_no_leaks(llm: LLM) -> None:
    pool = llm.engine.scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_blocks - 1  # block 0 is the null block
    assert not llm.engine.scheduler.proposer._index  # per-request proposer state dropped at finish


def greedy(max_tokens: int = NUM_TOKENS, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_batch_matches_transformers(tiny_model_dir, arch):
    model_dir = tiny_model_dir(arch, weight_std=WEIGHT_STD)
    llm = spec_llm(model_dir)
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
    assert stats.num_accepted_tokens > 0 and stats.num_drafts > 0
    assert sum(stats.accepted_per_pos) == stats.num_accepted_tokens
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


def test_chunked_prefill_with_a_7_token_budget(llama):
    model_dir, prompts, expected, _ = llama
    llm = spec_llm(model_dir, max_num_batched_tokens=7)  # drafts share the budget with prefill chunks
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy())
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert totals(llm).num_accepted_tokens > 0
    assert_no_leaks(llm)


def test_forced_preemption(llama):
    model_dir, prompts, expected, _ = llama
    llm = spec_llm(model_dir, num_gpu_blocks_override=21)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy())
    assert llm.engine.scheduler.num_preemptions_total > 0
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert totals(llm).num_accepted_tokens > 0
    assert_no_leaks(llm)


def test_requests_joining_mid_flight(llama):
    model_dir, prompts, expected, _ = llama
    llm = spec_llm(model_dir)
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


def test_stops_inside_accepted_runs_cut_where_the_plain_path_does(llama):
    """max_tokens, stop token ids (with and without min_tokens), EOS and stop strings at every position of the
    looping outputs, where most tokens arrive several per step."""
    model_dir, prompts, expected, plain = llama
    llm = spec_llm(model_dir)
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


def test_penalties_and_logit_bias(llama):
    model_dir, prompts, _, plain = llama
    llm = spec_llm(model_dir)
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


def test_structured_outputs_mask_every_verification_row(llama):
    """A regex whose text repeats: drafts are proposed inside the grammar and each verification row is masked
    by the grammar state after the drafts before it (the matcher rolled back afterwards)."""
    import re

    from pagedserve.structured.params import StructuredOutputsParams

    model_dir, prompts, _, plain = llama
    llm = spec_llm(model_dir)
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


def test_seeded_sampling_draws_as_without_speculation(llama):
    """A seeded request's generator is rewound to its last emitted row, so it yields exactly the plain path's
    tokens (float32: logits equal to rounding, far from the exponential race's ties)."""
    model_dir, prompts, _, plain = llama
    llm = spec_llm(model_dir)
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


def test_abort_while_verifying_frees_everything_and_the_others_go_on(llama):
    model_dir, prompts, expected, _ = llama
    llm = spec_llm(model_dir)
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
