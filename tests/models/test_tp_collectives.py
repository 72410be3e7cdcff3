"""The shared-memory collectives (distributed/shm.py) between two real processes: sums and gathers equal to
torch's own, across slot-sized chunks and dtypes, the same bits on both ranks; a peer that is gone or late
makes the wait raise instead of spinning forever."""

from __future__ import annotations

import multiprocessing
import time

import pytest
import torch

from pagedserve.distributed import shm

SLOT_BYTES = 4096  # small slots: every tensor below spans several chunks


def rank_main(path: str, rank: int, queue) -> None:
    comm = shm.ShmCommunicator(path, rank, 2, lambda: None, timeout_s=30, slot_bytes=SLOT_BYTES)
    torch.manual_seed(rank)
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3000, dtype=dtype)  # 12 KB of float32: three slots
        results[f"input-{dtype}"] = x.clone()
        results[f"sum-{dtype}"] = comm.all_reduce(x)
    part = torch.full((700, 3), float(rank))  # 700 rows of 3: gathered a slot's worth of rows at a time
    results["gather"] = comm.all_gather(part)
    queue.put((rank, {k: v.float().numpy() for k, v in results.items()}))  # numpy: no shared tensor handles
    comm.close()


def test_all_reduce_and_all_gather_match_torch_on_both_ranks(tmp_path):
    path = str(tmp_path / "segment")
    shm.create_segment(path, 2, SLOT_BYTES)
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    peers = [context.Process(target=rank_main, args=(path, rank, queue)) for rank in range(2)]
    for peer in peers:
        peer.start()
    results = dict(queue.get(timeout=120) for _ in peers)
    for peer in peers:
        peer.join(30)
    results = {rank: {k: torch.from_numpy(v) for k, v in r.items()} for rank, r in results.items()}
    for dtype in (torch.float32, torch.bfloat16):
        inputs = [results[r][f"input-{dtype}"].to(dtype) for r in range(2)]
        expected = (inputs[0] + inputs[1]).float()  # torch's bf16 add rounds once, as the slots' sum does
        assert torch.equal(results[0][f"sum-{dtype}"], expected)
        assert torch.equal(results[1][f"sum-{dtype}"], expected)  # the same bits on every rank
    gathered = torch.cat([torch.zeros(700, 3), torch.ones(700, 3)], dim=1)
    assert torch.equal(results[0]["gather"], gathered) and torch.equal(results[1]["gather"], gathered)


def test_a_lost_peer_fails_the_wait_at_once(tmp_path):
    path = str(tmp_path / "segment")
    shm.create_segment(path, 2, SLOT_BYTES)
    comm = shm.ShmCommunicator(path, 0, 2, lambda: "rank 1 exited with code -9", timeout_s=30,
                               slot_bytes=SLOT_BYTES)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 is not answering: rank 1 exited"):
        comm.all_reduce(torch.ones(4))
    assert time.monotonic() - start < 5


def test_a_peer_that_never_comes_times_out(tmp_path):
    path = str(tmp_path / "segment")
    shm.create_segment(path, 2, SLOT_BYTES)
    comm = shm.ShmCommunicator(path, 0, 2, lambda: None, timeout_s=0.5, slot_bytes=SLOT_BYTES)
    with pytest.raises(TimeoutError, match="did not reach the collective within"):
        comm.all_reduce(torch.ones(4))
