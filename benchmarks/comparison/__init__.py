"""Side-by-side speed comparison: pagedserve vs Hugging Face transformers (and, optionally, the peers).

One invocation measures, on the same machine, thread count, weights (bf16) and prompts:
  W1  single stream: one 32-token prompt -> 128 new tokens, EOS ignored        (output tok/s)
  W2  batch: 32 prompts x 128 tokens -> 64 new tokens each, EOS ignored          (output and total tok/s)
  W3  start-up to first token: from process start (Popen) to the first generated token (s)
for pagedserve (in-process `LLM.generate`; W3 also through `pagedserve serve` over HTTP) and for
transformers (`generate`, and its continuous-batching `generate_batch` for W2). Each system runs in
its own worker process (no shared torch state, its own peak RSS); the workers take turns, one
repeat at a time, so machine noise hits them alike. Tokens are counted from the outputs. The first
call of each workload is a warm-up, reported apart. Figures: min / median / max over --repeats.

Models: a random-weight model with the exact shape of Qwen2.5-0.5B-Instruct (bf16), and the real
Qwen2.5-Coder-0.5B-Instruct (its packaged GGUF, dequantized once to a bf16 Hugging Face directory)
when it is in pagedserve's cache. --quick: a tiny shape and short workloads, for a smoke run.
Peers: --with-llamacpp / --with-vllm run ../shared/peers/*/run.sh on the random-weight model (slow
the first time: they install themselves) and store their JSON under benchmarks/peers/; --peer-json
includes results saved earlier. Everything goes to a JSON file and to a Markdown report for this CPU class,
benchmarks/RESULTS_<class>.md (avx512-bf16, avx512, avx2: memory.probe.cpu_class); benchmarks/RESULTS.md
is the index, with each class's interleaved peer figures (benchmarks/interleaved.py --report).

    python benchmarks/compare.py                    # full run (~15 min on 2 cores) -> benchmarks/RESULTS_<class>.md
    python benchmarks/compare.py --quick            # smoke run -> benchmarks/out/RESULTS-quick.md
    python benchmarks/compare.py --peers-only --with-llamacpp --with-vllm
    python benchmarks/compare.py --render benchmarks/out/compare.json --peer-json benchmarks/peers/*.json
"""

# The package, by job: workloads.py (W1-W3, prompts), models.py (the models measured), runners.py (pagedserve and
# transformers inside a worker), workers.py (one process per system and its JSON-lines protocol, W3's fresh
# processes), measure.py (systems taking turns), peers.py (../shared/peers/*/run.sh), environment.py (machine,
# versions, CPU contention), figures.py / targets.py (+ targets.toml) / report.py (the Markdown), cli.py (flags).
# benchmarks/compare.py is the command.

from __future__ import annotations

import sys
import time
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1]
REPO = BENCHMARKS.parent
ENTRY = BENCHMARKS / "compare.py"  # the command; workers and W3 children are started on it
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # pagedserve, benchmarks.gguf_to_hf and tests.tiny_models from this checkout


def log(message: str) -> None:
    print(f"[compare {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)
