"""Workers: one process per system, driven by JSON lines (the protocol uses a private copy of stdout; anything
libraries print goes to stderr); W3 runs a fresh process per repeat, from process start to the first token."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from . import ENTRY
from .children import run as run_child, stop
from .runners import HFRunner, PagedserveRunner

PROTOCOL_PREFIX = "@@compare "


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def worker_main(system: str, model: str, threads: int, max_model_len: int) -> int:
    """Serve run commands from stdin; answer each with one protocol line."""
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # library prints (Python or C) go to stderr

    def reply(payload: dict[str, Any]) -> None:
        protocol.write(PROTOCOL_PREFIX + json.dumps(payload) + "\n")

    start = time.perf_counter()
    try:
        if system == "pagedserve-int8":
            runner = PagedserveRunner(model, threads, max_model_len, quantization="int8")
        else:
            runner_cls = PagedserveRunner if system == "pagedserve" else HFRunner
            runner = runner_cls(model, threads, max_model_len)
    except Exception as exc:  # reported to the orchestrator, which records it as this system's failure
        reply({"ok": False, "error": f"load failed: {type(exc).__name__}: {exc}"})
        return 1
    import torch

    import pagedserve

    reply({"ok": True, "load_s": time.perf_counter() - start, "threads": torch.get_num_threads(),
           "peak_rss_mib": _peak_rss_mib(), "pagedserve_from": str(Path(pagedserve.__file__).parent)})
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "exit":
            reply({"ok": True, "peak_rss_mib": _peak_rss_mib()})
            return 0
        try:
            result = runner.run(command["prompts"], command["output_len"], command["mode"])
            reply({"ok": True, **result, "peak_rss_mib": _peak_rss_mib()})
        except Exception as exc:
            reply({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
    return 0


class Worker:
    """The orchestrator's handle on one worker process."""

    def __init__(self, system: str, model: str, threads: int, max_model_len: int, log_dir: Path) -> None:
        self.system = system
        self.log_path = log_dir / f"worker-{system}.log"
        command = [sys.executable, str(ENTRY), "--worker", system, "--worker-model", model,
                   "--threads", str(threads), "--max-model-len", str(max_model_len)]
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                            text=True, bufsize=1, start_new_session=True)
        self.hello = self._read()

    def _read(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith(PROTOCOL_PREFIX):
                return json.loads(line[len(PROTOCOL_PREFIX):])
        tail = self.log_path.read_text(errors="replace").splitlines()[-15:]
        return {"ok": False, "error": f"worker exited with {self.process.wait()}: " + " | ".join(tail)}

    def call(self, command: dict[str, Any]) -> dict[str, Any]:
        if self.process.poll() is not None:
            return {"ok": False, "error": f"worker already exited with {self.process.returncode}"}
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        return self._read()

    def close(self) -> dict[str, Any]:
        """Ask the worker to exit (its final reply), up to 60 s for it; then end its process group (children.stop:
        anything it left running, such as tensor-parallel ranks, included)."""
        reply = self.call({"op": "exit"}) if self.process.poll() is None else {}
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        stop(self.process, grace=0)
        return reply


def w3_child_main(system: str, model: str, threads: int, max_model_len: int, t0: float, prompt: list[int]) -> int:
    """Load, generate ONE token, print the times (time.time() clock, relative to the parent's t0)."""
    marks = {"process_started": _process_start_time() - t0}
    if system == "pagedserve":
        from pagedserve import LLM, SamplingParams

        marks["imported"] = time.time() - t0
        llm = LLM(model, dtype="bfloat16", max_model_len=max_model_len, num_threads=threads, seed=0)
        marks["loaded"] = time.time() - t0
        output = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=1,
                                                                           ignore_eos=True))
        num_tokens = len(output[0].outputs[0].token_ids)
    else:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        marks["imported"] = time.time() - t0
        hf_model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).eval()
        hf_model.generation_config.eos_token_id = None
        marks["loaded"] = time.time() - t0
        with torch.inference_mode():
            ids = torch.tensor([prompt])
            out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False,
                                    pad_token_id=0)
        num_tokens = int(out.shape[1] - ids.shape[1])
    marks["first_token"] = time.time() - t0
    print(PROTOCOL_PREFIX + json.dumps({"ok": True, "marks": marks, "num_tokens": num_tokens,
                                        "peak_rss_mib": _peak_rss_mib()}), flush=True)
    return 0


def _process_start_time() -> float:
    import psutil

    return psutil.Process().create_time()


def run_w3(system: str, model: str, threads: int, max_model_len: int, prompt: list[int], log_dir: Path) -> dict:
    log_path = log_dir / f"w3-{system}.log"
    t0 = time.time()
    command = [sys.executable, str(ENTRY), "--w3-child", system, "--worker-model", model,
               "--threads", str(threads), "--max-model-len", str(max_model_len), "--t0", repr(t0),
               "--w3-prompt", ",".join(map(str, prompt))]
    with open(log_path, "ab") as log:
        done = run_child(command, timeout=1800, stderr=log)
    for line in done.stdout.splitlines():
        if line.startswith(PROTOCOL_PREFIX):
            reply = json.loads(line[len(PROTOCOL_PREFIX):])
            return {**reply, "first_token_s": reply["marks"]["first_token"]}
    return {"ok": False, "error": f"exit code {done.returncode}; see {log_path}"}


def run_w3_serve(model: str, threads: int, max_model_len: int, log_dir: Path) -> dict[str, Any]:
    """`pagedserve serve` in a child: time to /health 200, then TTFT of the first streamed request."""
    from pagedserve.benchmarks.startup import StartupBenchConfig, run_startup_bench

    config = StartupBenchConfig(model=model, num_steady_requests=0, max_tokens=1, ignore_eos=True,
                                log_path=str(log_dir / "w3-pagedserve-serve.log"), ready_timeout=1800,
                                serve_args=("--dtype", "bfloat16", "--max-model-len", str(max_model_len),
                                            "--num-threads", str(threads)))
    result = run_startup_bench(config)
    leftovers = result.shutdown.leftover_pids if result.shutdown else []
    if result.error or leftovers or result.first_request is None or result.first_request.ttft is None:
        return {"ok": False, "error": result.error or f"processes left behind: {leftovers}"}
    return {"ok": True, "first_token_s": result.time_to_ready + result.first_request.ttft,
            "marks": {"port_open": result.time_to_port_open, "ready": result.time_to_ready},
            "num_tokens": result.first_request.output_tokens, "peak_rss_mib": result.peak_rss_bytes / 2**20}
