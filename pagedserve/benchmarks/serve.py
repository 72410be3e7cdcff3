"""`bench serve`: load an OpenAI-compatible server with streamed requests and time every chunk.

Warm-up requests run first, one at a time, and are reported as "cold" apart from the steady
figures. Steady requests arrive as a Poisson process (`request_rate`, inf = all at once) and at most
`max_concurrency` are in flight; a request's send time is taken when it leaves the client, so the
client-side wait for a concurrency slot is not counted in its latency (as in `vllm bench serve`).
"""

from __future__ import annotations

import asyncio
import datetime
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from typing import TextIO

import httpx

from pagedserve.benchmarks.client import (CHAT_COMPLETIONS, COMPLETIONS, ENDPOINTS, build_request_body, send_request,
                                          server_url, unix_socket_path)
from pagedserve.benchmarks.datasets import (
    BenchPrompt,
    LocalTokenizer,
    PromptTokenizer,
    ServerTokenizer,
    build_random_prompts,
    count_prompt_tokens,
    read_jsonl_prompts,
    read_sharegpt_prompts,
    sample_lengths,
)
from pagedserve.benchmarks.metrics import BenchSummary, RequestRecord, summarize

DATASETS = ("random", "jsonl", "sharegpt")
PROMPT_FORMATS = ("token-ids", "text")


@dataclass(frozen=True)
class ServeBenchConfig:
    """Everything `bench serve` needs; the CLI builds it from flags."""

    base_url: str
    model: str | None = None  # None: the first id of GET /v1/models
    endpoint: str = COMPLETIONS
    dataset: str = "random"
    dataset_path: str | None = None
    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0
    num_prompts: int = 100
    max_concurrency: int | None = None  # None: no client-side limit
    request_rate: float = math.inf  # requests per second (Poisson arrivals); inf sends all at once
    warmup_requests: int = 1
    seed: int = 0
    ignore_eos: bool = False
    temperature: float = 0.0
    tokenizer: str | None = None  # local HF tokenizer dir; None: the server's /tokenize
    prompt_format: str = "token-ids"  # /v1/completions only; chat prompts are always text
    api_key: str | None = None
    request_timeout: float = 3600.0  # per read (until the next byte); a cold first token can take minutes
    show_progress: bool = True
    burstiness: float = 1.0  # vLLM's: gamma-distributed gaps of this shape (1: Poisson; lower: burstier)
    random_prefix_len: int = 0  # vLLM's: random prompts share a prefix of this many tokens
    sampling: dict = field(default_factory=dict)  # more sampling fields for every request (top_p, top_k, min_p)
    sharegpt_output_len: int | None = None  # ShareGPT: max_tokens for every prompt (default: its answer's length)

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {ENDPOINTS}, got {self.endpoint!r}")
        if self.dataset not in DATASETS:
            raise ValueError(f"dataset must be one of {DATASETS}, got {self.dataset!r}")
        if self.dataset in ("jsonl", "sharegpt") and not self.dataset_path:
            raise ValueError(f"dataset_path is required with dataset {self.dataset!r}")
        if self.dataset in ("jsonl", "sharegpt") and not os.path.isfile(self.dataset_path):  # (a bare [Errno 2])
            raise ValueError(f"--dataset-path {self.dataset_path}: no such file (the {self.dataset} dataset is read "
                             "from a local file)")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be positive (1: Poisson arrivals), got {self.burstiness}")
        if self.random_prefix_len < 0:
            raise ValueError(f"random_prefix_len must be >= 0, got {self.random_prefix_len}")
        if self.prompt_format not in PROMPT_FORMATS:
            raise ValueError(f"prompt_format must be one of {PROMPT_FORMATS}, got {self.prompt_format!r}")
        for name in ("input_len", "output_len", "num_prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.warmup_requests < 0:
            raise ValueError(f"warmup_requests must be >= 0, got {self.warmup_requests}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be at least 1, got {self.max_concurrency}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be positive (inf for all at once), got {self.request_rate}")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"range_ratio must be within [0, 1), got {self.range_ratio}")


@dataclass
class ServeBenchResult:
    """Raw records (warm-up and steady) and their summary."""

    config: ServeBenchConfig
    model: str
    started_at: str  # wall clock, ISO 8601
    clock_origin: float  # perf_counter() when the first request was sent; JSON times are relative to it
    prompt_source: str
    records: list[RequestRecord] = field(default_factory=list)
    summary: BenchSummary | None = None
    # The server's speculative decoding during the steady requests (its /metrics counters), when it speculates.
    spec_draft_tokens: float | None = None
    spec_accepted_tokens: float | None = None

    @property
    def spec_acceptance_rate(self) -> float | None:
        if not self.spec_draft_tokens:
            return None
        return self.spec_accepted_tokens / self.spec_draft_tokens


class Progress:
    """A carriage-return counter on stderr."""

    def __init__(self, label: str, total: int, enabled: bool, stream: TextIO | None = None) -> None:
        self.label, self.total, self.enabled = label, total, enabled
        self.stream = stream or sys.stderr
        self.num_done = self.num_failed = 0
        self._draw()

    def update(self, record: RequestRecord) -> None:
        self.num_done += 1
        self.num_failed += 0 if record.success else 1
        self._draw()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()

    def _draw(self) -> None:
        if self.enabled:
            failed = f" ({self.num_failed} failed)" if self.num_failed else ""
            self.stream.write(f"\r{self.label}: {self.num_done}/{self.total} requests done{failed}")
            self.stream.flush()


async def fetch_first_model(client: httpx.AsyncClient) -> str:
    """The first model id served (GET /v1/models)."""
    response = await client.get("/v1/models")
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise RuntimeError("GET /v1/models listed no model; pass --model")
    return models[0]["id"]


def _error_message(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text or f"HTTP {response.status_code}"


def _model_not_found(response: httpx.Response) -> bool:
    """An OpenAI-style 404 for a model the server does not serve (not a missing route)."""
    try:
        return response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"
    except (ValueError, KeyError, TypeError):
        return False


async def resolve_tokenizer(client: httpx.AsyncClient, model: str, local_path: str | None) -> PromptTokenizer | None:
    """A local tokenizer if given, else the server's /tokenize if it answers, else None."""
    if local_path:
        return LocalTokenizer(local_path)
    tokenizer = ServerTokenizer(client, model)
    try:
        await tokenizer.encode("hello")
    except httpx.HTTPStatusError as exc:
        if _model_not_found(exc.response):
            raise RuntimeError(f"the server serves no model {model!r}: {_error_message(exc.response)}") from None
        if exc.response.status_code in (404, 405):  # the route is missing: a local tokenizer is needed
            return None
        raise  # a wrong API key (401), a server error: said as it is, not as a missing route
    except (KeyError, ValueError):
        return None
    return tokenizer


async def build_prompts(config: ServeBenchConfig, tokenizer: PromptTokenizer | None, num: int) -> list[BenchPrompt]:
    """`num` prompts (warm-up ones first) from the configured dataset."""
    rng = random.Random(config.seed)
    if config.dataset == "jsonl":
        prompts = read_jsonl_prompts(config.dataset_path or "", num, config.output_len)
        if tokenizer is not None:
            await count_prompt_tokens(tokenizer, prompts)
        return prompts
    if tokenizer is None:
        raise RuntimeError(
            f"{config.dataset} prompts need a tokenizer: the server has no POST /tokenize; pass --tokenizer PATH "
            "(a local Hugging Face tokenizer directory of the served model)"
        )
    if config.dataset == "sharegpt":
        return await read_sharegpt_prompts(config.dataset_path or "", num, tokenizer, rng, config.sharegpt_output_len)
    input_lens = sample_lengths(rng, num, config.input_len, config.range_ratio)
    output_lens = sample_lengths(rng, num, config.output_len, config.range_ratio)
    as_text = config.endpoint == CHAT_COMPLETIONS or config.prompt_format == "text"
    return await build_random_prompts(tokenizer, rng, input_lens, output_lens, as_text, config.random_prefix_len)


async def _run_warmup(
    client: httpx.AsyncClient, config: ServeBenchConfig, model: str, prompts: list[BenchPrompt]
) -> list[RequestRecord]:
    """Warm-up requests one at a time: the first of them is the cold request."""
    progress = Progress("warm-up", len(prompts), config.show_progress and bool(prompts))
    records = []
    for index, prompt in enumerate(prompts):
        record = RequestRecord(request_id=index, is_warmup=True, planned_prompt_tokens=prompt.planned_prompt_tokens)
        body = build_request_body(
            config.endpoint, model, prompt.prompt, prompt.max_tokens, config.ignore_eos, config.temperature,
            config.sampling,
        )
        records.append(await send_request(client, config.endpoint, body, record, config.endpoint))
        progress.update(record)
    if prompts:
        progress.close()
    return records


async def _run_steady(
    client: httpx.AsyncClient, config: ServeBenchConfig, model: str, prompts: list[BenchPrompt], first_id: int
) -> list[RequestRecord]:
    """Poisson arrivals at `request_rate`, at most `max_concurrency` requests in flight."""
    arrivals = random.Random(config.seed + 1)
    slots = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    progress = Progress("steady", len(prompts), config.show_progress)

    async def one(index: int, prompt: BenchPrompt) -> RequestRecord:
        record = RequestRecord(request_id=first_id + index, planned_prompt_tokens=prompt.planned_prompt_tokens)
        body = build_request_body(
            config.endpoint, model, prompt.prompt, prompt.max_tokens, config.ignore_eos, config.temperature,
            config.sampling,
        )
        if slots is None:
            await send_request(client, config.endpoint, body, record, config.endpoint)
        else:
            async with slots:
                await send_request(client, config.endpoint, body, record, config.endpoint)
        progress.update(record)
        return record

    tasks = []
    for index, prompt in enumerate(prompts):
        if index and math.isfinite(config.request_rate):  # gamma gaps of mean 1/rate (shape 1: exponential)
            gap = arrivals.gammavariate(config.burstiness, 1.0 / (config.request_rate * config.burstiness))
            await asyncio.sleep(gap)
        tasks.append(asyncio.create_task(one(index, prompt)))
    records = list(await asyncio.gather(*tasks))
    progress.close()
    return records


SPEC_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
SPEC_ACCEPTED_TOKENS = "vllm:spec_decode_num_accepted_tokens_total"


async def spec_decode_counters(client: httpx.AsyncClient) -> tuple[float, float] | None:
    """(draft tokens, accepted drafts) from the server's /metrics (vLLM's names, summed over models); None when it
    does not speculate or exposes no metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        response = await client.get("/metrics")
        response.raise_for_status()
    except httpx.HTTPError:
        return None
    totals = {SPEC_DRAFT_TOKENS: 0.0, SPEC_ACCEPTED_TOKENS: 0.0}
    seen = False
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
                seen = True
    return (totals[SPEC_DRAFT_TOKENS], totals[SPEC_ACCEPTED_TOKENS]) if seen else None


def _make_client(config: ServeBenchConfig) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    base_url, transport = server_url(config.base_url), None
    socket = unix_socket_path(base_url)  # a server on --uds
    if socket is not None:
        base_url, transport = "http://localhost", httpx.AsyncHTTPTransport(uds=socket)
    return httpx.AsyncClient(
        base_url=base_url,
        transport=transport,
        headers=headers,
        timeout=httpx.Timeout(config.request_timeout, connect=30.0),
        # httpx caps a client at 100 connections by default, which would silently cap concurrency.
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        trust_env=False,  # no proxy from the environment between the benchmark and the server
    )


async def run_serve_bench(config: ServeBenchConfig) -> ServeBenchResult:
    """Run warm-up then steady requests against `config.base_url` and summarize them."""
    config.validate()
    async with _make_client(config) as client:
        model = config.model or await fetch_first_model(client)
        tokenizer = await resolve_tokenizer(client, model, config.tokenizer)
        prompts = await build_prompts(config, tokenizer, config.warmup_requests + config.num_prompts)
        result = ServeBenchResult(
            config=config,
            model=model,
            started_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            clock_origin=time.perf_counter(),
            prompt_source=f"{config.dataset} via {tokenizer.source if tokenizer else 'no tokenizer'}",
        )
        warmup = await _run_warmup(client, config, model, prompts[: config.warmup_requests])
        if warmup and not warmup[0].success:  # as vLLM's initial test run: no load against a server that refuses
            raise RuntimeError(f"the first request failed, so no load was sent: {warmup[0].error or 'no detail'}")
        before = await spec_decode_counters(client)
        steady_start = time.perf_counter()
        steady = await _run_steady(client, config, model, prompts[config.warmup_requests :], len(warmup))
        duration = time.perf_counter() - steady_start
        after = await spec_decode_counters(client)
    if before is not None and after is not None:
        result.spec_draft_tokens, result.spec_accepted_tokens = after[0] - before[0], after[1] - before[1]
    if (after or (0.0, 0.0))[1] > 0:  # accepted drafts arrive with the token that verified them: one chunk, more tokens
        for record in warmup + steady:
            record.usage_mismatch = record.output_tokens is not None and record.output_tokens < record.num_token_chunks
    result.records = warmup + steady
    result.summary = summarize(result.records, duration)
    return result


def run_serve_bench_sync(config: ServeBenchConfig) -> ServeBenchResult:
    """`run_serve_bench` for callers without an event loop (the CLI, tests)."""
    return asyncio.run(run_serve_bench(config))
