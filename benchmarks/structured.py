"""Structured outputs: what a JSON schema costs a decode step, and how long a grammar takes to compile.

    python benchmarks/structured.py [--rounds 5] [--report benchmarks/RESULTS_structured.md]

On the Qwen2.5-0.5B shape (random weights, the Qwen2.5 tokenizer: 151,936-entry vocabulary, built by
compare.py into benchmarks/out/models/), in this process, interleaved: decode tokens/s of a JSON-schema request
against the same request without a schema, at batch 1 and batch 32 (goal: constrained >= 0.9x). Both generate
exactly --max-tokens tokens (the schema holds a 1,000-character string, so the grammar never ends first), and
decode time is the time for max_tokens tokens minus the time for 1 (the prefill), so prompt work cancels out.
Then the first compilation of a schema (xgrammar import + vocabulary scan + compile), a second schema (compile
only) and a repeated one (cache hit), each timed around the engine's GrammarCompiler.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

SCHEMA = {"type": "object", "required": ["title", "body"], "additionalProperties": False,
          "properties": {"title": {"type": "string", "maxLength": 40},
                         "body": {"type": "string", "minLength": 1000, "maxLength": 1000}}}
SECOND_SCHEMA = {"type": "object", "required": ["sku", "sizes", "price"], "properties": {
    "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, "price": {"type": "number", "minimum": 0},
    "sizes": {"type": "array", "items": {"enum": ["S", "M", "L"]}, "maxItems": 3}}}


def decode_seconds(llm, prompts: list[list[int]], params: list, max_tokens: int) -> tuple[float, int]:
    """(seconds spent on tokens 2..max_tokens, tokens generated) for one batch (params: one per prompt)."""
    inputs = [{"prompt_token_ids": p} for p in prompts]
    start = time.perf_counter()
    llm.generate(inputs, [p.clone(max_tokens=1) for p in params])
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    outputs = llm.generate(inputs, [p.clone(max_tokens=max_tokens) for p in params])
    total = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    return total - prefill, generated - len(prompts)


def compile_latencies(llm) -> dict[str, float]:
    from pagedserve.structured import StructuredOutputsParams

    compiler = llm.engine.grammar_compiler
    timings = {}
    for label, schema in (("first schema (import + vocabulary scan + compile)", SCHEMA),
                          ("second schema (compile)", SECOND_SCHEMA), ("repeated schema (cache)", SCHEMA)):
        start = time.perf_counter()
        compiler.compile(StructuredOutputsParams(json=schema))
        timings[label] = time.perf_counter() - start
    return timings


def cpu_class() -> str:
    from pagedserve.memory.probe import cpu_class as probe, cpu_flags

    return probe(cpu_flags())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "out")
    parser.add_argument("--report", type=Path, default=None, help="write the markdown table here")
    args = parser.parse_args(argv)

    from comparison.models import QWEN05_SHAPE, build_random_model, default_gguf_path

    from pagedserve import LLM, SamplingParams
    from pagedserve.structured import StructuredOutputsParams

    model = build_random_model("qwen2.5-0.5b-shape-random", QWEN05_SHAPE,
                               args.out_dir / "models" / "qwen2.5-0.5b-shape-random", default_gguf_path())
    load = os.getloadavg()[0]
    llm = LLM(model["path"], max_model_len=1024)
    compile_times = compile_latencies(llm)
    free = SamplingParams(temperature=0.0, ignore_eos=True)  # generates max_tokens like the constrained one
    constrained = SamplingParams(temperature=0.0, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    llm.generate("warm up", constrained.clone(max_tokens=4))  # compiled once: the timed runs hit the cache
    rows = []
    vocab = llm.engine.config.model.hf_config.vocab_size
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = [[(97 * i + 31 * j + 7) % vocab for j in range(args.prompt_len)] for i in range(batch)]
        kinds = {"free": [free] * batch, "schema": [constrained] * batch}
        if batch > 1:  # one constrained request among free ones: what the others pay for it
            kinds["one schema"] = [constrained] + [free] * (batch - 1)
        rates: dict[str, list[float]] = {kind: [] for kind in kinds}
        order = list(kinds)
        for round_index in range(args.rounds):
            for kind in order[round_index % len(order):] + order[:round_index % len(order)]:  # rotated
                params = kinds[kind]
                seconds, tokens = decode_seconds(llm, prompts, params, args.max_tokens)
                rates[kind].append(tokens / seconds)
        medians = {kind: statistics.median(values) for kind, values in rates.items()}
        rows.append((batch, medians))
        print(f"batch {batch}: " + ", ".join(f"{k} {v:.1f} tok/s" for k, v in medians.items()), flush=True)
    report = format_report(rows, compile_times, args, load, os.getloadavg()[0])
    print(report)
    if args.report:
        args.report.write_text(report)
    return 0


def format_report(rows, compile_times, args, load_before: float, load_after: float) -> str:
    lines = [
        "# Structured outputs: cost per decode step and compile latency",
        "",
        f"`python benchmarks/structured.py --rounds {args.rounds}`, CPU class "
        f"{cpu_class()}, {os.cpu_count()} cores; Qwen2.5-0.5B shape, random weights, `--dtype auto`, greedy, "
        f"{args.prompt_len}-token prompts, {args.max_tokens} tokens each; medians of {args.rounds} interleaved "
        f"rounds (the order rotated each round). The VM's speed drifts by 5-10 % from minute to minute (the "
        f"profile of a mixed batch shows the model's own kernels, not grammar work, slower or faster between runs). Load average {load_before:.1f} before, {load_after:.1f} after (other processes on the cores "
        "make every figure lower; the ratio is what counts).",
        "",
        "| batch | decode tok/s, no schema | decode tok/s, JSON schema | ratio (goal >= 0.9) | one schema among "
        "free requests: tok/s, ratio |",
        "|---|---|---|---|---|",
    ]
    for batch, rates in rows:
        mixed = rates.get("one schema")
        mixed_cell = f"{mixed:.1f}, {mixed / rates['free']:.2f}" if mixed is not None else "-"
        lines.append(f"| {batch} | {rates['free']:.1f} | {rates['schema']:.1f} | {rates['schema'] / rates['free']:.2f} "
                     f"| {mixed_cell} |")
    lines += ["", "| grammar compilation | seconds |", "|---|---|"]
    lines += [f"| {label} | {seconds:.3f} |" for label, seconds in compile_times.items()]
    lines += ["", "The schema holds a 1,000-character string, so almost every token is allowed at almost every "
              "step: each constrained step fills a bitmask over the whole vocabulary and checks the UTF-8 guard "
              "(pagedserve/structured/), the worst case, not a cheap enum. Greedy rows are masked only when their "
              "argmax is forbidden.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
