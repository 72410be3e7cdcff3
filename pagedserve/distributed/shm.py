"""All-reduce and all-gather through shared memory, for ranks on one host (vLLM's CPU idea).

gloo sends every collective through loopback TCP: ~0.6 ms for one 896-float row on the 2-core test box, 49
of them a step for a 24-layer model, which is more than the step itself. Here each rank copies its tensor into
its own slot of one shared file, raises its sequence flag, waits until every flag has reached the same
sequence, and reads the slots: a sum in rank order (so every rank gets the same bits) or a concatenation.

Invariants:
- one sequence number per collective call chunk, the same on every rank (ranks call the same collectives in
  the same order: they run the same layers on the same step);
- two sets of slots alternate with the sequence's parity: a rank writes set s again only at seq + 2, after
  every rank raised seq + 1, i.e. after every rank finished reading seq from that set;
- a flag is raised after the data it announces is stored: Python's stores are in program order, x86 keeps
  stores in order, and a lock round trip between them fences the (possibly non-temporal) stores of a large
  copy. Other architectures use gloo (group.py decides).

A rank that stops raising its flag is found by `is_alive` (the watchdog's verdict) or the timeout; the wait
then raises, never spins forever.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

HEADER_BYTES = 4096
FLAG_STRIDE = 8  # int64s between two ranks' flags: one 64-byte cache line each
DEFAULT_SLOT_BYTES = 4 << 20
# Flag reads before a waiting rank starts yielding its core (~20 us of Python loop): ranks in step arrive
# within that, and on a box with more runnable threads than cores a pure spin starves the peer it waits for.
SPIN_CHECKS = 200


def segment_bytes(world_size: int, slot_bytes: int = DEFAULT_SLOT_BYTES) -> int:
    return HEADER_BYTES + 2 * world_size * slot_bytes


def create_segment(path: str, world_size: int, slot_bytes: int = DEFAULT_SLOT_BYTES) -> None:
    """A zeroed shared file for `world_size` ranks (sparse: pages cost memory only once written)."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, segment_bytes(world_size, slot_bytes))
    finally:
        os.close(fd)


class ShmCommunicator:
    def __init__(self, path: str, rank: int, world_size: int, is_alive: Callable[[], str | None],
                 timeout_s: float, slot_bytes: int = DEFAULT_SLOT_BYTES) -> None:
        """`is_alive()` returns None while every peer is alive, else why not."""
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, segment_bytes(world_size, slot_bytes))
        finally:
            os.close(fd)
        self.rank, self.world_size = rank, world_size
        self.slot_bytes = slot_bytes
        self._flags = np.frombuffer(self._map, dtype=np.int64, count=world_size * FLAG_STRIDE)
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        self._seq = 0
        self._fence = threading.Lock()
        self._is_alive = is_alive
        self.timeout_s = timeout_s

    def _slot(self, seq: int, rank: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        offset = HEADER_BYTES + ((seq % 2) * self.world_size + rank) * self.slot_bytes
        return self._bytes[offset:offset + numel * dtype.itemsize].view(dtype)

    def _post_and_wait(self, seq: int) -> None:
        with self._fence:  # a locked instruction: the slot's stores are visible before the flag
            pass
        self._flags[self.rank * FLAG_STRIDE] = seq
        deadline = None
        for peer in range(self.world_size):
            spins = 0
            while self._flags[peer * FLAG_STRIDE] < seq:
                spins += 1
                if spins > SPIN_CHECKS:  # the peer is late (descheduled, or still computing): give the core
                    os.sched_yield()     # away between checks rather than burn it on a shared box
                    if spins % 1024 == 0:
                        deadline = self._check(peer, deadline)

    def _check(self, peer: int, deadline: float | None) -> float:
        reason = self._is_alive()
        if reason is not None:
            raise RuntimeError(f"tensor-parallel rank {peer} is not answering: {reason}")
        now = time.monotonic()
        if deadline is None:
            return now + self.timeout_s
        if now > deadline:
            raise TimeoutError(f"tensor-parallel rank {peer} did not reach the collective within "
                               f"{self.timeout_s:.0f} s")
        return deadline

    def _chunk_elems(self, dtype: torch.dtype) -> int:
        return self.slot_bytes // dtype.itemsize

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's `x` (contiguous, CPU), in place; the same bits on every rank."""
        flat = x.view(-1)
        step = self._chunk_elems(x.dtype)
        for start in range(0, flat.numel(), step):
            chunk = flat[start:start + step]
            self._seq += 1
            n = chunk.numel()
            self._slot(self._seq, self.rank, x.dtype, n).copy_(chunk)
            self._post_and_wait(self._seq)
            slots = [self._slot(self._seq, r, x.dtype, n) for r in range(self.world_size)]
            torch.add(slots[0], slots[1], out=chunk)
            for slot in slots[2:]:
                chunk.add_(slot)
        return x

    def all_gather(self, x: torch.Tensor, to_rank0_only: bool = False) -> torch.Tensor | None:
        """[rows, cols] on each rank -> [rows, world_size * cols], rank r's columns at r * cols (with
        `to_rank0_only`: on rank 0; the others only hand theirs over and get None)."""
        rows, cols = x.shape
        reads = not to_rank0_only or self.rank == 0
        out = torch.empty((rows, self.world_size * cols), dtype=x.dtype) if reads else None
        rows_per_chunk = max(1, self._chunk_elems(x.dtype) // max(cols, 1))
        if cols > self._chunk_elems(x.dtype):
            raise ValueError(f"a row of {cols} values does not fit a {self.slot_bytes}-byte slot")
        for first in range(0, rows, rows_per_chunk):
            part = x[first:first + rows_per_chunk]
            self._seq += 1
            n = part.numel()
            self._slot(self._seq, self.rank, x.dtype, n).copy_(part.reshape(-1))
            self._post_and_wait(self._seq)
            for r in range(self.world_size if reads else 0):
                out[first:first + part.shape[0], r * cols:(r + 1) * cols] = \
                    self._slot(self._seq, r, x.dtype, n).view(part.shape[0], cols)
        return out

    def close(self) -> None:
        del self._flags, self._bytes
        self._map.close()
