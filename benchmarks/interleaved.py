"""pagedserve and llama.cpp taking turns, so that the machine's drifting memory bandwidth hits both.

compare.py runs the peers after pagedserve, minutes apart; on a VM whose batch-1 weight stream varies
between ~23 and ~52 GB/s from minute to minute that can move a ratio by 20 %. Here each round runs, in
fresh processes and back to back, every pair of the CPU-speed targets (the settings of
../shared/peers/llama-cpp/bench.py: 2 threads, greedy, EOS ignored, one 8-token warm-up per process):
  W1 (32-token prompt -> 128 tokens): pagedserve --dtype auto vs llama.cpp bf16 GGUF; pagedserve
     --quantization int8 vs llama.cpp Q8_0;
  W1 on the real Qwen2.5-Coder-0.5B GGUF (--real, the file pagedserve ships by name): pagedserve's default
     on it vs llama.cpp on the same file;
  W2 (32 x 128-token prompts -> 64 tokens each, --w2): pagedserve --dtype auto and --quantization int8 vs
     llama.cpp bf16 / Q8_0 with its 32 sequences batched per decode call (benchmarks/llamacpp_batched_w2.py);
  ready (--ready): process start to /health 200 of `pagedserve serve` on the default model and on the
     0.5B shape.
The order flips every round. Needs the peer installed by ../shared/peers/llama-cpp/run.sh (its venv and
GGUF files). On a CPU with AMX (class avx512-amx) that build's ggml AMX path crashes on Q8_0 files
(ggml_backend_amx_mul_mat, llama-cpp-python 0.3.36): put a venv built without it in its place, e.g.
CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
-DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON"
pip install llama-cpp-python==0.3.36 into a new venv, linked as PEER_DIR/venv. --report writes the table, with the CPU class and flags, into benchmarks/RESULTS.md's
section for this CPU class (one section per class; other classes' sections are kept).

    python benchmarks/interleaved.py MODEL_DIR [--peer-dir /tmp/llama-cpp-peer] [--rounds 3] [--w2] [--real]
                                     [--ready] [--report]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from comparison.children import run as run_child, stop_on_sigterm  # noqa: E402
from pagedserve.cli.common import set_thread_environment  # noqa: E402

PAGEDSERVE_W1 = """
import json, random, sys, time
from pagedserve import LLM, SamplingParams
rng = random.Random(1234)
prompt = [rng.randint(100, 30000) for _ in range(32)]
kwargs = {"quantization": sys.argv[2]} if sys.argv[2] != "none" else {}
llm = LLM(sys.argv[1], max_model_len=512, num_threads=2, **kwargs)  # --dtype auto
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
kwargs = {"quantization": sys.argv[2]} if sys.argv[2] != "none" else {}
llm = LLM(sys.argv[1], max_model_len=512, num_threads=2, **kwargs)  # --dtype auto
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
    """Rates from a fresh process: `code` is a -c program or a script path. pagedserve's processes wait on OpenMP
    as `pagedserve serve` does by default (cli.common.set_thread_environment: a brief spin, unless this environment
    chooses), so that `LLM(...)` is measured as the server runs."""
    command = [python, str(code)] if isinstance(code, Path) else [python, "-c", code]
    env = dict(os.environ)
    if python == sys.executable:
        set_thread_environment(None, env)
    done = run_child([*command, *argv], env=env)
    line = next((l for l in done.stdout.splitlines() if l.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{argv}: no result\n{done.stderr[-2000:]}")
    result = json.loads(line.removeprefix("RESULT "))
    return [r["out_tok_s"] if isinstance(r, dict) else r for r in result]


READY = """
import json, socket, subprocess, sys, time, urllib.request
start = time.time()
sock = socket.socket(); sock.bind(("127.0.0.1", 0)); port = sock.getsockname()[1]; sock.close()
cmd = [sys.executable, "-m", "pagedserve.cli.main", "serve", *sys.argv[1:], "--port", str(port), "--num-threads", "2"]
server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
try:
    while time.time() - start < 300:
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).status == 200:
                break
        except OSError:
            time.sleep(0.02)
    ready = time.time() - start
finally:
    server.terminate(); server.wait(30)
print("RESULT " + json.dumps([ready]))
"""


def systems_for(args: argparse.Namespace) -> list[tuple[str, str, str | Path, tuple[str, ...]]]:
    """(label, interpreter, program, argv) for every measured system; pairs are adjacent."""
    name = Path(args.model).name
    peer_python = str(args.peer_dir / "venv" / "bin" / "python")
    gguf = {kind: str(args.peer_dir / f"{name}-{kind}.gguf") for kind in ("bf16", "q8_0")}
    batched = Path(__file__).with_name("llamacpp_batched_w2.py")
    systems = [("W1 pagedserve auto", sys.executable, PAGEDSERVE_W1, (args.model, "none")),
               ("W1 llama.cpp bf16", peer_python, LLAMA_W1, (gguf["bf16"],)),
               ("W1 pagedserve int8", sys.executable, PAGEDSERVE_W1, (args.model, "int8")),
               ("W1 llama.cpp q8_0", peer_python, LLAMA_W1, (gguf["q8_0"],))]
    if args.real:
        from pagedserve.models.fetch import fetch_model

        real = str(fetch_model("qwen2.5-coder-0.5b-instruct"))
        systems += [("W1 real GGUF pagedserve default", sys.executable, PAGEDSERVE_W1, (real, "none")),
                    ("W1 real GGUF llama.cpp", peer_python, LLAMA_W1, (real,))]
    if args.w2:
        systems += [("W2 pagedserve auto", sys.executable, PAGEDSERVE_W2, (args.model, "none")),
                    ("W2 llama.cpp bf16 batched", peer_python, batched, (gguf["bf16"],)),
                    ("W2 pagedserve int8", sys.executable, PAGEDSERVE_W2, (args.model, "int8")),
                    ("W2 llama.cpp q8_0 batched", peer_python, batched, (gguf["q8_0"],))]
    if args.ready:
        systems += [("ready s, pagedserve serve (default model)", sys.executable, READY, ()),
                    ("ready s, pagedserve serve (0.5B shape)", sys.executable, READY, (args.model,))]
    return systems


# (target, ours, theirs, goal): ratio of medians ours / theirs must reach goal (ready: seconds, at most goal)
TARGETS = [("W1 --dtype auto >= 1.3x llama.cpp bf16", "W1 pagedserve auto", "W1 llama.cpp bf16", 1.3),
           ("W1 --quantization int8 >= 1.3x llama.cpp Q8_0", "W1 pagedserve int8", "W1 llama.cpp q8_0", 1.3),
           ("real Qwen2.5-Coder GGUF, default >= 1.3x llama.cpp (same file)", "W1 real GGUF pagedserve default",
            "W1 real GGUF llama.cpp", 1.3),
           ("W2 --dtype auto >= 1.3x llama.cpp bf16 batched", "W2 pagedserve auto", "W2 llama.cpp bf16 batched", 1.3),
           ("W2 int8 >= 1.3x llama.cpp Q8_0 batched", "W2 pagedserve int8", "W2 llama.cpp q8_0 batched", 1.3)]
READY_TARGETS = [("ready <= 2.5 s, SmolLM2-135M (default)", "ready s, pagedserve serve (default model)", 2.5),
                 ("ready <= 4 s, 0.5B shape", "ready s, pagedserve serve (0.5B shape)", 4.0)]


def cpu_class() -> tuple[str, str, list[str]]:
    """(class name, CPU model, flags that matter) of this machine."""
    from pagedserve.memory.probe import cpu_class as class_of, cpu_flags

    flags = cpu_flags()
    name = class_of(flags)
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "?")
    wanted = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")
    return name, model, [f for f in wanted if f in flags]


def render(rates: dict[str, list[float]], args: argparse.Namespace, wall_s: float) -> str:
    name, model, flags = cpu_class()
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    medians = {label: statistics.median(values) for label, values in rates.items() if values}
    lines = [f"<!-- class:{name} -->", f"## CPU class `{name}`", "",
             f"Measured {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='minutes')} at commit "
             f"`{commit}` by `python benchmarks/interleaved.py {' '.join(sys.argv[1:])}` ({args.rounds} rounds, "
             f"order flipped each round, fresh processes, {wall_s / 60:.0f} min). CPU: {model}, "
             f"{os.cpu_count()} logical CPUs; flags: {' '.join(flags)}. Model: {Path(args.model).name} "
             "(random weights, the Qwen2.5-0.5B shape) unless the row says otherwise; 2 threads.", "",
             "| System | rounds (median of each process's repeats) | median |", "|---|---|---|"]
    for label, values in rates.items():
        unit = "s" if label.startswith("ready") else "tok/s"
        lines.append(f"| {label} | {' / '.join(f'{v:.1f}' for v in values)} | {medians[label]:.2f} {unit} |")
    lines += ["", "| Target | ratio (or time) | met |", "|---|---|---|"]
    for target, ours, theirs, goal in TARGETS:
        if ours in medians and theirs in medians:
            value = medians[ours] / medians[theirs]
            per_round = " ".join(f"{a / b:.2f}" for a, b in zip(rates[ours], rates[theirs]))
            lines.append(f"| {target} | {value:.2f}x (rounds {per_round}) | {'yes' if value >= goal else 'no'} |")
    for target, label, goal in READY_TARGETS:
        if label in medians:
            lines.append(f"| {target} | {medians[label]:.2f} s | {'yes' if medians[label] <= goal else 'no'} |")
    return "\n".join(lines + ["", f"<!-- /class:{name} -->"])


def write_report(section: str, path: Path) -> None:
    """Replace this class's section of `path` (between its class markers), keeping the others."""
    name = re.search(r"<!-- class:(\S+) -->", section).group(1)
    text = path.read_text() if path.exists() else ""
    pattern = re.compile(rf"<!-- class:{re.escape(name)} -->.*?<!-- /class:{re.escape(name)} -->", re.S)
    text = pattern.sub(lambda _: section, text) if pattern.search(text) else text.rstrip() + "\n\n" + section + "\n"
    path.write_text(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="the Hugging Face directory the peer's GGUF files were converted from")
    parser.add_argument("--peer-dir", type=Path, default=Path("/tmp/llama-cpp-peer"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--w2", action="store_true", help="also W2, pagedserve vs llama.cpp batched")
    parser.add_argument("--real", action="store_true", help="also W1 on the real Qwen2.5-Coder GGUF, both on the file")
    parser.add_argument("--ready", action="store_true", help="also process start to /health 200 of pagedserve serve")
    parser.add_argument("--only", default="", help="comma-separated label prefixes to run (default: all)")
    parser.add_argument("--report", action="store_true", help="write this CPU class's section of benchmarks/RESULTS.md")
    args = parser.parse_args()
    stop_on_sigterm()
    systems = systems_for(args)
    if args.only:
        systems = [s for s in systems if any(s[0].startswith(p.strip()) for p in args.only.split(","))]
    rates: dict[str, list[float]] = {label: [] for label, *_ in systems}
    started = time.perf_counter()
    for round_index in range(args.rounds):
        order = systems if round_index % 2 == 0 else systems[::-1]
        for label, python, code, argv in order:
            result = run(python, code, *argv)
            rates[label].append(statistics.median(result))
            print(f"round {round_index + 1} {label}: {' '.join(f'{r:.2f}' for r in result)}", flush=True)
    section = render(rates, args, time.perf_counter() - started)
    print(section)
    if args.report:
        write_report(section, HERE / "RESULTS.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
