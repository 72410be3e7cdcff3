"""The Ray Serve application (`build_application`) and the CLI mode that runs it (`run`).

Two deployments: `PagedServeEngine` (EngineReplica x --replicas, each reserving --replica-cpus, routed by
PrefixAffinityRouter, health-checked through its /health) and `PagedServeIngress` (one, no CPU reserved), the
route "/" of Ray Serve's HTTP proxy on --host:--port. Ray restarts a replica whose actor dies or whose health
check fails; the others keep serving meanwhile.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import time

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.entrypoints.openai.options import ServeOptions
from pagedserve.entrypoints.ray_serve.args import ReplicaArgs
from pagedserve.entrypoints.ray_serve.ingress import Ingress
from pagedserve.entrypoints.ray_serve.replica import EngineReplica

logger = logging.getLogger("pagedserve.ray_serve")

APP_NAME = "pagedserve"
ENGINE_DEPLOYMENT = "PagedServeEngine"
INGRESS_DEPLOYMENT = "PagedServeIngress"
HEALTH_CHECK_PERIOD_S = 2.0  # Ray replaces a replica after 3 failed checks in a row
ROUTING_STATS_PERIOD_S = 2.0
# Ray imports it and ships router.py by value to every process holding a handle (see routing.py's registry).
ROUTER_CLASS = "pagedserve.entrypoints.ray_serve.router.PrefixAffinityRouter"


def build_application(engine_args: EngineArgs, options: ServeOptions, replica_args: ReplicaArgs,
                      env_vars: dict[str, str] | None = None) -> serve.Application:
    """The ingress bound to N engine replicas. `env_vars` are set in each replica's process before it starts
    (OMP_WAIT_POLICY and GOMP_SPINCOUNT must be there before torch loads)."""
    if engine_args.num_threads is None:  # the CPUs Ray reserved for the replica, not every core on its node
        engine_args = dataclasses.replace(engine_args, num_threads=max(1, int(replica_args.replica_cpus)))
    actor_options: dict = {"num_cpus": replica_args.replica_cpus}
    if env_vars:
        actor_options["runtime_env"] = {"env_vars": env_vars}
    engine = serve.deployment(
        EngineReplica, name=ENGINE_DEPLOYMENT, num_replicas=replica_args.replicas or 1,
        ray_actor_options=actor_options,
        max_ongoing_requests=replica_args.max_ongoing_requests_per_replica or engine_args.max_num_seqs,
        max_queued_requests=engine_args.max_waiting_requests,  # beyond: BackPressureError, a 429 as one server's
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
        request_router_config=RequestRouterConfig(request_router_class=ROUTER_CLASS,
                                                  request_routing_stats_period_s=ROUTING_STATS_PERIOD_S))
    ingress = serve.deployment(Ingress, name=INGRESS_DEPLOYMENT, num_replicas=1, ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=100_000)
    return ingress.bind(engine.bind(engine_args, options), ENGINE_DEPLOYMENT, replica_args.routing_prefix_chars,
                        options.max_request_body_bytes)


class _Stopped(Exception):
    """SIGINT or SIGTERM while the application deploys or serves."""


class _Signals:
    """SIGINT and SIGTERM for `run`: recorded (a handler only appends: a lock taken in one could deadlock the main
    thread), or raised as _Stopped; the handlers found are put back at the end."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self._before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def record(self, number: int, _frame: object) -> None:
        self.received.append(number)

    def stop(self, number: int, _frame: object) -> None:
        self.received.append(number)
        raise _Stopped

    def handle(self, handler) -> None:
        for sig in self._before:
            signal.signal(sig, handler)

    def restore(self) -> None:
        for sig, handler in self._before.items():
            signal.signal(sig, handler)


def run(engine_args: EngineArgs, options: ServeOptions, replica_args: ReplicaArgs,
        env_vars: dict[str, str] | None = None) -> int:
    """Start (or join) Ray, deploy, serve until SIGINT/SIGTERM, then take the application down; the exit code.
    A signal while Ray starts is acted on once it has started (one that interrupted ray.init left Ray's agents
    running); while the application deploys, at once (SIGTERM's default ended the process and left Ray up)."""
    signals = _Signals()
    signals.handle(signals.record)
    try:
        ray.init(address=replica_args.ray_address or "local")  # "local": a new Ray, never one found on the box
        return _serve(engine_args, options, replica_args, env_vars, signals)
    finally:
        signals.restore()


def _serve(engine_args: EngineArgs, options: ServeOptions, replica_args: ReplicaArgs,
           env_vars: dict[str, str] | None, signals: _Signals) -> int:
    """run's part once Ray is up: deploy, serve until a signal, take down (a second signal cannot cut that short)."""
    deployed = False
    try:
        if signals.received:
            raise _Stopped
        signals.handle(signals.stop)
        serve.start(http_options={"host": options.host, "port": options.port})
        problem = refusal(replica_args)
        if problem is not None:
            logger.error("%s", problem)
            return 2
        logger.info("starting %d replica(s) of %s on Ray (%s)", replica_args.replicas or 1, engine_args.model,
                    replica_args.ray_address or "local")
        deployed = True
        serve.run(build_application(engine_args, options, replica_args, env_vars), name=APP_NAME, route_prefix="/")
        logger.info("serving on http://%s:%d (%d replicas; GET /replicas lists them)", options.host, options.port,
                    replica_args.replicas or 1)
        signals.handle(signals.record)
        while not signals.received:
            time.sleep(0.2)
        raise _Stopped
    except _Stopped:
        logger.info("%s: taking the application down", signal.Signals(signals.received[0]).name)
        return 0
    except RuntimeError as exc:  # a deployment that failed (e.g. every replica's start-up): Ray says why
        logger.error("the Ray Serve application failed: %s", exc)
        return 1
    finally:
        signals.handle(signals.record)
        _take_down(replica_args.ray_address is not None, deployed)


def refusal(replica_args: ReplicaArgs) -> str | None:
    """Why the application cannot be deployed on this cluster (problem and fix), or None. Ray would otherwise
    wait forever for CPUs no node has, or replace another command's application of the same name."""
    num_replicas, cpus = replica_args.replicas or 1, replica_args.replica_cpus
    node_cpus = [node["Resources"].get("CPU", 0.0) for node in ray.nodes() if node["Alive"]]
    if cpus > max(node_cpus, default=0.0):
        return (f"--replica-cpus {cpus:g}: no node of this Ray cluster has that many CPUs (the largest has "
                f"{max(node_cpus, default=0.0):g}); lower --replica-cpus")
    if num_replicas * cpus > sum(node_cpus):
        return (f"--replicas {num_replicas} x --replica-cpus {cpus:g} reserve {num_replicas * cpus:g} CPUs and this "
                f"Ray cluster has {sum(node_cpus):g}: lower --replica-cpus (to {sum(node_cpus) / num_replicas:g}) "
                "or --replicas, or add nodes (ray start --address ...)")
    if APP_NAME in serve.status().applications:
        return (f"a Ray Serve application named {APP_NAME!r} already runs on this cluster (another `pagedserve "
                "serve --replicas`?); stop that one first (Ctrl-C in its terminal, or `serve shutdown`)")
    return None


def _take_down(joined: bool, deployed: bool) -> None:
    """Delete the application if this command deployed it; a Ray (and Serve) started here stops too, a joined
    cluster keeps running."""
    try:
        if deployed:
            serve.delete(APP_NAME)
        if not joined:
            serve.shutdown()
    finally:
        ray.shutdown()
