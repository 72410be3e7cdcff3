"""Tensor-parallel runners: rank 0's (inside the engine) and the workers' (ranks 1..N-1, own processes).

Rank 0 keeps everything that is not the model: scheduler, tokenizer, HTTP, per-request state, sampling. Its
`TPModelRunner` is a ModelRunner whose model is a `DriverModel`: each forward first sends the step's inputs
(token ids, positions, attention metadata: what `_prepare` built) to the workers, and each logits call the
hidden rows it projects; then rank 0 runs its own shard, and the collectives inside the layers keep the
ranks in step. The workers hold no request state: each one runs the same forward on the same inputs against
its own shard and its own KV pool (its KV heads); the logits are gathered to rank 0, the only one that
samples, so nothing comes back but the collectives' data.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from pagedserve.distributed.binding import bind_this_thread, format_cores, restore_thread_affinity
from pagedserve.distributed.group import TPGroup, shm_supported
from pagedserve.distributed.launch import WorkerLostError, WorkerSet, WorkerSpec
from pagedserve.distributed.wire import from_wire, to_wire
from pagedserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class DriverModel:
    """Rank 0's model: the shard, plus sending every forward's and logits call's inputs to the workers."""

    def __init__(self, shard: torch.nn.Module, workers: WorkerSet) -> None:
        self.shard = shard  # the runner reads the shard's num_layers, num_kv_heads, ... through us
        self.workers = workers

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list, meta: Any) -> torch.Tensor:
        self.workers.check_health()
        self.workers.send(("forward", to_wire((input_ids, positions, meta))))
        return self.shard(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self.workers.check_health()
        self.workers.send(("logits", to_wire(hidden)))
        return self.shard.compute_logits(hidden)

    def __getattr__(self, name: str) -> Any:  # num_kv_heads, head_dim, model.layers, ...: the shard's
        return getattr(self.shard, name)


class TPModelRunner(ModelRunner):
    """A ModelRunner over rank 0's shard that drives ranks 1..N-1 (see the module docstring)."""

    def __init__(self, config: Any, hf_config: Any, progress: Any = None, eos_token_id: int | None = None,
                 extra_eos_token_ids: Sequence[int] = ()) -> None:
        parallel = config.parallel
        world_size = parallel.tensor_parallel_size
        binding = [list(cores) for cores in parallel.cpu_binding]
        self._bound_thread = threading.get_native_id()
        self._previous_affinity = bind_this_thread(binding[0]) if binding else None
        use_shm = parallel.all_reduce == "shm" or (parallel.all_reduce == "auto" and shm_supported(config.device.device))
        group = TPGroup(0, world_size, config.device.device)
        workers = WorkerSet.start(group, config, binding, config.device.num_threads, use_shm,
                                  parallel.collective_timeout_s)
        self.workers = workers
        self._finalizer = weakref.finalize(self, _close, workers, self._bound_thread, self._previous_affinity)
        try:
            super().__init__(config, hf_config, progress, eos_token_id, tp=group,
                             extra_eos_token_ids=extra_eos_token_ids)  # loads rank 0's shard
            workers.connect()
        except BaseException:
            self.close()
            raise
        logger.info("tensor parallel: %d ranks, collectives over %s, cores %s, %d thread(s) each", world_size,
                    group.kind, " | ".join(format_cores(c) for c in binding) or "unbound",
                    config.device.num_threads)

    def _load_model(self, hf_config: Any, progress: Any) -> DriverModel:
        """Rank 0's shard, driving the workers' shards in every forward and logits call."""
        return DriverModel(super()._load_model(hf_config, progress), self.workers)

    @property
    def group(self) -> TPGroup:
        return self.workers.group

    def check_health(self) -> None:
        """Raises WorkerLostError once a rank has died: the engine cannot run another step."""
        self.workers.check_health()

    def release_kv_pages(self, block_ids: list[int], block_size: int, window_block_ids: list[int] = ()) -> int:
        """Every rank gives these free blocks' pages back (each holds its own KV heads of them)."""
        replies = self.workers.ask(("release", (block_ids, block_size, list(window_block_ids))))
        return super().release_kv_pages(block_ids, block_size, window_block_ids) + sum(replies)

    def close(self) -> None:
        """Stop the workers and give the calling thread its cores back."""
        self._finalizer()


def _close(workers: WorkerSet, thread_id: int, affinity: set[int] | None) -> None:
    workers.close()
    if affinity is not None:
        restore_thread_affinity(thread_id, affinity)


# ---- the worker process ------------------------------------------------------------------------------
def worker_main(spec: WorkerSpec, conn: Any) -> None:
    """Entry point of rank spec.rank: load the shard, join the group, then run commands until "stop" or
    until rank 0 is gone. Exits non-zero on any failure, after telling rank 0 why where it can."""
    logging.basicConfig(level=spec.log_level, stream=sys.stderr,  # as rank 0's: quiet offline, INFO under serve
                        format=f"%(asctime)s.%(msecs)03d %(levelname)s [tp rank {spec.rank}] %(name)s: %(message)s",
                        datefmt="%H:%M:%S")  # the server's format (cli/common.py), with the rank
    threading.Thread(target=_exit_when_orphaned, args=(spec.parent_pid,), daemon=True).start()
    # Rank 0 stops the ranks (after draining its requests) or they exit when it is gone: a Ctrl-C or a SIGTERM to
    # the whole process group (systemctl stop, kill -- -PGID) must not kill them under rank 0's requests.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        runner = _start_worker(spec)
        conn.send(("ready", ""))  # loaded: rank 0 joins the group once every rank is (a failure is seen at once)
        runner.tp.connect(spec.address)
    except BaseException as exc:  # noqa: BLE001 - reported to rank 0, which fails start-up with it
        logger.exception("rank %d failed to start", spec.rank)
        _send_quietly(conn, ("error", f"{type(exc).__name__}: {exc}"))
        os._exit(1)
    try:
        _serve(runner, conn)
    except (EOFError, OSError):
        logger.error("rank 0 is gone; rank %d exits", spec.rank)
        os._exit(1)
    except BaseException:  # noqa: BLE001 - rank 0 sees the group fail and declares the engine dead
        logger.exception("rank %d failed", spec.rank)
        os._exit(1)
    runner.tp.close()
    os._exit(0)


def _start_worker(spec: WorkerSpec) -> ModelRunner:
    from pagedserve.platform import bind_rank_device, configure_threads

    config = spec.config
    device = bind_rank_device(config.device.device, spec.rank)
    if spec.cores:
        bind_this_thread(spec.cores)
    if device == "cpu":
        configure_threads(spec.num_threads)
    group = TPGroup(spec.rank, spec.world_size, config.device.device)
    runner = ModelRunner(config, config.model.hf_config, tp=group)
    runner.allocate_kv_cache()
    return runner


def _serve(runner: ModelRunner, conn: Any) -> None:
    import pickle

    device = runner.device
    with torch.inference_mode():
        while True:
            message = pickle.loads(conn.recv_bytes())
            kind = message[0]
            if kind == "forward":
                input_ids, positions, meta = from_wire(message[1], device)
                runner.model(input_ids, positions, runner.kv_caches, meta)
            elif kind == "logits":
                runner.model.compute_logits(from_wire(message[1], device))
            elif kind == "release":  # memory pressure: this rank's pages of free blocks; rank 0 waits for the count
                conn.send(("released", runner.release_kv_pages(*message[1])))
            elif kind == "stop":
                return
            else:
                raise ValueError(f"unknown tensor-parallel command {kind!r}")


def _exit_when_orphaned(parent_pid: int) -> None:
    """Rank 0 died without closing us (SIGKILL, a crash): exit rather than wait in a collective."""
    while os.getppid() == parent_pid:
        time.sleep(0.2)
    os._exit(1)


def _send_quietly(conn: Any, message: Any) -> None:
    try:
        conn.send(message)
    except OSError:
        pass


__all__ = ["DriverModel", "TPModelRunner", "WorkerLostError", "worker_main"]
