"""`pagedserve serve [MODEL] [flags]`: the OpenAI-compatible server; flags mean what vLLM's mean."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from pagedserve import envs
from pagedserve.cli.common import (add_thread_args, apply_thread_args, engine_args_from_cli, fail,
                                   process_start_time, setup_logging)
from pagedserve.engine.arg_utils import EngineArgs, RequestLimits
from pagedserve.entrypoints.openai.tool_calls import PARSERS
from pagedserve.entrypoints.ray_serve.args import ReplicaArgs

if TYPE_CHECKING:
    from pagedserve.entrypoints.openai.api_server import ServeOptions


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve", help="Start the OpenAI-compatible server.",
        description="Start the OpenAI-compatible server. Binds 127.0.0.1 by default; use --host 0.0.0.0 "
                    "to accept connections from other machines.")
    EngineArgs.add_cli_args(parser)
    RequestLimits.add_cli_args(parser.add_argument_group("per-request limits (HTTP 400 beyond them)"))
    parser.add_argument("--host", default="127.0.0.1", help="Address to bind (0.0.0.0 exposes the server).")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None,
                        help="Require 'Authorization: Bearer KEY' (default: $PAGEDSERVE_API_KEY).")
    parser.add_argument("--max-request-body-bytes", type=int, default=8 << 20,
                        help="Larger request bodies get HTTP 413.")
    parser.add_argument("--shutdown-grace-s", type=float, default=30.0,
                        help="On SIGTERM/SIGINT, seconds in-flight requests get to finish.")
    parser.add_argument("--uvicorn-log-level", default="warning")
    parser.add_argument("--root-path", default="",
                        help="The path prefix a reverse proxy serves this server under (e.g. /llm); API and web "
                             "page then work at that prefix.")
    parser.add_argument("--disable-web-ui", action="store_true",
                        help="Do not serve the chat and dashboard page at / (then / is a 404).")
    parser.add_argument("--startup-hold-file", default=None, help=argparse.SUPPRESS)  # testing only: see api_server
    tools = parser.add_argument_group("tool calling")
    tools.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='Let tool_choice "auto" (the default with tools) parse the calls the model writes; '
                            "needs --tool-call-parser.")
    tools.add_argument("--tool-call-parser", default=None, choices=PARSERS,
                       help="How the model writes tool calls: hermes (<tool_call>{json}</tool_call>: Qwen2.5, "
                            "Qwen3, Hermes) or llama3_json (Llama 3.x JSON calls).")
    ReplicaArgs.add_cli_args(parser.add_argument_group(
        "replicas on Ray Serve (pip install 'pagedserve[ray]'; --host/--port are then the Ray Serve endpoint's)"))
    add_thread_args(parser)
    parser.add_argument("-v", "--verbose", action="store_true")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    apply_thread_args(args)
    from pagedserve.engine.startup import StartupTracker
    from pagedserve.engine.setup import check_engine_args
    from pagedserve.entrypoints.openai.api_server import ServeOptions, run_server

    startup = StartupTracker(t0=process_start_time())
    setup_logging(args.verbose)
    if not 0 < args.port < 65536:
        return fail(f"--port must be in 1..65535, got {args.port}")
    if args.root_path and not args.root_path.startswith("/"):
        return fail(f"--root-path must start with '/', got {args.root_path!r}")
    engine_args = engine_args_from_cli(args)
    limits = RequestLimits.from_cli_args(args)
    replica_args = ReplicaArgs.from_cli_args(args)
    try:
        check_engine_args(engine_args)  # unsupported values fail before the port opens
        limits.check()
        replica_args.check()
    except ValueError as exc:
        return fail(str(exc))
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        return fail(f"--enable-auto-tool-choice needs --tool-call-parser NAME ({', '.join(PARSERS)}): the format "
                    "in which this model writes its tool calls")
    options = ServeOptions(host=args.host, port=args.port, api_key=args.api_key or envs.api_key(),
                           max_body_bytes=args.max_request_body_bytes, shutdown_grace_s=args.shutdown_grace_s,
                           uvicorn_log_level=args.uvicorn_log_level, limits=limits,
                           tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
                           root_path=args.root_path, enable_web_ui=not args.disable_web_ui,
                           startup_hold_file=args.startup_hold_file)
    if replica_args.enabled:
        return run_replicas(engine_args, options, replica_args)
    return run_server(engine_args, options, startup)


def run_replicas(engine_args: EngineArgs, options: ServeOptions, replica_args: ReplicaArgs) -> int:
    """--replicas N: the engines as Ray Serve replicas behind one endpoint (entrypoints/ray_serve/)."""
    from pagedserve.entrypoints.ray_serve import RAY_MISSING, ray_is_installed

    if not ray_is_installed():
        return fail(RAY_MISSING)
    from pagedserve.entrypoints.ray_serve.app import run

    # Each replica's process reads its OpenMP wait policy before torch loads: hand it the one set here.
    policy = os.environ.get("OMP_WAIT_POLICY")
    return run(engine_args, options, replica_args, {"OMP_WAIT_POLICY": policy} if policy else None)
