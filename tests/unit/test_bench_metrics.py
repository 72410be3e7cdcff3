"""Metric math of `bench serve` on synthetic timings with hand-computed expectations."""

from __future__ import annotations

import math
import random
import re

import numpy as np
import pytest

from pagedserve.benchmarks.metrics import RequestRecord, compute_stats, percentile, summarize


def make_record(
    request_id: int = 0,
    send: float = 0.0,
    chunks: tuple[float, ...] = (0.5, 1.0),
    end: float | None = None,
    output_tokens: int | None = None,
    prompt_tokens: int | None = 5,
    is_warmup: bool = False,
    success: bool = True,
    max_tokens: int = 0,
    ignore_eos: bool = False,
) -> RequestRecord:
    """A finished request whose content chunks arrived at `chunks`; usage defaults to one token per chunk."""
    record = RequestRecord(
        request_id=request_id, is_warmup=is_warmup, success=success, max_tokens=max_tokens, ignore_eos=ignore_eos
    )
    record.send_time = send
    record.chunk_times = list(chunks)
    record.first_token_time = chunks[0] if chunks else None
    record.num_token_chunks = len(chunks)
    record.end_time = end if end is not None else (chunks[-1] if chunks else send)
    record.output_tokens = len(chunks) if output_tokens is None else output_tokens
    record.prompt_tokens = prompt_tokens
    record.planned_prompt_tokens = 5
    if not success:
        record.error = "HTTP 500: boom"
    return record


def test_percentile_interpolates_linearly_like_numpy() -> None:
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(values, 90) == pytest.approx(3.7)  # rank 2.7: 3 + 0.7 * (4 - 3)
    assert percentile(values, 99) == pytest.approx(3.97)
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile([7.0], 99) == 7.0
    rng = random.Random(3)
    sample = [rng.expovariate(1.0) for _ in range(37)]
    for pct in (1, 25, 50, 90, 99):
        assert percentile(sample, pct) == pytest.approx(float(np.percentile(sample, pct)))
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile(values, 101)


def test_stats_mean_std_are_population_figures() -> None:
    stats = compute_stats([2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0])
    assert stats.count == 8
    assert stats.mean == pytest.approx(5.0)
    assert stats.std == pytest.approx(2.0)  # the textbook population-std example
    assert stats.median == pytest.approx(4.5)
    assert (stats.min, stats.max) == (2.0, 9.0)
    empty = compute_stats([])
    assert empty.count == 0 and empty.mean is None and empty.p99 is None


def test_tpot_excludes_first_token_and_itl_is_per_chunk() -> None:
    record = make_record(send=10.0, chunks=(10.5, 10.7, 11.2, 12.5), end=12.5, output_tokens=5)
    assert record.ttft == pytest.approx(0.5)
    assert record.e2e_latency == pytest.approx(2.5)
    assert record.tpot == pytest.approx((2.5 - 0.5) / 4)  # 5 tokens: the 4 after the first
    assert record.itls == pytest.approx([0.2, 0.5, 1.3])
    one_token = make_record(chunks=(0.3,), end=0.4, output_tokens=1)
    assert one_token.tpot is None and one_token.itls == []


def test_summary_counts_only_successful_steady_requests() -> None:
    records = [
        make_record(0, send=0.0, chunks=(0.1, 0.2), end=0.3, output_tokens=10, prompt_tokens=5),
        make_record(1, send=0.0, chunks=(0.2, 0.4), end=0.6, output_tokens=20, prompt_tokens=5),
        make_record(2, send=0.0, chunks=(0.3, 0.6), end=0.9, output_tokens=30, prompt_tokens=5),
        make_record(3, send=0.0, chunks=(), end=0.1, output_tokens=999, success=False),
    ]
    summary = summarize(records, duration=2.0)
    assert (summary.num_completed, summary.num_failed) == (3, 1)
    assert summary.total_output_tokens == 60  # the failed request's 999 do not count
    assert summary.request_throughput == pytest.approx(1.5)
    assert summary.output_throughput == pytest.approx(30.0)
    assert summary.total_token_throughput == pytest.approx((15 + 60) / 2.0)
    assert summary.ttft.mean == pytest.approx(0.2)
    assert summary.e2e_latency.median == pytest.approx(0.6)
    # TPOT per request: (0.3-0.1)/9, (0.6-0.2)/19, (0.9-0.3)/29.
    assert summary.tpot.mean == pytest.approx((0.2 / 9 + 0.4 / 19 + 0.6 / 29) / 3)
    assert summary.itl.count == 3 and summary.itl.median == pytest.approx(0.2)
    assert summary.errors == {"HTTP 500: boom": 1}
    assert any("failed" in note for note in summary.warnings)
    assert "1 request(s) failed with: HTTP 500: boom" in summary.warnings  # what the server said, in the table


def test_warmup_is_excluded_from_steady_figures_and_reported_cold() -> None:
    steady = [make_record(i, send=300.0 + i, chunks=(300.5 + i, 302.0 + i), end=304.0 + i + 0.1 * i) for i in range(5)]
    warmup = make_record(99, send=0.0, chunks=(250.0, 262.0), end=262.1, is_warmup=True)
    summary = summarize([warmup, *steady], duration=10.0)
    assert summary.num_completed == 5
    assert summary.e2e_latency.max == pytest.approx(4.4)  # 262.1 s is not in the steady spread
    assert summary.total_output_tokens == 10
    cold = summary.cold
    assert cold.num_warmup == 1 and cold.first_request_is_warmup
    assert cold.first_request_e2e == pytest.approx(262.1)
    assert cold.first_request_ttft == pytest.approx(250.0)
    assert cold.steady_median_e2e == pytest.approx(4.2)
    assert cold.e2e_cold_steady_ratio == pytest.approx(262.1 / 4.2)


def test_without_warmup_first_steady_request_is_named_not_cold() -> None:
    records = [make_record(i, send=float(i), chunks=(i + 0.5, i + 1.0)) for i in range(3)]
    cold = summarize(records, duration=3.0).cold
    assert not cold.first_request_is_warmup and cold.num_warmup == 0
    assert cold.first_request_e2e == pytest.approx(1.0)


def test_flags_missing_usage_mismatch_and_early_stop() -> None:
    no_usage = make_record(0, chunks=(0.1, 0.2, 0.3))
    no_usage.output_tokens, no_usage.usage_missing = None, True
    mismatch = make_record(1, chunks=(0.1, 0.2), output_tokens=4)
    mismatch.usage_mismatch = True
    early = make_record(2, chunks=(0.1, 0.2), max_tokens=8, ignore_eos=True)
    eos_allowed = make_record(3, chunks=(0.1, 0.2), max_tokens=8, ignore_eos=False)
    summary = summarize([no_usage, mismatch, early, eos_allowed], duration=1.0)
    assert summary.num_usage_missing == 1
    assert summary.num_usage_mismatch == 1
    assert summary.num_early_stop == 1
    assert summary.total_output_tokens == 3 + 4 + 2 + 2  # missing usage falls back to chunks, and says so
    assert len(summary.warnings) == 3


def test_summarize_rejects_non_positive_duration_and_handles_all_failed() -> None:
    with pytest.raises(ValueError):
        summarize([], duration=0.0)
    summary = summarize([make_record(success=False)], duration=1.0)
    assert summary.num_completed == 0 and summary.output_throughput == 0.0
    assert summary.ttft.mean is None and summary.cold.first_request_e2e is None
    assert not math.isnan(summary.request_throughput)


def test_table_states_cold_and_steady_side_by_side() -> None:
    from pagedserve.benchmarks.report import format_table, result_to_dict
    from pagedserve.benchmarks.serve import ServeBenchConfig, ServeBenchResult

    steady = [make_record(i, send=300.0, chunks=(300.5, 303.0), end=304.3) for i in range(3)]
    warmup = make_record(9, send=0.0, chunks=(250.0, 262.0), end=262.1, is_warmup=True)
    result = ServeBenchResult(
        config=ServeBenchConfig(base_url="http://127.0.0.1:1"),
        model="m",
        started_at="now",
        clock_origin=0.0,
        prompt_source="test",
        records=[warmup, *steady],
        summary=summarize([warmup, *steady], duration=5.0),
    )
    table = format_table(result)
    assert "First request latency 262.1 s (cold) vs median 4.3 s steady" in table
    assert "Output token throughput (tok/s):" in table and "P99 TPOT (ms):" in table
    payload = result_to_dict(result)
    assert len(payload["warmup_records"]) == 1 and len(payload["records"]) == 3
    assert payload["config"]["request_rate"] == "inf"
    assert payload["records"][0]["chunk_times"] == [300.5, 303.0]


def test_a_bad_jsonl_line_is_named_by_file_and_line(tmp_path) -> None:
    from pagedserve.benchmarks.datasets import read_jsonl_prompts

    data = tmp_path / "prompts.jsonl"
    for text, words in (('{"prompt": "a"}\n\n{"prompt": "b",}\n', ":3: not JSON"),
                        ('{"prompt": "a", "max_tokens": "9"}\n', ":1: max_tokens/output_len must be an integer")):
        data.write_text(text)
        with pytest.raises(ValueError, match=re.escape(f"{data}{words}")):
            read_jsonl_prompts(data, 2, 16)
