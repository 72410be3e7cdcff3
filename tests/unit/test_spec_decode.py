"""Speculative decoding's pure-Python parts: the config, the n-gram proposer, and the scheduler's handling of
drafts with a fake model (no torch)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagedserve.config import SchedulerConfig
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedserve.core.scheduler import Scheduler
from pagedserve.request import Request
from pagedserve.sampling_params import SamplingParams
from pagedserve.spec_decode.acceptance import accepted_tokens
from pagedserve.spec_decode.config import SpeculativeConfig
from pagedserve.spec_decode.ngram import NgramProposer
from pagedserve.spec_decode.proposer import MAX_BACKOFF_STEPS

BS = 4


# ---- config ------------------------------------------------------------------------------------
def test_config_parses_vllms_json_and_dict():
    text = '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
    config = SpeculativeConfig.parse(text)
    assert (config.num_speculative_tokens, config.prompt_lookup_max, config.prompt_lookup_min) == (5, 4, 2)
    assert SpeculativeConfig.parse({"method": "[ngram]", "num_speculative_tokens": 3}).prompt_lookup_min == 5
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3,
                                    "prompt_lookup_max": 3}).prompt_lookup_min == 3
    assert SpeculativeConfig.parse(None) is None
    draft = SpeculativeConfig.parse('{"model": "/models/small", "num_speculative_tokens": 4}')  # vLLM's draft form
    assert (draft.method, draft.model, draft.num_speculative_tokens) == ("draft_model", "/models/small", 4)
    assert SpeculativeConfig.parse({"method": "draft_model", "model": "m", "num_speculative_tokens": 2,
                                    "disable_by_batch_size": 8}).disable_by_batch_size == 8


@pytest.mark.parametrize("value, words", [
    ("not json", "must be a JSON object"),
    ("[1, 2]", "must be a JSON object"),
    ({"method": "eagle", "num_speculative_tokens": 3}, "method 'eagle' is not supported"),
    ({"num_speculative_tokens": 3, "prompt_lookup_max": 3}, 'give "method": "ngram" for prompt lookup, or a draft'),
    ({"model": "/path/to/draft"}, "num_speculative_tokens must be an integer >= 1"),
    ({"model": "", "num_speculative_tokens": 3}, "draft_model needs \"model\""),
    ({"method": "draft_model", "num_speculative_tokens": 3}, "draft_model needs \"model\""),
    ({"model": "/path/to/draft", "num_speculative_tokens": 3, "prompt_lookup_max": 3}, "applies to method ngram"),
    ({"method": "ngram", "model": "/path/to/draft", "num_speculative_tokens": 3}, "method ngram takes no"),
    ({"model": "/path/to/draft", "num_speculative_tokens": 17}, "at most 16"),
    ({"method": "ngram"}, "num_speculative_tokens must be an integer >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens must be an integer >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 99}, "at most 16"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min (4) must be <= prompt_lookup_max (2)"),
    ({"method": "ngram", "num_speculative_tokens": 3, "lookahead": 2}, "unknown key 'lookahead'"),
    ({"model": "/d", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 2}, "draft_tensor_parallel_size 2"),
    # given alone, the bound named is the one given (it was reported under prompt_lookup_max)
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 0}, "prompt_lookup_min must be an integer"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": "2"}, "prompt_lookup_min must be an"),
])
def test_config_errors_name_the_problem(value, words):
    with pytest.raises(ValueError, match="speculative-config") as info:
        SpeculativeConfig.parse(value)
    assert words in str(info.value)


def test_vllm_s_draft_tensor_parallel_size_1_is_taken():
    """vLLM's draft-model examples give it; it was an unknown key."""
    spec = SpeculativeConfig.parse({"model": "/d", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 1})
    assert spec == SpeculativeConfig(method="draft_model", model="/d", num_speculative_tokens=3)


# ---- proposer ----------------------------------------------------------------------------------
def proposer(k=3, lo=1, hi=3) -> NgramProposer:
    return NgramProposer(SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=lo, prompt_lookup_max=hi))


def test_longest_suffix_match_proposes_what_followed_its_latest_occurrence():
    p = proposer()
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 4, 9, 2, 3, 5, 7, 2, 3]
    # suffix (2, 3): latest earlier occurrence at 5..6, followed by 5, 7, 2
    assert p.propose("r", tokens, 3) == [5, 7, 2]
    # a longer match wins over a more recent shorter one: (9, 2, 3) occurred once
    tokens2 = [9, 2, 3, 8, 8, 4, 2, 3, 6, 9, 2, 3]
    assert p.propose("s", tokens2, 3) == [8, 8, 4]
    assert p.propose("t", [1, 2, 3], 3) == []  # nothing repeats
    assert p.propose("r", tokens, 2) == [5, 7]  # bounded by the caller


def test_while_the_text_follows_the_last_drafts_source_the_next_drafts_continue_it():
    """A copy of the prompt's first line (10 .. 17) whose suffix (13, 14) also occurs later, before 99: the
    latest occurrence would propose 99, 31; the cursor continues the line being copied, and once the text strays
    from it the suffix's latest occurrence is back."""
    p = proposer(k=2, lo=2, hi=2)
    #         0   1   2   3   4   5   6   7   8   9  10  11  12
    prompt = [10, 11, 12, 13, 14, 15, 16, 17, 30, 13, 14, 99, 31]
    tokens = prompt + [10, 11]
    assert p.propose("r", tokens, 2) == [12, 13]  # (10, 11): only at 0..1
    tokens += [12, 13, 14]  # both drafts accepted, and the target's next token
    assert p.propose("r", tokens, 2) == [15, 16]  # (13, 14)'s latest occurrence (9..10) would give 99, 31
    assert p.propose("r", tokens, 2) == [15, 16]  # asked again with nothing new: the same place
    assert proposer(k=2, lo=2, hi=2).propose("s", list(tokens), 2) == [99, 31]  # a fresh index: latest occurrence
    tokens += [13, 14]  # the text strays from the line (15 was expected)
    assert p.propose("r", tokens, 2) == [13, 14]  # the latest occurrence of (13, 14) again: 16..17, then 13, 14


def test_matches_beyond_the_end_repeat_their_period():
    p = proposer(k=5)
    assert p.propose("a", [4, 7, 7], 5) == [7, 7, 7, 7, 7]
    assert p.propose("b", [1, 5, 6, 5, 6], 5) == [5, 6, 5, 6, 5]


def test_index_grows_incrementally_and_below_min_length_nothing_is_proposed():
    p = proposer(k=2, lo=2, hi=2)
    tokens = [1, 2, 3]
    assert p.propose("r", tokens, 2) == []
    tokens += [1, 2]  # the same list, appended to: the index catches up with the new tokens only
    assert p.propose("r", tokens, 2) == [3, 1]
    assert p._index["r"].num_indexed == len(tokens)
    assert p.propose("q", [5, 6, 7, 6], 2) == []  # a 1-token match is shorter than prompt_lookup_min


def test_a_request_whose_drafts_fail_backs_off_and_one_hit_resets_it():
    p = proposer(k=2)
    tokens = [1, 2, 1, 2, 1]
    waits = []
    for _ in range(9):
        steps = 0
        while not p.propose("r", tokens, 2):
            steps += 1
        waits.append(steps)
        p.record("r", 2, 0)
    assert waits == [0, 1, 2, 4, 8, 16, 32, 64, 64]  # doubling, capped
    assert waits[-1] == MAX_BACKOFF_STEPS
    p.record("r", 2, 1)
    p._tracks["r"].wait = 0
    assert p.propose("r", tokens, 2)
    p.record("r", 2, 0)  # after a hit, a miss waits 1 step again
    assert p.propose("r", tokens, 2) == [] and p.propose("r", tokens, 2)


def test_a_draft_model_proposes_as_many_tokens_as_the_request_lately_accepted():
    """A draft model pays a forward pass per draft token: after a miss it proposes 1, after a partial run the
    accepted count + 1, and doubles (up to k) while all are accepted. Free n-gram drafts keep k."""
    from pagedserve.spec_decode.draft import DraftModelProposer

    draft = DraftModelProposer(SpeculativeConfig.parse({"model": "d", "num_speculative_tokens": 5}))
    ngram = proposer(k=5)
    lengths = [draft.draft_length("r")]
    for num_drafts, accepted in ((5, 0), (1, 1), (2, 2), (4, 4), (5, 5), (5, 2), (3, 0), (1, 0)):
        for p in (draft, ngram):
            p.record("r", num_drafts, accepted)
        lengths.append(draft.draft_length("r"))
        assert ngram.draft_length("r") == 5 and ngram.lookahead("r") == 0
    assert lengths == [5, 1, 2, 4, 5, 5, 3, 1, 1]
    assert draft.lookahead("r") == 1 and draft.lookahead("other") == 5
    draft.drop("r")
    assert draft.draft_length("r") == 5


def test_stats_count_drafts_and_accepted_per_position():
    p = proposer(k=3)
    p.record("a", 3, 2)
    p.record("b", 2, 0)
    stats = p.take_stats()
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 5, 2)
    assert stats.accepted_per_pos == [1, 1, 0]
    assert p.take_stats().num_drafts == 0 and p.totals.num_drafts == 2
    assert stats.acceptance_rate == pytest.approx(0.4)


def test_acceptance_keeps_drafts_up_to_the_first_mismatch_and_adds_the_target_token():
    assert accepted_tokens([5], []) == [5]
    assert accepted_tokens([5, 6, 7], [5, 6]) == [5, 6, 7]  # all accepted + the bonus token
    assert accepted_tokens([5, 9, 7], [5, 6]) == [5, 9]  # the correction replaces the first rejected draft
    assert accepted_tokens([4, 6, 7], [5, 6]) == [4]


def test_spec_decode_does_not_import_torch():
    code = ("import sys, pagedserve.spec_decode.ngram, pagedserve.spec_decode.acceptance, pagedserve.core.scheduler, "
            "pagedserve.spec_decode.draft; sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# ---- scheduler with drafts ---------------------------------------------------------------------
def make_scheduler(num_blocks=64, budget=32, max_model_len=64, k=3, disable_by_batch_size=8) -> Scheduler:
    kv = KVCacheManager(num_blocks, BS, enable_caching=True)
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=max_model_len)
    spec = SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=1, prompt_lookup_max=2,
                             disable_by_batch_size=disable_by_batch_size)
    return Scheduler(config, kv, proposer=NgramProposer(spec))


def request(rid: str, prompt: list[int], max_tokens: int = 20) -> Request:
    return Request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens), max_tokens=max_tokens)


def cycle_model(out: SchedulerOutput, period: list[int], sched: Scheduler) -> ModelRunnerOutput:
    """A model whose next token continues `period` (a cycle), verifying drafts as the runner does."""
    sampled = {}
    for rid, need in out.needs_sample.items():
        if not need:
            continue
        known = sched.requests[rid].all_token_ids
        drafts = out.spec_token_ids.get(rid, [])
        context = list(known)
        targets = []
        for i in range(len(drafts) + 1):
            targets.append(period[(period.index(context[-1]) + 1) % len(period)])
            if i < len(drafts):
                context.append(drafts[i])
        sampled[rid] = accepted_tokens(targets, drafts)
    return ModelRunnerOutput(sampled_token_ids=sampled)


def run(sched: Scheduler, period: list[int], max_steps=200, after_step=None):
    """Step until done; `after_step(out, runner_out)` may add to each step's runner output before the scheduler
    reads it."""
    outputs: dict[str, list[int]] = {}
    steps = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        steps.append(out)
        runner_out = cycle_model(out, period, sched)
        if after_step is not None:
            after_step(out, runner_out)
        for core in sched.update_from_output(out, runner_out):
            outputs.setdefault(core.request_id, []).extend(core.new_token_ids)
    return outputs, steps


def test_drafts_are_scheduled_as_extra_tokens_and_outputs_are_unchanged():
    period = [10, 11, 12, 13]
    sched = make_scheduler()
    sched.add_request(request("a", [10, 11, 12, 13, 10], max_tokens=15))
    outputs, steps = run(sched, period)
    assert outputs["a"] == [period[(1 + i) % 4] for i in range(15)]  # 11, 12, 13, 10, ...
    spec_steps = [s for s in steps if s.spec_token_ids]
    assert spec_steps
    for s in spec_steps:
        drafts = s.spec_token_ids["a"]
        assert 1 <= len(drafts) <= 3
        assert s.num_scheduled_tokens["a"] == 1 + len(drafts)
        assert s.scheduled_token_ids["a"][1:] == drafts
    assert len(steps) < 15  # several tokens per step
    assert not sched.kv.req_to_blocks and sched.kv.pool.num_free_blocks == sched.kv.pool.num_blocks - 1


def test_drafts_never_exceed_max_tokens_max_model_len_or_the_budget():
    period = [3, 4]
    for max_tokens, max_model_len, budget in ((6, 64, 32), (40, 14, 32), (40, 64, 3)):
        sched = make_scheduler(max_model_len=max_model_len, budget=budget)
        sched.add_request(request("a", [3, 4, 3, 4], max_tokens=max_tokens))
        outputs, steps = run(sched, period)
        assert len(outputs["a"]) == min(max_tokens, max_model_len - 4)
        for s in steps:
            assert s.total_num_scheduled_tokens <= budget


def test_drafts_stop_above_the_batch_size_limit():
    sched = make_scheduler(disable_by_batch_size=2)
    for i in range(3):
        sched.add_request(request(str(i), [3, 4, 3, 4], max_tokens=8))
    _, steps = run(sched, [3, 4])
    assert not any(s.spec_token_ids for s in steps)
    sched = make_scheduler(disable_by_batch_size=3)
    for i in range(3):
        sched.add_request(request(str(i), [3, 4, 3, 4], max_tokens=8))
    _, steps = run(sched, [3, 4])
    assert any(s.spec_token_ids for s in steps)


def test_drafts_never_preempt_and_fall_back_to_one_token_when_blocks_are_short():
    # 2 requests, 4 tokens per block: 8 usable blocks hold them at 16 tokens each, with no room for drafts
    # beyond; without drafts this run needs no preemption, so none may happen with them.
    sched = make_scheduler(num_blocks=9)
    sched.add_request(request("a", [3, 4, 3, 4], max_tokens=12))
    sched.add_request(request("b", [4, 3, 4, 3], max_tokens=12))
    outputs, _ = run(sched, [3, 4])
    assert sched.num_preemptions_total == 0
    assert len(outputs["a"]) == len(outputs["b"]) == 12


def test_prefix_cache_registers_only_blocks_of_known_tokens():
    sched = make_scheduler()
    sched.add_request(request("a", [10, 11, 12, 13, 10, 11, 12], max_tokens=10))
    out = sched.schedule()  # prefill
    sched.update_from_output(out, cycle_model(out, [10, 11, 12, 13], sched))
    out = sched.schedule()  # a verification: 1 known token + drafts
    assert out.spec_token_ids["a"]
    req = sched.requests["a"]
    cached_blocks = sched.kv.num_cached_blocks["a"]
    assert cached_blocks * BS <= req.num_tokens  # no block hashed over draft positions


def test_finished_requests_propose_what_followed_in_them_and_leave_the_cache_in_order():
    p = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=3,
                                        ngram_cache_requests=2))
    assert p.propose("b", [7, 1, 2], 3) == []  # nothing repeats inside "b" and nothing has finished
    p.drop("a", [1, 2, 3, 4, 5, 6])  # "a" finished
    assert p.propose("b", [7, 1, 2], 3) == [3, 4, 5]  # (1, 2) was followed by 3, 4, 5 in "a"
    assert p.propose("c", [9, 8, 4, 5], 3) == [6]  # only what "a" had
    own = [1, 2, 8, 8, 1, 2]
    assert p.propose("d", own, 3) == [8, 8, 1]  # the request's own occurrence comes first
    p.drop("e", [3, 1, 2, 9, 9])  # a later finished request wins for (1, 2)
    assert p.propose("f", [0, 1, 2], 2) == [9, 9]
    p.drop("g", [5, 5, 5])  # capacity 2: "a" leaves; its (4, 5) goes with it, "e"'s (1, 2) stays
    assert p.propose("h", [0, 4, 5], 3) == [] and p.propose("i", [0, 1, 2], 2) == [9, 9]
    assert p.propose("j", [1, 2, 3, 4], 3) == []  # (3, 4) and (2, 3, 4) were only in "a"
    p.reset()
    assert p.propose("k", [0, 1, 2], 2) == [] and not p.finished.sequences


def test_without_the_cache_finished_requests_are_forgotten():
    p = proposer(lo=2)
    p.drop("a", [1, 2, 3, 4])
    assert p.propose("b", [7, 1, 2], 3) == [] and not p.finished.sequences


@pytest.mark.parametrize("value", [-1, True, "3"])
def test_cache_size_must_be_a_count(value):
    with pytest.raises(ValueError, match="ngram_cache_requests must be an integer >= 0"):
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "ngram_cache_requests": value})


# ---- a draft model's drafts (runner-proposed) ---------------------------------------------------
def draft_scheduler(num_blocks=64, budget=32, max_model_len=64, k=3, disable_by_batch_size=8) -> Scheduler:
    from pagedserve.spec_decode.draft import DraftModelProposer

    kv = KVCacheManager(num_blocks, BS, enable_caching=True)
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=max_model_len)
    spec = SpeculativeConfig.parse({"model": "draft", "num_speculative_tokens": k,
                                    "disable_by_batch_size": disable_by_batch_size})
    return Scheduler(config, kv, proposer=DraftModelProposer(spec))


def draft_model_run(sched: Scheduler, period: list[int], guess, max_steps=200, check_room=True):
    """cycle_model's target; after each step the 'draft model' offers guess(tokens so far) for every sampled
    request, as the runner does. Checks that every step that samples a request leaves it room for the draft
    model's K/V of its next proposals (the lookahead), within max_model_len."""
    def offer(out: SchedulerOutput, runner_out: ModelRunnerOutput) -> None:
        for rid, tokens in runner_out.sampled_token_ids.items():
            length = out.lookahead.get(rid, 0)  # the runner's draft model proposes only for these, this many
            if not length:
                continue
            known = sched.requests[rid].all_token_ids + tokens
            runner_out.draft_token_ids[rid] = guess(known)[:length]
            room = min(len(known) - 1 + length, sched.config.max_model_len)
            assert not check_room or len(sched.kv.block_ids(rid)) * BS >= room, (rid, known)

    return run(sched, period, max_steps, offer)


def test_draft_model_drafts_are_scheduled_the_next_step_and_outputs_are_unchanged():
    period = [10, 11, 12, 13]

    def right(tokens):  # a draft model that knows the cycle
        return [period[(period.index(tokens[-1]) + 1 + i) % 4] for i in range(3)]

    def wrong(tokens):  # one that is always a token ahead
        return [period[(period.index(tokens[-1]) + 2 + i) % 4] for i in range(3)]

    expected = [period[(1 + i) % 4] for i in range(15)]
    for guess, accepted in ((right, True), (wrong, False)):
        sched = draft_scheduler()
        sched.add_request(request("a", [10, 11, 12, 13, 10], max_tokens=15))
        outputs, steps = draft_model_run(sched, period, guess)
        assert outputs["a"] == expected
        spec_steps = [s for s in steps if s.spec_token_ids]
        assert spec_steps and all(s.scheduled_token_ids["a"][1:] == s.spec_token_ids["a"] for s in spec_steps)
        assert (sched.proposer.totals.num_accepted_tokens > 0) == accepted
        assert (len(steps) < 10) == accepted  # up to 4 tokens a step when the drafts are right
        assert not sched.kv.req_to_blocks and sched.kv.pool.num_free_blocks == sched.kv.pool.num_blocks - 1
        assert not sched.proposer._drafts


def test_a_draft_model_whose_drafts_keep_failing_stops_running_for_that_request():
    """The backoff every proposer shares: after each verification that accepted nothing the request gets no
    lookahead (so the runner's draft model does not run for it) for 1, 4, 16 ... steps (a draft model's tries
    cost compute, so it backs off faster than n-gram lookup); a right draft model keeps it on every step.
    Outputs are the target's either way."""
    period = [10, 11, 12, 13]

    def right(tokens):
        return [period[(period.index(tokens[-1]) + 1 + i) % 4] for i in range(3)]

    def wrong(tokens):
        return [period[(period.index(tokens[-1]) + 2 + i) % 4] for i in range(3)]

    expected = [period[(1 + i) % 4] for i in range(80)]
    named, lengths, tries = {}, {}, {}
    for name, guess in (("right", right), ("wrong", wrong)):
        sched = draft_scheduler(max_model_len=256)
        sched.add_request(request("a", [10, 11, 12, 13, 10], max_tokens=80))
        outputs, steps = draft_model_run(sched, period, guess, max_steps=400)
        assert outputs["a"] == expected
        decode_steps = steps[1:]
        named[name] = sum("a" in s.lookahead for s in decode_steps) / len(decode_steps)
        lengths[name] = [s.lookahead["a"] for s in decode_steps if "a" in s.lookahead]
        tries[name] = [i for i, s in enumerate(decode_steps) if "a" in s.spec_token_ids]
    assert named["right"] == 1.0
    assert named["wrong"] < 0.1
    # Between verifications: the missed one, 1, 4 then 16 steps out, the step after which the draft model proposes.
    assert [b - a for a, b in zip(tries["wrong"], tries["wrong"][1:])] == [3, 6, 18]
    # ... and each try after a miss asks the draft model for 1 token, not k: one draft step per try
    assert lengths["right"] == [3] * len(lengths["right"]) and lengths["wrong"][1:] == [1] * (len(lengths["wrong"]) - 1)


def test_draft_model_drafts_for_other_tokens_are_dropped():
    """Drafts offered for a token count the request no longer has (stale) are never scheduled."""
    from pagedserve.spec_decode.draft import DraftModelProposer

    proposer = DraftModelProposer(SpeculativeConfig.parse({"model": "d", "num_speculative_tokens": 3}))
    proposer.offer("a", 5, [1, 2, 3])
    assert proposer.propose("a", [0] * 6, 3) == []  # proposed after 5 tokens, asked after 6
    proposer.offer("a", 6, [1, 2, 3])
    assert proposer.propose("a", [0] * 6, 2) == [1, 2]  # trimmed to the room the scheduler has
    assert proposer.propose("a", [0] * 6, 2) == []  # used once


def test_drafts_offered_in_the_step_of_a_miss_are_dropped():
    """The runner proposes after a verification before the scheduler has counted its result: where it accepted
    nothing, the request sits the next step out, so those drafts must not be verified then."""
    from pagedserve.spec_decode.draft import DraftModelProposer

    proposer = DraftModelProposer(SpeculativeConfig.parse({"model": "d", "num_speculative_tokens": 3}))
    proposer.record("a", 3, 0)  # a miss: wait 1 step
    proposer.offer("a", 6, [1])
    assert proposer.backing_off("a") and proposer.propose("a", [0] * 6, 3) == []
    assert proposer.waits("a") and not proposer.backing_off("a")  # the step sat out
    proposer.offer("a", 7, [1])
    assert proposer.propose("a", [0] * 7, 3) == [1]


def test_draft_model_lookahead_stays_within_max_model_len_and_never_preempts():
    period = [3, 4]

    def right(tokens):
        return [period[(period.index(tokens[-1]) + 1 + i) % 2] for i in range(3)]

    sched = draft_scheduler(max_model_len=14)
    sched.add_request(request("a", [3, 4, 3, 4], max_tokens=40))
    outputs, _ = draft_model_run(sched, period, right)
    assert len(outputs["a"]) == 10
    sched = draft_scheduler(num_blocks=9)  # as test_drafts_never_preempt...: no room for drafts or lookahead
    sched.add_request(request("a", [3, 4, 3, 4], max_tokens=12))
    sched.add_request(request("b", [4, 3, 4, 3], max_tokens=12))
    outputs, _ = draft_model_run(sched, period, right, check_room=False)
    assert sched.num_preemptions_total == 0
    assert len(outputs["a"]) == len(outputs["b"]) == 12


def test_the_scheduler_names_who_gets_lookahead_and_none_above_the_batch_size_limit():
    """The runner's draft model proposes only for the requests given lookahead: the scheduler's one decision."""
    period = [3, 4]

    def right(tokens):
        return [period[(period.index(tokens[-1]) + 1 + i) % 2] for i in range(3)]

    for limit, expect in ((8, True), (1, False)):
        sched = draft_scheduler(disable_by_batch_size=limit)
        for rid in "ab":
            sched.add_request(request(rid, [3, 4, 3, 4], max_tokens=10))
        _, steps = draft_model_run(sched, period, right, check_room=expect)
        named = set().union(*(s.lookahead for s in steps))
        # Above the limit nobody gets lookahead, not even the first admission of a step that admits both.
        assert named == ({"a", "b"} if expect else set())
        assert any(s.spec_token_ids for s in steps) == expect
        assert all(s.lookahead.keys() <= {r for r, need in s.needs_sample.items() if need} for s in steps)
