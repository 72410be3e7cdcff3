"""Helpers shared by sub-commands: logging set-up and engine flags."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Mapping, MutableMapping

from pagedserve import envs
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.memory.sizes import GIB


# How idle OpenMP threads wait, as the environment tells libgomp (the OpenMP of torch's Linux wheels and of the
# native kernels) before it loads; None removes a variable, so the flag's choice is the one in force. libgomp spins
# ~100,000 times a millisecond; GOMP_SPINCOUNT overrides OMP_WAIT_POLICY's spin time (ACTIVE: minutes, so an idle
# server kept a core busy; unset: 300,000; PASSIVE: none).
WAIT_POLICIES = {
    "brief": {"GOMP_SPINCOUNT": "3000", "OMP_WAIT_POLICY": None},  # ~30 us, then sleep
    "spin": {"GOMP_SPINCOUNT": "300000", "OMP_WAIT_POLICY": None},  # libgomp's default, ~3 ms
    "passive": {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": None},  # sleep at once
}
DEFAULT_WAIT_POLICY = "brief"
WAIT_VARIABLES = tuple(sorted({name for variables in WAIT_POLICIES.values() for name in variables}))


def wait_settings(environ: Mapping[str, str]) -> dict[str, str]:
    """The wait variables `environ` sets (the user's choice, or what a parent process passed on)."""
    return {name: environ[name] for name in WAIT_VARIABLES if name in environ}


def add_thread_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--omp-wait-policy", choices=sorted(WAIT_POLICIES), default=None,
        help="How idle CPU worker threads wait between kernels. brief (default): spin ~30 us, then sleep; spin: "
             "libgomp's own ~3 ms; passive: sleep at once. Waiting long only pays on a quiet box: on 2 cores with "
             "another process busy on one, Qwen2.5-Coder-0.5B decodes at 17 tok/s brief, 4 spin, 20 passive "
             "(SmolLM2: 30, 2-10, 52); quiet, brief is ~3 %% behind spin and passive ~30 %%. Default: brief, "
             "unless $OMP_WAIT_POLICY or $GOMP_SPINCOUNT is set.")


def thread_environment(policy: str | None, environ: Mapping[str, str]) -> dict[str, str | None]:
    """The variables to set (None: remove) before torch loads for --omp-wait-policy `policy` (None: the flag was
    not given, so the default policy unless `environ` already chooses one)."""
    if policy is None:
        if wait_settings(environ):
            return {}
        policy = DEFAULT_WAIT_POLICY
    return dict(WAIT_POLICIES[policy])


def set_thread_environment(policy: str | None, environ: MutableMapping[str, str]) -> None:
    """Apply thread_environment(policy, environ) to `environ` (os.environ, or a child process's copy)."""
    for name, value in thread_environment(policy, environ).items():
        if value is None:
            environ.pop(name, None)
        else:
            environ[name] = value


def apply_thread_args(args: argparse.Namespace) -> None:
    """Must run before torch is imported: OpenMP reads how its threads wait once, when it loads."""
    if "torch" not in sys.modules:
        set_thread_environment(getattr(args, "omp_wait_policy", None), os.environ)


def setup_logging(verbose: bool = False) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s.%(msecs)03d %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S", stream=sys.stderr)


def engine_args_from_cli(args: argparse.Namespace) -> EngineArgs:
    """EngineArgs from parsed flags, with the environment variables vLLM users already set."""
    engine_args = EngineArgs.from_cli_args(args)
    if engine_args.kv_cache_memory is None:
        kv_gib = envs.vllm_cpu_kvcache_space_gib()
        if kv_gib:
            engine_args.kv_cache_memory = int(kv_gib * GIB)
    if engine_args.cpu_binding is None:
        engine_args.cpu_binding = envs.vllm_cpu_omp_threads_bind()
        if engine_args.cpu_binding is not None:
            from pagedserve.distributed.plan import check_parallel_args, named_cores
            from pagedserve.memory.probe import read_cores

            try:
                check_parallel_args(engine_args.tensor_parallel_size, engine_args.cpu_binding, "auto")
                if engine_args.cpu_binding.strip().lower() not in ("auto", "nobind"):
                    named_cores(engine_args.cpu_binding, engine_args.tensor_parallel_size, read_cores())
            except ValueError as exc:  # the variable's value, not a flag the user gave
                raise ValueError(f"VLLM_CPU_OMP_THREADS_BIND: {exc}".replace("--cpu-binding ", "")) from None
    return engine_args


def _user_facing_errors() -> tuple[type[BaseException], ...]:
    """Start-up failures that already say what is wrong and how to fix it: no traceback for these."""
    from pagedserve.formats.errors import ModelValidationError
    from pagedserve.memory.plan import InsufficientMemoryError
    from pagedserve.models.fetch import ModelFetchError

    return (InsufficientMemoryError, ModelFetchError, ModelValidationError)


USER_FACING_ERRORS = _user_facing_errors()


def fail(message: str) -> int:
    """Print a CLI error (problem and fix) and return the exit code."""
    print(f"pagedserve: error: {message}", file=sys.stderr)
    return 2


def process_start_time() -> float:
    """When this process started (time.time() clock), so start-up is timed from the real beginning."""
    from pagedserve.memory.probe import process_start_time as from_proc

    started = from_proc()  # exact to the clock tick (psutil's create_time can be up to 1 s early)
    if started is not None:
        return started
    try:
        import psutil

        return psutil.Process(os.getpid()).create_time()
    except Exception:  # psutil missing or /proc unreadable: time from now
        import time

        return time.time()
