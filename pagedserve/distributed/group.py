"""TPGroup: the collectives one tensor-parallel rank calls, and what happens when a peer is lost.

The sharded layers call `all_reduce` (after o and down, and the vocab-parallel embedding) and `gather` (the
logits, which only rank 0 samples from). Ranks on one CPU host use the shared-memory path (shm.py); otherwise the torch.distributed
process group (gloo on CPU, NCCL on CUDA: platform.distributed_backend). The group has no default
torch.distributed state: several engines (and their groups) can live in one process, as tests need.

A lost peer must fail the step, never hang it: gloo raises as soon as the peer's socket closes (and after
`timeout_s` otherwise); the shared-memory wait polls `dead` (set by the watchdog in launch.py or, on a
worker, when rank 0 is gone) and the same timeout. After any failure the group stays dead: every later
collective raises at once, so the engine's retry step fails fast and the engine is declared dead.
"""

from __future__ import annotations

import datetime
import logging
import time
from dataclasses import dataclass

import torch

from pagedserve.memory.probe import is_x86

logger = logging.getLogger(__name__)

class RankLostError(RuntimeError):
    """A tensor-parallel peer died or stopped answering: this group can run no more collectives."""


@dataclass
class CollectiveStats:
    """Time spent inside collectives (including waiting for slower peers), for benchmarks and logs."""

    num_calls: int = 0
    seconds: float = 0.0
    num_bytes: int = 0


@dataclass(frozen=True)
class GroupAddress:
    """Where the ranks meet: the TCP store on rank 0's host and, for the shared-memory path, the file."""

    host: str
    port: int
    shm_path: str | None
    backend: str  # "gloo" or "nccl"
    timeout_s: float


def shm_supported(device: str) -> bool:
    """The shared-memory path runs here: CPU tensors on x86 (its flags rely on x86's store order)."""
    return device == "cpu" and is_x86()


class TPGroup:
    def __init__(self, rank: int, world_size: int, device: str = "cpu") -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device  # where the tensors of its collectives live
        self.stats = CollectiveStats()
        self.dead: str | None = None  # why this group can run no more collectives
        self._process_group = None
        self._shm = None
        self._store = None
        self.kind = "not connected"  # which path the collectives take, in words (start-up log, benchmarks)


    def connect(self, address: GroupAddress, store=None) -> None:
        """Join the group; blocks until every rank joined (or the timeout). `store`: rank 0's own TCPStore."""
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=address.timeout_s)
        if store is None:
            store = dist.TCPStore(address.host, address.port, self.world_size, is_master=False, timeout=timeout)
        self._store = store
        prefix = dist.PrefixStore("pagedserve-tp", store)
        if address.backend == "nccl":
            self._process_group = dist.ProcessGroupNCCL(prefix, self.rank, self.world_size)
        else:
            self._process_group = dist.ProcessGroupGloo(prefix, self.rank, self.world_size, timeout)
        if address.shm_path is not None:
            from pagedserve.distributed.shm import ShmCommunicator

            self._shm = ShmCommunicator(address.shm_path, self.rank, self.world_size, lambda: self.dead,
                                        address.timeout_s)
        self.kind = "shared memory" if self._shm is not None else address.backend
        self.barrier()

    def mark_dead(self, reason: str) -> None:
        if self.dead is None:
            self.dead = reason
            logger.error("tensor-parallel group (rank %d of %d) is dead: %s", self.rank, self.world_size, reason)

    def _run(self, what: str, x: torch.Tensor, fn) -> torch.Tensor:
        if self.dead is not None:
            raise RankLostError(f"tensor parallelism is down: {self.dead}")
        start = time.perf_counter()
        try:
            result = fn(x)
        except Exception as exc:
            self.mark_dead(f"{what} failed: {type(exc).__name__}: {exc}")
            raise RankLostError(f"tensor parallelism is down: {self.dead}") from exc
        self.stats.num_calls += 1
        self.stats.seconds += time.perf_counter() - start
        self.stats.num_bytes += x.numel() * x.element_size()
        return result

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `x`, in place (`x` contiguous)."""
        if self._shm is not None:
            return self._run("all-reduce", x, self._shm.all_reduce)

        def gloo(t: torch.Tensor) -> torch.Tensor:
            self._process_group.allreduce([t]).wait()
            return t

        return self._run("all-reduce", x, gloo)

    def gather(self, x: torch.Tensor) -> torch.Tensor | None:
        """[rows, cols] on every rank -> [rows, world_size * cols] on rank 0 (rank r's block at columns
        r * cols); None on the others."""
        x = x.contiguous()
        if self._shm is not None:
            return self._run("gather", x, lambda t: self._shm.all_gather(t, to_rank0_only=True))

        def gloo(t: torch.Tensor) -> torch.Tensor | None:
            import torch.distributed as dist

            parts = [[torch.empty_like(t) for _ in range(self.world_size)]] if self.rank == 0 else []
            options = dist.GatherOptions()
            options.rootRank = 0
            self._process_group.gather(parts, [t], options).wait()
            return torch.cat(parts[0], dim=-1) if self.rank == 0 else None

        return self._run("gather", x, gloo)

    def barrier(self) -> None:
        self.all_reduce(torch.zeros(1, device=self.device))

    def close(self) -> None:
        if self._shm is not None:
            self._shm.close()
            self._shm = None
        self._process_group = None
        self._store = None
