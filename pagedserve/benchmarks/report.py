"""Human table (stdout, laid out like `vllm bench serve`) and raw JSON of a serving benchmark."""

from __future__ import annotations

import dataclasses
import json
import math
import shlex
from pathlib import Path
from typing import Any

from pagedserve.benchmarks.metrics import BenchSummary, RequestRecord, Stats, percentile
from pagedserve.benchmarks.serve import ServeBenchResult
from pagedserve.benchmarks.startup import StartupResult
from pagedserve.benchmarks.throughput import GenerateRun, ThroughputResult
from pagedserve.memory.sizes import GIB

_WIDTH = 50
_LABEL_WIDTH = 40


def _rule(title: str = "", fill: str = "-") -> str:
    return f"{title:{fill}^{_WIDTH}}" if title else fill * _WIDTH


def _row(label: str, value: Any, fmt: str = ".2f") -> str:
    if value is None:
        text = "n/a"
    elif isinstance(value, float) and not math.isinf(value):
        text = format(value, fmt)
    else:
        text = str(value)
    return f"{label + ':':<{_LABEL_WIDTH}}{text:>{_WIDTH - _LABEL_WIDTH}}"


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def _human_seconds(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds >= 1.0 else f"{seconds * 1000.0:.1f} ms"


def _stats_rows(title: str, short: str, stats: Stats) -> list[str]:
    return [
        _rule(title),
        _row(f"Mean {short} (ms)", _ms(stats.mean)),
        _row(f"Median {short} (ms)", _ms(stats.median)),
        _row(f"Std {short} (ms)", _ms(stats.std)),
        _row(f"P90 {short} (ms)", _ms(stats.p90)),
        _row(f"P99 {short} (ms)", _ms(stats.p99)),
    ]


def _cold_rows(summary: BenchSummary) -> list[str]:
    cold = summary.cold
    which = "cold" if cold.first_request_is_warmup else "no warm-up: first steady request"
    rows = [
        _rule(" Cold start (warm-up, excluded above) "),
        _row("Warm-up requests", cold.num_warmup),
        _row(f"First request latency ({which}) (s)", cold.first_request_e2e, ".3f"),
        _row("Median steady latency (s)", cold.steady_median_e2e, ".3f"),
        _row("Cold / steady latency", cold.e2e_cold_steady_ratio, ".1f"),
        _row("First request TTFT (ms)", _ms(cold.first_request_ttft)),
        _row("Median steady TTFT (ms)", _ms(cold.steady_median_ttft)),
        _row("Cold / steady TTFT", cold.ttft_cold_steady_ratio, ".1f"),
    ]
    return rows


def _spec_rows(result: ServeBenchResult | ThroughputResult, over: str = "") -> list[str]:
    """Speculative decoding's drafts and their acceptance, when the engine speculated (`over`: what the count
    sums, where rows beside it are per run)."""
    if result.spec_draft_tokens is None:
        return []
    return [_row(f"Draft tokens proposed{over}", int(result.spec_draft_tokens)),
            _row("Draft acceptance rate", result.spec_acceptance_rate, ".1%")]


def _spec_dict(result: ServeBenchResult | ThroughputResult) -> dict[str, Any] | None:
    if result.spec_draft_tokens is None:
        return None
    return {"draft_tokens": result.spec_draft_tokens, "accepted_tokens": result.spec_accepted_tokens,
            "acceptance_rate": result.spec_acceptance_rate}


def format_table(result: ServeBenchResult) -> str:
    """The summary as a fixed-width table, with one sentence per raised honesty flag after it."""
    summary = result.summary
    assert summary is not None, "format_table needs a summarized result"
    config = result.config
    lines = [
        _rule(" Serving Benchmark Result ", "="),
        _row("Model", result.model),
        _row("Endpoint", config.endpoint),
        _row("Successful requests", summary.num_completed),
        _row("Failed requests", summary.num_failed),
        _row("Maximum request concurrency", config.max_concurrency or "unlimited"),
        _row("Request rate configured (RPS)", config.request_rate),
        _row("Benchmark duration (s)", summary.duration),
        _row("Total input tokens (usage)", summary.total_input_tokens),
        _row("Total generated tokens (usage)", summary.total_output_tokens),
        _row("Request throughput (req/s)", summary.request_throughput),
        _row("Output token throughput (tok/s)", summary.output_throughput),
        _row("Total token throughput (tok/s)", summary.total_token_throughput),
        *_stats_rows("Time to First Token", "TTFT", summary.ttft),
        *_stats_rows("Time per Output Token (excl. 1st token)", "TPOT", summary.tpot),
        _row("Decode rate at median TPOT (tok/s)", 1.0 / summary.tpot.median if summary.tpot.median else None),
        *_stats_rows("Inter-token Latency (per chunk)", "ITL", summary.itl),
        *_stats_rows("End-to-end Latency", "E2EL", summary.e2e_latency),
        *_cold_rows(summary),
        *_spec_rows(result),
        _rule(" Honesty checks "),
        _row("Requests without usage (all)", summary.num_usage_missing),
        _row("Usage != streamed chunks (all)", summary.num_usage_mismatch),
        _row("Early stops despite ignore_eos (all)", summary.num_early_stop),
        _rule(fill="="),
    ]
    lines += [f"WARNING: {note}" for note in summary.warnings]
    if summary.cold.first_request_e2e is not None and summary.cold.steady_median_e2e is not None:
        label = "cold" if summary.cold.first_request_is_warmup else "first, no warm-up"
        lines.append(
            f"First request latency {_human_seconds(summary.cold.first_request_e2e)} ({label}) "
            f"vs median {_human_seconds(summary.cold.steady_median_e2e)} steady"
        )
    return "\n".join(lines)


def _record_to_dict(record: RequestRecord, origin: float) -> dict[str, Any]:
    """Every raw timing, relative to the benchmark's clock origin, plus the derived metrics."""
    raw = dataclasses.asdict(record)
    for name in ("send_time", "end_time", "first_token_time"):
        if raw[name] is not None:
            raw[name] = raw[name] - origin
    raw["chunk_times"] = [moment - origin for moment in record.chunk_times]
    raw.update(ttft=record.ttft, tpot=record.tpot, e2e_latency=record.e2e_latency, itls=record.itls)
    return raw


def _finite(value: Any) -> Any:
    """JSON has no Infinity: write an infinite rate as the string 'inf'."""
    return "inf" if isinstance(value, float) and math.isinf(value) else value


def result_to_dict(result: ServeBenchResult) -> dict[str, Any]:
    """Config, summary (with warnings) and every raw record; times in seconds."""
    assert result.summary is not None, "result_to_dict needs a summarized result"
    summary = dataclasses.asdict(result.summary)
    summary["warnings"] = result.summary.warnings
    return {
        "benchmark": "serve",
        "started_at": result.started_at,
        "model": result.model,
        "prompt_source": result.prompt_source,
        "config": {key: _finite(value) for key, value in dataclasses.asdict(result.config).items() if key != "api_key"},
        "summary": summary,
        "spec_decode": _spec_dict(result),
        "time_unit": "s, relative to the first request sent",
        "warmup_records": [_record_to_dict(r, result.clock_origin) for r in result.records if r.is_warmup],
        "records": [_record_to_dict(r, result.clock_origin) for r in result.records if not r.is_warmup],
    }


def write_json(path: str | Path, payload: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(payload, indent=2, allow_nan=False) + "\n", encoding="utf-8")


def _gib(num_bytes: int) -> float:
    return num_bytes / GIB


def format_startup_table(result: StartupResult) -> str:
    """Start-up phases, first vs steady request, peak RSS and the shutdown check."""
    lines = [
        _rule(" Startup Benchmark Result ", "="),
        "Command:",
        f"  {shlex.join(result.command)}",
        _row("Time to port open (s)", result.time_to_port_open, ".2f"),
        _row("Time to ready (/health 200) (s)", result.time_to_ready, ".2f"),
    ]
    if result.phases:
        lines.append(_rule(" Phases seen in /health 503 bodies "))
        for phase in result.phases:
            progress = "" if phase.last_progress is None else f" (last {phase.last_progress:.0%})"
            lines.append(_row(f"{phase.phase} from {phase.first_seen:.2f} s{progress}", phase.duration, ".2f"))
    if result.server_phases:
        lines.append(_rule(" Phases recorded by the server "))
        for server_phase in result.server_phases:
            label = f"{server_phase.name} from {server_phase.started_at_s:.2f} s"
            lines.append(_row(label, server_phase.duration_s, ".2f"))
        lines.append(_row("Server's own time to ready (s)", result.server_ready_elapsed_s, ".2f"))
    first = result.first_request
    lines += [
        _rule(" Requests "),
        _row("Model", result.model),
        _row("First request latency (cold) (s)", first.e2e_latency if first else None, ".3f"),
        _row("First request TTFT (ms)", _ms(first.ttft) if first else None),
        _row(f"Median of {len(result.steady_requests)} steady latencies (s)", result.steady_median_e2e, ".3f"),
        _row("Median steady TTFT (ms)", _ms(result.steady_median_ttft)),
        _row("Cold / steady latency", result.cold_steady_ratio, ".1f"),
        _row("Output tokens per request (usage)", first.output_tokens if first else None),
        _rule(" Process tree "),
        _row("Peak RSS, summed over the tree (GiB)", _gib(result.peak_rss_bytes), ".3f"),
    ]
    if result.shutdown is not None:
        shutdown = result.shutdown
        lines += [
            _row("Processes seen", shutdown.num_processes_seen),
            _row("Stopped with", shutdown.signal_used),
            _row("Shutdown time (s)", shutdown.shutdown_seconds, ".2f"),
            _row("Processes left behind", len(shutdown.leftover_pids)),
        ]
    lines.append(_rule(fill="="))
    if result.error:
        lines.append(f"ERROR: {result.error}")
    if result.shutdown is not None and result.shutdown.leftover_pids:
        lines.append(f"ERROR: processes left running: {result.shutdown.leftover_pids}")
    lines.append(f"Server log: {result.log_path}")
    return "\n".join(lines)


def startup_to_dict(result: StartupResult) -> dict[str, Any]:
    """Every figure of a start-up run; request times relative to the first request sent."""
    payload = dataclasses.asdict(result)
    origin = result.first_request.send_time if result.first_request else 0.0
    payload["first_request"] = _record_to_dict(result.first_request, origin) if result.first_request else None
    payload["steady_requests"] = [_record_to_dict(r, origin) for r in result.steady_requests]
    payload["health_status_codes"] = {str(code): count for code, count in result.health_status_codes.items()}
    payload["benchmark"] = "startup"
    payload["time_unit"] = "s; phases since launch, requests since the first request was sent"
    return payload


def _spread_row(label: str, stats: Stats) -> str:
    """'median (min-max)' of a rate."""
    if stats.median is None:
        return _row(label, None)
    return _row(label, f"{stats.median:.2f} ({stats.min:.2f}-{stats.max:.2f})")


def _run_rows(title: str, run: GenerateRun) -> list[str]:
    return [
        _rule(title),
        _row("Requests", run.num_requests),
        _row("Prompt tokens (counted)", run.num_prompt_tokens),
        _row("Output tokens (counted)", run.num_output_tokens),
        _row("Elapsed (s)", run.elapsed_s, ".3f"),
        _row("Output token throughput (tok/s)", run.output_throughput),
    ]


def format_throughput_table(result: ThroughputResult) -> str:
    """Timed runs as median (min-max), the warm-up run apart, then one sentence per raised flag."""
    config = result.config
    runs = result.runs
    lines = [
        _rule(" Offline Throughput Benchmark Result ", "="),
        _row("Model", result.model),
        _row("Prompts per run", config.num_prompts),
        _row("Input / output length", f"{config.input_len} / {config.output_len}"),
        _row("Engine load time (s)", result.load_seconds, ".2f"),
        _rule(f" {len(runs)} timed runs: median (min-max) "),
        _spread_row("Request throughput (req/s)", result.request_throughput),
        _spread_row("Output token throughput (tok/s)", result.output_throughput),
        _spread_row("Total token throughput (tok/s)", result.total_token_throughput),
        _row("Prompt tokens per run (counted)", runs[0].num_prompt_tokens if runs else None),
        _row("Output tokens per run (counted)", runs[0].num_output_tokens if runs else None),
    ]
    lines += _spec_rows(result, f" ({len(runs)} runs)" if len(runs) > 1 else "")
    if result.warmup is not None:
        lines += _run_rows(" Warm-up run (excluded above) ", result.warmup)
    lines.append(_rule(fill="="))
    lines += [f"WARNING: {note}" for note in result.warnings]
    return "\n".join(lines)


def throughput_to_dict(result: ThroughputResult) -> dict[str, Any]:
    """Config, every run with its counts and rates, and the spread of each rate."""
    def run_dict(run: GenerateRun) -> dict[str, Any]:
        return {**dataclasses.asdict(run), "request_throughput": run.request_throughput,
                "output_throughput": run.output_throughput, "total_token_throughput": run.total_token_throughput}

    return {
        "benchmark": "throughput",
        "started_at": result.started_at,
        "model": result.model,
        "config": dataclasses.asdict(result.config),
        "load_seconds": result.load_seconds,
        "warmup": run_dict(result.warmup) if result.warmup else None,
        "runs": [run_dict(run) for run in result.runs],
        "summary": {name: dataclasses.asdict(getattr(result, name))
                    for name in ("request_throughput", "output_throughput", "total_token_throughput")},
        "warnings": result.warnings,
        "spec_decode": _spec_dict(result),
    }


# ---- `vllm bench serve --save-result`'s file ---------------------------------------------------------------------
VLLM_PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")


def parse_goodput(text: str | None) -> dict[str, float]:
    """vLLM's --goodput "ttft:100 tpot:50" (service-level objectives in ms) as {metric: seconds}."""
    objectives: dict[str, float] = {}
    for item in (text or "").replace(",", " ").split():
        name, _, value = item.partition(":")
        try:
            bound = float(value)
        except ValueError:
            bound = -1.0
        if name not in ("ttft", "tpot", "e2el") or not bound > 0:
            raise ValueError(f"--goodput {item!r}: give METRIC:MILLISECONDS with METRIC one of ttft, tpot, e2el")
        objectives[name] = bound / 1000.0
    return objectives


def request_goodput(records: list[RequestRecord], duration: float, objectives: dict[str, float]) -> float:
    """Steady requests per second that succeeded within every objective (vLLM's request_goodput)."""
    def meets(record: RequestRecord) -> bool:
        values = {"ttft": record.ttft, "tpot": record.tpot, "e2el": record.e2e_latency}
        return all(values[name] is None or values[name] <= bound for name, bound in objectives.items())

    good = sum(1 for r in records if not r.is_warmup and r.success and meets(r))
    return good / duration if duration > 0 else 0.0


def vllm_result_dict(result: ServeBenchResult, backend: str, percentile_metrics: list[str],
                     metric_percentiles: list[float], label: str | None = None,
                     metadata: dict[str, str] | None = None, goodput: dict[str, float] | None = None) -> dict[str, Any]:
    """The steady requests as `vllm bench serve --save-result` writes them: flat keys, latencies in ms
    (mean_ttft_ms, p99_tpot_ms, ...), per-request lists, so that tools reading vLLM's files read these. Input
    tokens are the server's usage (a chat template's tokens included; vLLM counts the dataset's)."""
    summary = result.summary
    assert summary is not None, "vllm_result_dict needs a summarized result"
    steady = [r for r in result.records if not r.is_warmup]
    done = [r for r in steady if r.success]
    config = result.config
    stamp = result.started_at.replace("-", "").replace(":", "").replace("T", "-")[:15]
    out: dict[str, Any] = {
        "date": stamp, "backend": backend, "label": label, "model_id": result.model,
        "tokenizer_id": config.tokenizer or result.model, "num_prompts": config.num_prompts,
        "request_rate": "inf" if math.isinf(config.request_rate) else config.request_rate,
        "burstiness": config.burstiness, "max_concurrency": config.max_concurrency,
        "duration": summary.duration, "completed": summary.num_completed, "failed": summary.num_failed,
        "total_input_tokens": summary.total_input_tokens, "total_output_tokens": summary.total_output_tokens,
        "request_throughput": summary.request_throughput, "output_throughput": summary.output_throughput,
        "total_token_throughput": summary.total_token_throughput,
        "request_goodput": request_goodput(result.records, summary.duration, goodput) if goodput else None,
        "input_lens": [r.counted_prompt_tokens for r in done], "output_lens": [r.counted_output_tokens for r in done],
        "ttfts": [r.ttft for r in done], "itls": [r.itls for r in done],
        "generated_texts": [r.generated_text for r in done], "errors": [r.error for r in steady if not r.success],
        **(metadata or {}),
    }
    samples = {"ttft": [r.ttft for r in done if r.ttft is not None],
               "tpot": [r.tpot for r in done if r.tpot is not None],
               "itl": [gap for r in done for gap in r.itls], "e2el": [r.e2e_latency for r in done]}
    for name in percentile_metrics:
        values = [v * 1000.0 for v in samples[name]]
        out[f"mean_{name}_ms"] = sum(values) / len(values) if values else 0.0
        out[f"median_{name}_ms"] = percentile(values, 50.0) if values else 0.0
        out[f"std_{name}_ms"] = (math.sqrt(sum((v - out[f"mean_{name}_ms"]) ** 2 for v in values) / len(values))
                                 if values else 0.0)
        for pct in metric_percentiles:
            out[f"p{pct:g}_{name}_ms"] = percentile(values, pct) if values else 0.0
    return out


def vllm_result_filename(result: ServeBenchResult, backend: str, label: str | None) -> str:
    """vLLM's default name: {label or backend}-{rate}qps[-concurrency{N}]-{model}-{date}.json."""
    config = result.config
    rate = "inf" if math.isinf(config.request_rate) else str(float(config.request_rate))  # vLLM's: 20.0qps
    concurrency = f"-concurrency{config.max_concurrency}" if config.max_concurrency else ""
    model = result.model.rstrip("/").split("/")[-1]
    stamp = result.started_at.replace("-", "").replace(":", "").replace("T", "-")[:15]
    return f"{label or backend}-{rate}qps{concurrency}-{model}-{stamp}.json"
