"""One linear kernel (`ps_linear_bf16`, `ps_linear_i8` or `ps_linear_q`), an older commit's against the working
tree's, taking turns.

Both versions of pagedserve/kernels/cpu_kernels.c are compiled side by side (attention_ab.side_by_side: -O3
-march=native, or x86-64-v3 with --avx2; AMX stays off unless --amx) and called through ctypes on the same inputs:
Qwen2.5-0.5B's linear shapes (gate/up 9728x896, down 896x4864, q/k/v 1152x896), random weights packed once by this
tree's kernels (the layouts must not have changed between the two commits; GGUF blocks quantized by gguf.quants), in
enough copies to stream from memory as a model's layers do, bf16 activations, M rows of x. The outputs must be
bit-identical (the check fails otherwise; --bits-may-differ reports by how much instead, for a change that adds in
another order); the time is the median of repeats taking turns (the order flipped every repeat), per call; "paired"
is the median of each repeat's own ratio (steadier where the VM's bandwidth drifts).

    python benchmarks/linear_ab.py --before COMMIT [--avx2 [--vnni] | --amx] [--kind bf16|int8|q4_1|q5_0]
        [--rows 1 2 5 9 16] [--mib 200] [--shapes 960x576 576x576 3072x576 576x1536] [--bits-may-differ]

--shapes replaces the default shapes (outputs x inputs; the example is SmolLM2-135M's qkv, o, gate/up and down).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

SHAPES = [(9728, 896), (896, 4864), (1152, 896)]
P, I64, INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
QTYPES = {"q4_1": "Q4_1", "q5_0": "Q5_0"}  # --kind: the GGUF block types `ps_linear_q` serves as stored


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="older commit (its cpu_kernels.c via git show)")
    parser.add_argument("--avx2", action="store_true", help="build both for x86-64-v3 (the AVX2 kernels)")
    parser.add_argument("--kind", choices=["bf16", "int8", *QTYPES], default="bf16",
                        help="weights: bf16, int8 per channel, or a GGUF block type served as stored")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 5, 9, 16])
    parser.add_argument("--mib", type=int, default=200, help="weight copies per shape, in MiB (past the caches)")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--shapes", nargs="+", default=None, metavar="NxK",
                        help="outputs x inputs of each linear (default: Qwen2.5-0.5B's)")
    parser.add_argument("--bits-may-differ", action="store_true",
                        help="report, instead of refusing, outputs that differ (a change that adds in another order)")
    parser.add_argument("--amx", action="store_true", help="turn AMX on in both (ps_amx_init), where the CPU has it")
    parser.add_argument("--vnni", action="store_true",
                        help="with --avx2: the working tree's side adds -mavxvnni (AVX-VNNI's int8 sums; needs a CPU "
                             "with it), so --before HEAD measures what AVX-VNNI gives")
    args = parser.parse_args()
    shapes = SHAPES if args.shapes is None else [tuple(int(v) for v in s.split("x")) for s in args.shapes]
    if args.vnni and not args.avx2:
        parser.error("--vnni compares AVX2 builds: add --avx2")
    if args.avx2:  # pack in the AVX2 build's layout (its bf16 blocks hold 16 outputs, not 64)
        os.environ["PAGEDSERVE_CPU_ISA"] = "avx2"
    import torch

    from attention_ab import side_by_side
    from ready_ab import in_turns
    from pagedserve.kernels import cpu_kernels
    from pagedserve.layers.linear import quantize_int8_per_channel

    kernels = cpu_kernels()
    if kernels is None:
        raise SystemExit("no native kernels on this machine")
    threads = torch.get_num_threads()
    with side_by_side(args.before, args.avx2, ("-mavxvnni",) if args.vnni else ()) as (march, libs):
        for lib in libs.values():
            lib.ps_linear_bf16.argtypes = [P, P, P, P, I64, I64, I64, INT]
            lib.ps_linear_i8.argtypes = [P, P, P, P, P, P, I64, I64, I64, INT, INT]
            lib.ps_linear_q.argtypes = [P, P, INT, P, P, I64, I64, I64, INT, INT]
            if args.amx and not lib.ps_amx_init(1):
                raise SystemExit("--amx: this CPU or kernel grants no AMX tiles")
        print(f"-march={march} ({kernels.isa} layout{', AMX' if args.amx else ''}"
              f"{', after: -mavxvnni' if args.vnni else ''}), {threads} threads, "
              f"{args.kind} weights, bf16 x")
        for n, k in shapes:
            torch.manual_seed(n + k)
            weight = torch.randn(n, k)
            if args.kind == "bf16":
                packed = kernels.pack_bf16(weight.bfloat16())
            elif args.kind in QTYPES:
                import numpy as np
                from gguf import GGMLQuantizationType
                from gguf.quants import quantize

                qtype = GGMLQuantizationType[QTYPES[args.kind]]
                blocks = quantize(weight.numpy() * 0.05, qtype).view(np.uint8).reshape(n, -1)
                rows = kernels.pack_gguf_q(torch.from_numpy(blocks.copy()), int(qtype), k)
                packed, qkind = kernels.pack_q_rows(*rows[:3]), rows[3]
            else:
                qweight, scales = quantize_int8_per_channel(weight)
                sums = kernels.row_sums(qweight)
                packed = kernels.pack_rows(qweight)
            bytes_per_copy = packed.numel() * packed.element_size()
            copies = max(1, (args.mib << 20) // bytes_per_copy)
            weights = [packed.clone() for _ in range(copies)]

            def call(lib: ctypes.CDLL, w, x, y) -> None:
                m = x.shape[0]
                if args.kind == "bf16":
                    lib.ps_linear_bf16(x.data_ptr(), w.data_ptr(), None, y.data_ptr(), m, n, k, threads)
                elif args.kind in QTYPES:
                    lib.ps_linear_q(x.data_ptr(), w.data_ptr(), qkind, None, y.data_ptr(), m, n, k, 1, threads)
                else:
                    lib.ps_linear_i8(x.data_ptr(), w.data_ptr(), scales.data_ptr(), sums.data_ptr(), None,
                                     y.data_ptr(), m, n, k, 1, threads)

            for rows in args.rows:
                x = torch.randn(rows, k).bfloat16()
                outs = {}
                for name, lib in libs.items():
                    outs[name] = torch.empty(rows, n, dtype=torch.bfloat16)
                    call(lib, weights[0], x, outs[name])
                same = torch.equal(outs["before"], outs["after"])
                if not same and not args.bits_may_differ:
                    raise SystemExit(f"{n}x{k}, {rows} rows: the two kernels' outputs differ (--bits-may-differ: a "
                                     "change that adds in another order)")
                before_out, after_out = outs["before"].float(), outs["after"].float()
                spread = (before_out - after_out).abs().max() / before_out.abs().max()
                agreement = "outputs bit-identical" if same else f"outputs differ by up to {spread:.1e} of the largest"
                y = torch.empty(rows, n, dtype=torch.bfloat16)
                times: dict[str, list[float]] = {name: [] for name in libs}
                for index in range(args.repeats):
                    for name, lib in in_turns(libs, index):
                        start = time.perf_counter()
                        for w in weights:
                            call(lib, w, x, y)
                        times[name].append((time.perf_counter() - start) / len(weights))
                before, after = statistics.median(times["before"]), statistics.median(times["after"])
                paired = statistics.median(b / a for b, a in zip(times["before"], times["after"]))
                print(f"{n}x{k}, {rows} rows: before {before * 1e3:.3f} ms, after {after * 1e3:.3f} ms "
                      f"({bytes_per_copy / after / 1e9:.1f} GB/s of weights), {before / after:.2f}x, paired "
                      f"{paired:.2f}x ({agreement})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
