"""ReplicaArgs: the `serve --replicas N` flags, documented once (flags are generated from the fields)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.engine.arg_utils import FlagArgs


@dataclass
class ReplicaArgs(FlagArgs):
    replicas: int | None = field(default=None, metadata={"help": (
        "Run N engines as Ray Serve replicas behind this one endpoint (needs pagedserve[ray]); requests sharing "
        "a session id, user or prompt prefix go to the replica that has it cached.")})
    ray_address: str | None = field(default=None, metadata={"help": (
        "The Ray cluster to run the replicas on: host:port of `ray start --head`, or auto (default: a local "
        "Ray started and stopped with this command).")})
    replica_cpus: float = field(default=1.0, metadata={"help": (
        "CPUs Ray reserves for each replica; also each engine's thread count unless --num-threads is given.")})
    routing_prefix_chars: int = field(default=256, metadata={"help": (
        "Requests whose prompts share this many first characters (without a session id or user) go to the "
        "same replica.")})
    max_ongoing_requests_per_replica: int | None = field(default=None, metadata={"help": (
        "Requests one replica takes at once; beyond it the next replica in the key's order serves (default: "
        "--max-num-seqs).")})

    @property
    def enabled(self) -> bool:
        return self.replicas is not None or self.ray_address is not None

    def check(self) -> None:
        """ValueError naming the flag for a value out of range."""
        if self.replicas is not None and self.replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {self.replicas}")
        if self.replica_cpus <= 0:
            raise ValueError(f"--replica-cpus must be > 0, got {self.replica_cpus}")
        if self.routing_prefix_chars < 1:
            raise ValueError(f"--routing-prefix-chars must be >= 1, got {self.routing_prefix_chars}")
        if self.max_ongoing_requests_per_replica is not None and self.max_ongoing_requests_per_replica < 1:
            raise ValueError("--max-ongoing-requests-per-replica must be >= 1, got "
                             f"{self.max_ongoing_requests_per_replica}")
