"""Draft-model speculation with a draft that (almost) always agrees: the target's own weights, quantized.

    python benchmarks/spec_draft_self.py [--rounds 3] [--k 4]

Target: the shipped Qwen2.5-Coder-0.5B-Instruct, exported from its GGUF (Q4_K_M: mostly Q5_0 tensors) as a bf16 Hugging Face directory
(benchmarks/gguf_to_hf.py; `--dtype auto` serves it in bf16). Draft: the same GGUF, which `--dtype auto` serves
as int8 weights: it shares the tokenizer and nearly every greedy choice, so its acceptance shows the machinery's
best case, and its cost (half the target's bytes per step) what a draft only 2x cheaper than its target can give.
No shipped pair of models of different sizes shares a tokenizer, so this stands in for a good draft.
Workloads: speculative.py's editing and quoting prompts and an open-ended one (no text to copy), batch 1,
greedy, chat template; both engines in this process, taking turns in rotated order; medians of the rounds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from speculative import WORKLOADS, chat_prompt, rotated, run_pagedserve  # noqa: E402

WRITE = ("Write a Python function that parses an ISO 8601 date string without using datetime, with a docstring "
         "and three doctest examples.", 300)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--out-dir", default=str(HERE / "out" / "models" / "qwen2.5-coder-0.5b-instruct-bf16"))
    args = parser.parse_args()
    from gguf_to_hf import save_as_hf_dir
    import torch

    from pagedserve import LLM
    from pagedserve.models.fetch import resolve_model

    gguf = str(resolve_model("qwen2.5-coder-0.5b-instruct"))
    target = Path(args.out_dir)
    if not (target / "model.safetensors").exists():
        save_as_hf_dir(gguf, target, torch.bfloat16)
    kwargs = dict(max_model_len=2048, enable_prefix_caching=False)
    plain = LLM(str(target), **kwargs)
    spec = LLM(str(target), speculative_config={"model": gguf, "num_speculative_tokens": args.k}, **kwargs)
    jobs = {name: (chat_prompt(plain, text), max_tokens) for name, (text, max_tokens) in
            {**WORKLOADS, "write": WRITE}.items()}
    systems = {"plain": lambda: run_pagedserve(plain, jobs), "draft": lambda: run_pagedserve(spec, jobs)}
    runs: dict[str, list[dict]] = {system: [] for system in systems}
    for round_index in range(args.rounds):
        for system in rotated(list(systems), round_index):
            runs[system].append(systems[system]())
    totals = spec.engine.scheduler.proposer.totals
    print(f"k = {args.k}, draft acceptance {totals.acceptance_rate:.0%}")
    print("| workload | prompt / output tokens | bf16 tok/s (decode) | + int8 self-draft tok/s (decode) | "
          "speed-up, e2e (decode) | text identical |")
    print("|---|---|---|---|---|---|")
    for name in jobs:
        rate = {s: statistics.median(len(r[name]["tokens"]) / r[name]["seconds"] for r in runs[s]) for s in systems}
        decode = {s: statistics.median((len(r[name]["tokens"]) - 1) / r[name]["decode_seconds"] for r in runs[s])
                  for s in systems}
        identical = all(r[name]["tokens"] == runs["plain"][0][name]["tokens"] for s in systems for r in runs[s])
        print(f"| {name} | {len(jobs[name][0])} / {len(runs['plain'][0][name]['tokens'])} | {rate['plain']:.1f} "
              f"({decode['plain']:.1f}) | {rate['draft']:.1f} ({decode['draft']:.1f}) | "
              f"{rate['draft'] / rate['plain']:.2f}x ({decode['draft'] / decode['plain']:.2f}x) | "
              f"{'yes' if identical else 'NO'} |")


if __name__ == "__main__":
    main()
