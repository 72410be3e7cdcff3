"""Peers (../shared/peers/*/run.sh): run once on a model directory, their JSON kept."""

from __future__ import annotations

import datetime
import json
import os
import shlex
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from . import BENCHMARKS, REPO, log
from .children import stop
from .environment import ContentionMeter

PEERS_DIR = REPO.parent / "shared" / "peers"
LLAMACPP_WORK = Path("/tmp/llama-cpp-peer")  # run.sh's default work directory (its venv and GGUF files)


def run_peer(peer: str, model: dict[str, Any], out_dir: Path, save_dir: Path) -> dict[str, Any]:
    """Run a peer's run.sh on the model directory; parse its '### RESULTS {json}' lines; save and return them."""
    script = PEERS_DIR / peer / "run.sh"
    started = datetime.datetime.now(datetime.timezone.utc)
    log_path = out_dir / f"peer-{peer}-{model['name']}-{started:%Y%m%dT%H%M%S}.log"
    command = [str(script), model["path"]]
    load_before = os.getloadavg()
    log(f"running peer {peer} on {model['name']} (log: {log_path}); the first run installs it (slow)")
    start = time.perf_counter()
    meter = ContentionMeter()
    with open(log_path, "w") as handle:
        process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        load_samples = []  # 1-minute load average every 10 s: how busy the machine was meanwhile
        try:
            while process.poll() is None:
                load_samples.append(os.getloadavg()[0])
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    continue
        finally:  # also when the benchmark is stopped: the peer's build or run goes with it
            stop(process, grace=0)
        done = subprocess.CompletedProcess(command, process.returncode)
    contention = meter.stop()
    text = log_path.read_text(errors="replace")
    results = [json.loads(line.split("### RESULTS ", 1)[1]) for line in text.splitlines()
               if line.startswith("### RESULTS ")]
    entry = {"peer": peer, "model": model["name"], "model_path": model["path"],
             "date": started.isoformat(timespec="seconds"), "command": shlex.join(command),
             "returncode": done.returncode, "wall_s": time.perf_counter() - start, "results": results,
             "load_average_before": load_before, "load_average_after": os.getloadavg(),
             "load_average_1min_during": {"max": max(load_samples, default=0.0),
                                          "mean": statistics.fmean(load_samples) if load_samples else 0.0},
             "others_cpu_share": contention["others_cpu_share"], "own_cpu_share": contention["own_cpu_share"],
             "progress_lines": [line for line in text.splitlines() if line.startswith("### ")
                                and not line.startswith("### RESULTS")],
             "log": str(log_path)}
    if done.returncode != 0 or not results:
        entry["failure"] = "\n".join(text.splitlines()[-25:])
    elif peer == "llama-cpp":
        results.append(run_llamacpp_batched(model, log_path))
    save_dir.mkdir(parents=True, exist_ok=True)
    saved = save_dir / f"{peer}-{model['name']}.json"
    saved.write_text(json.dumps(entry, indent=2) + "\n")
    log(f"peer {peer}: exit {done.returncode}, {len(results)} result line(s); saved {saved}")
    return entry


def run_llamacpp_batched(model: dict[str, Any], log_path: Path) -> dict[str, Any]:
    """llama.cpp's W2 with all 32 sequences in each decode call (benchmarks/llamacpp_batched_w2.py, run with
    the interpreter run.sh installed): the peer script's own W2 is sequential."""
    python = LLAMACPP_WORK / "venv" / "bin" / "python"
    gguf = LLAMACPP_WORK / f"{Path(model['path']).name}-bf16.gguf"
    command = [str(python), str(BENCHMARKS / "llamacpp_batched_w2.py"), str(gguf)]
    log(f"running llama.cpp batched W2 on {gguf.name}")
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    with open(log_path, "a") as handle:
        handle.write(f"\n$ {shlex.join(command)}\n{done.stdout}{done.stderr[-4000:]}")
    line = next((l for l in done.stdout.splitlines() if l.startswith("RESULT ")), None)
    runs = json.loads(line.removeprefix("RESULT ")) if line else []
    return {"gguf": "bf16", "W2_batched": runs, "command": shlex.join(command)}
