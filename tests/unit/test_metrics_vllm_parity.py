"""/metrics as vLLM v1's: its labels (model_name and engine), vllm:iteration_tokens_total, vllm:request_params_n and
_max_tokens from a scripted workload, aborted requests kept out of the finished-request histograms, and the HTTP
metrics of prometheus_fastapi_instrumentator that vLLM's server exposes."""

from __future__ import annotations

from types import SimpleNamespace

from fastapi.testclient import TestClient
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.core.sched_output import SchedulerStats
from pagedserve.engine.startup import StartupTracker
from pagedserve.entrypoints.openai.api_server import ServerState, build_app
from pagedserve.metrics import EngineMetrics
from pagedserve.outputs import CompletionOutput, RequestMetrics, RequestOutput

MODEL = "m"
VLLM = {"model_name": MODEL, "engine": "0"}
ENGINE = SimpleNamespace(stats=SchedulerStats(), resident_memory=None, cpu_threads=None)


def output(request_id: str, num_prompt: int, tokens: dict[int, int], reasons: dict[int, str] | None = None,
           finished: bool = False, n: int = 1, max_tokens: int | None = None) -> RequestOutput:
    """A delta output: `tokens` new tokens per choice index, `reasons` the choices that finish in it."""
    reasons = reasons or {}
    completions = [CompletionOutput(i, "", list(range(count)), finish_reason=reasons.get(i))
                   for i, count in tokens.items()]
    metrics = RequestMetrics(arrival_time=0.0, first_scheduled_time=0.0, n=n, max_tokens=max_tokens)
    return RequestOutput(request_id, None, list(range(num_prompt)), completions, finished, metrics=metrics)


def value(metrics: EngineMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, {**VLLM, **labels})


def test_every_vllm_metric_carries_model_name_and_engine_as_vllm_s_and_pagedserve_s_only_model_name():
    metrics = EngineMetrics(MODEL, max_model_len=64, cache_info={"block_size": "16"})
    metrics.observe_grammar_compile(0.5)
    families = list(text_string_to_metric_families(generate_latest(metrics.registry).decode()))
    vllm = [s for f in families if f.name.startswith("vllm:") and f.name != "vllm:cache_config_info"
            for s in f.samples]
    assert len(vllm) > 100
    for sample in vllm:
        assert sample.labels["model_name"] == MODEL and sample.labels["engine"] == "0", sample
    # vLLM's info gauge: the cache config's fields and the engine, no model name
    assert metrics.registry.get_sample_value("vllm:cache_config_info", {"block_size": "16", "engine": "0"}) == 1
    own = [s for f in families if f.name.startswith("pagedserve:") for s in f.samples]
    assert own and all(set(s.labels) - {"le"} == {"model_name"} for s in own)


def test_iteration_tokens_count_the_steps_that_made_tokens_with_first_tokens_bringing_their_prompts():
    metrics = EngineMetrics(MODEL, max_model_len=64)
    # step 1: a's and b's prompts done (5 + 3 tokens), one token each; step 2: a prefill chunk, no output
    metrics.observe_step(ENGINE, [output("a", 5, {0: 1}), output("b", 3, {0: 1})])
    metrics.observe_step(ENGINE, [])
    # step 3: two more tokens for a (speculative decoding), one for b; then b is aborted: no step, no tokens
    metrics.observe_step(ENGINE, [output("a", 5, {0: 2}), output("b", 3, {0: 1})])
    metrics.observe_step(ENGINE, [output("b", 3, {0: 0}, {0: "abort"}, finished=True)])
    assert value(metrics, "vllm:iteration_tokens_total_count") == 2
    assert value(metrics, "vllm:iteration_tokens_total_sum") == 10 + 3
    buckets = {edge: value(metrics, "vllm:iteration_tokens_total_bucket", le=edge)
               for edge in ("1.0", "8.0", "16.0", "16384.0", "+Inf")}
    assert buckets == {"1.0": 0, "8.0": 1, "16.0": 2, "16384.0": 2, "+Inf": 2}  # vLLM's edges


def test_each_choice_counts_as_a_request_and_n_once_and_aborted_ones_enter_no_histogram():
    """vLLM runs each of n choices as a child request: its success, prompt tokens, latencies, lengths and
    max_tokens are counted per choice; n and the most tokens of a choice once per (parent) request, when its last
    choice finishes; an aborted choice counts as an abort and in no histogram."""
    metrics = EngineMetrics(MODEL, max_model_len=64)
    # a: n=2, max_tokens=7, its choices finishing in different steps; b: no max_tokens (offline), one step
    metrics.observe_step(ENGINE, [output("a", 4, {0: 1, 1: 1}, n=2, max_tokens=7),
                                  output("b", 2, {0: 1}, {0: "stop"}, finished=True, max_tokens=None)])
    metrics.observe_step(ENGINE, [output("a", 4, {0: 1, 1: 1}, {1: "length"}, n=2, max_tokens=7)])
    metrics.observe_step(ENGINE, [output("a", 4, {0: 1}, {0: "stop"}, finished=True, n=2, max_tokens=7)])
    # c: n=5, one choice ran 2 tokens then its client left
    metrics.observe_step(ENGINE, [output("c", 9, {0: 2}, n=5, max_tokens=40)])
    metrics.observe_step(ENGINE, [output("c", 9, {0: 0}, {0: "abort"}, finished=True, n=5, max_tokens=40)])
    assert value(metrics, "vllm:request_params_n_count") == 2 and value(metrics, "vllm:request_params_n_sum") == 3
    assert value(metrics, "vllm:request_params_n_bucket", le="1.0") == 1
    assert value(metrics, "vllm:request_params_n_bucket", le="2.0") == 2
    assert value(metrics, "vllm:request_params_n_bucket", le="20.0") == 2
    assert value(metrics, "vllm:request_max_num_generation_tokens_count") == 2  # a (its longest choice, 3) and b
    assert value(metrics, "vllm:request_max_num_generation_tokens_sum") == 3 + 1
    assert value(metrics, "vllm:request_params_max_tokens_count") == 2  # a's choices; None is left out, as vLLM
    assert value(metrics, "vllm:request_params_max_tokens_sum") == 14
    assert value(metrics, "vllm:request_params_max_tokens_bucket", le="5.0") == 0
    assert value(metrics, "vllm:request_params_max_tokens_bucket", le="10.0") == 2  # vLLM's 1-2-5 edges
    # c's 5 choices count as aborts, but in no latency or length histogram (vLLM records finished requests only)
    assert value(metrics, "vllm:request_success_total", finished_reason="abort") == 5
    assert value(metrics, "vllm:request_success_total", finished_reason="stop") == 2
    assert value(metrics, "vllm:request_success_total", finished_reason="length") == 1
    for name in ("vllm:e2e_request_latency_seconds_count", "vllm:request_prompt_tokens_count",
                 "vllm:request_decode_time_seconds_count", "vllm:request_generation_tokens_count"):
        assert value(metrics, name) == 3, name
    assert value(metrics, "vllm:request_prompt_tokens_sum") == 4 + 4 + 2
    assert value(metrics, "vllm:request_generation_tokens_sum") == 3 + 2 + 1
    assert value(metrics, "vllm:generation_tokens_total") == 5 + 1 + 2  # c's tokens were generated all the same
    # prompt tokens and TTFT once per choice that produced a token (c's one choice too); ITL per choice and step
    assert value(metrics, "vllm:prompt_tokens_total") == 4 + 4 + 2 + 9
    assert value(metrics, "vllm:time_to_first_token_seconds_count") == 4
    assert value(metrics, "vllm:inter_token_latency_seconds_count") == 3  # a's two choices, then a's choice 0


def test_http_metrics_as_the_instrumentator_s_with_vllm_s_excluded_handlers():
    client = TestClient(build_app(ServerState(StartupTracker())))  # no engine: generation routes answer 503
    client.get("/v1/models")
    client.get("/v1/models/some-model")
    client.post("/v1/completions", json={"model": "m", "prompt": "hi"})
    client.get("/no-such-route")
    client.get("/web/markdown.js")  # the page's assets: their mount's path, as the instrumentator names it
    for path in ("/health", "/ping", "/version", "/server_info", "/metrics"):
        client.get(path)
    text = client.get("/metrics").text
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}

    def sample(name: str, **labels: str) -> float | None:
        return samples.get((name, tuple(sorted(labels.items()))))

    assert sample("http_requests_total", handler="/v1/models", method="GET", status="5xx") == 1
    assert sample("http_requests_total", handler="/v1/models/{model:path}", method="GET", status="5xx") == 1
    assert sample("http_requests_total", handler="/v1/completions", method="POST", status="5xx") == 1
    assert sample("http_requests_total", handler="none", method="GET", status="4xx") == 1  # no route: "none"
    assert sample("http_requests_total", handler="/web", method="GET", status="2xx") == 1
    assert not any(name == "http_requests_total" and any(v in ("/health", "/ping", "/version", "/server_info",
                                                              "/metrics") for _, v in labels)
                   for name, labels in samples)  # vLLM's excluded handlers
    assert sample("http_request_duration_highr_seconds_count") == 5
    assert sample("http_request_duration_seconds_bucket", handler="/v1/completions", method="POST", le="+Inf") == 1
    assert sample("http_request_size_bytes_sum", handler="/v1/completions") == len(b'{"model":"m","prompt":"hi"}')
    assert sample("http_response_size_bytes_count", handler="/v1/models") == 1
    assert sample("http_response_size_bytes_sum", handler="/v1/models") > 0
    assert "process_resident_memory_bytes" in text  # one registry: the process collectors before any engine


def test_speculative_counters_start_at_zero_as_vllm_s():
    """A rate over the spec-decode counters read "no data" until the first draft; vLLM creates them at 0."""
    metrics = EngineMetrics(MODEL, max_model_len=64)
    assert value(metrics, "vllm:spec_decode_num_drafts_total") is None
    metrics.start_spec_decode(3)
    for name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total"):
        assert value(metrics, name) == 0
    assert [value(metrics, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(p))
            for p in range(4)] == [0, 0, 0, None]
