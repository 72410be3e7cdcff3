"""Sentences/s of all-MiniLM-L6-v2: pagedserve's LLM.embed vs sentence-transformers, side by side in one run.

Usage: python benchmarks/embeddings.py [--sentences 1024] [--rounds 7] [--threads N] [--output FILE.md]

Every system embeds the same corpus (varied sentences, 3 to ~100 tokens) once per round; the order of the
systems rotates from round to round so that load from other processes falls on all of them alike. One
warm-up round runs first and is reported apart. Figures are min / median / max over the timed rounds, plus
the median of the per-round ratios against sentence-transformers (paired, so less sensitive to drift).
Also: one sentence at a time (a request's latency when there is nothing to batch with), and how close each
pagedserve configuration is to sentence-transformers' vectors (min cosine over the corpus).
Both run in this process with the same torch thread count (--threads, default: the cores this process may
use); sentence-transformers uses its defaults (batch_size 32, sorted by length, float32).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

SEEDS = [
    "A man is eating food.", "The girl is carrying a baby.", "A monkey is playing drums.",
    "Paris is the capital of France and its largest city.", "def square(x): return x * x",
    "The mitochondria is the powerhouse of the cell.", "Stock markets fell sharply after the announcement.",
    "Please reset my password, I cannot log in since yesterday.", "Die Katze schläft auf dem Sofa.",
    "SELECT name FROM users WHERE age > 30 ORDER BY name;", "ok", "What time does the train to Berlin leave?",
    "Quantum entanglement links the states of two particles regardless of distance.",
    "The recipe calls for two cups of flour, one egg and a pinch of salt.", "I loved this movie!",
    "Rain is expected in the afternoon, with clearing skies by evening.", "Error 404: page not found",
    "The committee postponed its decision until the next quarterly meeting.", "你好，世界！",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
]


def corpus(num: int) -> list[str]:
    """num sentences of 1-4 seed sentences each (deterministic): lengths from 3 to ~100 tokens."""
    out = []
    for i in range(num):
        parts = 1 + (i * 7) % 4
        out.append(" ".join(SEEDS[(i * 3 + j * 5) % len(SEEDS)] for j in range(parts)))
    return out


@dataclass
class System:
    name: str
    embed: Callable[[list[str]], np.ndarray]
    rates: list[float] = field(default_factory=list)  # sentences/s per timed round
    cpu_seconds: list[float] = field(default_factory=list)  # process CPU time per timed round
    warmup_rate: float = 0.0
    latencies_ms: list[float] = field(default_factory=list)
    min_cosine: float | None = None


def make_systems(model_dir: str, dtypes: list[str], threads: int) -> list[System]:
    from sentence_transformers import SentenceTransformer

    from pagedserve import LLM

    st = SentenceTransformer(model_dir, device="cpu")
    systems = [System("sentence-transformers (float32, batch 32)",
                      lambda texts: st.encode(texts, convert_to_numpy=True))]
    for dtype in dtypes:
        llm = LLM(model_dir, dtype=dtype, num_threads=threads)  # sets torch's thread count for both

        def embed(texts: list[str], llm=llm) -> np.ndarray:
            return np.array([o.outputs.embedding for o in llm.embed(texts, truncate_prompt_tokens=-1)])

        systems.append(System(f"pagedserve LLM.embed ({dtype})", embed))
    return systems


def timed(fn: Callable[[], object], cpu: list[float] | None = None) -> float:
    """Wall seconds of fn(); its process CPU seconds are appended to `cpu` if given."""
    start, start_cpu = time.perf_counter(), time.process_time()
    fn()
    if cpu is not None:
        cpu.append(time.process_time() - start_cpu)
    return time.perf_counter() - start


def run(systems: list[System], texts: list[str], rounds: int, num_latency: int) -> None:
    reference = systems[0].embed(texts)
    for system in systems:
        vectors = system.embed(texts)  # warm-up round, and the accuracy check
        system.warmup_rate = len(texts) / timed(lambda s=system: s.embed(texts))
        if system is not systems[0]:
            cos = (vectors * reference).sum(1) / (np.linalg.norm(vectors, axis=1) * np.linalg.norm(reference, axis=1))
            system.min_cosine = float(cos.min())
    for r in range(rounds):
        for k in range(len(systems)):
            system = systems[(r + k) % len(systems)]
            system.rates.append(len(texts) / timed(lambda s=system: s.embed(texts), system.cpu_seconds))
    for system in systems:
        for text in texts[:num_latency]:
            system.latencies_ms.append(1000 * timed(lambda s=system, t=text: s.embed([t])))


def report(systems: list[System], texts: list[str], num_tokens: int, args: argparse.Namespace,
           load_before: tuple, load_after: tuple) -> str:
    base = systems[0]
    lines = [
        "# Embeddings: all-MiniLM-L6-v2, pagedserve vs sentence-transformers",
        "",
        f"Run with `python benchmarks/embeddings.py --sentences {args.sentences} --rounds {args.rounds} "
        f"--threads {args.threads}` on "
        f"{time.strftime('%Y-%m-%d')}: {_cpu_name()}, {os.cpu_count()} cores visible, torch {torch.__version__}, "
        f"{torch.get_num_threads()} torch thread(s) for both. Load average {load_before[0]:.1f} before and "
        f"{load_after[0]:.1f} after (this machine is shared: other jobs ran on the same cores, which is why "
        "every figure is a spread over rounds taken in rotating order).",
        "",
        f"Corpus: {len(texts)} sentences, {num_tokens} tokens in all (mean {num_tokens / len(texts):.1f} per "
        "sentence, [CLS] and [SEP] included), embedded in one call per round.",
        "",
        f"## Throughput ({args.rounds} timed rounds after one warm-up round)",
        "",
        "| system | sentences/s min | median | max | tokens/s median | warm-up round | ratio vs ST (median of "
        "paired rounds) | CPU s per 1k sentences (median) | min cosine vs ST |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for system in systems:
        rates = system.rates
        ratio = statistics.median(a / b for a, b in zip(rates, base.rates))
        cosine = "reference" if system.min_cosine is None else f"{system.min_cosine:.6f}"
        lines.append(f"| {system.name} | {min(rates):.0f} | {statistics.median(rates):.0f} | {max(rates):.0f} | "
                     f"{statistics.median(rates) * num_tokens / len(texts):.0f} | {system.warmup_rate:.0f} | "
                     f"{ratio:.2f}x | {1000 * statistics.median(system.cpu_seconds) / len(texts):.2f} | {cosine} |")
    lines += [
        "",
        f"## One sentence at a time ({args.latency} sentences, milliseconds per call)",
        "",
        "| system | min | median | p90 | max |",
        "|---|---:|---:|---:|---:|",
    ]
    for system in systems:
        lat = sorted(system.latencies_ms)
        p90 = lat[min(len(lat) - 1, int(0.9 * len(lat)))]
        lines.append(f"| {system.name} | {lat[0]:.1f} | {statistics.median(lat):.1f} | {p90:.1f} | {lat[-1]:.1f} |")
    lines += [
        "",
        "CPU seconds are this process's (all threads), a figure less moved by other jobs than wall time.",
        "",
        "Raw sentences/s per round:",
        "",
    ]
    for system in systems:
        lines.append(f"- {system.name}: {', '.join(f'{r:.0f}' for r in system.rates)}")
    return "\n".join(lines) + "\n"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="Model directory (default: the packaged all-minilm-l6-v2).")
    parser.add_argument("--sentences", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--latency", type=int, default=64, help="Sentences embedded one at a time.")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="pagedserve dtypes to run.")
    parser.add_argument("--threads", type=int, default=None, help="torch threads for both (default: usable cores)")
    parser.add_argument("--output", default=None, help="Write the Markdown report here too.")
    args = parser.parse_args()
    if args.model is None:
        from pagedserve.models.fetch import resolve_model

        args.model = str(resolve_model("all-minilm-l6-v2"))
    if args.threads is None:
        from pagedserve.platform import usable_cpu_count

        args.threads = usable_cpu_count()
    texts = corpus(args.sentences)
    systems = make_systems(args.model, args.dtypes.split(","), args.threads)
    assert torch.get_num_threads() == args.threads
    from transformers import AutoTokenizer

    num_tokens = sum(len(ids) for ids in AutoTokenizer.from_pretrained(args.model)(texts)["input_ids"])
    load_before = os.getloadavg()
    run(systems, texts, args.rounds, args.latency)
    text = report(systems, texts, num_tokens, args, load_before, os.getloadavg())
    print(text)
    if args.output:
        Path(args.output).write_text(text)


if __name__ == "__main__":
    main()
