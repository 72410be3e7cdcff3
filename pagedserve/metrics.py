"""Prometheus metrics under vLLM's names, so existing vLLM dashboards work unchanged."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Summary, disable_created_metrics

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
_ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_N_BUCKETS = (1, 2, 5, 10, 20)
_LATENCY_BUCKETS = _TTFT_BUCKETS  # pagedserve's own latencies (grammar compiles)
# vLLM's `engine` label: the index of the engine core behind the server. One here (-dp 1), as vLLM's default.
ENGINE_INDEX = "0"


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
class _ChoiceTiming:
    """One choice of a request (vLLM runs each of n choices as a request of its own, and counts it as one)."""

    first_token_time: float | None = None
    last_token_time: float | None = None
    num_tokens: int = 0
    finished: bool = False  # its finish was counted
    aborted: bool = False


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


def new_registry() -> CollectorRegistry:
    """The server's one registry: process_* and python_* as vLLM's, then the engine's and the HTTP metrics."""
    from prometheus_client import GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR

    registry = CollectorRegistry()
    for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
        registry.register(collector)
    return registry


class EngineMetrics:
    """vLLM's metrics carry vLLM's labels, model_name and engine (the index of its engine core: one here, "0"), and
    are bound to them once, so they are exported from the start (0 running, no tokens yet), not only after the first
    engine step. pagedserve's own metrics (pagedserve:*) carry model_name alone and appear with their first value."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None, max_model_len: int = 131072,
                 cache_info: dict[str, str] | None = None, outputs_per_step: bool = True) -> None:
        """`cache_info`: vllm:cache_config_info's labels (block_size, num_gpu_blocks, cache_dtype, ...);
        `outputs_per_step`: every step's new tokens reach observe_step (the server's deltas). False for the offline
        LLM, whose outputs come at a request's end: the per-step histograms (tokens per iteration, inter-token
        latencies) are then left empty rather than filled with whole requests."""
        self.outputs_per_step = outputs_per_step
        self.registry = registry if registry is not None else new_registry()
        self.model_name = model_name
        self._label_values = (model_name, ENGINE_INDEX)
        self._add_vllm_metrics(token_count_buckets(max_model_len))
        if cache_info is not None:
            info = {**cache_info, "engine": ENGINE_INDEX}
            Gauge("vllm:cache_config_info", "The KV cache's configuration (its labels).", sorted(info),
                  registry=self.registry).labels(**info).set(1)
        self._add_own_metrics()
        self.stats_log = StatsLog(time.monotonic())
        self._timings: dict[str, dict[int, _ChoiceTiming]] = {}

    @classmethod
    def for_engine(cls, engine, registry: CollectorRegistry | None = None, outputs_per_step: bool = True
                   ) -> EngineMetrics:
        """The metrics of `engine` (an LLMEngine): its served name, context length and cache configuration, with
        the memory gauges' start-up reading already in."""
        model, cache = engine.config.model, engine.config.cache
        metrics = cls(model.served_model_name, registry, max_model_len=model.max_model_len, cache_info={
            "block_size": str(cache.block_size), "num_gpu_blocks": str(cache.num_blocks),  # vLLM's: its null one too
            "cache_dtype": str(cache.kv_cache_dtype), "enable_prefix_caching": str(cache.enable_prefix_caching)},
            outputs_per_step=outputs_per_step)
        metrics.observe_engine_state(engine)
        if engine.config.speculative is not None:  # at 0 from the start, as vLLM's (a rate reads "no data" else)
            metrics.start_spec_decode(engine.config.speculative.num_speculative_tokens)
        return metrics

    def start_spec_decode(self, num_positions: int) -> None:
        """The speculative-decoding counters, each position's too, at 0."""
        for counter in (self.spec_drafts, self.spec_draft_tokens, self.spec_accepted_tokens):
            counter.labels(*self._label_values).inc(0)
        for position in range(num_positions):
            self.spec_accepted_per_pos.labels(*self._label_values, str(position)).inc(0)

    def _add_vllm_metrics(self, lengths: list[int]) -> None:
        r, labels, values = self.registry, ["model_name", "engine"], self._label_values

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, labels, registry=r).labels(*values)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, labels, registry=r).labels(*values)

        def histogram(name: str, doc: str, buckets: Any) -> Any:
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(*values)

        self.running = gauge("vllm:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent.")
        self.gpu_cache_usage = gauge("vllm:gpu_cache_usage_perc", "KV-cache usage (vLLM's former name of "
                                     "vllm:kv_cache_usage_perc, which its stock dashboard reads).")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prefilled prompt tokens.")
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens.")
        self.preemptions = counter("vllm:num_preemptions", "Preemptions.")
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        success = Counter("vllm:request_success", "Finished requests by finish reason.", labels + ["finished_reason"],
                          registry=r)
        self.success = {reason: success.labels(*values, reason) for reason in ("stop", "length", "abort")}
        self.iteration_tokens = histogram("vllm:iteration_tokens_total", "Tokens per engine step: the prompts that "
                                          "got their first token and the tokens generated.", _ITERATION_TOKEN_BUCKETS)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between tokens.", _TOKEN_LATENCY_BUCKETS)
        self.tpot = histogram("vllm:time_per_output_token_seconds", "Time between tokens (vLLM's former name of "
                              "vllm:inter_token_latency_seconds, which its stock dashboard reads).",
                              _TOKEN_LATENCY_BUCKETS)
        self.request_tpot = histogram("vllm:request_time_per_output_token_seconds", "A finished request's decode "
                                      "time over its output tokens after the first.", _TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to finish.", _REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds", "Arrival to first schedule.",
                                    _REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds", "First schedule to first token.",
                                      _REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram("vllm:request_decode_time_seconds", "First token to finish.",
                                     _REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram("vllm:request_inference_time_seconds", "First schedule to finish.",
                                        _REQUEST_LATENCY_BUCKETS)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens", "A finished request's prompt tokens.",
                                               lengths)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens", "A finished choice's "
                                                   "generated tokens.", lengths)
        self.request_max_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens", "The most tokens a finished request's choices generated.",
            lengths)
        self.request_n = histogram("vllm:request_params_n", "Histogram of the n request parameter.", _N_BUCKETS)
        self.request_max_tokens = histogram("vllm:request_params_max_tokens", "Histogram of the max_tokens request "
                                            "parameter.", lengths)
        # Speculative decoding's: at 0 from the start where the engine speculates (start_spec_decode), else none
        self.spec_drafts = Counter("vllm:spec_decode_num_drafts", "Verifications of draft tokens (speculative "
                                   "decoding): one per request per step that carried drafts.", labels, registry=r)
        self.spec_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.", labels,
                                         registry=r)
        self.spec_accepted_tokens = Counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                                            labels, registry=r)
        self.spec_accepted_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                             "Draft tokens accepted at each draft position.", labels + ["position"],
                                             registry=r)

    def _add_own_metrics(self) -> None:
        r, labels = self.registry, ["model_name"]
        self.grammar_compile = Histogram("pagedserve:grammar_compile_seconds",
                                         "Time to compile a structured-output grammar (cache misses only).", labels,
                                         buckets=_LATENCY_BUCKETS, registry=r)
        self.rss = Gauge("pagedserve:resident_memory_bytes", "Resident set size (VmRSS) of the server process.",
                         labels, registry=r)
        self.planned_rss = Gauge("pagedserve:planned_resident_memory_bytes",
                                 "What the memory plan expects resident now: steady + KV blocks written + one "
                                 "step's activations.", labels, registry=r)
        self.cpu_threads = Gauge("pagedserve:cpu_threads", "CPU threads the engine runs steps on now: fewer than "
                                 "configured while other processes keep the CPUs busy (--cpu-give-way).", labels,
                                 registry=r)
        self.rss_over_plan = Gauge("pagedserve:resident_memory_over_plan_ratio",
                                   "RSS / planned resident memory - 1 (a warning is logged above 0.1).", labels,
                                   registry=r)

    def observe_grammar_compile(self, seconds: float) -> None:
        """Called on the grammar compiler's thread after each compilation."""
        self.grammar_compile.labels(self.model_name).observe(seconds)

    def observe_step(self, engine, outputs: list[RequestOutput]) -> None:
        """Called on the engine thread after each step (and with the final outputs of aborted requests)."""
        stats = engine.stats
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        self.gpu_cache_usage.set(stats.kv_cache_usage)
        if stats.num_preemptions:
            self.preemptions.inc(stats.num_preemptions)
        if stats.prefix_cache_queries:
            self.prefix_queries.inc(stats.prefix_cache_queries)
            self.prefix_hits.inc(stats.prefix_cache_hits)
        if stats.spec_decode is not None and stats.spec_decode.num_drafts:
            self._observe_spec_decode(stats.spec_decode)
        self.observe_engine_state(engine)
        now = time.monotonic()
        prompt_tokens = generation_tokens = 0
        for output in outputs:
            new_prompt, new_generated = self._observe_output(output, now)
            prompt_tokens += new_prompt
            generation_tokens += new_generated
        # vLLM's iteration: a step with outputs, its prompts counted whole when their first token comes. A step
        # with no token (a prefill chunk, the finals of aborted requests) is none, as in vLLM.
        if prompt_tokens + generation_tokens and self.outputs_per_step:
            self.iteration_tokens.observe(prompt_tokens + generation_tokens)
        self.stats_log.add_step(stats, prompt_tokens, generation_tokens)

    def _observe_spec_decode(self, spec) -> None:
        values = self._label_values
        self.spec_drafts.labels(*values).inc(spec.num_drafts)
        self.spec_draft_tokens.labels(*values).inc(spec.num_draft_tokens)
        self.spec_accepted_tokens.labels(*values).inc(spec.num_accepted_tokens)
        for position, count in enumerate(spec.accepted_per_pos):
            if count:
                self.spec_accepted_per_pos.labels(*values, str(position)).inc(count)

    def observe_engine_state(self, engine) -> None:
        """The gauges an idle engine changes too (an idle release gives KV memory back; give-way's thread count):
        after each step, at start and at each scrape of /metrics (they read a step's values until the next step
        before, while /health read the new ones, QA-P)."""
        self.observe_memory(engine.resident_memory)
        if engine.cpu_threads is not None:
            self.cpu_threads.labels(self.model_name).set(engine.cpu_threads)

    def observe_memory(self, memory: ResidentMemory | None) -> None:
        """The last RSS reading against the plan (memory/rss.py), where the engine keeps one."""
        reading = memory.last if memory is not None else None
        if reading is None:
            return
        self.rss.labels(self.model_name).set(reading.rss_bytes)
        self.planned_rss.labels(self.model_name).set(reading.expected_bytes)
        self.rss_over_plan.labels(self.model_name).set(reading.over_plan)

    def _observe_output(self, output: RequestOutput | PoolingRequestOutput, now: float) -> tuple[int, int]:
        """Records one output; returns (prompt tokens, generated tokens) it accounts for. Each of n > 1 choices
        counts as a request, as vLLM counts its child requests: its prompt tokens, TTFT, ITLs, success, latency and
        lengths; the n and the most tokens of a choice once per request, as vLLM's parent request records them."""
        if isinstance(output, PoolingRequestOutput):
            return self._observe_pooling(output, now), 0
        choices = self._timings.setdefault(output.request_id, {})
        metrics = output.metrics
        num_prompt = num_new = 0
        for completion in output.outputs:  # deltas in the server; a choice done early is left out of later ones
            choice = choices.setdefault(completion.index, _ChoiceTiming())
            if completion.token_ids:
                num_new += len(completion.token_ids)
                choice.num_tokens += len(completion.token_ids)
                if choice.first_token_time is None:
                    # The engine's time of the first token: `now`'s step in the server (its outputs are deltas), the
                    # request's real first step where outputs are final-only (the offline LLM's get_metrics)
                    first = now if metrics is None or metrics.first_token_time is None else metrics.first_token_time
                    choice.first_token_time = first
                    num_prompt += len(output.prompt_token_ids)
                    if metrics is not None:
                        self.ttft.observe(first - metrics.arrival_time)
                        if metrics.first_scheduled_time is not None:
                            self.queue_time.observe(metrics.first_scheduled_time - metrics.arrival_time)
                elif choice.last_token_time is not None:
                    self.itl.observe(now - choice.last_token_time)
                    self.tpot.observe(now - choice.last_token_time)
                choice.last_token_time = now
            if completion.finish_reason is not None and not choice.finished:
                self._finish_choice(output, choice, completion.finish_reason, now)
        if output.finished:
            del self._timings[output.request_id]
            for index in range(metrics.n if metrics is not None else len(output.outputs)):
                choice = choices.setdefault(index, _ChoiceTiming())
                if not choice.finished:  # ended without a reason of its own
                    self._finish_choice(output, choice, "abort", now)
            # Once per request, as vLLM's parent request records them when its last choice finishes (none aborted)
            if metrics is not None and not any(c.aborted for c in choices.values()):
                self.request_n.observe(metrics.n)
                self.request_max_generation_tokens.observe(max(c.num_tokens for c in choices.values()))
        if num_new:
            self.generation_tokens.inc(num_new)
        if num_prompt:
            self.prompt_tokens.inc(num_prompt)
        return num_prompt, num_new

    def _finish_choice(self, output: RequestOutput, choice: _ChoiceTiming, reason: str, now: float) -> None:
        """One choice's success; vLLM records a finished request's latencies and lengths, never an aborted one's
        (its output processor drops an aborted request's state unrecorded)."""
        choice.finished, choice.aborted = True, reason == "abort"
        self.success[reason].inc()
        metrics = output.metrics
        if choice.aborted or metrics is None:
            return
        self.e2e.observe(now - metrics.arrival_time)
        if choice.first_token_time is None:
            return
        self.request_prompt_tokens.observe(len(output.prompt_token_ids))
        self.request_generation_tokens.observe(choice.num_tokens)
        if metrics.max_tokens:  # the engine's max_tokens: the request's, or the room left in max_model_len
            self.request_max_tokens.observe(metrics.max_tokens)
        decode = now - choice.first_token_time
        self.decode_time.observe(decode)
        if choice.num_tokens > 1:
            self.request_tpot.observe(decode / (choice.num_tokens - 1))
        if metrics.first_scheduled_time is not None:
            self.prefill_time.observe(max(0.0, choice.first_token_time - metrics.first_scheduled_time))
            self.inference_time.observe(now - metrics.first_scheduled_time)

    def _observe_pooling(self, output: PoolingRequestOutput, now: float) -> int:
        """An embedding request: prompt tokens (returned), queue time and latency; it generates no tokens."""
        embedded = bool(output.outputs.embedding)  # empty: aborted before its prompt ran
        self.success["stop" if embedded else "abort"].inc()
        metrics = output.metrics
        if not embedded:
            return 0
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        if metrics is not None:
            self.e2e.observe(now - metrics.arrival_time)
            if metrics.first_scheduled_time is not None:
                self.queue_time.observe(metrics.first_scheduled_time - metrics.arrival_time)
        return len(output.prompt_token_ids)


# prometheus_fastapi_instrumentator's default metrics, which vLLM's server exposes (and FastAPI dashboards read)
_HTTP_HIGHR_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 2.5, 3, 3.5, 4, 4.5, 5, 7.5, 10, 30,
                       60)
_HTTP_LOWR_BUCKETS = (0.1, 0.5, 1)
# vLLM's excluded handlers (its instrumentator searches each as a pattern in the route or path)
HTTP_EXCLUDED = ("/metrics", "/health", "/load", "/ping", "/version", "/server_info")


class HttpMetrics:
    """vLLM's HTTP metrics under the instrumentator's names, labels and buckets: http_requests_total (method,
    status as "2xx", handler: the route's template, "none" where no route matched), the request and response
    Content-Length summaries, and a request's duration (a stream's whole length) under both histograms."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.total = Counter("http_requests_total", "Total number of requests by method, status and handler.",
                             ("method", "status", "handler"), registry=r)
        self.request_size = Summary("http_request_size_bytes", "Content length of incoming requests by handler. "
                                    "Only value of header is respected. Otherwise ignored. No percentile "
                                    "calculated. ", ("handler",), registry=r)
        self.response_size = Summary("http_response_size_bytes", "Content length of outgoing responses by handler. "
                                     "Only value of header is respected. Otherwise ignored. No percentile "
                                     "calculated. ", ("handler",), registry=r)
        self.duration_highr = Histogram("http_request_duration_highr_seconds", "Latency with many buckets but no API "
                                        "specific labels. Made for more accurate percentile calculations. ",
                                        buckets=_HTTP_HIGHR_BUCKETS, registry=r)
        self.duration = Histogram("http_request_duration_seconds", "Latency with only few buckets by handler. Made "
                                  "to be only used if aggregation by handler is important. ", ("method", "handler"),
                                  buckets=_HTTP_LOWR_BUCKETS, registry=r)

    def observe(self, method: str, handler: str, status: int, seconds: float, request_bytes: int,
                response_bytes: int) -> None:
        """One answered request (the caller leaves out HTTP_EXCLUDED)."""
        self.total.labels(method, f"{str(status)[0]}xx", handler).inc()
        self.request_size.labels(handler).observe(request_bytes)
        self.response_size.labels(handler).observe(response_bytes)
        self.duration_highr.observe(seconds)
        self.duration.labels(method, handler).observe(seconds)
