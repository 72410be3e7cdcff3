"""How fast batch-1 bf16 matmuls stream a 0.5B model's weights, with packed weights on huge pages or not.

Allocates the 97 matrices of Qwen2.5-0.5B (24 layers of qkv, o, gate_up, down, and the 151936 x 896
logits matrix) in the native kernel's packed layout, either through `CpuKernels.weight_buffer` (own
2 MiB-aligned mappings advised for transparent huge pages, as the engine does) or plain torch tensors,
then times batch-1 `linear_bf16` over all of them. Run it in fresh processes, alternating the modes:
the machine's bandwidth drifts from minute to minute.

    for i in 1 2 3; do python benchmarks/stream_weights.py huge; python benchmarks/stream_weights.py plain; done
"""

from __future__ import annotations

import argparse
import time

import torch

from pagedserve.kernels import cpu_kernels

SHAPES = [(1152, 896), (896, 896), (9728, 896), (896, 4864)] * 24 + [(151936, 896)]


def anon_huge_mib() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return next((int(line.split()[1]) // 1024 for line in f if line.startswith("AnonHugePages")), 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["huge", "plain"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    kernels = cpu_kernels()
    if kernels is None:
        raise SystemExit("needs the native kernels (AVX-512 or AVX2; see `pagedserve doctor`)")
    torch.set_num_threads(args.threads)
    if args.mode == "plain":
        kernels.weight_buffer = lambda *shape, dtype: torch.empty(*shape, dtype=dtype)
    packed = [kernels.pack_bf16(torch.randn(n, k).bfloat16()) for n, k in SHAPES]
    nbytes = sum(p.numel() * p.element_size() for p in packed)
    inputs = {k: torch.randn(1, k).bfloat16() for _, k in SHAPES}

    def step() -> None:
        for (n, k), weight in zip(SHAPES, packed):
            kernels.linear_bf16(inputs[k], weight, None, n)

    for _ in range(3):
        step()
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    median = sorted(times)[len(times) // 2]
    print(f"{args.mode}: {nbytes / 1e9:.2f} GB of packed weights in {median * 1e3:.1f} ms (median) = "
          f"{nbytes / median / 1e9:.1f} GB/s; {anon_huge_mib()} MiB on huge pages")


if __name__ == "__main__":
    main()
