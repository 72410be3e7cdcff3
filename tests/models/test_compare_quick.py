"""benchmarks/compare.py --quick end to end on a tiny model shape: every system, workload and figure is there,
with tokens counted from the outputs (no speed is asserted). Slow (~35 s on 2 cores: every system in fresh
processes): `python -m pytest -m slow tests/models/test_compare_quick.py`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_quick_run_measures_every_system_and_counts_tokens(tmp_path: Path) -> None:
    results, raw = tmp_path / "RESULTS.md", tmp_path / "compare.json"
    command = [sys.executable, str(REPO / "benchmarks" / "compare.py"), "--quick", "--repeats", "1",
               "--out-dir", str(tmp_path / "out"), "--results", str(results), "--json", str(raw)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(raw.read_text())
    (model,) = report["models"]
    assert model["errors"] == {}
    expected = {"W1": (1, 8, 16), "W2": (4, 16, 8)}  # prompts, input length, output length of --quick
    seen = set()
    for entry in model["runs"]:
        prompts, input_len, output_len = expected[entry["workload"]]
        assert entry["num_requests"] == prompts
        assert entry["num_prompt_tokens"] == prompts * input_len
        assert entry["num_output_tokens"] == prompts * output_len, entry
        assert entry["num_early_stops"] == 0 and entry["elapsed_s"] > 0
        seen.add((entry["system"], entry["workload"], entry["repeat"]))
    assert seen == {(system, workload, repeat) for repeat in ("warmup", 0)
                    for system, workload in [("pagedserve", "W1"), ("hf-generate", "W1"), ("pagedserve", "W2"),
                                             ("hf-generate", "W2"), ("hf-cb", "W2"), ("pagedserve-int8", "W1")]}
    w3 = {entry["system"]: entry for entry in model["w3"]}
    assert set(w3) == {"pagedserve", "hf-generate", "pagedserve-serve"}
    for system in ("pagedserve", "hf-generate"):
        marks = w3[system]["marks"]
        assert w3[system]["num_tokens"] == 1
        assert 0 <= marks["imported"] <= marks["loaded"] <= marks["first_token"] == w3[system]["first_token_s"]
    assert w3["pagedserve-serve"]["num_tokens"] == 1
    assert 0 < w3["pagedserve-serve"]["marks"]["ready"] < w3["pagedserve-serve"]["first_token_s"]
    assert set(model["systems"]) == {"pagedserve", "hf", "pagedserve-int8"}
    assert all(info["threads"] == report["meta"]["threads"] for info in model["systems"].values())
    text = results.read_text()
    assert report["meta"]["command"] in text
    assert "| W1 | output tok/s |" in text and "| W2 | total tok/s |" in text and "| W3 |" in text
    assert "| W1 | output tok/s, pagedserve `--quantization int8` |" in text
    assert "—" not in text.split("| W1 | output tok/s |")[1].split("\n")[0].split("|")[1]  # pagedserve W1 figure
