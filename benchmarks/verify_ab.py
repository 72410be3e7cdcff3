"""Speculative verification steps of an older commit against the working tree, taking turns.

For kernel changes that matter to the rows of a verification (1 + k rows of one request): each tree runs
`speculative.py`'s workloads (edit, quote) with its n-gram configuration on a real model, in a fresh process (PYTHONPATH
pointing at the tree), the order flipping every round; reported per workload are the median time of the runner's
1 + k-row steps and of its 1-row steps, and the request's output tok/s. The older commit is a git worktree
(`git worktree add /tmp/oldtree COMMIT`).

    python benchmarks/verify_ab.py --before /tmp/oldtree [--models smollm2-135m-instruct,...] [--rounds 3]
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
from speculative import MODELS, SPEC  # noqa: E402

CHILD = r"""
import collections, json, statistics, sys, time
sys.path.insert(0, sys.argv[3])
import speculative
from pagedserve import LLM, SamplingParams
from pagedserve.models.fetch import resolve_model
spec = json.loads(sys.argv[2])
llm = LLM(str(resolve_model(sys.argv[1])), max_model_len=2048, enable_prefix_caching=False, speculative_config=spec)
runner, rows = llm.engine.runner, 1 + spec["num_speculative_tokens"]
execute, out = runner.execute, {}
for workload, (text, max_tokens) in speculative.WORKLOADS.items():
    tokens = speculative.chat_prompt(llm, text)
    llm.generate([{"prompt_token_ids": tokens}], SamplingParams(temperature=0.0, max_tokens=4))
    steps = collections.defaultdict(list)
    def timed(scheduled):
        start = time.perf_counter()
        result = execute(scheduled)
        steps[scheduled.total_num_scheduled_tokens].append(time.perf_counter() - start)
        return result
    runner.execute = timed
    start = time.perf_counter()
    result = llm.generate([{"prompt_token_ids": tokens}], SamplingParams(temperature=0.0, max_tokens=max_tokens))
    seconds = time.perf_counter() - start
    runner.execute = execute
    median = lambda n: statistics.median(steps[n]) * 1e3 if steps[n] else None
    out[workload] = {"tok_s": len(result[0].outputs[0].token_ids) / seconds, "verify_ms": median(rows),
                     "one_row_ms": median(1)}
print("RESULT " + json.dumps(out))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="worktree of the older commit")
    parser.add_argument("--after", type=Path, default=REPO, help="tree to compare (default: this one)")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--speculative-config", dest="spec", type=json.loads, default=SPEC)
    args = parser.parse_args()
    stop_on_sigterm()
    trees = prepare_trees(args.before, args.after)
    for model in filter(None, args.models.split(",")):
        runs: dict[str, list[dict]] = {name: [] for name in trees}
        for index in range(args.rounds):
            for name, tree in in_turns(trees, index):
                runs[name].append(run_in_tree(tree, CHILD, model, json.dumps(args.spec), str(HERE)))
                print(f"{model} round {index + 1} {name}: {json.dumps(runs[name][-1])}", flush=True)
        for workload in runs["before"][0]:
            def median(name: str, key: str) -> float:
                return statistics.median(run[workload][key] or float("nan") for run in runs[name])
            print(f"{model} {workload}: {1 + args.spec['num_speculative_tokens']}-row step "
                  f"{median('before', 'verify_ms'):.2f} -> {median('after', 'verify_ms'):.2f} ms, 1-row step "
                  f"{median('before', 'one_row_ms'):.2f} -> {median('after', 'one_row_ms'):.2f} ms, "
                  f"{median('before', 'tok_s'):.1f} -> {median('after', 'tok_s'):.1f} tok/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
