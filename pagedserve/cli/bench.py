"""`pagedserve bench`: honest benchmarks.

bench serve       load a running OpenAI-compatible server; TTFT / TPOT / ITL / E2E with spread,
                  throughput from counted tokens, warm-up reported apart as "cold".
bench startup     launch a server, time port open, readiness phases, first vs steady requests,
                  peak RSS of its process tree; stop the tree and check nothing is left.
bench throughput  offline LLM.generate on random token prompts (like `vllm bench throughput`):
                  requests/s, output and total tok/s from counted tokens, warm-up run apart.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
from typing import TYPE_CHECKING

from pagedserve import envs
from pagedserve.engine.arg_utils import DefaultsHelpFormatter

if TYPE_CHECKING:
    from pagedserve.benchmarks.serve import ServeBenchConfig
    from pagedserve.benchmarks.startup import StartupBenchConfig
    from pagedserve.benchmarks.throughput import ThroughputBenchConfig

# vLLM's --backend names of the APIs this client speaks, and the endpoint each loads by default
BACKEND_ENDPOINTS = {"openai": "/v1/completions", "vllm": "/v1/completions", "openai-chat": "/v1/chat/completions",
                     "openai-embeddings": "/v1/embeddings"}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="benchmarks: serving load, server start-up, offline throughput",
        description="Honest benchmarks: token rates from counted tokens, warm-up apart, spread not one number.",
    )
    bench_subparsers = parser.add_subparsers(dest="bench_command", metavar="BENCH",  # no prefixes, as main.py
                                             parser_class=functools.partial(
                                                 argparse.ArgumentParser, allow_abbrev=False,
                                                 formatter_class=DefaultsHelpFormatter))
    _register_serve(bench_subparsers)
    _register_startup(bench_subparsers)
    _register_throughput(bench_subparsers)

    def print_help(_: argparse.Namespace) -> int:
        parser.print_help()
        return 2

    parser.set_defaults(func=print_help)


def _register_serve(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="load a running OpenAI-compatible server with streamed requests",
        description="Load a running OpenAI-compatible server and report latency distributions and token throughput.",
    )
    target = parser.add_argument_group("server")
    target.add_argument("--base-url", default=None,
                        help="server root URL, or unix:PATH for a server on --uds (default: http://HOST:PORT)")
    target.add_argument("--host", default="127.0.0.1", help="with --port, the server when --base-url is not given")
    target.add_argument("--port", type=int, default=8000)
    target.add_argument("--model", default=None, help="model name to request (default: first id of GET /v1/models)")
    target.add_argument("--backend", default="openai", choices=sorted(BACKEND_ENDPOINTS),
                        help="vLLM's: the API to load, its default --endpoint (openai and vllm: /v1/completions, "
                             "openai-chat: /v1/chat/completions, openai-embeddings: /v1/embeddings)")
    target.add_argument("--endpoint", default=None,
                        choices=["/v1/completions", "/v1/chat/completions", "/v1/embeddings"],
                        help="(default: the --backend's)")
    target.add_argument("--api-key", default=None,
                        help="bearer token (default: $PAGEDSERVE_API_KEY, else $VLLM_API_KEY, else $OPENAI_API_KEY)")
    target.add_argument(
        "--request-timeout",
        type=float,
        default=3600.0,
        help="seconds to wait for the next byte of a response (default: %(default)s)",
    )
    data = parser.add_argument_group("prompts")
    data.add_argument("--dataset", "--dataset-name", dest="dataset", default="random",
                      choices=["random", "jsonl", "sharegpt"])
    data.add_argument("--dataset-path", default=None, help='jsonl: a file of {"prompt": ..., "max_tokens": ...} '
                      "lines; sharegpt: ShareGPT's JSON (ShareGPT_V3_unfiltered_cleaned_split.json), read as vLLM's "
                      "(first turn the prompt, the answer's length its max_tokens)")
    data.add_argument("--sharegpt-output-len", type=int, default=None,
                      help="ShareGPT: max_tokens of every prompt instead of its answer's length")
    data.add_argument("--random-prefix-len", type=int, default=0,
                      help="random prompts share a prefix of this many random tokens, counted on top of the input "
                           "length (vLLM's)")
    data.add_argument("--input-len", "--random-input-len", dest="input_len", type=int, default=1024)
    data.add_argument("--output-len", "--random-output-len", dest="output_len", type=int, default=128)
    data.add_argument(
        "--range-ratio",
        "--random-range-ratio",
        dest="range_ratio",
        type=float,
        default=0.0,
        help="lengths drawn uniformly in [len*(1-r), len*(1+r)] (default: %(default)s)",
    )
    data.add_argument("--tokenizer", default=None, help="local HF tokenizer dir, if the server has no /tokenize")
    data.add_argument(
        "--prompt-format",
        default="token-ids",
        choices=["token-ids", "text"],
        help="/v1/completions prompts as token ids (exact) or text (re-tokenized to check); chat is always text",
    )
    load = parser.add_argument_group("load")
    load.add_argument("--num-prompts", type=int, default=100)
    load.add_argument(
        "--max-concurrency", type=int, default=None, help="requests in flight at most (default: no limit)"
    )
    load.add_argument(
        "--request-rate", type=float, default=math.inf, help="Poisson arrivals per second; inf = all at once"
    )
    load.add_argument("--warmup-requests", type=int, default=1, help="sequential requests first, reported as cold")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="arrival gaps gamma-distributed with this shape, mean 1/--request-rate (1: Poisson; "
                           "lower: burstier)")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--ignore-eos", action="store_true", help="ask for exactly max_tokens tokens (vLLM extra param)")
    load.add_argument("--temperature", type=float, default=0.0)
    load.add_argument("--top-p", type=float, default=None)
    load.add_argument("--top-k", type=int, default=None)
    load.add_argument("--min-p", type=float, default=None)
    out = parser.add_argument_group("output")
    out.add_argument("--json", dest="json_path", default=None, help="write every raw timing and the summary here")
    out.add_argument("--save-result", action="store_true",
                     help="also write the steady requests as `vllm bench serve --save-result` does (flat keys, "
                          "ms), to --result-dir/--result-filename")
    out.add_argument("--result-dir", default=None, help="(default: the current folder)")
    out.add_argument("--result-filename", default=None,
                     help="(default: vLLM's {label or backend}-{rate}qps-{model}-{date}.json)")
    out.add_argument("--label", default=None, help="a name for the run in the saved result (vLLM's)")
    out.add_argument("--metadata", nargs="*", default=[], metavar="KEY=VALUE",
                     help="more fields for the saved result (vLLM's)")
    out.add_argument("--percentile-metrics", default="ttft,tpot,itl",
                     help="saved result: the metrics with percentiles, of ttft, tpot, itl, e2el")
    out.add_argument("--metric-percentiles", default="99", help="saved result: their percentiles, e.g. 25,50,99")
    out.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                     help="saved result and table: requests per second within these service-level objectives, "
                          "e.g. ttft:200 tpot:50 (of ttft, tpot, e2el)")
    out.add_argument("--no-progress", "--disable-tqdm", dest="no_progress", action="store_true",
                     help="no progress counter on stderr")
    out.add_argument("--strict", action="store_true", help="exit 1 when any honesty check is raised")
    parser.set_defaults(func=run_serve)


def _register_startup(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "startup",
        help="launch a server; time start-up phases, first and steady requests, peak RSS",
        usage="%(prog)s [options] [MODEL] [options] [-- SERVE_FLAGS ...]",
        description=(
            "Launch `pagedserve serve MODEL` (or --server-cmd) on a free port, time port open and readiness, "
            "send a first request and steady ones, report peak RSS, then stop it and check nothing is left. "
            "Flags after `--` go to the server."
        ),
    )
    parser.add_argument(
        "--server-cmd",
        default=None,
        help='another server command, e.g. "vllm serve M --port {port}"; {port} {host} {model} are filled, '
        "and --host/--port appended when {port} is absent",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=None, help="default: a free port")
    parser.add_argument("--ready-timeout", type=float, default=1800.0, help="seconds to wait for readiness")
    parser.add_argument("--num-steady-requests", type=int, default=5)
    parser.add_argument("--prompt", default="Hello, my name is")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"])
    parser.add_argument("--grace-period", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL")
    parser.add_argument("--api-key", default=None,
                        help="bearer token (default: $PAGEDSERVE_API_KEY, else $VLLM_API_KEY, else $OPENAI_API_KEY)")
    parser.add_argument("--log-file", default=None, help="server output (default: a temporary file, reported)")
    parser.add_argument("--json", dest="json_path", default=None, help="write every figure here")
    # One REMAINDER positional keeps `--` in place (MODEL plus a `?` positional would not): MODEL, our
    # own flags written after it, `--`, then the server's flags. `_split_startup_rest` sorts them out.
    parser.add_argument(
        "rest",
        nargs=argparse.REMAINDER,
        metavar="[MODEL] [-- SERVE_FLAGS ...]",
        help="model to serve (also fills {model} in --server-cmd), then after `--` flags for the server",
    )
    parser.set_defaults(func=run_startup, startup_parser=parser)


def _register_throughput(subparsers: argparse._SubParsersAction) -> None:
    from pagedserve.cli.common import add_thread_args
    from pagedserve.engine.arg_utils import EngineArgs

    parser = subparsers.add_parser(
        "throughput",
        help="offline LLM.generate on random token prompts; requests/s and tok/s from counted tokens",
        description=(
            "Build the engine in this process (MODEL and engine flags as for `pagedserve serve`), run a warm-up "
            "batch (reported apart), then --num-iters batches of --num-prompts random token prompts "
            "(fresh prompts each time, greedy, EOS ignored) through LLM.generate. Rates come from the tokens "
            "counted in the outputs."
        ),
    )
    EngineArgs.add_cli_args(parser, positional_model=True)
    add_thread_args(parser)
    data = parser.add_argument_group("workload")
    data.add_argument("--num-prompts", type=int, default=32, help="prompts per batch (default: %(default)s)")
    data.add_argument("--input-len", "--random-input-len", dest="input_len", type=int, default=128)
    data.add_argument("--output-len", "--random-output-len", dest="output_len", type=int, default=64)
    data.add_argument("--range-ratio", "--random-range-ratio", dest="range_ratio", type=float, default=0.0,
                      help="lengths drawn uniformly in [len*(1-r), len*(1+r)] (default: %(default)s)")
    data.add_argument("--num-iters", type=int, default=3, help="timed batches (default: %(default)s)")
    data.add_argument("--num-warmup-prompts", type=int, default=None,
                      help="prompts in the warm-up batch (default: --num-prompts; 0: none)")
    data.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--json", dest="json_path", default=None, help="write every run and the summary here")
    parser.set_defaults(func=run_throughput)


def serve_config_from_args(args: argparse.Namespace) -> ServeBenchConfig:
    from pagedserve.benchmarks.serve import ServeBenchConfig

    sampling = {name: getattr(args, name) for name in ("top_p", "top_k", "min_p") if getattr(args, name) is not None}
    return ServeBenchConfig(
        base_url=args.base_url or f"http://{args.host}:{args.port}",
        model=args.model,
        endpoint=args.endpoint or BACKEND_ENDPOINTS[args.backend],
        dataset=args.dataset,
        dataset_path=args.dataset_path,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.range_ratio,
        num_prompts=args.num_prompts,
        max_concurrency=args.max_concurrency,
        request_rate=args.request_rate,
        warmup_requests=args.warmup_requests,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        tokenizer=args.tokenizer,
        prompt_format=args.prompt_format,
        api_key=args.api_key or envs.client_api_key(),
        request_timeout=args.request_timeout,
        show_progress=not args.no_progress,
        burstiness=args.burstiness,
        random_prefix_len=args.random_prefix_len,
        sampling=sampling,
        sharegpt_output_len=args.sharegpt_output_len,
    )


def _saved_result_options(args: argparse.Namespace) -> dict:
    """--save-result's settings, checked before the run (ValueError naming the flag)."""
    from pagedserve.benchmarks.report import VLLM_PERCENTILE_METRICS, parse_goodput

    metrics = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    unknown = [m for m in metrics if m not in VLLM_PERCENTILE_METRICS]
    if unknown:
        raise ValueError(f"--percentile-metrics {unknown[0]!r}: give some of {', '.join(VLLM_PERCENTILE_METRICS)}")
    try:
        percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    except ValueError:
        percentiles = [-1.0]
    if not all(0 <= p <= 100 for p in percentiles):
        raise ValueError(f"--metric-percentiles {args.metric_percentiles!r}: numbers in [0, 100], comma-separated")
    metadata = {}
    for item in args.metadata:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--metadata {item!r}: give KEY=VALUE")
        metadata[key] = value
    return {"percentile_metrics": metrics, "metric_percentiles": percentiles, "label": args.label,
            "metadata": metadata, "goodput": parse_goodput(" ".join(args.goodput or []))}


def check_writable(path: str, flag: str = "--json") -> None:
    """ValueError naming `flag` and its path where the figures could not be written (found after a whole run
    before)."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise ValueError(f"{flag} {path}: folder {folder} does not exist or cannot be written")


def run_error(exc: Exception, base_url: str, request_timeout: float) -> str:
    """What a failed run says: where the server was not reachable, or that it wants an API key (QA-AG: httpx's
    own words named neither the address nor --api-key)."""
    import httpx

    if isinstance(exc, httpx.ConnectError):
        return f"cannot connect to {base_url} ({exc}): is the server running there? (--base-url, or --host/--port)"
    if isinstance(exc, httpx.HTTPStatusError) and exc.response.status_code == 401:
        return (f"{base_url} asks for an API key (401): pass --api-key, or set PAGEDSERVE_API_KEY / "
                "OPENAI_API_KEY")
    return str(exc) or f"{type(exc).__name__} (--request-timeout {request_timeout:g} s?)"


def run_serve(args: argparse.Namespace) -> int:
    import httpx

    from pagedserve.benchmarks.report import (format_table, request_goodput, result_to_dict, vllm_result_dict,
                                              vllm_result_filename, write_json)
    from pagedserve.benchmarks.serve import run_serve_bench_sync

    try:
        config = serve_config_from_args(args)
        config.validate()
        saved = _saved_result_options(args)
        if args.json_path:
            check_writable(args.json_path)  # before the run, not after it
        if args.save_result:  # the folder made, as vLLM's bench makes it
            if args.result_dir:
                try:
                    os.makedirs(args.result_dir, exist_ok=True)
                except OSError as exc:
                    raise ValueError(f"--result-dir {args.result_dir}: cannot be made ({exc})") from exc
            named = [flag for flag, value in (("--result-dir", args.result_dir),
                                              ("--result-filename", args.result_filename)) if value]
            check_writable(os.path.join(args.result_dir or ".", args.result_filename or "result.json"),
                           "/".join(named) or "--result-dir")  # (a folder in the file name was said as --result-dir)
    except ValueError as exc:
        print(f"pagedserve bench serve: error: {exc}", file=sys.stderr)
        return 2
    try:
        result = run_serve_bench_sync(config)
    except (RuntimeError, ValueError, OSError, httpx.HTTPError) as exc:
        print(f"pagedserve bench serve: error: {run_error(exc, config.base_url, args.request_timeout)}",
              file=sys.stderr)
        return 1
    print(format_table(result))
    if result.summary is not None:  # --metric-percentiles the table does not show (it has P90 and P99)
        figures = vllm_result_dict(result, args.backend, **saved)
        for name in saved["percentile_metrics"]:
            for pct in saved["metric_percentiles"]:
                if pct not in (50.0, 90.0, 99.0):
                    print(f"{f'P{pct:g} {name.upper()} (ms):':<40}{figures[f'p{pct:g}_{name}_ms']:>10.2f}")
    if saved["goodput"] and result.summary is not None:
        goodput = request_goodput(result.records, result.summary.duration, saved["goodput"])
        print(f"{'Request goodput (req/s):':<40}{goodput:>10.2f}")
    if args.json_path:
        write_json(args.json_path, result_to_dict(result))
        print(f"Raw timings written to {args.json_path}")
    if args.save_result and result.summary is not None:
        path = os.path.join(args.result_dir or ".",
                            args.result_filename or vllm_result_filename(result, args.backend, args.label))
        write_json(path, vllm_result_dict(result, args.backend, **saved))
        print(f"Result written to {path} (vllm bench serve's format)")
    summary = result.summary
    if summary is None or summary.num_completed == 0:
        return 1
    return 1 if args.strict and summary.warnings else 0


def _split_startup_rest(rest: list[str]) -> tuple[str | None, list[str], list[str]]:
    """[MODEL] [our flags] [-- server flags] -> (model, our flags, server flags)."""
    split = rest.index("--") if "--" in rest else len(rest)
    before, serve_args = rest[:split], rest[split + 1 :]
    model = before.pop(0) if before and not before[0].startswith("-") else None
    return model, before, serve_args


def _merge_startup_args(args: argparse.Namespace) -> tuple[argparse.Namespace, str | None, list[str]]:
    """Parse our own flags written after MODEL (before `--`) into `args`: (args, model, server flags)."""
    model, ours, serve_args = _split_startup_rest(list(args.rest))
    if ours:
        args = args.startup_parser.parse_args(ours, namespace=argparse.Namespace(**{**vars(args), "rest": []}))
        if args.rest:
            raise ValueError(f"unexpected arguments {args.rest}; server flags go after `--`")
    return args, model, serve_args


def startup_config_from_args(args: argparse.Namespace) -> StartupBenchConfig:
    from pagedserve.benchmarks.startup import StartupBenchConfig

    args, model, serve_args = _merge_startup_args(args)
    if model is None and not args.server_cmd:
        raise ValueError("give a MODEL to serve, or --server-cmd")
    return StartupBenchConfig(
        model=model,
        server_cmd=args.server_cmd,
        serve_args=tuple(serve_args),
        host=args.host,
        port=args.port,
        ready_timeout=args.ready_timeout,
        num_steady_requests=args.num_steady_requests,
        prompt=args.prompt,
        max_tokens=args.max_tokens,
        ignore_eos=args.ignore_eos,
        endpoint=args.endpoint,
        grace_period=args.grace_period,
        log_path=args.log_file,
        api_key=args.api_key or envs.client_api_key(),
    )


def run_startup(args: argparse.Namespace) -> int:
    from pagedserve.benchmarks.report import format_startup_table, startup_to_dict, write_json
    from pagedserve.benchmarks.startup import run_startup_bench

    try:
        config = startup_config_from_args(args)
        args = _merge_startup_args(args)[0]  # --json written after MODEL counts too
    except ValueError as exc:
        print(f"pagedserve bench startup: error: {exc}", file=sys.stderr)
        return 2
    result = run_startup_bench(config)
    print(format_startup_table(result))
    if args.json_path:
        write_json(args.json_path, startup_to_dict(result))
        print(f"Figures written to {args.json_path}")
    has_leftovers = result.shutdown is not None and bool(result.shutdown.leftover_pids)
    return 1 if result.error or has_leftovers else 0


def throughput_config_from_args(args: argparse.Namespace) -> ThroughputBenchConfig:
    from pagedserve.benchmarks.throughput import ThroughputBenchConfig

    config = ThroughputBenchConfig(
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.range_ratio,
        num_iters=args.num_iters,
        num_warmup_prompts=args.num_warmup_prompts,
        seed=args.seed,
        temperature=args.temperature,
    )
    config.validate()
    return config


def run_throughput(args: argparse.Namespace) -> int:
    import dataclasses
    import time

    from pagedserve.cli.common import apply_thread_args, engine_args_from_cli, setup_logging

    apply_thread_args(args)  # before torch loads
    from pagedserve.benchmarks.report import format_throughput_table, throughput_to_dict, write_json
    from pagedserve.benchmarks.throughput import run_throughput_bench, token_pool
    from pagedserve.entrypoints.llm import LLM

    try:
        config = throughput_config_from_args(args)
        engine_args = engine_args_from_cli(args)
    except ValueError as exc:
        print(f"pagedserve bench throughput: error: {exc}", file=sys.stderr)
        return 2
    setup_logging()
    start = time.perf_counter()
    try:
        llm = LLM(**dataclasses.asdict(engine_args))
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"pagedserve bench throughput: error: {exc}", file=sys.stderr)
        return 1
    load_seconds = time.perf_counter() - start
    model_config = llm.engine.config.model
    if model_config.task != "generate":  # (its first prompt raised "give PoolingParams" with a traceback)
        print(f"pagedserve bench throughput: error: {engine_args.model} is an embedding model: bench throughput "
              "times text generation (serve it and time /v1/embeddings: pagedserve bench serve --backend "
              "openai-embeddings)", file=sys.stderr)
        return 2
    longest = int(config.input_len * (1 + config.range_ratio)) + int(config.output_len * (1 + config.range_ratio))
    if longest > model_config.max_model_len:
        print(f"pagedserve bench throughput: error: prompts + outputs reach {longest} tokens, more than "
              f"max_model_len {model_config.max_model_len}; lower --input-len/--output-len", file=sys.stderr)
        return 2
    tokenizer = llm.get_tokenizer()
    vocab_size = min(model_config.hf_config.vocab_size, getattr(tokenizer, "vocab_size", None) or 1 << 62)
    pool = token_pool(vocab_size, getattr(tokenizer, "all_special_ids", []))
    result = run_throughput_bench(llm, pool, config, model=model_config.served_model_name, load_seconds=load_seconds)
    print(format_throughput_table(result))
    if args.json_path:
        write_json(args.json_path, throughput_to_dict(result))
        print(f"Figures written to {args.json_path}")
    return 0
