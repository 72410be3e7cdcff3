"""Decode (or prefill) tok/s of an older commit against the working tree, at a given batch and context, taking turns.

For kernel changes that matter only at some batch sizes or context lengths (decode attention grows with the
context): B prompts of L random tokens, greedy, EOS ignored; the decode rate is B * N / (time to generate N + 1
tokens - time to generate 1), so the prefill is not counted. With --prefill the rate is instead B * L / (time to
generate 1 token): the prompts' prefill, prefix caching off. Each tree runs in a fresh process (PYTHONPATH
pointing at it, both trees byte-compiled), the order flipping every round (ready_ab.py's helpers), because this
VM's speed drifts from minute to minute. The older commit is a git worktree (`git worktree add /tmp/oldtree COMMIT`).

    python benchmarks/decode_ab.py --before /tmp/oldtree MODEL --batch 8 --context 1536 --tokens 64 [--rounds 2]
    python benchmarks/decode_ab.py --before /tmp/oldtree MODEL --prefill --batch 1 --context 428
    python benchmarks/decode_ab.py --before . MODEL --env-after PAGEDSERVE_BATCH_INVARIANT=1  # a switch, one tree
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from ready_ab import REPO, in_turns, prepare_trees, run_in_tree, stop_on_sigterm  # noqa: E402

CHILD = r"""
import json, sys, time
from pagedserve import LLM, SamplingParams
model, batch, context, tokens, repeats, prefill = sys.argv[1], *map(int, sys.argv[2:7])
llm = LLM(model, max_model_len=context + tokens + 8, **json.loads(sys.argv[7]))
def prompts(seed):
    return [{"prompt_token_ids": [(seed * 977 + b * 131 + i * 7) % 5000 + 10 for i in range(context)]}
            for b in range(batch)]
def seconds(n, seed):
    start = time.perf_counter()
    llm.generate(prompts(seed), SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    return time.perf_counter() - start
seconds(2, 0)
if prefill:
    rates = [batch * context / seconds(1, 10 + r) for r in range(repeats)]
else:
    rates = [batch * tokens / (seconds(tokens + 1, 20 + r) - seconds(1, 10 + r)) for r in range(repeats)]
print("RESULT " + json.dumps(max(rates)))
"""


def decode_rate(tree: Path, args: argparse.Namespace, env: list[str]) -> float:
    return run_in_tree(tree, CHILD, args.model, str(args.batch), str(args.context), str(args.tokens),
                       str(args.repeats), str(int(args.prefill)), json.dumps(args.engine_kwargs),
                       env=dict(item.split("=", 1) for item in env))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="model path")
    parser.add_argument("--before", type=Path, required=True, help="worktree of the older commit")
    parser.add_argument("--after", type=Path, default=REPO, help="tree to compare (default: this one)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=128, help="prompt tokens per sequence")
    parser.add_argument("--tokens", type=int, default=64, help="decoded tokens per sequence")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per process (the best is kept)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--engine-kwargs", type=json.loads, default={}, help='e.g. \'{"quantization": "int8"}\'')
    parser.add_argument("--prefill", action="store_true", help="time the prompts' prefill instead of decoding")
    for side in ("before", "after"):
        parser.add_argument(f"--env-{side}", nargs="*", default=[], metavar="VAR=VALUE",
                            help=f"environment of the {side} runs (with --before . an A/B of a switch in one tree)")
    args = parser.parse_args()
    stop_on_sigterm()
    args.model = str(Path(args.model).resolve())
    if args.prefill:
        args.engine_kwargs = {"enable_prefix_caching": False, **args.engine_kwargs}  # every repeat prefills again
    trees = prepare_trees(args.before, args.after)
    rates: dict[str, list[float]] = {name: [] for name in trees}
    for index in range(args.rounds):
        for name, tree in in_turns(trees, index):
            rates[name].append(decode_rate(tree, args, getattr(args, f"env_{name}")))
            print(f"round {index + 1} {name}: {rates[name][-1]:.1f} tok/s", flush=True)
    before, after = statistics.median(rates["before"]), statistics.median(rates["after"])
    what = "prefill" if args.prefill else "decode"
    print(f"{what}, batch {args.batch}, context {args.context}: before {before:.1f} tok/s, after {after:.1f} tok/s, "
          f"ratio {after / before:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
