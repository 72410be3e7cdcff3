"""benchmarks/compare.py's flags and its run: models, measurements, peers, the JSON and the report."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any



from . import BENCHMARKS, log
from . import __doc__ as DESCRIPTION
from .children import stop_on_sigterm
from .environment import ContentionMeter, git_state, machine_info, this_cpu_class, versions
from .measure import measure_model
from .models import QWEN05_SHAPE, QWEN_GGUF_NAME, TINY_SHAPE, build_random_model, build_real_model, default_gguf_path
from .peers import run_peer
from .report import render
from .workers import w3_child_main, worker_main
from .workloads import FULL_WORKLOADS, QUICK_WORKLOADS


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from pagedserve.platform import usable_cpu_count

    parser = argparse.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny model shape and short workloads (smoke run)")
    parser.add_argument("--threads", type=int, default=usable_cpu_count())
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats (default: 3; --quick: 2)")
    parser.add_argument("--models", default="random,real",
                        help="comma list of random (Qwen2.5-0.5B shape) and real (Qwen2.5-Coder GGUF, when cached)")
    parser.add_argument("--gguf", type=Path, default=None, help="the Qwen2.5-Coder-0.5B GGUF (default: pagedserve's cache)")
    parser.add_argument("--out-dir", type=Path, default=BENCHMARKS / "out", help="models, logs, JSON (not committed)")
    parser.add_argument("--results", type=Path, default=None,
                        help="Markdown report (default: benchmarks/RESULTS_<cpu class>.md; --quick: "
                             "OUT_DIR/RESULTS-quick.md)")
    parser.add_argument("--json", type=Path, default=None, help="raw figures (default: OUT_DIR/compare[-quick].json)")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-hf-cb", action="store_true", help="skip transformers' continuous batching")
    parser.add_argument("--skip-w3", action="store_true")
    parser.add_argument("--no-w3-serve", action="store_true", help="W3 without the `pagedserve serve` variant")
    parser.add_argument("--all-extras", action="store_true",
                        help="HF continuous batching and `pagedserve serve` W3 on every model, not only the first")
    parser.add_argument("--with-llamacpp", action="store_true", help="run ../shared/peers/llama-cpp/run.sh too")
    parser.add_argument("--with-vllm", action="store_true", help="run ../shared/peers/vllm-cpu/run.sh too")
    parser.add_argument("--peers-only", action="store_true", help="only run the requested peers (and save them)")
    parser.add_argument("--peer-json", type=Path, nargs="*", default=[], help="peer results saved earlier")
    parser.add_argument("--peer-save-dir", type=Path, default=BENCHMARKS / "peers")
    parser.add_argument("--render", type=Path, default=None,
                        help="re-render the report from a saved JSON (with --peer-json: those peer files instead)")
    # Internal: worker and W3 child processes.
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--w3-child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-model", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--t0", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--w3-prompt", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeats is None:
        args.repeats = 2 if args.quick else 3
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.results is None:
        args.results = args.out_dir / "RESULTS-quick.md" if args.quick else BENCHMARKS / f"RESULTS_{this_cpu_class()}.md"
    if args.json is None:
        args.json = args.out_dir / ("compare-quick.json" if args.quick else "compare.json")
    return args


def prepare_models(args: argparse.Namespace) -> list[dict[str, Any]]:
    gguf = args.gguf or default_gguf_path()
    wanted = {name.strip() for name in args.models.split(",") if name.strip()}
    models = []
    if args.quick:
        return [build_random_model("tiny-qwen2-shape", TINY_SHAPE, args.out_dir / "models" / "tiny-qwen2", None)]
    if "random" in wanted:
        log("building (or reusing) the Qwen2.5-0.5B-shaped random model")
        models.append(build_random_model("qwen2.5-0.5b-shape-random", QWEN05_SHAPE,
                                         args.out_dir / "models" / "qwen2.5-0.5b-shape-random", gguf))
    if "real" in wanted:
        if gguf.is_file():
            log(f"preparing the real model from {gguf}")
            models.append(build_real_model(gguf, args.out_dir / "models" / "qwen2.5-coder-0.5b-instruct-bf16"))
        else:
            log(f"real model skipped: {gguf} is not cached (fetch it with `pagedserve doctor {QWEN_GGUF_NAME}`)")
    return models


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args.worker, args.worker_model, args.threads, args.max_model_len)
    if args.w3_child:
        prompt = [int(t) for t in args.w3_prompt.split(",") if t]
        return w3_child_main(args.w3_child, args.worker_model, args.threads, args.max_model_len, args.t0, prompt)
    stop_on_sigterm()  # the orchestrator: its `finally` blocks close the workers
    peers = [json.loads(path.read_text()) for path in args.peer_json]
    if args.render:
        report = json.loads(args.render.read_text())
        report["meta"]["rendered"] = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                                      "command": shlex.join(["python", "benchmarks/compare.py",
                                                             *(sys.argv[1:] if argv is None else argv)])}
        # Peer files given now replace the copies saved in the JSON (their notes may have been completed since).
        args.results.write_text(render(report, peers or report.get("peers", [])) + "\n")
        log(f"wrote {args.results}")
        return 0
    args.out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": shlex.join(["python", "benchmarks/compare.py", *(sys.argv[1:] if argv is None else argv)]),
            "quick": args.quick, "threads": args.threads, "repeats": args.repeats,
            "max_model_len": args.max_model_len, "machine": machine_info(), "versions": versions(),
            "git": git_state(), "load_start": os.getloadavg(),
            "environment": {name: os.environ[name] for name in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "KMP_BLOCKTIME",
                                                                "LD_PRELOAD", "MKL_NUM_THREADS") if name in os.environ},
            "workloads": [asdict(w) for w in (QUICK_WORKLOADS if args.quick else FULL_WORKLOADS)]}
    models = prepare_models(args)
    meter = ContentionMeter()
    records = []
    if not args.peers_only:
        log_dir = args.out_dir / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        workloads = QUICK_WORKLOADS if args.quick else FULL_WORKLOADS
        for index, model in enumerate(models):
            # The full set on the first model; the slowest extras again only with --all-extras (time budget).
            records.append(measure_model(model, args, workloads, log_dir, extras=index == 0 or args.all_extras))
    peer_models = [m for m in models if m["kind"] == "random"][:1]
    for peer, wanted in (("llama-cpp", args.with_llamacpp), ("vllm-cpu", args.with_vllm)):
        for model in peer_models if wanted else []:
            peers.append(run_peer(peer, model, args.out_dir, args.peer_save_dir))
    if args.peers_only:
        return 0 if all(not p.get("failure") for p in peers) else 1
    meta["load_end"] = os.getloadavg()
    meta["contention"] = meter.stop()
    meta["wall_s"] = time.perf_counter() - started
    report = {"meta": meta, "models": records, "peers": peers}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(render(report, peers) + "\n")
    log(f"wrote {args.results} and {args.json}")
    failed = any(record["errors"] for record in records)
    return 1 if failed else 0
