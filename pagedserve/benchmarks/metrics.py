"""Per-request records and the summary of a serving benchmark. Pure Python (no torch, no numpy).

Definitions (all times in seconds, from `time.perf_counter()` on the client):
  TTFT  = first token chunk arrival - send time.
  E2E   = end time (stream closed) - send time.
  TPOT  = (E2E - TTFT) / (output_tokens - 1): time per output token *after* the first one, per
          request; undefined (skipped) for requests with fewer than 2 output tokens.
  ITL   = gaps between successive token chunks of one request. A chunk may carry more than one
          token (speculative decoding, detokenizer hold-back), so ITL is per chunk, not per token.
Token counts come from the server's usage (`completion_tokens`); a request without usage falls back
to its token-chunk count and is flagged, a request whose usage disagrees with the chunk count is
flagged (against a server that accepted speculative drafts, only a usage below the chunk count: a chunk then
carries its verified drafts too), and neither is ever hidden. Throughputs count successful steady-state requests only.

Percentiles use linear interpolation between closest ranks, exactly like `numpy.percentile`'s
default ("linear"): rank = p/100 * (n - 1), interpolating between the two neighbouring sorted values.
The standard deviation is the population one (ddof=0), like `numpy.std`'s default.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

# Percentiles reported for every latency metric, besides mean, median and std.
REPORTED_PERCENTILES = (90.0, 99.0)


@dataclass
class RequestRecord:
    """What one request did, as observed by the client."""

    request_id: int
    is_warmup: bool = False
    success: bool = False
    error: str = ""
    # Requested lengths.
    planned_prompt_tokens: int = 0  # content tokens the client built (0 if unknown)
    max_tokens: int = 0
    ignore_eos: bool = False
    # Counted by the server (usage of the final chunk); None when the server sent no usage.
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    # Observed in the stream.
    num_token_chunks: int = 0  # choices with a text field (see client._consume_event), empty text included
    num_empty_chunks: int = 0  # of those, chunks whose text was '' (bytes held back by the detokenizer)
    generated_text: str = ""
    finish_reason: str | None = None
    send_time: float = 0.0
    first_token_time: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    end_time: float = 0.0
    usage_missing: bool = False
    usage_mismatch: bool = False

    @property
    def counted_output_tokens(self) -> int:
        """Output tokens from usage, else (flagged by `usage_missing`) the token-chunk count."""
        return self.output_tokens if self.output_tokens is not None else self.num_token_chunks

    @property
    def counted_prompt_tokens(self) -> int:
        """Prompt tokens from usage, else the number the client planned."""
        return self.prompt_tokens if self.prompt_tokens is not None else self.planned_prompt_tokens

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.send_time

    @property
    def e2e_latency(self) -> float:
        return self.end_time - self.send_time

    @property
    def tpot(self) -> float | None:
        """Time per output token excluding the first; None when fewer than 2 tokens."""
        ttft = self.ttft
        if ttft is None or self.counted_output_tokens < 2:
            return None
        return (self.e2e_latency - ttft) / (self.counted_output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [later - earlier for earlier, later in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def is_early_stop(self) -> bool:
        """Fewer tokens than max_tokens although ignore_eos asked for exactly max_tokens."""
        return self.success and self.ignore_eos and self.counted_output_tokens < self.max_tokens


@dataclass
class Stats:
    """Distribution of one metric, in seconds. Values are None when there are no samples."""

    count: int
    mean: float | None
    std: float | None
    median: float | None
    p90: float | None
    p99: float | None
    min: float | None
    max: float | None


@dataclass
class ColdSummary:
    """The first (warm-up) requests next to steady state, so a cold start is never read as speed."""

    num_warmup: int
    num_warmup_failed: int
    first_request_is_warmup: bool  # False: no warm-up ran; "first" is the first steady request
    first_request_e2e: float | None
    first_request_ttft: float | None
    warmup_e2e_latencies: list[float]
    steady_median_e2e: float | None
    steady_median_ttft: float | None
    e2e_cold_steady_ratio: float | None
    ttft_cold_steady_ratio: float | None


@dataclass
class BenchSummary:
    """Steady-state figures of a serving benchmark plus the cold start and the honesty flags."""

    num_completed: int
    num_failed: int
    duration: float
    total_input_tokens: int
    total_planned_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft: Stats
    tpot: Stats
    itl: Stats
    e2e_latency: Stats
    cold: ColdSummary
    # Honesty flags (steady and warm-up requests together: a flaw is a flaw).
    num_usage_missing: int
    num_usage_mismatch: int
    num_early_stop: int
    errors: dict[str, int]

    @property
    def warnings(self) -> list[str]:
        """Human sentences for every flag that is raised; empty when all is well."""
        notes = []
        if self.num_usage_missing:
            notes.append(
                f"{self.num_usage_missing} request(s) (warm-up included) had no usage in the stream: their "
                "output tokens are token-chunk counts, which may differ from the real token count"
            )
        if self.num_usage_mismatch:
            notes.append(
                f"{self.num_usage_mismatch} request(s) (warm-up included) reported usage.completion_tokens different "
                "from the number of streamed token chunks"
            )
        if self.num_early_stop:
            notes.append(
                f"{self.num_early_stop} request(s) (warm-up included) stopped before max_tokens although ignore_eos "
                "was requested: the server may not honour ignore_eos"
            )
        if self.num_failed:
            notes.append(f"{self.num_failed} steady request(s) failed; they are excluded from throughput")
        if self.cold.num_warmup_failed:
            notes.append(f"{self.cold.num_warmup_failed} warm-up request(s) failed")
        for error, count in sorted(self.errors.items(), key=lambda item: -item[1])[:3]:  # what the server said
            notes.append(f"{count} request(s) failed with: {error[:300]}")
        return notes


def percentile(values: list[float], pct: float) -> float:
    """`numpy.percentile(values, pct)` with the default linear interpolation."""
    if not values:
        raise ValueError("percentile of an empty list")
    if not 0.0 <= pct <= 100.0:
        raise ValueError(f"percentile must be within [0, 100], got {pct}")
    ordered = sorted(values)
    rank = pct / 100.0 * (len(ordered) - 1)
    low = math.floor(rank)
    high = math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def compute_stats(values: list[float]) -> Stats:
    """Mean, population std, median, p90, p99, min and max of `values`."""
    if not values:
        return Stats(count=0, mean=None, std=None, median=None, p90=None, p99=None, min=None, max=None)
    mean = sum(values) / len(values)
    variance = sum((value - mean) ** 2 for value in values) / len(values)
    p90, p99 = (percentile(values, pct) for pct in REPORTED_PERCENTILES)
    return Stats(
        count=len(values),
        mean=mean,
        std=math.sqrt(variance),
        median=percentile(values, 50.0),
        p90=p90,
        p99=p99,
        min=min(values),
        max=max(values),
    )


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def summarize_cold(records: list[RequestRecord], steady: Stats, steady_ttft: Stats) -> ColdSummary:
    """The first request (a warm-up one if any ran) against the steady medians."""
    warmup = sorted((r for r in records if r.is_warmup), key=lambda r: r.send_time)
    pool = warmup or sorted((r for r in records if not r.is_warmup), key=lambda r: r.send_time)
    first = next((r for r in pool if r.success), None)
    first_e2e = first.e2e_latency if first else None
    first_ttft = first.ttft if first else None
    return ColdSummary(
        num_warmup=len(warmup),
        num_warmup_failed=sum(1 for r in warmup if not r.success),
        first_request_is_warmup=bool(warmup),
        first_request_e2e=first_e2e,
        first_request_ttft=first_ttft,
        warmup_e2e_latencies=[r.e2e_latency for r in warmup if r.success],
        steady_median_e2e=steady.median,
        steady_median_ttft=steady_ttft.median,
        e2e_cold_steady_ratio=_ratio(first_e2e, steady.median),
        ttft_cold_steady_ratio=_ratio(first_ttft, steady_ttft.median),
    )


def summarize(records: list[RequestRecord], duration: float) -> BenchSummary:
    """Summarize a run. `duration` is the wall time of the steady phase (warm-up excluded)."""
    if duration <= 0:
        raise ValueError(f"duration must be positive, got {duration}")
    steady = [r for r in records if not r.is_warmup]
    done = [r for r in steady if r.success]
    total_output = sum(r.counted_output_tokens for r in done)
    total_input = sum(r.counted_prompt_tokens for r in done)
    ttfts = [r.ttft for r in done if r.ttft is not None]
    tpots = [r.tpot for r in done if r.tpot is not None]
    itls = [gap for r in done for gap in r.itls]
    e2e = compute_stats([r.e2e_latency for r in done])
    ttft = compute_stats(ttfts)
    return BenchSummary(
        num_completed=len(done),
        num_failed=len(steady) - len(done),
        duration=duration,
        total_input_tokens=total_input,
        total_planned_input_tokens=sum(r.planned_prompt_tokens for r in done),
        total_output_tokens=total_output,
        request_throughput=len(done) / duration,
        output_throughput=total_output / duration,
        total_token_throughput=(total_input + total_output) / duration,
        ttft=ttft,
        tpot=compute_stats(tpots),
        itl=compute_stats(itls),
        e2e_latency=e2e,
        cold=summarize_cold(records, e2e, ttft),
        num_usage_missing=sum(1 for r in records if r.success and r.usage_missing),
        num_usage_mismatch=sum(1 for r in records if r.success and r.usage_mismatch),
        num_early_stop=sum(1 for r in records if r.is_early_stop),
        errors=dict(Counter(r.error for r in records if not r.success)),
    )
