"""Tensor parallelism across processes on one host (vLLM's --tensor-parallel-size).

- `sharding.py`: which slice of each checkpoint tensor a rank holds (Megatron: q/k/v and gate/up by output
  rows, o and down by input columns, the vocabulary by rows); pure arithmetic, checked before anything loads.
- `group.py`: `TPGroup`, the collectives the sharded layers call (all-reduce, all-gather), over gloo or the
  shared-memory path of `shm.py`, with timeouts and a dead flag so that a lost rank fails a step instead of
  hanging it.
- `binding.py`: each rank's cores (`--cpu-binding "0-7|8-15"`, default: the usable cores split evenly).
- `layers.py`: the vocab-parallel embedding and logits.
- `launch.py`: rank 0 (the engine's process) starts ranks 1..N-1, watches them, and sends each step's inputs.

The worker side is `worker/tp_worker.py`.
"""
