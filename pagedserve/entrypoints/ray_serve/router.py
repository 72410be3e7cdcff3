"""PrefixAffinityRouter: Ray Serve's RequestRouter API, ranking replicas by the request's routing key.

Ray Serve calls `choose_replicas` for every call on a handle to the engine deployment and tries the ranks in
order: a rank whose replica is at `max_ongoing_requests` rejects, and the next is tried (with Ray's backoff once
all have). So a key's requests go to its first replica (routing.rank_replicas) while that replica is healthy and
not full, then to its second, and so on. Replicas that report themselves unhealthy (record_routing_stats) rank
last, and those a request names in `avoid` (they refused it) are left out; a request without a key goes to the
least loaded of the healthy ones (Ray's own queue-length probe).

The router runs inside the process holding the handle (the ingress); it also publishes the replica set there
(routing.publish_replicas), so the ingress can ask each replica for its /health and /metrics.
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from pagedserve.entrypoints.ray_serve.routing import PINNED_PREFIX, publish_replicas, rank_replicas


class PrefixAffinityRouter(RequestRouter):
    def initialize_state(self, **kwargs: Any) -> None:
        """No tunables: the key is chosen by the ingress, fullness is Ray's max_ongoing_requests."""

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        listing = [{"replica": r.replica_id.unique_id, "actor_name": r.replica_id.to_full_id_str(),
                    "node_id": r.node_id} for r in replicas]
        publish_replicas(self._deployment_id.app_name, self._deployment_id.name, listing)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        kwargs = pending_request.kwargs if pending_request is not None else {}
        avoid = set(kwargs.get("avoid") or ())  # replicas that refused this request already
        candidate_replicas = [r for r in candidate_replicas if r.replica_id.unique_id not in avoid] or \
            candidate_replicas
        healthy = [r for r in candidate_replicas if (r.routing_stats or {}).get("healthy", True)]
        unhealthy = [r for r in candidate_replicas if r not in healthy]
        key = kwargs.get("routing_key")
        if not key:
            return [healthy or candidate_replicas]
        if key.startswith(PINNED_PREFIX):
            pinned = [r for r in candidate_replicas if r.replica_id.unique_id == key[len(PINNED_PREFIX):]]
            return [pinned or candidate_replicas]  # gone: any replica answers, under its own id
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        order = rank_replicas(key, [r.replica_id.unique_id for r in healthy])
        order += rank_replicas(key, [r.replica_id.unique_id for r in unhealthy])
        return [[by_id[replica_id]] for replica_id in order]
