"""`pagedserve bench throughput` end to end on a tiny model: the real engine, counted tokens, warm-up apart."""

from __future__ import annotations

import json

from pagedserve.cli import main as cli_main


def test_cli_runs_the_engine_and_counts_every_token(tiny_model_dir, tmp_path, capsys) -> None:
    out = tmp_path / "throughput.json"
    code = cli_main.main(["bench", "throughput", tiny_model_dir("qwen2"), "--dtype", "float32",
                          "--max-model-len", "128", "--num-prompts", "3", "--input-len", "10", "--output-len", "5",
                          "--num-iters", "2", "--num-warmup-prompts", "1", "--json", str(out)])
    table = capsys.readouterr().out
    assert code == 0, table
    assert "Output token throughput (tok/s):" in table and "Warm-up run (excluded above)" in table
    payload = json.loads(out.read_text())
    assert payload["warmup"]["num_requests"] == 1 and payload["warmup"]["num_output_tokens"] == 5
    assert len(payload["runs"]) == 2
    for run in payload["runs"]:
        assert (run["num_requests"], run["num_prompt_tokens"], run["num_output_tokens"]) == (3, 30, 15)
        assert run["num_early_stops"] == 0 and run["num_cached_prompt_tokens"] == 0
        assert run["output_throughput"] == run["num_output_tokens"] / run["elapsed_s"]
    summary = payload["summary"]["output_throughput"]
    assert summary["count"] == 2 and summary["min"] <= summary["median"] <= summary["max"]
    assert payload["load_seconds"] > 0 and payload["warnings"] == []


def test_cli_refuses_a_workload_longer_than_the_context(tiny_model_dir, capsys) -> None:
    code = cli_main.main(["bench", "throughput", tiny_model_dir("qwen2"), "--dtype", "float32",
                          "--max-model-len", "32", "--input-len", "30", "--output-len", "8", "--num-iters", "1"])
    assert code == 2
    assert "max_model_len 32" in capsys.readouterr().err


def test_cli_reports_the_draft_acceptance_rate_of_a_speculating_engine(tiny_model_dir, tmp_path, capsys) -> None:
    out = tmp_path / "throughput.json"
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}'
    # Small weights: the tiny model falls into loops, so drafts are proposed and accepted (test_speculative.py).
    code = cli_main.main(["bench", "throughput", tiny_model_dir("qwen2", weight_std=0.06), "--dtype", "float32",
                          "--max-model-len", "128", "--num-prompts", "2", "--input-len", "10", "--output-len", "40",
                          "--num-iters", "1", "--num-warmup-prompts", "0", "--speculative-config", spec,
                          "--json", str(out)])
    table = capsys.readouterr().out
    assert code == 0, table
    payload = json.loads(out.read_text())["spec_decode"]
    assert 0 < payload["accepted_tokens"] <= payload["draft_tokens"]
    assert f"{payload['acceptance_rate']:.1%}" in table and "Draft acceptance rate:" in table
    assert json.loads(out.read_text())["runs"][0]["num_output_tokens"] == 80  # speculation changes no count
