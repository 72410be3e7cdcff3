"""benchmarks/compare.py's report (benchmarks/comparison/) on synthetic figures: spread, warm-up apart, ratios, peers (no torch)."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def load_compare() -> Any:
    """benchmarks/comparison/ (the package benchmarks/compare.py runs): its report and workloads modules."""
    if str(REPO / "benchmarks") not in sys.path:
        sys.path.insert(0, str(REPO / "benchmarks"))
    from comparison import report, workloads

    return types.SimpleNamespace(render=report.render, prompt_rng=workloads.prompt_rng)


def run(system: str, workload: str, repeat: Any, rate: float, prompt: int, output: int) -> dict[str, Any]:
    return {"system": system, "workload": workload, "repeat": repeat, "elapsed_s": output / rate,
            "num_requests": 1, "num_prompt_tokens": prompt, "num_output_tokens": output, "num_early_stops": 0}


def synthetic_report() -> dict[str, Any]:
    runs = [run("pagedserve", "W1", "warmup", 1.0, 32, 128), run("hf-generate", "W1", "warmup", 1.0, 32, 128)]
    for repeat, (ours, theirs) in enumerate([(10.0, 5.0), (30.0, 15.0), (20.0, 10.0)]):
        runs += [run("pagedserve", "W1", repeat, ours, 32, 128), run("hf-generate", "W1", repeat, theirs, 32, 128)]
        runs += [run("pagedserve", "W2", repeat, 8 * ours, 4096, 2048),
                 run("hf-generate", "W2", repeat, 4 * ours, 4096, 2048),
                 run("hf-cb", "W2", repeat, 2 * ours, 4096, 2048)]
    w3 = [{"system": "pagedserve", "repeat": r, "first_token_s": s, "peak_rss_mib": 900.0, "marks": {"loaded": s - 1}}
          for r, s in enumerate([3.0, 2.0, 4.0])]
    w3 += [{"system": "hf-generate", "repeat": r, "first_token_s": s, "peak_rss_mib": 1500.0}
           for r, s in enumerate([6.0, 8.0, 7.0])]
    model = {"name": "qwen2.5-0.5b-shape-random", "path": "/m", "kind": "random", "description": "shape",
             "tokenizer": "tok", "workloads": [{"name": "W1", "description": "one"}, {"name": "W2", "description": "b"}],
             "systems": {"pagedserve": {"load_s": 1.0, "threads": 2, "peak_rss_mib": 2000.0},
                         "hf": {"load_s": 2.0, "threads": 2, "peak_rss_mib": 2500.0}},
             "runs": runs, "w3": w3, "errors": {"hf-cb/W1": "not run"}}
    meta = {"date": "2026-01-01T00:00:00+00:00", "command": "python benchmarks/compare.py", "quick": False,
            "threads": 2, "repeats": 3, "max_model_len": 2048, "load_start": [0.5, 0, 0], "load_end": [0.7, 0, 0],
            "wall_s": 600.0, "versions": {"torch": "x"}, "workloads": model["workloads"],
            "machine": {"cpu": "Some CPU", "logical_cpus": 2, "usable_cores": 2, "memory_gib": 24.0, "kernel": "k",
                        "hypervisor": True, "flags": ["avx512_bf16"]},
            "git": {"commit": "abc123", "subject": "s", "uncommitted_engine_files": ["pagedserve/worker/model_runner.py"]}}
    return {"meta": meta, "models": [model], "peers": []}


VLLM = {"peer": "vllm-cpu", "model": "qwen2.5-0.5b-shape-random", "date": "2026-01-01T01:00:00+00:00",
        "command": "run.sh /m", "returncode": 0, "wall_s": 300.0, "load_average_before": [0.4, 0, 0],
        "load_average_after": [0.6, 0, 0], "load_average_1min_during": {"mean": 0.9, "max": 1.2},
        "others_cpu_share": 0.05, "own_cpu_share": 0.7,
        "results": [{"vllm_version": "0.32.0", "W0_from_process_start_s": 90.0, "peak_rss_tree_sum_MiB": 8000.0,
                     "W1": [{"out_tok_s": 5.0}, {"out_tok_s": 8.0}, {"out_tok_s": 12.0}, {"out_tok_s": 10.0}],
                     "W2": [{"out_tok_s": 100.0, "total_tok_s": 300.0}, {"out_tok_s": 60.0, "total_tok_s": 180.0}]}]}
LLAMA = {"peer": "llama-cpp", "model": "qwen2.5-0.5b-shape-random", "date": "2026-01-01T02:00:00+00:00",
         "command": "run.sh /m", "returncode": 1, "wall_s": 50.0, "load_average_before": [0.3, 0, 0],
         "load_average_after": [3.9, 0, 0], "note": "Installed ahead of time.", "disturbed": True,
         "results": [{"gguf": "bf16", "load_s": 0.5, "W1_tok_s": [9.0, 11.0, 10.0], "W2_sequential_out_tok_s": 40.0,
                      "W2_total_tok_s": 120.0},
                     {"gguf": "bf16", "command": "python llamacpp_batched_w2.py m.gguf",
                      "W2_batched": [{"out_tok_s": 80.0, "total_tok_s": 240.0, "prefill_s": 10.0, "decode_tok_s": 150.0},
                                     {"out_tok_s": 60.0, "total_tok_s": 180.0, "prefill_s": 12.0, "decode_tok_s": 110.0}]}],
         "failure": "q8_0: convert failed: something precise"}


def test_table_has_spread_ratios_and_warmup_apart() -> None:
    compare = load_compare()
    text = compare.render(synthetic_report(), [])
    assert "python benchmarks/compare.py" in text and "`abc123`" in text
    assert "uncommitted changes in pagedserve/worker/model_runner.py" in text
    # Medians of the timed repeats only (warm-ups at 1 tok/s are left out), min-max, ratio of medians.
    assert "| W1 | output tok/s | 20.0 (10.0–30.0) | 10.0 (5.0–15.0) | — | 2.00x | — |" in text
    assert "| W2 | output tok/s | 160.0 (80.0–240.0) | 80.0 (40.0–120.0) | 40.0 (20.0–60.0) | 2.00x | 4.00x |" in text
    total = 160.0 * (4096 + 2048) / 2048
    assert f"| W2 | total tok/s | {total:.1f} " in text
    assert "| W3 | s to first token (lower is better) | 3.00 (2.00–4.00) | 7.00 (6.00–8.00) | — | 0.43x" in text
    assert "| pagedserve/W1 | 1.0 | 128.00 | 32 + 128 (early stops 0) |" in text
    assert "`hf-cb/W1`: not run" in text
    assert "No peer results included" in text


def test_peer_sections_compare_with_this_run_and_show_failures() -> None:
    compare = load_compare()
    text = compare.render(synthetic_report(), [VLLM, LLAMA])
    assert "### vllm-cpu on qwen2.5-0.5b-shape-random — run 2026-01-01T01:00:00+00:00" in text
    # vLLM's first W1 call is its warm-up: median of 8, 12, 10 = 10; pagedserve's median is 20.
    assert "W1 10.0 (8.0–12.0) output tok/s" in text and "call 1 warm-up 5.0" in text
    assert "pagedserve (this run) / vLLM: W1 2.00x, W2 2.00x." in text
    assert "llama.cpp bf16 GGUF: W1 10.0 (9.0–11.0) tok/s" in text
    assert "W2 run one sequence at a time (not batched): 40.0 output tok/s" in text
    assert "pagedserve (this run, bf16) / llama.cpp bf16: W1 2.00x, W2 4.00x (sequential W2)." in text
    assert "W2 batched (32 sequences per decode call, benchmarks/llamacpp_batched_w2.py): 70.0 (60.0–80.0) output tok/s" in text
    assert "prefill 11.0 (10.0–12.0) s, then 130.0 (110.0–150.0) tok/s decoding (2 runs after a warm-up)" in text
    assert "pagedserve (this run, bf16) / llama.cpp batched: W2 2.29x." in text
    assert "convert failed: something precise" in text
    vllm_part, llama_part = text.split("### llama-cpp")
    vllm_part = vllm_part.split("### vllm")[1]
    assert "during: mean 0.90, max 1.20; other processes used 5% of the machine's CPU time meanwhile" in vllm_part
    assert "**" not in vllm_part  # quiet: no warning
    assert "Other processes competed for the cores during this run" in llama_part  # hand-set flag of an old run
    assert "Installed ahead of time." in llama_part
    busy = compare.render(synthetic_report(), [{**VLLM, "others_cpu_share": 0.4}])
    assert "**Other processes used 40% of the CPU time during this run" in busy
    assert "| W1 >= 1.6x vLLM-CPU | 2.00x | met — but the peer ran on a busy machine: not a fair comparison |" in busy


def test_targets_of_the_speed_issue_are_checked_against_hf_and_peers() -> None:
    compare = load_compare()
    text = compare.render(synthetic_report(), [VLLM, LLAMA])
    assert "| W1 >= 45 tok/s | 20.0 tok/s | not met |" in text
    assert "| W1 >= 3x HF generate | 2.00x | not met |" in text
    assert "| W2 >= 1.8x HF generate | 2.00x | met |" in text
    assert "| W1 >= 1.6x vLLM-CPU | 2.00x | met |" in text  # measured quiet
    assert "| W1 >= 1.25x llama.cpp bf16 | 2.00x | met — but the peer ran on a busy machine" in text
    # against the batched llama.cpp W2 (median 70), not its sequential one (40)
    assert "| W2 >= 1.3x llama.cpp batched (32 sequences per decode call) | 2.29x | met — but the peer ran" in text
    assert "| process start to LLM ready <= 1/10 of vLLM-CPU | 0.02x | met |" in text  # median 2 s vs 90 s
    assert "| peak RSS <= 1/3 of vLLM-CPU (W1+W2 worker vs its process tree) | 0.25x | met |" in text
    without_peers = compare.render(synthetic_report(), [])
    assert "| W1 >= 1.6x vLLM-CPU | — | not measured in this report |" in without_peers


def test_prompt_seeds_do_not_depend_on_the_process() -> None:
    compare = load_compare()
    first = compare.prompt_rng(0, "W2", 1).random()
    assert first == compare.prompt_rng(0, "W2", 1).random()
    assert first != compare.prompt_rng(0, "W2", 2).random()


def test_importing_compare_does_not_import_torch() -> None:
    import subprocess

    code = (f"import importlib.util, sys; spec = importlib.util.spec_from_file_location('c', "
            f"{str(REPO / 'benchmarks' / 'compare.py')!r}); m = importlib.util.module_from_spec(spec); "
            "sys.modules['c'] = m; spec.loader.exec_module(m); sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_every_target_names_a_figure_the_report_has() -> None:
    load_compare()
    from comparison import targets

    ours = {"pagedserve/W1", "pagedserve/W2", "pagedserve-int8/W1", "hf-generate/W1", "hf-generate/W2", "ready", "rss"}
    for target in targets.load_targets()["target"]:
        assert target["value"] in ours, target
        assert "at_least" in target or target["other"] in ours | set(targets.PEER_FIGURES), target
        assert target.get("peer") in (None, "llama", "vllm"), target
