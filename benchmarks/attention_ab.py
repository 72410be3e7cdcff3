"""Decode attention alone (`ps_decode_attention`), an older commit's kernel against the working tree's, taking turns.

Both versions of pagedserve/kernels/cpu_kernels.c are compiled here with the flags pagedserve builds with
(-O3 -march=native, or -march=x86-64-v3 with --avx2 for the AVX2 kernels) and called through ctypes on the same
inputs: a batch of sequences with the Qwen2.5-0.5B attention shape (14 query heads, 2 KV heads, head size 64,
bf16; --heads 9 3 for SmolLM2-135M's), a paged pool (blocks of 16 slots, shuffled), contexts of the given
lengths. The outputs must be bit-identical (the check fails otherwise; --allow-differences times a change of
roundings and prints the largest difference); the time is the median of repeats taking turns (the order flipped
every repeat), per layer call.

    python benchmarks/attention_ab.py --before COMMIT [--avx2] [--batch 32] [--contexts 100 1000 2000] [--heads 9 3]
        [--allow-differences]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from ready_ab import REPO, in_turns  # noqa: E402

SOURCE = "pagedserve/kernels/cpu_kernels.c"
P, I64, INT, F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


def build(source: str, march: str, out: Path, extra: tuple[str, ...] = ()) -> ctypes.CDLL:
    c_file = out.with_suffix(".c")
    c_file.write_text(source)
    subprocess.run(["gcc", "-O3", f"-march={march}", *extra, "-fopenmp", "-shared", "-fPIC", str(c_file), "-o",
                    str(out), "-lm"], check=True)
    return ctypes.CDLL(str(out))


@contextlib.contextmanager
def side_by_side(before: str, avx2: bool, after_flags: tuple[str, ...] = ()
                 ) -> Iterator[tuple[str, dict[str, ctypes.CDLL]]]:
    """The older commit's cpu_kernels.c (git show) and this tree's, compiled alike (the tree's with `after_flags`
    added): (-march, {"before", "after"})."""
    march = "x86-64-v3" if avx2 else "native"
    old_source = subprocess.run(["git", "-C", str(REPO), "show", f"{before}:{SOURCE}"], check=True,
                                capture_output=True, text=True).stdout
    with tempfile.TemporaryDirectory() as tmp:
        yield march, {"before": build(old_source, march, Path(tmp) / "before.so"),
                      "after": build((REPO / SOURCE).read_text(), march, Path(tmp) / "after.so", after_flags)}


def attend(lib: ctypes.CDLL, q, k_cache, v_cache, slots, lens, threads: int) -> torch.Tensor:
    b, hq, d = q.shape
    out = torch.empty(b, hq, d, dtype=q.dtype)
    lib.ps_decode_attention(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(),
                            lens.data_ptr(), out.data_ptr(), b, hq, k_cache.shape[1], d, slots.shape[1], d ** -0.5,
                            int(q.dtype == torch.bfloat16), threads)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="older commit (its cpu_kernels.c via git show)")
    parser.add_argument("--avx2", action="store_true", help="build both for x86-64-v3 (the AVX2 kernels)")
    parser.add_argument("--allow-differences", action="store_true",
                        help="time kernels whose outputs differ (a change of roundings), printing the largest "
                        "difference")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--contexts", type=int, nargs="+", default=[100, 1000, 2000])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--heads", type=int, nargs=2, default=[14, 2], metavar=("HQ", "HKV"),
                        help="query and KV heads (default Qwen2.5-0.5B's 14 2; SmolLM2-135M: 9 3)")
    args = parser.parse_args()
    threads = torch.get_num_threads()
    with side_by_side(args.before, args.avx2) as (march, libs):
        for lib in libs.values():
            lib.ps_decode_attention.argtypes = [P, I64, P, P, P, P, P, I64, I64, I64, I64, I64, F32, INT, INT]
        print(f"-march={march}, {threads} threads, batch {args.batch}, {args.heads[0]} query / {args.heads[1]} KV heads "
              "of 64, bf16")
        for context in args.contexts:
            torch.manual_seed(context)
            (hq, hkv), d, block = args.heads, 64, 16
            blocks_per_seq = -(-context // block)
            num_slots = args.batch * blocks_per_seq * block
            k_cache, v_cache = (torch.randn(num_slots, hkv, d).bfloat16() for _ in range(2))
            order = torch.randperm(args.batch * blocks_per_seq).view(args.batch, blocks_per_seq)
            slots = (order[:, :, None] * block + torch.arange(block)).reshape(args.batch, -1).contiguous()
            lens = torch.full((args.batch,), context, dtype=torch.int64)
            q = torch.randn(args.batch, hq, d).bfloat16()
            outs = {name: attend(lib, q, k_cache, v_cache, slots, lens, threads) for name, lib in libs.items()}
            outputs = "outputs bit-identical"
            if not torch.equal(outs["before"], outs["after"]):
                difference = float((outs["before"].float() - outs["after"].float()).abs().max())
                if not args.allow_differences:
                    raise SystemExit(f"context {context}: the two kernels' outputs differ (at most {difference:.2e}); "
                                     "--allow-differences for a change of roundings")
                outputs = f"outputs differ by at most {difference:.2e}"
            times: dict[str, list[float]] = {name: [] for name in libs}
            calls = max(3, 60_000 // context)
            for index in range(args.repeats):
                for name, lib in in_turns(libs, index):
                    start = time.perf_counter()
                    for _ in range(calls):
                        attend(lib, q, k_cache, v_cache, slots, lens, threads)
                    times[name].append((time.perf_counter() - start) / calls)
            before, after = statistics.median(times["before"]), statistics.median(times["after"])
            print(f"context {context}: before {before * 1e3:.3f} ms, after {after * 1e3:.3f} ms a layer, "
                  f"{before / after:.2f}x ({outputs})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
