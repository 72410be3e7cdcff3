"""GGUF blocks as stored (`ps_linear_q`: Q4_1, Q5_0) against the same matrices requantized to int8 (`ps_linear_i8`),
the two kernels taking turns in one process; and whole models served both ways in fresh processes taking turns.

Kernels: Qwen2.5-0.5B's linear shapes by default (gate/up 9728x896, down 896x4864, q/k/v 1152x896), random weights
quantized by gguf.quants, in enough copies to stream from memory as a model's layers do, bf16 activations, M rows of
x; the time is the median per call over repeats, the order flipped every repeat; GB/s counts the bytes each kernel's
weights take.

    python benchmarks/gguf_blocks.py [--rows 1 2 5 16 64 256] [--mib 200] [--shapes 960x576 ...]
    python benchmarks/gguf_blocks.py --model smollm2-135m-instruct [--rounds 3] [--tokens 128]

--model: batch-1 decode (a 32-token prompt, `--tokens` greedy tokens, EOS ignored; the workload of W1) and a
512-token prompt's prefill, with --quantization gguf (the file's blocks, the default) and int8, each round a fresh
process per setting, the order flipped every round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from comparison.children import run as run_child, stop_on_sigterm  # noqa: E402

SHAPES = [(9728, 896), (896, 4864), (1152, 896)]
CHILD = """
import json, sys, time
from pagedserve import LLM, SamplingParams
quantization, model, tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
llm = LLM(model, quantization=quantization, max_model_len=1024, enable_prefix_caching=False)
decode = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
prompt = [{"prompt_token_ids": [(37 * i) % 5000 + 100 for i in range(32)]}]
llm.generate(prompt, SamplingParams(max_tokens=4))  # warm
rates = []
for _ in range(3):
    start = time.perf_counter()
    llm.generate(prompt, decode)
    rates.append(tokens / (time.perf_counter() - start))
long = [{"prompt_token_ids": [(53 * i) % 5000 + 100 for i in range(512)]}]
start = time.perf_counter()
llm.generate(long, SamplingParams(max_tokens=1))
prefill = 512 / (time.perf_counter() - start)
print(json.dumps({"decode": sorted(rates)[1], "prefill": prefill}))
"""


def kernels_ab(args: argparse.Namespace) -> None:
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType as QType
    from gguf.quants import quantize

    from pagedserve.kernels import cpu_kernels

    kernels = cpu_kernels()
    if kernels is None:
        sys.exit("no native kernels here")
    shapes = SHAPES if args.shapes is None else [tuple(int(v) for v in s.split("x")) for s in args.shapes]
    print(f"kernels {kernels.isa}, {torch.get_num_threads()} threads, bf16 x; ms per call (GB/s of weights)")
    for n, k in shapes:
        rng = np.random.default_rng(0)
        w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
        copies = max(1, args.mib * (1 << 20) // (n * k))
        entries = {}
        q8 = kernels.requant_gguf_i8(torch.from_numpy(quantize(w, QType.Q8_0).view(np.uint8).reshape(n, -1).copy()),
                                     int(QType.Q8_0), k)
        packed = [(kernels.pack_rows(q8[0]), q8[1], kernels.row_sums(q8[0])) for _ in range(copies)]
        entries["int8"] = (n * k + 12 * n, lambda x, i: kernels.linear_i8(x, *packed[i % copies], None, n))
        for qtype in (QType.Q4_1, QType.Q5_0):
            blocks = torch.from_numpy(quantize(w, qtype).view(np.uint8).reshape(n, -1).copy())
            rows = kernels.pack_gguf_q(blocks, int(qtype), k)
            weights = [kernels.pack_q_rows(*rows[:3]) for _ in range(copies)]
            size = weights[0].numel()
            entries[qtype.name] = (size, lambda x, i, weights=weights, kind=rows[3]:
                                   kernels.linear_q(x, weights[i % copies], kind, None, n))
        for rows in args.rows:
            x = torch.randn(rows, k).bfloat16()
            reps = max(3, int(args.calls / max(1, rows ** 0.5)))
            times = {name: [] for name in entries}
            for repeat in range(args.repeats):
                order = list(entries) if repeat % 2 == 0 else list(entries)[::-1]
                for name in order:
                    call = entries[name][1]
                    start = time.perf_counter()
                    for i in range(reps):
                        call(x, i)
                    times[name].append((time.perf_counter() - start) / reps)
            cells = []
            for name, (size, _) in entries.items():
                t = statistics.median(times[name])
                cells.append(f"{name} {t * 1e3:.3f} ({size / t / 1e9:.1f})")
            print(f"{n}x{k} rows {rows}: " + "  ".join(cells), flush=True)


def models_ab(args: argparse.Namespace) -> None:
    results = {"gguf": [], "int8": []}
    for round_ in range(args.rounds):
        order = ["gguf", "int8"] if round_ % 2 == 0 else ["int8", "gguf"]
        for quantization in order:
            out = run_child([sys.executable, "-c", CHILD, quantization, args.model, str(args.tokens)], check=True,
                            cwd=HERE.parent)
            result = json.loads(out.stdout.strip().splitlines()[-1])
            results[quantization].append(result)
            print(f"round {round_ + 1} {quantization}: decode {result['decode']:.1f} tok/s, "
                  f"prefill {result['prefill']:.0f} tok/s", flush=True)
    for key in ("decode", "prefill"):
        ratios = [g[key] / i[key] for g, i in zip(results["gguf"], results["int8"])]
        print(f"{key}: gguf / int8 = {statistics.median(ratios):.2f}x (rounds {' '.join(f'{r:.2f}' for r in ratios)})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 5, 16, 64, 256])
    parser.add_argument("--mib", type=int, default=200, help="weight copies per shape, in MiB (past the caches)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--calls", type=int, default=40, help="calls per repeat at one row (fewer for more rows)")
    parser.add_argument("--shapes", nargs="+", default=None, metavar="NxK")
    parser.add_argument("--model", default=None, help="a GGUF (path or packaged name): whole-model rounds instead")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    stop_on_sigterm()
    if args.model:
        models_ab(args)
    else:
        kernels_ab(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
