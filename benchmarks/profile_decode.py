"""Where a decode step's time goes: W1 (single stream) and W2 (batch) timings plus a torch profile.

Usage: python benchmarks/profile_decode.py MODEL_DIR [--dtype bfloat16] [--profile] [--batch 32]
"""

from __future__ import annotations

import argparse
import statistics
import time


from pagedserve import LLM, SamplingParams


def run_w1(llm: LLM, repeats: int) -> list[float]:
    rates = []
    for r in range(repeats):
        prompt = {"prompt_token_ids": [(r * 31 + i * 7) % 1000 + 10 for i in range(32)]}
        t0 = time.perf_counter()
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True))[0]
        rates.append(len(out.outputs[0].token_ids) / (time.perf_counter() - t0))
    return rates


def run_w2(llm: LLM, batch: int) -> float:
    prompts = [{"prompt_token_ids": [(b * 131 + i * 7) % 1000 + 10 for i in range(128)]} for b in range(batch)]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--batch", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3)
    args, extra = parser.parse_known_args()
    kwargs = {}
    for item in extra:
        key, _, value = item.lstrip("-").partition("=")
        kwargs[key.replace("-", "_")] = int(value) if value.isdigit() else value
    llm = LLM(args.model, dtype=args.dtype, max_model_len=2048, **kwargs)
    rates = run_w1(llm, args.repeats)
    print(f"W1 tok/s: min {min(rates):.1f} median {statistics.median(rates):.1f} max {max(rates):.1f}")
    if args.batch:
        print(f"W2 output tok/s (batch {args.batch}): {run_w2(llm, args.batch):.1f}")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            llm.generate([{"prompt_token_ids": list(range(10, 42))}],
                         SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
