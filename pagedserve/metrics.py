"""Prometheus metrics under vLLM's names, so existing vLLM dashboards work unchanged."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

from pagedserve.memory.rss import ResidentMemory
from pagedserve.outputs import PoolingRequestOutput, RequestOutput

disable_created_metrics()  # as vLLM: no *_created series beside every counter and histogram

# vLLM's buckets, histogram by histogram, so dashboards and alerts on an `le` edge read the same series.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                          20.0, 40.0, 80.0)
_REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                            240.0, 480.0, 960.0, 1920.0, 7680.0)
_LATENCY_BUCKETS = _TTFT_BUCKETS  # pagedserve's own latencies (grammar compiles)


def token_count_buckets(max_model_len: int) -> list[int]:
    """vLLM's 1-2-5 buckets up to max_model_len (request prompt and generation lengths)."""
    buckets, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10 ** exponent
            if value > max_model_len:
                return buckets
            buckets.append(value)
        exponent += 1


@dataclass
class _RequestTiming:
    last_token_time: float | None = None
    first_token_time: float | None = None
    seen_first_token: bool = False
    num_tokens: dict[int, int] = field(default_factory=dict)  # completion index -> tokens seen
    finished: set[int] = field(default_factory=set)  # completion indexes whose finish was counted


@dataclass
class _Window:
    """What happened since the last stats line."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0


class StatsLog:
    """vLLM's periodic stats line ("Avg prompt throughput: ... tokens/s, ... Running: N reqs, ..."), for a server
    log read by people (the numbers are /metrics' too). The engine thread adds to the window after each step;
    `line` (from a timer) reads and resets it: None when nothing happened since an idle line was written."""

    def __init__(self, now: float) -> None:
        self._lock = threading.Lock()
        self._window = _Window()
        self._since = now
        self._running = self._waiting = 0
        self._kv_usage = 0.0
        self._idle_written = True

    def add_step(self, stats: Any, prompt_tokens: int, generation_tokens: int) -> None:
        with self._lock:
            window = self._window
            window.prompt_tokens += prompt_tokens
            window.generation_tokens += generation_tokens
            window.prefix_queries += stats.prefix_cache_queries
            window.prefix_hits += stats.prefix_cache_hits
            if stats.spec_decode is not None:
                window.draft_tokens += stats.spec_decode.num_draft_tokens
                window.accepted_tokens += stats.spec_decode.num_accepted_tokens
            self._running, self._waiting, self._kv_usage = stats.num_running, stats.num_waiting, stats.kv_cache_usage

    def line(self, now: float) -> str | None:
        with self._lock:
            window, since = self._window, self._since
            self._window, self._since = _Window(), now
            running, waiting, kv_usage = self._running, self._waiting, self._kv_usage
        busy = bool(window.prompt_tokens or window.generation_tokens or running or waiting)
        if not busy and self._idle_written:
            return None
        self._idle_written = not busy
        elapsed = max(now - since, 1e-9)
        # vLLM's line, its "Engine 000:" prefix and an always-present hit rate included, for parsers of its logs
        # (its "GPU KV cache usage" reads "KV cache usage": the pool is in host memory here)
        hit_rate = window.prefix_hits / window.prefix_queries if window.prefix_queries else 0.0
        text = (f"Engine 000: Avg prompt throughput: {window.prompt_tokens / elapsed:.1f} tokens/s, Avg generation "
                f"throughput: {window.generation_tokens / elapsed:.1f} tokens/s, Running: {running} reqs, Waiting: "
                f"{waiting} reqs, KV cache usage: {100 * kv_usage:.1f}%, Prefix cache hit rate: {100 * hit_rate:.1f}%")
        if window.draft_tokens:
            text += f", Draft acceptance rate: {100 * window.accepted_tokens / window.draft_tokens:.1f}%"
        return text


class EngineMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None, max_model_len: int = 131072,
                 cache_info: dict[str, str] | None = None) -> None:
        """`cache_info`: vllm:cache_config_info's labels (block_size, num_gpu_blocks, cache_dtype, ...)."""
        if registry is None:
            from prometheus_client import GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR

            registry = CollectorRegistry()
            for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):  # process_*, python_* as vLLM's
                registry.register(collector)
        self.registry = registry
        labels = ["model_name"]
        r = self.registry
        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch.", labels, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", labels, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent.", labels,
                              registry=r)
        self.gpu_cache_usage = Gauge("vllm:gpu_cache_usage_perc", "KV-cache usage (vLLM's former name of "
                                     "vllm:kv_cache_usage_perc, which its stock dashboard reads).", labels, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefilled prompt tokens.", labels, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens.", labels, registry=r)
        self.preemptions = Counter("vllm:num_preemptions", "Preemptions.", labels, registry=r)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                      labels, registry=r)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", labels,
                                   registry=r)
        self.success = Counter("vllm:request_success", "Finished requests by finish reason.",
                               labels + ["finished_reason"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", labels,
                              buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between tokens.", labels,
                             buckets=_TOKEN_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("vllm:time_per_output_token_seconds", "Time between tokens (vLLM's former name of "
                              "vllm:inter_token_latency_seconds, which its stock dashboard reads).", labels,
                              buckets=_TOKEN_LATENCY_BUCKETS, registry=r)
        self.request_tpot = Histogram("vllm:request_time_per_output_token_seconds", "A finished request's decode "
                                      "time over its output tokens after the first.", labels,
                                      buckets=_TOKEN_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to finish.", labels,
                             buckets=_REQUEST_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("vllm:request_queue_time_seconds", "Arrival to first schedule.", labels,
                                    buckets=_REQUEST_LATENCY_BUCKETS, registry=r)
        self.prefill_time = Histogram("vllm:request_prefill_time_seconds", "First schedule to first token.", labels,
                                      buckets=_REQUEST_LATENCY_BUCKETS, registry=r)
        self.decode_time = Histogram("vllm:request_decode_time_seconds", "First token to finish.", labels,
                                     buckets=_REQUEST_LATENCY_BUCKETS, registry=r)
        self.inference_time = Histogram("vllm:request_inference_time_seconds", "First schedule to finish.", labels,
                                        buckets=_REQUEST_LATENCY_BUCKETS, registry=r)
        lengths = token_count_buckets(max_model_len)
        self.request_prompt_tokens = Histogram("vllm:request_prompt_tokens", "A finished request's prompt tokens.",
                                               labels, buckets=lengths, registry=r)
        self.request_generation_tokens = Histogram("vllm:request_generation_tokens", "A finished choice's "
                                                   "generated tokens.", labels, buckets=lengths, registry=r)
        self.request_max_generation_tokens = Histogram(
            "vllm:request_max_num_generation_tokens", "The most tokens a finished request's choices generated.",
            labels, buckets=lengths, registry=r)
        if cache_info is not None:
            info = Gauge("vllm:cache_config_info", "The KV cache's configuration (its labels).", sorted(cache_info),
                         registry=r)
            info.labels(**cache_info).set(1)
        self.grammar_compile = Histogram("pagedserve:grammar_compile_seconds",
                                         "Time to compile a structured-output grammar (cache misses only).", labels,
                                         buckets=_LATENCY_BUCKETS, registry=r)
        self.rss = Gauge("pagedserve:resident_memory_bytes", "Resident set size (VmRSS) of the server process.",
                         labels, registry=r)
        self.planned_rss = Gauge("pagedserve:planned_resident_memory_bytes",
                                 "What the memory plan expects resident now: steady + KV blocks written + one "
                                 "step's activations.", labels, registry=r)
        self.rss_over_plan = Gauge("pagedserve:resident_memory_over_plan_ratio",
                                   "RSS / planned resident memory - 1 (a warning is logged above 0.1).", labels,
                                   registry=r)
        self.spec_drafts = Counter("vllm:spec_decode_num_drafts", "Verifications of draft tokens (speculative "
                                   "decoding): one per request per step that carried drafts.", labels, registry=r)
        self.spec_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.", labels,
                                         registry=r)
        self.spec_accepted_tokens = Counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                                            labels, registry=r)
        self.spec_accepted_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                             "Draft tokens accepted at each draft position.", labels + ["position"],
                                             registry=r)
        self.model_name = model_name
        self.stats_log = StatsLog(time.monotonic())
        self._timings: dict[str, _RequestTiming] = {}
        for reason in ("stop", "length", "abort"):
            self.success.labels(model_name, reason)
        # Exported from the start (0 running, no tokens yet), not only after the first engine step.
        for metric in (self.running, self.waiting, self.kv_usage, self.gpu_cache_usage, self.prompt_tokens,
                       self.generation_tokens, self.preemptions, self.prefix_queries, self.prefix_hits, self.ttft,
                       self.itl, self.tpot, self.request_tpot, self.e2e, self.queue_time, self.prefill_time,
                       self.decode_time, self.inference_time, self.request_prompt_tokens,
                       self.request_generation_tokens, self.request_max_generation_tokens):
            metric.labels(model_name)

    def observe_grammar_compile(self, seconds: float) -> None:
        """Called on the grammar compiler's thread after each compilation."""
        self.grammar_compile.labels(self.model_name).observe(seconds)

    def observe_step(self, engine, outputs: list[RequestOutput]) -> None:
        """Called on the engine thread after each step."""
        name = self.model_name
        stats = engine.stats
        self.running.labels(name).set(stats.num_running)
        self.waiting.labels(name).set(stats.num_waiting)
        self.kv_usage.labels(name).set(stats.kv_cache_usage)
        self.gpu_cache_usage.labels(name).set(stats.kv_cache_usage)
        if stats.num_preemptions:
            self.preemptions.labels(name).inc(stats.num_preemptions)
        if stats.prefix_cache_queries:
            self.prefix_queries.labels(name).inc(stats.prefix_cache_queries)
            self.prefix_hits.labels(name).inc(stats.prefix_cache_hits)
        if stats.spec_decode is not None and stats.spec_decode.num_drafts:
            self._observe_spec_decode(stats.spec_decode)
        self.observe_memory(engine.resident_memory)
        now = time.monotonic()
        prompt_tokens = generation_tokens = 0
        for output in outputs:
            new_prompt, new_generated = self._observe_output(output, now)
            prompt_tokens += new_prompt
            generation_tokens += new_generated
        self.stats_log.add_step(stats, prompt_tokens, generation_tokens)

    def _observe_spec_decode(self, spec) -> None:
        name = self.model_name
        self.spec_drafts.labels(name).inc(spec.num_drafts)
        self.spec_draft_tokens.labels(name).inc(spec.num_draft_tokens)
        self.spec_accepted_tokens.labels(name).inc(spec.num_accepted_tokens)
        for position, count in enumerate(spec.accepted_per_pos):
            if count:
                self.spec_accepted_per_pos.labels(name, str(position)).inc(count)

    def observe_memory(self, memory: ResidentMemory | None) -> None:
        """The last RSS reading against the plan (memory/rss.py), where the engine keeps one."""
        reading = memory.last if memory is not None else None
        if reading is None:
            return
        self.rss.labels(self.model_name).set(reading.rss_bytes)
        self.planned_rss.labels(self.model_name).set(reading.expected_bytes)
        self.rss_over_plan.labels(self.model_name).set(reading.over_plan)

    def _observe_output(self, output: RequestOutput | PoolingRequestOutput, now: float) -> tuple[int, int]:
        """Records one output; returns (prompt tokens, generated tokens) it accounts for."""
        if isinstance(output, PoolingRequestOutput):
            return self._observe_pooling(output, now), 0
        name = self.model_name
        num_prompt = 0
        timing = self._timings.setdefault(output.request_id, _RequestTiming())
        metrics = output.metrics
        num_new = 0
        for completion in output.outputs:
            seen = timing.num_tokens.get(completion.index, 0)
            total = seen + len(completion.token_ids)  # outputs are deltas in the server
            timing.num_tokens[completion.index] = total
            num_new += len(completion.token_ids)
            # One success per choice, when its finish first shows: with n > 1 a choice that finished early is
            # left out of the later (delta) outputs, so counting the final output's choices missed it.
            if completion.finish_reason is not None and completion.index not in timing.finished:
                timing.finished.add(completion.index)
                self.success.labels(name, completion.finish_reason).inc()
        if num_new:
            self.generation_tokens.labels(name).inc(num_new)
            if not timing.seen_first_token:
                timing.seen_first_token = True
                timing.first_token_time = now
                num_prompt = len(output.prompt_token_ids)
                self.prompt_tokens.labels(name).inc(num_prompt)
                if metrics is not None:
                    self.ttft.labels(name).observe(now - metrics.arrival_time)
                    if metrics.first_scheduled_time is not None:
                        self.queue_time.labels(name).observe(metrics.first_scheduled_time - metrics.arrival_time)
            elif timing.last_token_time is not None:
                self.itl.labels(name).observe(now - timing.last_token_time)
                self.tpot.labels(name).observe(now - timing.last_token_time)
            timing.last_token_time = now
        if output.finished:
            del self._timings[output.request_id]
            for completion in output.outputs:
                if completion.index not in timing.finished:  # ended without a reason of its own
                    self.success.labels(name, "abort").inc()
            if metrics is not None:
                self.e2e.labels(name).observe(now - metrics.arrival_time)
            if timing.first_token_time is not None:  # it ran: vLLM's per-request phases and lengths
                self._observe_finished(output, timing, now)
        return num_prompt, num_new

    def _observe_finished(self, output: RequestOutput, timing: _RequestTiming, now: float) -> None:
        name = self.model_name
        generated = list(timing.num_tokens.values()) or [0]  # every choice (the last output lacks those done early)
        self.request_prompt_tokens.labels(name).observe(len(output.prompt_token_ids))
        for count in generated:
            self.request_generation_tokens.labels(name).observe(count)
        self.request_max_generation_tokens.labels(name).observe(max(generated))
        decode = now - timing.first_token_time
        self.decode_time.labels(name).observe(decode)
        if max(generated) > 1:
            self.request_tpot.labels(name).observe(decode / (max(generated) - 1))
        scheduled = output.metrics.first_scheduled_time if output.metrics is not None else None
        if scheduled is not None:
            self.prefill_time.labels(name).observe(max(0.0, timing.first_token_time - scheduled))
            self.inference_time.labels(name).observe(now - scheduled)

    def _observe_pooling(self, output: PoolingRequestOutput, now: float) -> int:
        """An embedding request: prompt tokens (returned), queue time and latency; it generates no tokens."""
        name = self.model_name
        embedded = bool(output.outputs.embedding)  # empty: aborted before its prompt ran
        self.success.labels(name, "stop" if embedded else "abort").inc()
        metrics = output.metrics
        if embedded:
            self.prompt_tokens.labels(name).inc(len(output.prompt_token_ids))
        if metrics is not None:
            self.e2e.labels(name).observe(now - metrics.arrival_time)
            if embedded and metrics.first_scheduled_time is not None:
                self.queue_time.labels(name).observe(metrics.first_scheduled_time - metrics.arrival_time)
        return len(output.prompt_token_ids) if embedded else 0
