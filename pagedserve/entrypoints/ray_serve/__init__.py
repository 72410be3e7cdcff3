"""Replicas on Ray Serve: N pagedserve engines behind one OpenAI-compatible endpoint (`serve --replicas N`).

    client -> Ray Serve proxy -> ingress.Ingress -> (PrefixAffinityRouter) -> replica.EngineReplica x N

- `routing.py`: which replica a request prefers (session or user id, else its prompt's first characters); no ray.
- `args.py`: `ReplicaArgs`, the `--replicas` flags; no ray.
- `router.py`: `PrefixAffinityRouter`, Ray Serve's RequestRouter ranking the replicas in routing.py's order.
- `replica.py`: `EngineReplica`, one engine and pagedserve's own FastAPI app (api_server.build_app) per replica;
  requests reach that app in-process over ASGI, so every route, error and stream is the single server's.
- `ingress.py`: the front: routing key, forwarding, /health and /metrics over all replicas, /replicas.
- `app.py`: `build_application()` (a Ray Serve Application) and `run()` (the CLI mode).

Only `app.py`, `router.py`, `replica.py` and `ingress.py` import ray; ray is the optional extra `pagedserve[ray]`.
"""

from __future__ import annotations

RAY_MISSING = ("--replicas runs the engines as Ray Serve replicas, and ray is not installed: "
               "pip install 'pagedserve[ray]' (in a checkout: pip install -e '.[ray]')")


def ray_is_installed() -> bool:
    """True when ray with Ray Serve imports (checked without importing pagedserve's ray modules)."""
    try:
        import ray.serve  # noqa: F401
    except ImportError:
        return False
    return True
