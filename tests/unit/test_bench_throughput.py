"""`bench throughput` logic with a fake engine: counted tokens, fresh prompts, warm-up apart, flags."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import pytest

from pagedserve.benchmarks.report import format_throughput_table, throughput_to_dict
from pagedserve.benchmarks.throughput import (
    ThroughputBenchConfig,
    count_outputs,
    random_token_prompts,
    run_throughput_bench,
    token_pool,
)


@dataclass
class Sample:
    token_ids: list[int]


@dataclass
class Output:
    prompt_token_ids: list[int]
    outputs: list[Sample]
    num_cached_tokens: int = 0


@dataclass
class FakeLLM:
    """Generates max_tokens tokens, except `short_by` fewer for the first prompt of every call."""

    short_by: int = 0
    cached_tokens: int = 0
    calls: list[list[list[int]]] = field(default_factory=list)

    def generate(self, prompts: list[dict[str, Any]], sampling_params: list[Any]) -> list[Output]:
        self.calls.append([p["prompt_token_ids"] for p in prompts])
        outputs = []
        for index, (prompt, params) in enumerate(zip(prompts, sampling_params)):
            assert params.ignore_eos and params.temperature == 0.0
            num = params.max_tokens - (self.short_by if index == 0 else 0)
            outputs.append(Output(prompt["prompt_token_ids"], [Sample(list(range(num)))], self.cached_tokens))
        return outputs


def test_token_pool_leaves_out_special_ids() -> None:
    assert token_pool(6, [0, 5]) == [1, 2, 3, 4]
    with pytest.raises(ValueError):
        token_pool(2, [0, 1])


def test_random_prompts_have_exact_lengths_from_the_pool() -> None:
    prompts = random_token_prompts(random.Random(0), [7, 8, 9], [3, 1, 5])
    assert [len(p) for p in prompts] == [3, 1, 5]
    assert {t for p in prompts for t in p} <= {7, 8, 9}


def test_runs_count_tokens_from_outputs_with_fresh_prompts_and_warmup_apart() -> None:
    llm = FakeLLM()
    config = ThroughputBenchConfig(num_prompts=4, input_len=6, output_len=3, num_iters=3, num_warmup_prompts=2)
    result = run_throughput_bench(llm, list(range(100, 200)), config, model="fake")
    assert len(llm.calls) == 1 + 3
    assert len(llm.calls[0]) == 2  # the warm-up batch
    batches = [tuple(map(tuple, call)) for call in llm.calls]
    assert len(set(batches)) == 4  # every run on new prompts: no prefix-cache reuse between runs
    assert result.warmup is not None and result.warmup.is_warmup and result.warmup.num_output_tokens == 6
    assert len(result.runs) == 3
    for run in result.runs:
        assert not run.is_warmup
        assert (run.num_requests, run.num_prompt_tokens, run.num_output_tokens) == (4, 24, 12)
        assert run.output_throughput == pytest.approx(12 / run.elapsed_s)
        assert run.total_token_throughput == pytest.approx(36 / run.elapsed_s)
        assert run.request_throughput == pytest.approx(4 / run.elapsed_s)
    rates = sorted(run.output_throughput for run in result.runs)
    stats = result.output_throughput
    assert (stats.min, stats.median, stats.max, stats.count) == (rates[0], rates[1], rates[2], 3)
    assert result.warnings == []


def test_early_stops_and_cache_hits_are_flagged_and_rates_use_real_counts() -> None:
    llm = FakeLLM(short_by=2, cached_tokens=16)
    config = ThroughputBenchConfig(num_prompts=3, input_len=4, output_len=5, num_iters=1, num_warmup_prompts=0)
    result = run_throughput_bench(llm, list(range(10, 50)), config)
    assert result.warmup is None
    run = result.runs[0]
    assert run.num_output_tokens == 13 and run.num_requested_output_tokens == 15
    assert run.num_early_stops == 1 and run.num_cached_prompt_tokens == 48
    assert run.output_throughput == pytest.approx(13 / run.elapsed_s)
    warnings = " ".join(result.warnings)
    assert "1 sample(s) stopped before max_tokens" in warnings and "48 prompt token(s)" in warnings
    table = format_throughput_table(result)
    assert "WARNING" in table and "Warm-up run" not in table
    payload = throughput_to_dict(result)
    assert payload["runs"][0]["num_output_tokens"] == 13 and payload["warmup"] is None


def test_count_outputs_rejects_a_missing_output() -> None:
    with pytest.raises(ValueError):
        count_outputs([Output([1], [Sample([2])])], [1, 1], ignore_eos=True)


def test_config_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match="num_iters"):
        ThroughputBenchConfig(num_iters=0).validate()
    with pytest.raises(ValueError, match="range_ratio"):
        ThroughputBenchConfig(range_ratio=1.0).validate()
