"""`bench throughput`: offline `LLM.generate` on random token prompts, like `vllm bench throughput`.

Rates come from tokens counted in the outputs (len(prompt_token_ids), len(token_ids) of every sample),
never from the requested lengths. A warm-up run on its own prompts goes first and is reported apart;
then `num_iters` timed runs, each on fresh random prompts so that prefix caching never turns a run
into a cache hit (cached prompt tokens are counted and shown anyway), reported as min/median/max.
Pure Python: the engine is passed in (anything with `generate(prompts, sampling_params)`).
"""

from __future__ import annotations

import datetime
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from pagedserve.benchmarks.datasets import sample_lengths
from pagedserve.benchmarks.metrics import Stats, compute_stats
from pagedserve.sampling_params import SamplingParams


class Generator(Protocol):
    def generate(self, prompts: Any, sampling_params: Any = None) -> list[Any]: ...


@dataclass(frozen=True)
class ThroughputBenchConfig:
    """Everything `bench throughput` needs besides the engine; the CLI builds it from flags."""

    num_prompts: int = 32
    input_len: int = 128
    output_len: int = 64
    range_ratio: float = 0.0
    num_iters: int = 3
    num_warmup_prompts: int | None = None  # None: as many as num_prompts; 0: no warm-up run
    seed: int = 0
    temperature: float = 0.0
    ignore_eos: bool = True

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        for name in ("num_prompts", "input_len", "output_len", "num_iters"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.num_warmup_prompts is not None and self.num_warmup_prompts < 0:
            raise ValueError(f"num_warmup_prompts must be >= 0, got {self.num_warmup_prompts}")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"range_ratio must be within [0, 1), got {self.range_ratio}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")


@dataclass
class GenerateRun:
    """One timed `generate` call over a batch of prompts, with the tokens counted in its outputs."""

    is_warmup: bool
    elapsed_s: float
    num_requests: int
    num_prompt_tokens: int
    num_output_tokens: int
    num_requested_output_tokens: int
    num_cached_prompt_tokens: int = 0
    num_early_stops: int = 0  # samples with fewer tokens than max_tokens although ignore_eos was set

    @property
    def request_throughput(self) -> float:
        return self.num_requests / self.elapsed_s

    @property
    def output_throughput(self) -> float:
        return self.num_output_tokens / self.elapsed_s

    @property
    def total_token_throughput(self) -> float:
        return (self.num_prompt_tokens + self.num_output_tokens) / self.elapsed_s


@dataclass
class ThroughputResult:
    config: ThroughputBenchConfig
    model: str
    started_at: str  # wall clock, ISO 8601
    load_seconds: float | None = None  # building the engine (weights, KV cache, its own warm-up)
    warmup: GenerateRun | None = None
    runs: list[GenerateRun] = field(default_factory=list)
    # Speculative decoding during the timed runs (engines with --speculative-config): drafts proposed, accepted.
    spec_draft_tokens: int | None = None
    spec_accepted_tokens: int | None = None

    @property
    def spec_acceptance_rate(self) -> float | None:
        if not self.spec_draft_tokens:
            return None
        return self.spec_accepted_tokens / self.spec_draft_tokens

    @property
    def request_throughput(self) -> Stats:
        return compute_stats([run.request_throughput for run in self.runs])

    @property
    def output_throughput(self) -> Stats:
        return compute_stats([run.output_throughput for run in self.runs])

    @property
    def total_token_throughput(self) -> Stats:
        return compute_stats([run.total_token_throughput for run in self.runs])

    @property
    def warnings(self) -> list[str]:
        """A sentence for every honesty flag raised (timed runs and warm-up together)."""
        runs = self.runs + ([self.warmup] if self.warmup else [])
        notes = []
        early = sum(run.num_early_stops for run in runs)
        if early:
            notes.append(f"{early} sample(s) stopped before max_tokens although ignore_eos was set; "
                         "rates use the tokens really generated")
        cached = sum(run.num_cached_prompt_tokens for run in self.runs)
        if cached:
            notes.append(f"{cached} prompt token(s) of the timed runs were served from the prefix cache")
        return notes


def token_pool(vocab_size: int, special_ids: Sequence[int]) -> list[int]:
    """Ordinary token ids to draw prompts from: [0, vocab_size) without the special ones."""
    excluded = set(special_ids)
    pool = [token_id for token_id in range(vocab_size) if token_id not in excluded]
    if not pool:
        raise ValueError(f"no ordinary token ids below {vocab_size}")
    return pool


def random_token_prompts(rng: random.Random, pool: Sequence[int], input_lens: Sequence[int]) -> list[list[int]]:
    """One prompt of exactly `input_lens[i]` ids per entry, drawn uniformly from `pool`."""
    return [rng.choices(pool, k=length) for length in input_lens]


def count_outputs(outputs: Sequence[Any], max_tokens: Sequence[int], ignore_eos: bool) -> dict[str, int]:
    """Prompt, output and cached-prompt tokens, and early stops, counted from RequestOutputs."""
    counts = {"num_prompt_tokens": 0, "num_output_tokens": 0, "num_cached_prompt_tokens": 0, "num_early_stops": 0}
    for output, wanted in zip(outputs, max_tokens, strict=True):
        counts["num_prompt_tokens"] += len(output.prompt_token_ids)
        counts["num_cached_prompt_tokens"] += getattr(output, "num_cached_tokens", 0) or 0
        for sample in output.outputs:
            counts["num_output_tokens"] += len(sample.token_ids)
            if ignore_eos and len(sample.token_ids) < wanted:
                counts["num_early_stops"] += 1
    return counts


def time_generate(llm: Generator, prompts: list[list[int]], output_lens: list[int], config: ThroughputBenchConfig,
                  is_warmup: bool = False) -> GenerateRun:
    """Time one `generate` call over all prompts (one continuous batch) and count its tokens."""
    params = [SamplingParams(temperature=config.temperature, max_tokens=length, ignore_eos=config.ignore_eos,
                             seed=config.seed + index) for index, length in enumerate(output_lens)]
    batch = [{"prompt_token_ids": prompt} for prompt in prompts]
    start = time.perf_counter()
    outputs = llm.generate(batch, params)
    elapsed = time.perf_counter() - start
    if len(outputs) != len(prompts):
        raise RuntimeError(f"generate returned {len(outputs)} outputs for {len(prompts)} prompts")
    counts = count_outputs(outputs, output_lens, config.ignore_eos)
    return GenerateRun(is_warmup=is_warmup, elapsed_s=elapsed, num_requests=len(prompts),
                       num_requested_output_tokens=sum(output_lens), **counts)


def _draw(rng: random.Random, pool: Sequence[int], num: int, config: ThroughputBenchConfig
          ) -> tuple[list[list[int]], list[int]]:
    input_lens = sample_lengths(rng, num, config.input_len, config.range_ratio)
    output_lens = sample_lengths(rng, num, config.output_len, config.range_ratio)
    return random_token_prompts(rng, pool, input_lens), output_lens


def run_throughput_bench(llm: Generator, pool: Sequence[int], config: ThroughputBenchConfig, model: str = "",
                         load_seconds: float | None = None) -> ThroughputResult:
    """Warm-up run (reported apart), then `num_iters` timed runs on fresh prompts."""
    config.validate()
    rng = random.Random(config.seed)
    result = ThroughputResult(config=config, model=model, load_seconds=load_seconds,
                              started_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    num_warmup = config.num_prompts if config.num_warmup_prompts is None else config.num_warmup_prompts
    if num_warmup:
        prompts, output_lens = _draw(rng, pool, num_warmup, config)
        result.warmup = time_generate(llm, prompts, output_lens, config, is_warmup=True)
    before = spec_decode_totals(llm)
    for _ in range(config.num_iters):
        prompts, output_lens = _draw(rng, pool, config.num_prompts, config)
        result.runs.append(time_generate(llm, prompts, output_lens, config))
    after = spec_decode_totals(llm)
    if before is not None and after is not None:
        result.spec_draft_tokens, result.spec_accepted_tokens = after[0] - before[0], after[1] - before[1]
    return result


def spec_decode_totals(llm: Generator) -> tuple[int, int] | None:
    """(draft tokens, accepted drafts) so far, for an engine that speculates; None otherwise."""
    engine = getattr(llm, "engine", None)
    proposer = getattr(getattr(engine, "scheduler", None), "proposer", None)
    if proposer is None:
        return None
    return proposer.totals.num_draft_tokens, proposer.totals.num_accepted_tokens
