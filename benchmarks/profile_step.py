"""Break one decode step down: matmuls, attention, other tensor ops, and Python/dispatch overhead.

Usage: python benchmarks/profile_step.py MODEL_DIR [--threads N] [--tokens 32]
Counts of tensor ops per step are deterministic; times depend on the machine's load.
"""

from __future__ import annotations

import argparse
import time

from torch.profiler import ProfilerActivity, profile

from pagedserve import LLM, SamplingParams

CATEGORIES = {
    "matmul": ("mkldnn::_linear_pointwise", "aten::addmm", "aten::mm", "aten::_weight_int8pack_mm"),
    "attention": ("aten::_scaled_dot_product_flash_attention_for_cpu",),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    llm = LLM(args.model, dtype=args.dtype, max_model_len=1024, num_threads=args.threads)
    prompt = {"prompt_token_ids": list(range(100, 132))}
    # Prefill once (and cache it) so the profiled call is dominated by decode steps.
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([prompt], params)
    wall_ms = (time.perf_counter() - start) * 1e3 / args.tokens
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate([prompt], params)
    events = prof.key_averages()
    totals = {name: 0.0 for name in CATEGORIES}
    num_ops = 0
    other = 0.0
    for event in events:
        if not event.key.startswith(("aten::", "mkldnn::")):
            continue
        num_ops += event.count
        for name, keys in CATEGORIES.items():
            if event.key in keys:
                totals[name] += event.self_cpu_time_total
                break
        else:
            other += event.self_cpu_time_total
    per_step = lambda us: us / 1e3 / args.tokens
    print(f"threads {args.threads}: {wall_ms:.1f} ms per token unprofiled ({1e3 / wall_ms:.1f} tok/s)")
    for name, value in totals.items():
        print(f"  {name:10s} {per_step(value):7.2f} ms/step")
    print(f"  {'other ops':10s} {per_step(other):7.2f} ms/step   ({num_ops / args.tokens:.0f} tensor ops per step)")
    accounted = sum(per_step(v) for v in totals.values()) + per_step(other)
    print(f"  the rest (Python, dispatch, scheduler, sampler glue): {max(0.0, wall_ms - accounted):.2f} ms/step")


if __name__ == "__main__":
    main()
