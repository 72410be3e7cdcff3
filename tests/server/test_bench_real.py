"""`bench serve` and `bench startup` against real `pagedserve serve` processes on a tiny model.

The server streams one SSE chunk per generated token and a final usage chunk with `choices: []`, so
with ignore_eos every request must have exactly max_tokens chunks, equal to usage.completion_tokens.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import psutil
import pytest

from pagedserve.benchmarks.metrics import Stats
from pagedserve.benchmarks.serve import ServeBenchConfig, run_serve_bench_sync
from pagedserve.benchmarks.startup import StartupBenchConfig, run_startup_bench
from pagedserve.cli import main as cli_main
from pagedserve.engine.startup import PHASES
from tests.server.server_utils import start_server

SERVE_FLAGS = ("--max-model-len", "256", "--dtype", "float32", "--max-num-seqs", "8")


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    srv = start_server(tiny_model_dir("qwen2"), "--served-model-name", "tiny-bench", *SERVE_FLAGS,
                       log_dir=tmp_path_factory.mktemp("logs"))
    yield srv
    assert srv.stop() == 0, srv.log()


def assert_all_present(stats: Stats, count: int) -> None:
    assert stats.count == count
    for name in ("mean", "std", "median", "p90", "p99", "min", "max"):
        value = getattr(stats, name)
        assert value is not None and math.isfinite(value) and value >= 0, (name, value)
    assert stats.min <= stats.median <= stats.max


def test_serve_every_figure_present_and_tokens_equal_usage(server) -> None:
    config = ServeBenchConfig(base_url=server.url, num_prompts=6, input_len=12, output_len=5, ignore_eos=True,
                              warmup_requests=2, max_concurrency=3, show_progress=False, seed=3)
    result = run_serve_bench_sync(config)
    summary = result.summary
    assert result.model == "tiny-bench"
    assert result.prompt_source == "random via server /tokenize"
    assert (summary.num_completed, summary.num_failed) == (6, 0), summary.errors
    assert summary.warnings == []
    assert (summary.num_usage_missing, summary.num_usage_mismatch, summary.num_early_stop) == (0, 0, 0)
    assert summary.total_output_tokens == 6 * 5
    assert summary.total_input_tokens == summary.total_planned_input_tokens == 6 * 12
    for record in result.records:  # warm-up ones too
        assert record.success, record.error
        assert record.output_tokens == record.num_token_chunks == len(record.chunk_times) == 5
        assert record.prompt_tokens == record.planned_prompt_tokens == 12
        assert record.finish_reason == "length"
    assert_all_present(summary.ttft, 6)
    assert_all_present(summary.tpot, 6)
    assert_all_present(summary.itl, 6 * 4)
    assert_all_present(summary.e2e_latency, 6)
    assert summary.duration > 0
    assert summary.output_throughput == pytest.approx(30 / summary.duration)
    assert summary.request_throughput == pytest.approx(6 / summary.duration)
    cold = summary.cold
    assert cold.num_warmup == 2 and cold.first_request_is_warmup
    assert cold.first_request_e2e > 0 and cold.e2e_cold_steady_ratio is not None


def test_serve_text_prompts_on_chat_endpoint(server) -> None:
    """Chat prompts are text re-tokenized by the server's /tokenize; usage still equals the chunks."""
    config = ServeBenchConfig(base_url=server.url, endpoint="/v1/chat/completions", num_prompts=3, input_len=8,
                              output_len=4, ignore_eos=True, warmup_requests=0, show_progress=False)
    summary = run_serve_bench_sync(config).summary
    assert (summary.num_completed, summary.num_failed) == (3, 0), summary.errors
    assert summary.total_output_tokens == 12
    assert summary.num_usage_mismatch == summary.num_usage_missing == 0
    assert summary.total_input_tokens > summary.total_planned_input_tokens  # the chat template adds tokens


def test_serve_cli_json_has_raw_timings(server, tmp_path: Path, capsys) -> None:
    out = tmp_path / "serve.json"
    code = cli_main.main(["bench", "serve", "--base-url", server.url, "--num-prompts", "4", "--input-len", "10",
                          "--output-len", "3", "--ignore-eos", "--no-progress", "--strict", "--json", str(out)])
    table = capsys.readouterr().out
    assert code == 0, table
    assert "Total generated tokens (usage):" in table and "WARNING" not in table
    payload = json.loads(out.read_text())
    assert payload["summary"]["total_output_tokens"] == 12
    assert len(payload["records"]) == 4 and len(payload["warmup_records"]) == 1
    for record in payload["records"]:
        assert record["output_tokens"] == len(record["chunk_times"]) == 3
        assert 0 <= record["ttft"] <= record["e2e_latency"]


def live_children() -> set[int]:
    """Descendants of this test process that still run (zombies count as gone)."""
    alive = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                alive.add(child.pid)
        except psutil.NoSuchProcess:
            continue
    return alive


def test_startup_reports_all_phases_and_leaves_no_child(tiny_model_dir, tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    children_before = live_children()
    config = StartupBenchConfig(model=tiny_model_dir("qwen2"), serve_args=SERVE_FLAGS, num_steady_requests=3,
                                max_tokens=4, ignore_eos=True, log_path=str(log), ready_timeout=120)
    result = run_startup_bench(config)
    assert result.error is None, f"{result.error}\n{log.read_text()}"
    # Every phase the server went through, from its own record, in order, each with a duration.
    assert [phase.name for phase in result.server_phases] == list(PHASES)
    for phase in result.server_phases[:-1]:
        assert phase.duration_s is not None and phase.duration_s >= 0
    starts = [phase.started_at_s for phase in result.server_phases]
    assert starts == sorted(starts)
    assert result.server_ready_elapsed_s >= starts[-1]
    assert 0 < result.time_to_port_open <= result.time_to_ready
    assert result.health_status_codes.get(200, 0) >= 1
    # Requests: the cold one and the steady ones, tokens from usage.
    assert result.first_request.output_tokens == 4
    assert [r.output_tokens for r in result.steady_requests] == [4, 4, 4]
    assert result.cold_steady_ratio is not None and result.steady_median_e2e > 0
    assert result.peak_rss_bytes > 50 * 2**20  # python + torch + the model: tens of MiB at least
    # The whole tree is gone: nothing left behind, and none of the pids seen still runs.
    assert result.shutdown is not None and result.shutdown.leftover_pids == []
    assert result.shutdown.signal_used == "SIGTERM"
    assert result.child_exit_code is not None
    assert result.shutdown.num_processes_seen >= 1
    assert live_children() - children_before == set()


def test_startup_cli_table_names_the_phases(tiny_model_dir, tmp_path: Path, capsys) -> None:
    out = tmp_path / "startup.json"
    code = cli_main.main(["bench", "startup", tiny_model_dir("qwen2"), "--num-steady-requests", "2",
                          "--max-tokens", "3", "--log-file", str(tmp_path / "log"), "--json", str(out),
                          "--", *SERVE_FLAGS])
    table = capsys.readouterr().out
    assert code == 0, table
    assert "Phases recorded by the server" in table
    for phase in ("loading_weights", "allocating_kv", "warming_up"):
        assert f"{phase} from" in table
    assert "Processes left behind:" in table and "ERROR" not in table
    payload = json.loads(out.read_text())
    assert [phase["name"] for phase in payload["server_phases"]] == list(PHASES)
    assert payload["shutdown"]["leftover_pids"] == []
