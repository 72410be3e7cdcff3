"""pagedserve and llama.cpp taking turns, so that the machine's drifting memory bandwidth hits both.

compare.py runs the peers after pagedserve, minutes apart; on a VM whose batch-1 weight stream varies
between ~23 and ~52 GB/s from minute to minute that can move a ratio by 20 %. Here each round runs, in
fresh processes and back to back: W1 (32-token prompt, 128 tokens, greedy, 2 threads, one 8-token warm-up
per process; the settings of ../shared/peers/llama-cpp/bench.py) for pagedserve bf16, llama.cpp bf16 GGUF,
pagedserve --quantization int8 and llama.cpp Q8_0; with --w2 also W2 (32 x 128-token prompts, 64 tokens
each) for pagedserve bf16 and llama.cpp bf16 with its sequences batched (benchmarks/llamacpp_batched_w2.py).
The order flips every round. Needs the peer installed by ../shared/peers/llama-cpp/run.sh (its venv and
GGUF files).

    python benchmarks/interleaved.py MODEL_DIR [--peer-dir /tmp/llama-cpp-peer] [--rounds 3] [--w2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

PAGEDSERVE_W1 = """
import json, random, sys, time
from pagedserve import LLM, SamplingParams
rng = random.Random(1234)
prompt = [rng.randint(100, 30000) for _ in range(32)]
kwargs = {"quantization": sys.argv[2]} if sys.argv[2] != "none" else {}
llm = LLM(sys.argv[1], dtype="bfloat16", max_model_len=512, num_threads=2, **kwargs)
params = lambda n: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
llm.generate([{"prompt_token_ids": prompt}], params(8))
rates = []
for _ in range(3):
    t = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], params(128))[0]
    rates.append(len(out.outputs[0].token_ids) / (time.perf_counter() - t))
print("RESULT " + json.dumps(rates))
"""

PAGEDSERVE_W2 = """
import json, random, sys, time
from pagedserve import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="bfloat16", max_model_len=512, num_threads=2)
params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
def run(seed):
    rng = random.Random(seed)
    prompts = [{"prompt_token_ids": [rng.randint(100, 30000) for _ in range(128)]} for _ in range(32)]
    t = time.perf_counter()
    out = llm.generate(prompts, params)
    return sum(len(o.outputs[0].token_ids) for o in out) / (time.perf_counter() - t)
run(0)
print("RESULT " + json.dumps([run(1), run(2)]))
"""

LLAMA_W1 = """
import json, random, sys, time
from llama_cpp import Llama
rng = random.Random(1234)
prompt = [rng.randint(100, 30000) for _ in range(32)]
llm = Llama(model_path=sys.argv[1], n_ctx=512, n_batch=512, n_threads=2, n_threads_batch=2, verbose=False, seed=0)
def gen(n):
    llm.reset(); t = time.perf_counter(); k = 0
    for _ in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        k += 1
        if k == n:
            break
    return k / (time.perf_counter() - t)
gen(8)
print("RESULT " + json.dumps([gen(128) for _ in range(3)]))
"""


def run(python: str, code: str | Path, *argv: str) -> list[float]:
    """Rates from a fresh process: `code` is a -c program or a script path."""
    command = [python, str(code)] if isinstance(code, Path) else [python, "-c", code]
    done = subprocess.run([*command, *argv], capture_output=True, text=True, check=False)
    line = next((l for l in done.stdout.splitlines() if l.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{argv}: no result\n{done.stderr[-2000:]}")
    result = json.loads(line.removeprefix("RESULT "))
    return [r["out_tok_s"] if isinstance(r, dict) else r for r in result]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="the Hugging Face directory the peer's GGUF files were converted from")
    parser.add_argument("--peer-dir", type=Path, default=Path("/tmp/llama-cpp-peer"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--w2", action="store_true", help="also W2: pagedserve bf16 vs llama.cpp batched")
    args = parser.parse_args()
    name = Path(args.model).name
    peer_python = str(args.peer_dir / "venv" / "bin" / "python")
    systems = [("pagedserve bf16", sys.executable, PAGEDSERVE_W1, (args.model, "none")),
               ("llama.cpp bf16", peer_python, LLAMA_W1, (str(args.peer_dir / f"{name}-bf16.gguf"),)),
               ("pagedserve int8", sys.executable, PAGEDSERVE_W1, (args.model, "int8")),
               ("llama.cpp q8_0", peer_python, LLAMA_W1, (str(args.peer_dir / f"{name}-q8_0.gguf"),))]
    if args.w2:
        systems += [("pagedserve bf16 W2", sys.executable, PAGEDSERVE_W2, (args.model,)),
                    ("llama.cpp bf16 batched W2", peer_python, Path(__file__).with_name("llamacpp_batched_w2.py"),
                     (str(args.peer_dir / f"{name}-bf16.gguf"),))]
    rates: dict[str, list[float]] = {label: [] for label, *_ in systems}
    for round_index in range(args.rounds):
        order = systems if round_index % 2 == 0 else systems[::-1]
        for label, python, code, argv in order:
            result = run(python, code, *argv)
            rates[label].append(statistics.median(result))
            print(f"round {round_index + 1} {label}: {' '.join(f'{r:.1f}' for r in result)} tok/s", flush=True)
    medians = {label: statistics.median(values) for label, values in rates.items()}
    print("\nmedian of round medians (tok/s): " + ", ".join(f"{k} {v:.1f}" for k, v in medians.items()))
    print(f"pagedserve bf16 / llama.cpp bf16: {medians['pagedserve bf16'] / medians['llama.cpp bf16']:.2f}x; "
          f"pagedserve int8 / llama.cpp q8_0: {medians['pagedserve int8'] / medians['llama.cpp q8_0']:.2f}x")
    per_round = [p / l for p, l in zip(rates["pagedserve bf16"], rates["llama.cpp bf16"])]
    print("per-round bf16 ratios: " + " ".join(f"{r:.2f}" for r in per_round))
    if args.w2:
        print(f"W2 output tok/s, pagedserve bf16 / llama.cpp batched bf16: "
              f"{medians['pagedserve bf16 W2'] / medians['llama.cpp bf16 batched W2']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
