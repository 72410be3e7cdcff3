"""Speculative decoding's worst case for a draft model: one whose drafts are practically never accepted.

    python benchmarks/spec_draft_worst_case.py [--rounds 3] [--k 4]

Target: the Qwen2.5-0.5B shape with random weights (bf16; benchmarks/comparison/models.py builds it). Draft: the
same shape cut to 2 layers with other random weights (seed 1), so it shares the tokenizer and vocabulary but not
a single preference. Workloads as benchmarks/compare.py: W1 (32 random tokens -> 128, batch 1) and W2 (32 x 128
-> 64, batch 32; above the default disable_by_batch_size nobody speculates). Goal (issue #14): >= 0.95x of
speculation off.

Each measurement is a fresh process (loads, one untimed run of the workload, then a timed run: the first W2 run
pays first-touch page faults); processes with and without the draft model take turns, rotated each round;
medians of the rounds and their ratio are printed.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from comparison.children import run as run_child, stop_on_sigterm  # noqa: E402

WORKLOADS = {"W1": (1, 32, 128), "W2": (32, 128, 64)}  # batch, prompt tokens, output tokens


def build_models(out_dir: Path) -> tuple[str, str]:
    from comparison.models import QWEN05_SHAPE, build_random_model, default_gguf_path

    gguf = default_gguf_path()
    target = build_random_model("qwen2.5-0.5b-shape-random", QWEN05_SHAPE,
                                out_dir / "models" / "qwen2.5-0.5b-shape-random", gguf)
    draft = build_random_model("qwen2.5-0.5b-shape-random-2-layers", {**QWEN05_SHAPE, "num_hidden_layers": 2},
                               out_dir / "models" / "qwen2.5-0.5b-shape-random-2-layers", gguf, seed=1)
    return target["path"], draft["path"]


def child(target: str, draft: str | None, workload: str, k: int) -> None:
    """One measurement, printed as a JSON line: output tok/s of the timed run, and the drafts it verified."""
    from pagedserve import LLM, SamplingParams

    spec = {"model": draft, "num_speculative_tokens": k} if draft else None
    llm = LLM(target, max_model_len=1024, speculative_config=spec)
    batch, prompt_len, max_tokens = WORKLOADS[workload]
    vocab = llm.engine.config.model.hf_config.vocab_size
    rng = random.Random(1234)
    inputs = [{"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(prompt_len)]} for _ in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(inputs, params)  # untimed: first-touch page faults, the draft model's first forwards
    proposer = llm.engine.scheduler.proposer
    before = proposer.totals.num_draft_tokens if proposer else 0
    start = time.perf_counter()
    outputs = llm.generate(inputs, params)
    seconds = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outputs]
    print(json.dumps({"tok_s": sum(map(len, tokens)) / seconds, "tokens": tokens,
                      "draft_tokens": (proposer.totals.num_draft_tokens - before) if proposer else 0}))


def measure(target: str, draft: str | None, workload: str, k: int) -> dict:
    command = [sys.executable, __file__, "--child", workload, "--target", target, "--k", str(k)]
    if draft:
        command += ["--draft", draft]
    done = run_child(command, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--workloads", default="W1,W2")
    parser.add_argument("--out-dir", type=Path, default=HERE / "out")
    parser.add_argument("--child", choices=sorted(WORKLOADS), help=argparse.SUPPRESS)
    parser.add_argument("--target", help=argparse.SUPPRESS)
    parser.add_argument("--draft", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.target, args.draft, args.child, args.k)
        return 0
    stop_on_sigterm()
    target, draft = build_models(args.out_dir)
    systems = {"no speculation": None, "+ draft model": draft}
    for workload in args.workloads.split(","):
        results: dict[str, list[dict]] = {name: [] for name in systems}
        for round_index in range(args.rounds):
            order = list(systems)[round_index % 2:] + list(systems)[:round_index % 2]
            for name in order:
                results[name].append(measure(target, systems[name], workload, args.k))
        rates = {name: statistics.median(r["tok_s"] for r in runs) for name, runs in results.items()}
        identical = all(r["tokens"] == results["no speculation"][0]["tokens"] for runs in results.values()
                        for r in runs)
        print(f"{workload}: no speculation {rates['no speculation']:.1f} tok/s, + draft model "
              f"{rates['+ draft model']:.1f} tok/s, ratio {rates['+ draft model'] / rates['no speculation']:.2f}x; "
              f"drafts per timed run {[r['draft_tokens'] for r in results['+ draft model']]}; identical {identical}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
