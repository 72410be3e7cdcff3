"""Rank 0's side of tensor parallelism: start ranks 1..N-1, meet them, send them each step, watch them.

Each worker is a spawned process (a fresh interpreter: no inherited OpenMP or engine threads) running
worker/tp_worker.py's `worker_main`. Commands go down one pipe per worker (a blocking read: an idle worker
costs nothing, and it sees EOF when rank 0 is gone); collectives go through TPGroup. A watchdog thread waits
on the workers' process sentinels: when one exits, the group is marked dead at once (a collective waiting
for it raises) and `check_health` raises from then on, which the engine turns into "engine dead".
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedserve.distributed.group import GroupAddress, TPGroup

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 600.0  # loading a shard of a large model from a cold disk


@dataclass
class WorkerSpec:
    """Everything a worker needs, pickled into its process."""

    rank: int
    world_size: int
    config: Any  # the engine's EngineConfig
    address: GroupAddress
    cores: list[int]
    num_threads: int
    parent_pid: int
    log_level: int = logging.INFO  # the parent's pagedserve log level (INFO under serve; an offline caller's own)


class WorkerLostError(RuntimeError):
    """A tensor-parallel worker exited or reported a failure."""


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


SPAWN_GUARD_HINT = ("tensor-parallel ranks are started with 'spawn', which imports the main script again: a script "
                    "must create LLM(..., tensor_parallel_size=N) under `if __name__ == \"__main__\":`")


def _main_is_a_script() -> bool:
    """Whether the main module is the user's script (not pagedserve's command line), which ranks re-import."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    return path is not None and "pagedserve" not in Path(path).resolve().parts


class WorkerSet:
    def __init__(self, group: TPGroup, address: GroupAddress, store: Any, processes: list, conns: list) -> None:
        self.group = group
        self.address = address
        self._store = store
        self.processes = processes
        self.conns = conns
        self._closed = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="pagedserve-tp-watchdog", daemon=True)
        self._watchdog.start()

    @classmethod
    def start(cls, group: TPGroup, config: Any, binding: list[list[int]], num_threads: int,
              use_shm: bool, timeout_s: float) -> WorkerSet:
        """Start ranks 1..N-1 (they load their shards while rank 0 loads its own)."""
        import torch.distributed as dist

        from pagedserve.distributed import shm
        from pagedserve.platform import distributed_backend
        from pagedserve.worker.tp_worker import worker_main

        if getattr(multiprocessing.current_process(), "_inheriting", False):
            raise RuntimeError(SPAWN_GUARD_HINT)  # a rank importing the user's script ran its LLM(...) again
        store = dist.TCPStore("127.0.0.1", 0, group.world_size, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        shm_path = None
        if use_shm:
            shm_path = os.path.join(_shm_dir(), f"pagedserve-tp-{os.getpid()}-{id(group):x}")
            shm.create_segment(shm_path, group.world_size)
        address = GroupAddress("127.0.0.1", store.port, shm_path, distributed_backend(config.device.device),
                               timeout_s)
        context = multiprocessing.get_context("spawn")
        processes, conns = [], []
        try:
            for rank in range(1, group.world_size):
                ours, theirs = context.Pipe()
                spec = WorkerSpec(rank, group.world_size, config, address, binding[rank], num_threads, os.getpid(),
                                  logging.getLogger("pagedserve").getEffectiveLevel())
                process = context.Process(target=worker_main, args=(spec, theirs), name=f"pagedserve-tp-rank{rank}",
                                          daemon=True)
                process.start()
                theirs.close()
                processes.append(process)
                conns.append(ours)
        except BaseException:  # nothing started is left behind: no ranks, no shared-memory file
            for process in processes:
                process.kill()
            if shm_path is not None and os.path.exists(shm_path):
                os.unlink(shm_path)
            raise
        logger.info("tensor parallel: started ranks 1..%d (pids %s)", group.world_size - 1,
                    ", ".join(str(p.pid) for p in processes))
        return cls(group, address, store, processes, conns)

    def connect(self) -> None:
        """Wait until every worker has loaded its shard and allocated its KV pool (a worker that fails or dies
        meanwhile is reported at once), then join the group with them (rank 0)."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        for rank, conn in enumerate(self.conns, start=1):
            try:
                kind, detail = self._next_message(rank, conn, deadline, "start-up")
            except WorkerLostError as exc:
                if _main_is_a_script():
                    raise WorkerLostError(f"{exc}. {SPAWN_GUARD_HINT}") from exc
                raise
            if kind != "ready":
                raise WorkerLostError(f"tensor-parallel rank {rank} failed to start: {detail}")
        self.group.connect(self.address, store=self._store)
        if self.address.shm_path is not None:  # every rank has it mapped: the name can go (no leftover file)
            os.unlink(self.address.shm_path)

    def _next_message(self, rank: int, conn: Any, deadline: float, waiting_for: str) -> tuple[str, Any]:
        """Rank `rank`'s next (kind, detail) on its pipe; WorkerLostError where it dies, or sends nothing by
        `deadline` (time.monotonic), while rank 0 waits for `waiting_for`."""
        while not conn.poll(0.05):
            self.check_health()
            if time.monotonic() > deadline:
                raise WorkerLostError(f"tensor-parallel rank {rank} did not answer (waiting for {waiting_for})")
        try:
            return conn.recv()
        except (EOFError, OSError) as exc:
            raise WorkerLostError(f"tensor-parallel rank {rank} exited (waiting for {waiting_for}; exit code "
                                  f"{self.processes[rank - 1].exitcode})") from exc

    def send(self, message: Any) -> None:
        """One command to every worker (pickled once)."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for conn in self.conns:
                conn.send_bytes(data)
        except OSError as exc:  # a worker's end is gone: it died
            self.group.mark_dead(f"a tensor-parallel worker stopped reading commands: {exc}")
            self.check_health()
            raise

    def ask(self, message: Any, timeout_s: float = 60.0) -> list[Any]:
        """Send a command every worker answers outside the collectives, and return their answers (rank 1 first);
        WorkerLostError where a rank dies or stays silent for `timeout_s`."""
        self.send(message)
        deadline = time.monotonic() + timeout_s
        return [self._next_message(rank, conn, deadline, repr(message[0]))[1]
                for rank, conn in enumerate(self.conns, start=1)]

    def check_health(self) -> None:
        """WorkerLostError once any rank has died (or the group failed)."""
        if self.group.dead is not None:
            raise WorkerLostError(f"tensor parallelism is down: {self.group.dead}")

    def _watch(self) -> None:
        sentinels = {p.sentinel: (rank, p) for rank, p in enumerate(self.processes, start=1)}
        while sentinels and not self._closed.is_set():
            for sentinel in multiprocessing.connection.wait(list(sentinels), timeout=0.5):
                rank, process = sentinels.pop(sentinel)
                process.join(1)
                if not self._closed.is_set():
                    self.group.mark_dead(f"rank {rank} (pid {process.pid}) exited with code {process.exitcode}")

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the workers (politely, then by signal) and release the group."""
        if self._closed.is_set():
            return
        self._closed.set()
        for conn in self.conns:
            try:
                conn.send_bytes(pickle.dumps(("stop",)))
            except OSError:
                pass
        deadline = time.monotonic() + timeout_s
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join(1)
        for conn in self.conns:
            conn.close()
        if self.address.shm_path is not None and os.path.exists(self.address.shm_path):
            os.unlink(self.address.shm_path)
        self.group.dead = self.group.dead or "the engine closed it"
        self.group.close()
        self._store = None
