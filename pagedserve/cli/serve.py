"""`pagedserve serve [MODEL] [flags]`: the OpenAI-compatible server; flags mean what vLLM's mean."""

from __future__ import annotations

import argparse
import logging
import os
import signal
from dataclasses import replace

from pagedserve import envs
from pagedserve.cli.common import (add_thread_args, apply_thread_args, engine_args_from_cli, fail,
                                   process_start_time, setup_logging, wait_settings)
from pagedserve.engine import vllm_compat
from pagedserve.engine.arg_utils import EngineArgs, RequestLimits
from pagedserve.entrypoints.openai.options import ServeOptions
from pagedserve.entrypoints.ray_serve.args import ReplicaArgs

logger = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve", help="Start the OpenAI-compatible server.",
        description="Start the OpenAI-compatible server. Binds 127.0.0.1 by default; use --host 0.0.0.0 "
                    "to accept connections from other machines.")
    add_serve_flags(parser)
    parser.add_argument("-v", "--verbose", action="store_true")
    parser.set_defaults(func=run)


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    """Every flag of `serve`: also taken by `plan` and `doctor`, so a serve command line pastes into them."""
    EngineArgs.add_cli_args(parser, positional_model=True)
    RequestLimits.add_cli_args(parser.add_argument_group("per-request limits (HTTP 400 beyond them)"))
    ServeOptions.add_cli_args(parser)
    ReplicaArgs.add_cli_args(parser.add_argument_group(
        "replicas on Ray Serve (pip install 'pagedserve[ray]'; --host/--port are then the Ray Serve endpoint's)"))
    add_thread_args(parser)
    vllm_compat.add_cli_args(parser)


def exit_on_signals_until_serving() -> None:
    """SIGTERM/SIGINT before the server takes them over (the first second: importing torch) end the process with
    exit code 0, as a stop later in start-up does; SIGTERM's default ended it with 143, SIGINT's with a
    KeyboardInterrupt traceback. The HTTP server installs its own handlers when it starts."""
    def leave(signum: int, frame: object) -> None:
        raise SystemExit(0)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, leave)


def run(args: argparse.Namespace) -> int:
    exit_on_signals_until_serving()
    from pagedserve.engine.startup import StartupTracker, pause_garbage_collection, resume_garbage_collection

    pause_garbage_collection()  # until ready: before the imports below, which are most of start-up
    apply_thread_args(args)
    from pagedserve.entrypoints.openai.api_server import run_server

    startup = StartupTracker(t0=process_start_time())
    setup_logging(args.verbose)
    replica_args = ReplicaArgs.from_cli_args(args)
    try:
        engine_args, options = checked_settings(args)  # unsupported values fail before the port opens
        replica_args.check()
        if replica_args.enabled and options.uds:
            raise ValueError("--uds is not available with --replicas: Ray Serve's endpoint listens on TCP "
                             "(--host, --port)")
        if not options.uds and not replica_args.enabled:  # before the model loads (uvicorn's [Errno 98] came after)
            from pagedserve.cli.doctor import FAIL, check_port

            port = check_port(options.port, options.host)
            if port.status == FAIL:
                raise ValueError(f"{port.detail}: {port.fix}")
    except ValueError as exc:
        return fail(str(exc))
    if replica_args.enabled:
        resume_garbage_collection()  # the replicas start their own processes; this one only waits
        return run_replicas(engine_args, options, replica_args)
    return run_server(engine_args, options, startup)


def checked_settings(args: argparse.Namespace) -> tuple[EngineArgs, ServeOptions]:
    """The engine's and the server's settings from serve's flags, checked (ValueError naming the flag); the vLLM
    flags that have no effect here are logged with why."""
    from pagedserve.engine.setup import check_engine_args

    for note in vllm_compat.check(vars(args)):
        logger.info("%s", note)
    engine_args = engine_args_from_cli(args)
    check_engine_args(engine_args)
    return engine_args, checked_options(args)


def checked_options(args: argparse.Namespace) -> ServeOptions:
    """The server's settings from serve's flags (and VLLM_API_KEY), checked: ValueError naming the flag."""
    options = ServeOptions.from_cli_args(args, limits=RequestLimits.from_cli_args(args))
    keys = options.api_key or envs.api_key()
    options = replace(options, api_key=[keys] if isinstance(keys, str) else keys)
    options.check()
    return options


def run_replicas(engine_args: EngineArgs, options: ServeOptions, replica_args: ReplicaArgs) -> int:
    """--replicas N: the engines as Ray Serve replicas behind one endpoint (entrypoints/ray_serve/)."""
    from pagedserve.entrypoints.ray_serve import RAY_MISSING, ray_is_installed

    if not ray_is_installed():
        return fail(RAY_MISSING)
    from pagedserve.entrypoints.ray_serve.app import run

    # Each replica's process reads how its OpenMP threads wait before torch loads: hand it what is set here.
    return run(engine_args, options, replica_args, wait_settings(os.environ) or None)
