"""One model measured: W1 and W2 with the systems taking turns repeat by repeat, then W3."""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path
from typing import Any

from . import log
from .workloads import W3_PROMPT_LEN, Workload, make_prompts, prompt_pool, prompt_rng
from .workers import Worker, run_w3, run_w3_serve


def measure_model(model: dict[str, Any], args: argparse.Namespace, workloads: tuple[Workload, ...],
                  log_dir: Path, extras: bool = True) -> dict[str, Any]:
    """W1, W2 (warm-up + repeats, systems taking turns) and W3 for one model. Without `extras`, no HF
    continuous batching and no `pagedserve serve` W3 (the slowest parts; kept for the first model)."""
    path = model["path"]
    pool = prompt_pool(path)
    record: dict[str, Any] = {**model, "workloads": [asdict(w) for w in workloads], "systems": {}, "runs": [],
                              "w3": [], "errors": {}, "skipped": [] if extras else ["hf-cb", "pagedserve-serve"]}
    workers: dict[str, Worker] = {}
    for system in ("pagedserve", "hf") + (("pagedserve-int8",) if extras else ()):
        log(f"{model['name']}: loading {system} worker")
        worker = Worker(system, path, args.threads, args.max_model_len, log_dir)
        if worker.hello.get("ok"):
            workers[system] = worker
            record["systems"][system] = {k: v for k, v in worker.hello.items() if k != "ok"}
        else:
            record["errors"][system] = worker.hello.get("error")
            worker.close()
    turns = [(w, s) for w in workloads for s in ("pagedserve", "hf-generate", "hf-cb", "pagedserve-int8")
             if not (s == "hf-cb" and (w.num_prompts == 1 or args.no_hf_cb or not extras))
             and not (s == "pagedserve-int8" and (w.name != "W1" or not extras))]
    try:
        for repeat in ["warmup", *range(args.repeats)]:
            order = turns if repeat == "warmup" or repeat % 2 == 0 else turns[::-1]
            for workload, system in order:
                _one_run(record, workers, pool, workload, system, repeat, args.seed)
    finally:
        for name, worker in workers.items():
            final = worker.close()
            if final.get("ok"):
                record["systems"][name]["peak_rss_mib"] = final["peak_rss_mib"]
    if not args.skip_w3:
        _measure_w3(record, args, pool, log_dir, with_serve=extras and not args.no_w3_serve)
    return record


def _one_run(record: dict[str, Any], workers: dict[str, Worker], pool: list[int], workload: Workload, system: str,
             repeat: int | str, seed: int) -> None:
    worker = workers.get(system if system.startswith("pagedserve") else "hf")
    key = f"{system}/{workload.name}"
    if worker is None or key in record["errors"]:
        return
    # Same prompts for every system in a repeat; new prompts in every repeat (no prefix-cache reuse).
    index = -1 if repeat == "warmup" else int(repeat)
    prompts = make_prompts(pool, workload, prompt_rng(seed, workload.name, index))
    reply = worker.call({"op": "run", "mode": system, "prompts": prompts, "output_len": workload.output_len})
    if not reply.get("ok"):
        record["errors"][key] = reply.get("error")
        log(f"{key} failed: {reply.get('error')}")
        return
    entry = {"system": system, "workload": workload.name, "repeat": repeat,
             **{k: v for k, v in reply.items() if k not in ("ok", "peak_rss_mib")}}
    record["runs"].append(entry)
    log(f"{record['name']} {key} {'warm-up' if repeat == 'warmup' else f'repeat {repeat + 1}'}: "
        f"{entry['num_output_tokens']} tokens in {entry['elapsed_s']:.2f} s = "
        f"{entry['num_output_tokens'] / entry['elapsed_s']:.1f} tok/s")


def _measure_w3(record: dict[str, Any], args: argparse.Namespace, pool: list[int], log_dir: Path,
                with_serve: bool) -> None:
    systems = ["pagedserve", "hf-generate"] + (["pagedserve-serve"] if with_serve else [])
    for repeat in range(args.repeats):
        prompt = prompt_rng(args.seed, "W3", repeat).choices(pool, k=W3_PROMPT_LEN)
        for system in systems if repeat % 2 == 0 else systems[::-1]:
            key = f"{system}/W3"
            if key in record["errors"]:
                continue
            if system == "pagedserve-serve":
                reply = run_w3_serve(record["path"], args.threads, args.max_model_len, log_dir)
            else:
                child = "pagedserve" if system == "pagedserve" else "hf"
                reply = run_w3(child, record["path"], args.threads, args.max_model_len, prompt, log_dir)
            if not reply.get("ok"):
                record["errors"][key] = reply.get("error")
                log(f"{key} failed: {reply.get('error')}")
                continue
            record["w3"].append({"system": system, "repeat": repeat, **{k: v for k, v in reply.items() if k != "ok"}})
            log(f"{record['name']} {key} repeat {repeat + 1}: first token after {reply['first_token_s']:.2f} s")
