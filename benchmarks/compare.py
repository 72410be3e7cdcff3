#!/usr/bin/env python
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

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import resource
import shlex
import statistics
import subprocess
import sys
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # pagedserve and tests.tiny_models from this checkout

PEERS_DIR = REPO.parent / "shared" / "peers"
LLAMACPP_WORK = Path("/tmp/llama-cpp-peer")  # run.sh's default work directory (its venv and GGUF files)
QWEN_GGUF_NAME = "qwen2.5-coder-0.5b-instruct"
PROTOCOL_PREFIX = "@@compare "

# Qwen2.5-0.5B-Instruct's config.json, architecture fields only.
QWEN05_SHAPE = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                    num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                    rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=151643,
                    eos_token_id=151645, sliding_window=None, use_sliding_window=False)
TINY_SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-6,
                  tie_word_embeddings=True, bos_token_id=None, eos_token_id=2)


@dataclass(frozen=True)
class Workload:
    name: str
    num_prompts: int
    input_len: int
    output_len: int
    description: str


FULL_WORKLOADS = (Workload("W1", 1, 32, 128, "single stream: 1 x 32-token prompt -> 128 new tokens"),
                  Workload("W2", 32, 128, 64, "batch: 32 x 128-token prompts -> 64 new tokens each"))
QUICK_WORKLOADS = (Workload("W1", 1, 8, 16, "single stream: 1 x 8-token prompt -> 16 new tokens"),
                   Workload("W2", 4, 16, 8, "batch: 4 x 16-token prompts -> 8 new tokens each"))
W3_PROMPT_LEN = 32

SYSTEMS = {
    "pagedserve": "pagedserve LLM.generate (in-process)",
    "hf-generate": "transformers generate()",
    "hf-cb": "transformers generate_batch() (continuous batching)",
    "pagedserve-serve": "pagedserve serve (HTTP, first streamed token)",
    "pagedserve-int8": "pagedserve LLM.generate with --quantization int8 (W1 only)",
}


# --------------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------------

def default_gguf_path() -> Path:
    from pagedserve import envs

    return envs.cache_dir() / QWEN_GGUF_NAME / f"{QWEN_GGUF_NAME}.gguf"


def _is_built(out: Path, stamp: dict[str, Any]) -> bool:
    marker = out / ".compare-complete"
    return marker.is_file() and json.loads(marker.read_text()) == stamp


def _mark_built(out: Path, stamp: dict[str, Any]) -> None:
    (out / ".compare-complete").write_text(json.dumps(stamp))


def make_portable(out: Path) -> None:
    """Let older transformers (the peers' venvs) read the directory as this one does: a top-level rope_theta
    next to transformers 5's rope_parameters, and a tokenizer class that every version knows."""
    config_path, tokenizer_path = out / "config.json", out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    rope = config.get("rope_parameters") or {}
    if "rope_theta" not in config and "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]
        config_path.write_text(json.dumps(config, indent=2) + "\n")
    if tokenizer_path.is_file():
        tokenizer_config = json.loads(tokenizer_path.read_text())
        if tokenizer_config.get("tokenizer_class") == "TokenizersBackend":
            tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
            tokenizer_path.write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def save_tokenizer(out: Path, vocab_size: int, gguf: Path | None) -> str:
    """The Qwen GGUF's tokenizer when available and the vocab matches, else a small byte-level BPE."""
    if gguf is not None and gguf.is_file() and vocab_size == QWEN05_SHAPE["vocab_size"]:
        from pagedserve.models.gguf_loader import GGUFCheckpoint

        with GGUFCheckpoint(gguf) as checkpoint:
            checkpoint.build_tokenizer().save_pretrained(str(out))
        return f"Qwen2.5 tokenizer from {gguf.name}"
    from tests.tiny_models import make_tokenizer

    make_tokenizer(out)
    return "tiny byte-level BPE (512 ids; prompts are token ids, so the model's vocab is still used)"


def build_random_model(name: str, shape: dict[str, Any], out: Path, gguf: Path | None, seed: int = 0) -> dict[str, Any]:
    """A Qwen2ForCausalLM with `shape`, random weights (seeded), saved in bf16; reused when already built."""
    stamp = {"shape": shape, "seed": seed, "gguf": str(gguf) if gguf and gguf.is_file() else None}
    info = {"name": name, "path": str(out), "kind": "random"}
    if _is_built(out, stamp):
        make_portable(out)
        return {**info, **json.loads((out / ".compare-info").read_text())}
    import torch
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    config = transformers.Qwen2Config(**shape)
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = transformers.Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model = model.to(torch.bfloat16)
    num_params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out)
    del model
    tokenizer = save_tokenizer(out, shape["vocab_size"], gguf)
    details = {"num_params": num_params, "tokenizer": tokenizer,
               "description": f"Qwen2 shape {shape['num_hidden_layers']} layers x {shape['hidden_size']}, "
                              f"random weights (seed {seed}), bf16"}
    (out / ".compare-info").write_text(json.dumps(details))
    make_portable(out)
    _mark_built(out, stamp)
    return {**info, **details}


def build_real_model(gguf: Path, out: Path) -> dict[str, Any]:
    """The packaged Qwen2.5-Coder-0.5B-Instruct GGUF, dequantized once into a bf16 Hugging Face directory."""
    from collections import Counter

    from pagedserve.models.gguf_loader import GGUFCheckpoint

    stamp = {"gguf": str(gguf), "size": gguf.stat().st_size}
    with GGUFCheckpoint(gguf) as checkpoint:
        specs = checkpoint.tensor_specs()
    qtypes = Counter(spec.qtype.name for spec in specs)
    if not _is_built(out, stamp):
        import torch

        from benchmarks.gguf_to_hf import save_as_hf_dir

        save_as_hf_dir(gguf, out, dtype=torch.bfloat16)
        _mark_built(out, stamp)
    make_portable(out)
    stored = ", ".join(f"{count} {name}" for name, count in qtypes.most_common())
    return {"name": "qwen2.5-coder-0.5b-instruct", "path": str(out), "kind": "real",
            "num_params": sum(spec.num_elements for spec in specs),
            "tokenizer": "Qwen2.5 tokenizer from the GGUF",
            "description": f"real weights: {gguf.name} (tensors stored as {stored}; untied output matrix) "
                           "dequantized to bf16"}


def prompt_pool(model_dir: str) -> list[int]:
    """Ordinary token ids: the tokenizer's base vocabulary (below the model's vocab and 150000), minus
    special and added tokens; the same pool for every system."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    vocab_size = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    excluded = set(tokenizer.all_special_ids) | set(tokenizer.get_added_vocab().values())
    limit = min(vocab_size, len(tokenizer), 150000)
    pool = [token_id for token_id in range(limit) if token_id not in excluded]
    if vocab_size >= 100000:
        pool = [token_id for token_id in pool if token_id >= 1000]  # as in the vLLM peer's prompts
    return pool


def prompt_rng(seed: int, label: str, repeat: int) -> random.Random:
    """A generator that depends only on its arguments (str hashes differ between processes; crc32 does not)."""
    return random.Random(zlib.crc32(f"{seed}/{label}/{repeat}".encode()))


def make_prompts(pool: list[int], workload: Workload, rng: random.Random) -> list[list[int]]:
    return [rng.choices(pool, k=workload.input_len) for _ in range(workload.num_prompts)]


# --------------------------------------------------------------------------------------------------
# Workers: one process per system, driven by JSON lines (the protocol uses a private copy of stdout;
# anything libraries print goes to stderr).
# --------------------------------------------------------------------------------------------------

def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


class PagedserveRunner:
    def __init__(self, model: str, threads: int, max_model_len: int, quantization: str | None = None) -> None:
        from pagedserve import LLM

        self.llm = LLM(model, dtype="bfloat16", max_model_len=max_model_len, num_threads=threads, seed=0,
                       quantization=quantization)

    def run(self, prompts: list[list[int]], output_len: int, mode: str) -> dict[str, Any]:
        from pagedserve.benchmarks.throughput import ThroughputBenchConfig, time_generate

        run = time_generate(self.llm, prompts, [output_len] * len(prompts), ThroughputBenchConfig())
        return {"elapsed_s": run.elapsed_s, "num_requests": run.num_requests,
                "num_prompt_tokens": run.num_prompt_tokens, "num_output_tokens": run.num_output_tokens,
                "num_early_stops": run.num_early_stops, "num_cached_prompt_tokens": run.num_cached_prompt_tokens}


class HFRunner:
    def __init__(self, model: str, threads: int, max_model_len: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).eval()
        self.model.generation_config.eos_token_id = None  # EOS ignored: exactly max_new_tokens
        self.pad_id = 0
        self.max_model_len = max_model_len

    def run(self, prompts: list[list[int]], output_len: int, mode: str) -> dict[str, Any]:
        if mode == "hf-cb":
            return self._run_cb(prompts, output_len)
        from transformers import GenerationConfig

        config = GenerationConfig(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
                                  eos_token_id=None, pad_token_id=self.pad_id)
        input_ids = self.torch.tensor(prompts)  # equal lengths: no padding
        start = time.perf_counter()
        with self.torch.inference_mode():
            output = self.model.generate(input_ids, attention_mask=self.torch.ones_like(input_ids),
                                         generation_config=config)
        elapsed = time.perf_counter() - start
        generated = output[:, input_ids.shape[1]:]
        return {"elapsed_s": elapsed, "num_requests": len(prompts), "num_prompt_tokens": int(input_ids.numel()),
                "num_output_tokens": int(generated.numel()),
                "num_early_stops": sum(1 for row in generated if row.numel() < output_len)}

    def _run_cb(self, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        config = GenerationConfig(max_new_tokens=output_len, do_sample=False, eos_token_id=None,
                                  pad_token_id=self.pad_id)
        # Sized explicitly: on CPU the automatic sizing (meant for GPU memory) takes 10-20 s per call.
        tokens = max(len(p) for p in prompts) + output_len
        cb_config = ContinuousBatchingConfig(num_blocks=len(prompts) * (-(-tokens // 256)) + 4,
                                             max_batch_tokens=2048)
        start = time.perf_counter()
        results = self.model.generate_batch(prompts, generation_config=config, continuous_batching_config=cb_config)
        elapsed = time.perf_counter() - start
        outputs = list(results.values())
        failed = [o for o in outputs if getattr(o, "error", None)]
        if len(outputs) != len(prompts) or failed:
            raise RuntimeError(f"generate_batch returned {len(outputs)} results for {len(prompts)} prompts, "
                               f"{len(failed)} with errors: {failed[0].error if failed else ''}")
        counts = [len(o.generated_tokens) for o in outputs]
        return {"elapsed_s": elapsed, "num_requests": len(prompts),
                "num_prompt_tokens": sum(len(o.prompt_ids) for o in outputs), "num_output_tokens": sum(counts),
                "num_early_stops": sum(1 for c in counts if c < output_len)}


def worker_main(system: str, model: str, threads: int, max_model_len: int) -> int:
    """Serve run commands from stdin; answer each with one protocol line."""
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # library prints (Python or C) go to stderr

    def reply(payload: dict[str, Any]) -> None:
        protocol.write(PROTOCOL_PREFIX + json.dumps(payload) + "\n")

    start = time.perf_counter()
    try:
        if system == "pagedserve-int8":
            runner = PagedserveRunner(model, threads, max_model_len, quantization="int8")
        else:
            runner_cls = PagedserveRunner if system == "pagedserve" else HFRunner
            runner = runner_cls(model, threads, max_model_len)
    except Exception as exc:  # reported to the orchestrator, which records it as this system's failure
        reply({"ok": False, "error": f"load failed: {type(exc).__name__}: {exc}"})
        return 1
    import torch

    import pagedserve

    reply({"ok": True, "load_s": time.perf_counter() - start, "threads": torch.get_num_threads(),
           "peak_rss_mib": _peak_rss_mib(), "pagedserve_from": str(Path(pagedserve.__file__).parent)})
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "exit":
            reply({"ok": True, "peak_rss_mib": _peak_rss_mib()})
            return 0
        try:
            result = runner.run(command["prompts"], command["output_len"], command["mode"])
            reply({"ok": True, **result, "peak_rss_mib": _peak_rss_mib()})
        except Exception as exc:
            reply({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
    return 0


class Worker:
    """The orchestrator's handle on one worker process."""

    def __init__(self, system: str, model: str, threads: int, max_model_len: int, log_dir: Path) -> None:
        self.system = system
        self.log_path = log_dir / f"worker-{system}.log"
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", system, "--worker-model", model,
                   "--threads", str(threads), "--max-model-len", str(max_model_len)]
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                            text=True, bufsize=1)
        self.hello = self._read()

    def _read(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith(PROTOCOL_PREFIX):
                return json.loads(line[len(PROTOCOL_PREFIX):])
        tail = self.log_path.read_text(errors="replace").splitlines()[-15:]
        return {"ok": False, "error": f"worker exited with {self.process.wait()}: " + " | ".join(tail)}

    def call(self, command: dict[str, Any]) -> dict[str, Any]:
        if self.process.poll() is not None:
            return {"ok": False, "error": f"worker already exited with {self.process.returncode}"}
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        return self._read()

    def close(self) -> dict[str, Any]:
        reply = self.call({"op": "exit"}) if self.process.poll() is None else {}
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        return reply


# --------------------------------------------------------------------------------------------------
# W3: process start to first token, in a fresh process each time
# --------------------------------------------------------------------------------------------------

def w3_child_main(system: str, model: str, threads: int, max_model_len: int, t0: float, prompt: list[int]) -> int:
    """Load, generate ONE token, print the times (time.time() clock, relative to the parent's t0)."""
    marks = {"process_started": _process_start_time() - t0}
    if system == "pagedserve":
        from pagedserve import LLM, SamplingParams

        marks["imported"] = time.time() - t0
        llm = LLM(model, dtype="bfloat16", max_model_len=max_model_len, num_threads=threads, seed=0)
        marks["loaded"] = time.time() - t0
        output = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=1,
                                                                           ignore_eos=True))
        num_tokens = len(output[0].outputs[0].token_ids)
    else:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        marks["imported"] = time.time() - t0
        hf_model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).eval()
        hf_model.generation_config.eos_token_id = None
        marks["loaded"] = time.time() - t0
        with torch.inference_mode():
            ids = torch.tensor([prompt])
            out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False,
                                    pad_token_id=0)
        num_tokens = int(out.shape[1] - ids.shape[1])
    marks["first_token"] = time.time() - t0
    print(PROTOCOL_PREFIX + json.dumps({"ok": True, "marks": marks, "num_tokens": num_tokens,
                                        "peak_rss_mib": _peak_rss_mib()}), flush=True)
    return 0


def _process_start_time() -> float:
    import psutil

    return psutil.Process().create_time()


def run_w3(system: str, model: str, threads: int, max_model_len: int, prompt: list[int], log_dir: Path) -> dict:
    log_path = log_dir / f"w3-{system}.log"
    t0 = time.time()
    command = [sys.executable, str(Path(__file__).resolve()), "--w3-child", system, "--worker-model", model,
               "--threads", str(threads), "--max-model-len", str(max_model_len), "--t0", repr(t0),
               "--w3-prompt", ",".join(map(str, prompt))]
    with open(log_path, "ab") as log:
        done = subprocess.run(command, stdout=subprocess.PIPE, stderr=log, text=True, timeout=1800)
    for line in done.stdout.splitlines():
        if line.startswith(PROTOCOL_PREFIX):
            reply = json.loads(line[len(PROTOCOL_PREFIX):])
            return {**reply, "first_token_s": reply["marks"]["first_token"]}
    return {"ok": False, "error": f"exit code {done.returncode}; see {log_path}"}


def run_w3_serve(model: str, threads: int, max_model_len: int, log_dir: Path) -> dict[str, Any]:
    """`pagedserve serve` in a child: time to /health 200, then TTFT of the first streamed request."""
    from pagedserve.benchmarks.startup import StartupBenchConfig, run_startup_bench

    config = StartupBenchConfig(model=model, num_steady_requests=0, max_tokens=1, ignore_eos=True,
                                log_path=str(log_dir / "w3-pagedserve-serve.log"), ready_timeout=1800,
                                serve_args=("--dtype", "bfloat16", "--max-model-len", str(max_model_len),
                                            "--num-threads", str(threads)))
    result = run_startup_bench(config)
    leftovers = result.shutdown.leftover_pids if result.shutdown else []
    if result.error or leftovers or result.first_request is None or result.first_request.ttft is None:
        return {"ok": False, "error": result.error or f"processes left behind: {leftovers}"}
    return {"ok": True, "first_token_s": result.time_to_ready + result.first_request.ttft,
            "marks": {"port_open": result.time_to_port_open, "ready": result.time_to_ready},
            "num_tokens": result.first_request.output_tokens, "peak_rss_mib": result.peak_rss_bytes / 2**20}


# --------------------------------------------------------------------------------------------------
# Orchestration
# --------------------------------------------------------------------------------------------------

def log(message: str) -> None:
    print(f"[compare {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def measure_model(model: dict[str, Any], args: argparse.Namespace, workloads: tuple[Workload, ...],
                  log_dir: Path, extras: bool = True) -> dict[str, Any]:
    """W1, W2 (warm-up + repeats, systems taking turns) and W3 for one model. Without `extras`, no HF
    continuous batching and no `pagedserve serve` W3 (the slowest parts; kept for the first model)."""
    path = model["path"]
    pool = prompt_pool(path)
    record: dict[str, Any] = {**model, "workloads": [asdict(w) for w in workloads], "systems": {}, "runs": [],
                              "w3": [], "errors": {}, "skipped": [] if extras else ["hf-cb", "pagedserve-serve"]}
    workers: dict[str, Worker] = {}
    for system in ("pagedserve", "hf") + (("pagedserve-int8",) if extras else ()):
        log(f"{model['name']}: loading {system} worker")
        worker = Worker(system, path, args.threads, args.max_model_len, log_dir)
        if worker.hello.get("ok"):
            workers[system] = worker
            record["systems"][system] = {k: v for k, v in worker.hello.items() if k != "ok"}
        else:
            record["errors"][system] = worker.hello.get("error")
            worker.close()
    turns = [(w, s) for w in workloads for s in ("pagedserve", "hf-generate", "hf-cb", "pagedserve-int8")
             if not (s == "hf-cb" and (w.num_prompts == 1 or args.no_hf_cb or not extras))
             and not (s == "pagedserve-int8" and (w.name != "W1" or not extras))]
    try:
        for repeat in ["warmup", *range(args.repeats)]:
            order = turns if repeat == "warmup" or repeat % 2 == 0 else turns[::-1]
            for workload, system in order:
                _one_run(record, workers, pool, workload, system, repeat, args.seed)
    finally:
        for name, worker in workers.items():
            final = worker.close()
            if final.get("ok"):
                record["systems"][name]["peak_rss_mib"] = final["peak_rss_mib"]
    if not args.skip_w3:
        _measure_w3(record, args, pool, log_dir, with_serve=extras and not args.no_w3_serve)
    return record


def _one_run(record: dict[str, Any], workers: dict[str, Worker], pool: list[int], workload: Workload, system: str,
             repeat: int | str, seed: int) -> None:
    worker = workers.get(system if system.startswith("pagedserve") else "hf")
    key = f"{system}/{workload.name}"
    if worker is None or key in record["errors"]:
        return
    # Same prompts for every system in a repeat; new prompts in every repeat (no prefix-cache reuse).
    index = -1 if repeat == "warmup" else int(repeat)
    prompts = make_prompts(pool, workload, prompt_rng(seed, workload.name, index))
    reply = worker.call({"op": "run", "mode": system, "prompts": prompts, "output_len": workload.output_len})
    if not reply.get("ok"):
        record["errors"][key] = reply.get("error")
        log(f"{key} failed: {reply.get('error')}")
        return
    entry = {"system": system, "workload": workload.name, "repeat": repeat,
             **{k: v for k, v in reply.items() if k not in ("ok", "peak_rss_mib")}}
    record["runs"].append(entry)
    log(f"{record['name']} {key} {'warm-up' if repeat == 'warmup' else f'repeat {repeat + 1}'}: "
        f"{entry['num_output_tokens']} tokens in {entry['elapsed_s']:.2f} s = "
        f"{entry['num_output_tokens'] / entry['elapsed_s']:.1f} tok/s")


def _measure_w3(record: dict[str, Any], args: argparse.Namespace, pool: list[int], log_dir: Path,
                with_serve: bool) -> None:
    systems = ["pagedserve", "hf-generate"] + (["pagedserve-serve"] if with_serve else [])
    for repeat in range(args.repeats):
        prompt = prompt_rng(args.seed, "W3", repeat).choices(pool, k=W3_PROMPT_LEN)
        for system in systems if repeat % 2 == 0 else systems[::-1]:
            key = f"{system}/W3"
            if key in record["errors"]:
                continue
            if system == "pagedserve-serve":
                reply = run_w3_serve(record["path"], args.threads, args.max_model_len, log_dir)
            else:
                child = "pagedserve" if system == "pagedserve" else "hf"
                reply = run_w3(child, record["path"], args.threads, args.max_model_len, prompt, log_dir)
            if not reply.get("ok"):
                record["errors"][key] = reply.get("error")
                log(f"{key} failed: {reply.get('error')}")
                continue
            record["w3"].append({"system": system, "repeat": repeat, **{k: v for k, v in reply.items() if k != "ok"}})
            log(f"{record['name']} {key} repeat {repeat + 1}: first token after {reply['first_token_s']:.2f} s")


# --------------------------------------------------------------------------------------------------
# Peers (../shared/peers/*/run.sh): run once, keep their JSON
# --------------------------------------------------------------------------------------------------

class ContentionMeter:
    """CPU time used by OTHER processes while we measure: system busy CPU time minus this process's own
    (itself plus every child it has waited for, whose times the kernel adds to ours). The load average
    cannot tell: it counts the benchmarked program's own threads too."""

    def __init__(self) -> None:
        self.start_wall = time.monotonic()
        self.start_busy = self._system_busy()
        self.start_own = self._own()

    @staticmethod
    def _system_busy() -> float:
        import psutil

        times = psutil.cpu_times()
        # Time this machine's processes ran (guest time is already inside user; steal is the hypervisor's).
        return sum(getattr(times, name, 0.0) for name in ("user", "nice", "system", "irq", "softirq"))

    @staticmethod
    def _own() -> float:
        times = os.times()
        return times.user + times.system + times.children_user + times.children_system

    def stop(self) -> dict[str, float]:
        """Call after every child has been waited for. Shares are of the whole machine (all cores)."""
        wall = time.monotonic() - self.start_wall
        capacity = wall * (os.cpu_count() or 1)
        busy = self._system_busy() - self.start_busy
        own = self._own() - self.start_own
        return {"wall_s": wall, "own_cpu_share": own / capacity, "others_cpu_share": max(0.0, busy - own) / capacity}


def run_peer(peer: str, model: dict[str, Any], out_dir: Path, save_dir: Path) -> dict[str, Any]:
    """Run a peer's run.sh on the model directory; parse its '### RESULTS {json}' lines; save and return them."""
    script = PEERS_DIR / peer / "run.sh"
    started = datetime.datetime.now(datetime.timezone.utc)
    log_path = out_dir / f"peer-{peer}-{model['name']}-{started:%Y%m%dT%H%M%S}.log"
    command = [str(script), model["path"]]
    load_before = os.getloadavg()
    log(f"running peer {peer} on {model['name']} (log: {log_path}); the first run installs it (slow)")
    start = time.perf_counter()
    meter = ContentionMeter()
    with open(log_path, "w") as handle:
        process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, text=True)
        load_samples = []  # 1-minute load average every 10 s: how busy the machine was meanwhile
        while process.poll() is None:
            load_samples.append(os.getloadavg()[0])
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                continue
        done = subprocess.CompletedProcess(command, process.returncode)
    contention = meter.stop()
    text = log_path.read_text(errors="replace")
    results = [json.loads(line.split("### RESULTS ", 1)[1]) for line in text.splitlines()
               if line.startswith("### RESULTS ")]
    entry = {"peer": peer, "model": model["name"], "model_path": model["path"],
             "date": started.isoformat(timespec="seconds"), "command": shlex.join(command),
             "returncode": done.returncode, "wall_s": time.perf_counter() - start, "results": results,
             "load_average_before": load_before, "load_average_after": os.getloadavg(),
             "load_average_1min_during": {"max": max(load_samples, default=0.0),
                                          "mean": statistics.fmean(load_samples) if load_samples else 0.0},
             "others_cpu_share": contention["others_cpu_share"], "own_cpu_share": contention["own_cpu_share"],
             "progress_lines": [line for line in text.splitlines() if line.startswith("### ")
                                and not line.startswith("### RESULTS")],
             "log": str(log_path)}
    if done.returncode != 0 or not results:
        entry["failure"] = "\n".join(text.splitlines()[-25:])
    elif peer == "llama-cpp":
        results.append(run_llamacpp_batched(model, log_path))
    save_dir.mkdir(parents=True, exist_ok=True)
    saved = save_dir / f"{peer}-{model['name']}.json"
    saved.write_text(json.dumps(entry, indent=2) + "\n")
    log(f"peer {peer}: exit {done.returncode}, {len(results)} result line(s); saved {saved}")
    return entry


def run_llamacpp_batched(model: dict[str, Any], log_path: Path) -> dict[str, Any]:
    """llama.cpp's W2 with all 32 sequences in each decode call (benchmarks/llamacpp_batched_w2.py, run with
    the interpreter run.sh installed): the peer script's own W2 is sequential."""
    python = LLAMACPP_WORK / "venv" / "bin" / "python"
    gguf = LLAMACPP_WORK / f"{Path(model['path']).name}-bf16.gguf"
    command = [str(python), str(REPO / "benchmarks" / "llamacpp_batched_w2.py"), str(gguf)]
    log(f"running llama.cpp batched W2 on {gguf.name}")
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    with open(log_path, "a") as handle:
        handle.write(f"\n$ {shlex.join(command)}\n{done.stdout}{done.stderr[-4000:]}")
    line = next((l for l in done.stdout.splitlines() if l.startswith("RESULT ")), None)
    runs = json.loads(line.removeprefix("RESULT ")) if line else []
    return {"gguf": "bf16", "W2_batched": runs, "command": shlex.join(command)}


# --------------------------------------------------------------------------------------------------
# Environment
# --------------------------------------------------------------------------------------------------

def _cpu_class() -> str:
    from pagedserve.memory.probe import cpu_class, cpu_flags

    return cpu_class(cpu_flags())


def machine_info() -> dict[str, Any]:
    from pagedserve.platform import cpu_flags, usable_cpu_count

    model_name = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model_name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    interesting = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16",
                   "amx_tile", "amx_bf16", "amx_int8")
    flags = cpu_flags()
    try:
        import psutil

        memory_gib = psutil.virtual_memory().total / 2**30
    except ImportError:
        memory_gib = None
    return {"cpu": model_name, "cpu_class": _cpu_class(), "logical_cpus": os.cpu_count(), "usable_cores": usable_cpu_count(),
            "flags": [f for f in interesting if f in flags], "memory_gib": memory_gib,
            "kernel": platform.release(), "hypervisor": "hypervisor" in flags}


def versions() -> dict[str, str]:
    import importlib.metadata as metadata

    found = {"python": platform.python_version()}
    for package in ("pagedserve", "torch", "transformers", "tokenizers", "safetensors", "numpy"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = "not installed"
    return found


def git_state() -> dict[str, Any]:
    def git(*argv: str) -> str:
        try:
            return subprocess.run(["git", "-C", str(REPO), *argv], capture_output=True, text=True,
                                  timeout=30).stdout
        except (OSError, subprocess.TimeoutExpired):
            return ""

    # Porcelain lines are "XY path": do not strip the output, X may be a space.
    dirty = [line[3:] for line in git("status", "--porcelain", "--", "pagedserve").splitlines() if len(line) > 3]
    return {"commit": git("rev-parse", "HEAD").strip(), "subject": git("log", "-1", "--format=%s").strip(),
            "uncommitted_engine_files": dirty}


# --------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------

def spread(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "n": len(values)}


def fmt(stat: dict[str, float] | None, digits: int = 1) -> str:
    if stat is None:
        return "—"
    return f"{stat['median']:.{digits}f} ({stat['min']:.{digits}f}–{stat['max']:.{digits}f})"


def ratio(numerator: dict | None, denominator: dict | None) -> str:
    if not numerator or not denominator or not denominator["median"]:
        return "—"
    return f"{numerator['median'] / denominator['median']:.2f}x"


def summarize(record: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """(system, metric) -> spread over the timed repeats; plus the warm-up figures."""
    table: dict[str, dict[str, Any]] = {}
    for run in record["runs"]:
        key = f"{run['system']}/{run['workload']}"
        slot = table.setdefault(key, {"output": [], "total": [], "warmup": None, "tokens": set()})
        output_rate = run["num_output_tokens"] / run["elapsed_s"]
        total_rate = (run["num_output_tokens"] + run["num_prompt_tokens"]) / run["elapsed_s"]
        if run["repeat"] == "warmup":
            slot["warmup"] = {"output": output_rate, "elapsed_s": run["elapsed_s"]}
        else:
            slot["output"].append(output_rate)
            slot["total"].append(total_rate)
            slot["tokens"].add((run["num_prompt_tokens"], run["num_output_tokens"], run.get("num_early_stops", 0)))
    for w3 in record["w3"]:
        table.setdefault(f"{w3['system']}/W3", {"seconds": [], "rss": []})
        table[f"{w3['system']}/W3"]["seconds"].append(w3["first_token_s"])
        table[f"{w3['system']}/W3"]["rss"].append(w3.get("peak_rss_mib") or 0.0)
    return table


def render_model(record: dict[str, Any]) -> list[str]:
    table = summarize(record)
    get = lambda key, metric: spread(table.get(key, {}).get(metric, []))  # noqa: E731
    workloads = {w["name"]: w for w in record["workloads"]}
    params = f"{record['num_params'] / 1e6:.0f} M parameters, " if record.get("num_params") else ""
    lines = [f"### {record['name']}", "", f"{params}{record['description']}; tokenizer: {record['tokenizer']}.", ""]
    lines += ["| Workload | Metric | pagedserve | HF generate | HF continuous batching | pagedserve / HF generate "
              "| pagedserve / HF CB |", "|---|---|---|---|---|---|---|"]
    for name in ("W1", "W2"):
        if name not in workloads:
            continue
        metrics = [("output", "output tok/s")] + ([("total", "total tok/s")] if name == "W2" else [])
        for metric, label in metrics:
            ps, hf, cb = (get(f"{s}/{name}", metric) for s in ("pagedserve", "hf-generate", "hf-cb"))
            lines.append(f"| {name} | {label} | {fmt(ps)} | {fmt(hf)} | {fmt(cb)} | {ratio(ps, hf)} | {ratio(ps, cb)} |")
    int8 = get("pagedserve-int8/W1", "output")
    if int8:
        lines.append(f"| W1 | output tok/s, pagedserve `--quantization int8` | {fmt(int8)} | | | "
                     f"{ratio(int8, get('hf-generate/W1', 'output'))} (vs HF bf16) | |")
    ps3, hf3, srv3 = (get(f"{s}/W3", "seconds") for s in ("pagedserve", "hf-generate", "pagedserve-serve"))
    if ps3 or hf3 or srv3:
        lines.append(f"| W3 | s to first token (lower is better) | {fmt(ps3, 2)} | {fmt(hf3, 2)} | — | "
                     f"{ratio(ps3, hf3)} (time ratio) | — |")
        if srv3:
            lines.append(f"| W3 | s to first token, `pagedserve serve` over HTTP | {fmt(srv3, 2)} | | | "
                         f"{ratio(srv3, hf3)} (time ratio) | |")
    lines += ["", "Figures: median (min–max) over the timed repeats; ratios are of medians (rates: above 1 means "
              "pagedserve is faster; W3 times: below 1 means pagedserve is faster).", ""]
    lines += _render_counts(record, table)
    return lines


def _render_counts(record: dict[str, Any], table: dict[str, dict[str, Any]]) -> list[str]:
    lines = ["Warm-up (first call, excluded above), tokens counted per timed run (prompt, output, early stops), "
             "load time and peak RSS of each worker process:", "",
             "| System / workload | Warm-up output tok/s | Warm-up s | Counted tokens per run |", "|---|---|---|---|"]
    for key, slot in table.items():
        if key.endswith("/W3"):
            continue
        warm = slot.get("warmup") or {}
        counts = ", ".join(f"{p} + {o} (early stops {e})" for p, o, e in sorted(slot["tokens"]))
        lines.append(f"| {key} | {warm.get('output', float('nan')):.1f} | {warm.get('elapsed_s', float('nan')):.2f} "
                     f"| {counts} |")
    lines += ["", "| Worker | Load s | Torch threads | Peak RSS MiB |", "|---|---|---|---|"]
    for name, info in record["systems"].items():
        lines.append(f"| {name} | {info.get('load_s', float('nan')):.2f} | {info.get('threads')} | "
                     f"{info.get('peak_rss_mib', float('nan')):.0f} |")
    w3_rss = {key: spread(slot["rss"]) for key, slot in table.items() if key.endswith("/W3")}
    if w3_rss:
        lines += ["", "W3 peak RSS (MiB, median over repeats): " + ", ".join(
            f"{key.removesuffix('/W3')} {stat['median']:.0f}" for key, stat in w3_rss.items() if stat) + "."]
    if record.get("skipped"):
        lines += ["", f"Not run on this model (time budget; `--all-extras` runs them): {', '.join(record['skipped'])}."]
    if record["errors"]:
        lines += ["", "Failures:", ""] + [f"- `{key}`: {message}" for key, message in record["errors"].items()]
    return lines + [""]


def render_peer(entry: dict[str, Any], ours: dict[str, Any] | None) -> list[str]:
    during = entry.get("load_average_1min_during")
    lines = [f"### {entry['peer']} on {entry['model']} — run {entry['date']}", "",
             f"Command: `{entry['command']}` (exit {entry['returncode']}, {entry['wall_s']:.0f} s wall; 1-minute load "
             f"average, which counts the peer's own threads, before {entry['load_average_before'][0]:.2f}, after "
             f"{entry['load_average_after'][0]:.2f}"
             + (f", during: mean {during['mean']:.2f}, max {during['max']:.2f}" if during else "")
             + _contention_text(entry.get("others_cpu_share") is not None and
                                {"others_cpu_share": entry["others_cpu_share"], "own_cpu_share": entry["own_cpu_share"]}
                                or None) + ").", ""]
    if (entry.get("others_cpu_share") or 0.0) > BUSY_OTHERS_SHARE:
        lines += [f"**Other processes used {entry['others_cpu_share']:.0%} of the CPU time during this run: these "
                  "figures are below what this peer does on a quiet machine.**", ""]
    elif entry.get("others_cpu_share") is None and entry.get("disturbed"):
        lines += ["**Other processes competed for the cores during this run (see the note): these figures are "
                  "below what this peer does on a quiet machine.**", ""]
    if entry.get("note"):
        lines += [entry["note"], ""]
    if entry.get("failure"):
        lines += ["It failed; the last lines of its output:", "", "```", entry["failure"], "```", ""]
    table = summarize(ours) if ours else {}
    ps_w1 = spread(table.get("pagedserve/W1", {}).get("output", []))
    ps_w2 = spread(table.get("pagedserve/W2", {}).get("output", []))
    ps_int8 = spread(table.get("pagedserve-int8/W1", {}).get("output", []))
    for result in entry["results"]:
        lines += _render_peer_result(entry["peer"], result, ps_w1, ps_w2, ps_int8)
    return lines


def _render_peer_result(peer: str, result: dict[str, Any], ps_w1: dict | None, ps_w2: dict | None,
                        ps_int8: dict | None = None) -> list[str]:
    if peer == "vllm-cpu":
        w1 = [call["out_tok_s"] for call in result.get("W1", [])[1:]]  # call 1 is its warm-up
        w2 = [run["out_tok_s"] for run in result.get("W2", [])]
        w2_total = [run["total_tok_s"] for run in result.get("W2", [])]
        w1_stat, w2_stat = spread(w1), spread(w2)
        return [f"vLLM {result.get('vllm_version')}: W1 {fmt(w1_stat)} output tok/s (calls 2-4; call 1 warm-up "
                f"{result['W1'][0]['out_tok_s']:.1f}) · W2 {fmt(w2_stat)} output tok/s, {fmt(spread(w2_total))} "
                f"total tok/s (its 2 runs) · process start to LLM ready {result.get('W0_from_process_start_s', 0):.1f} s "
                f"· peak RSS over its processes {result.get('peak_rss_tree_sum_MiB', 0):.0f} MiB.",
                f"pagedserve (this run) / vLLM: W1 {ratio(ps_w1, w1_stat)}, W2 {ratio(ps_w2, w2_stat)}.", ""]
    if peer == "llama-cpp" and "W2_batched" in result:
        runs = result["W2_batched"]
        if not runs:
            return [f"llama.cpp batched W2 (`{result.get('command')}`) gave no result; see the peer log.", ""]
        w2_stat = spread([r["out_tok_s"] for r in runs])
        return [f"llama.cpp {result['gguf']} GGUF, W2 batched (32 sequences per decode call, "
                f"benchmarks/llamacpp_batched_w2.py): {fmt(w2_stat)} output tok/s, "
                f"{fmt(spread([r['total_tok_s'] for r in runs]))} total; prefill "
                f"{fmt(spread([r['prefill_s'] for r in runs]))} s, then {fmt(spread([r['decode_tok_s'] for r in runs]))} "
                f"tok/s decoding ({len(runs)} runs after a warm-up).",
                f"pagedserve (this run, bf16) / llama.cpp batched: W2 {ratio(ps_w2, w2_stat)}.", ""]
    if peer == "llama-cpp":
        w1_stat = spread(result.get("W1_tok_s", []))
        w2 = result.get("W2_sequential_out_tok_s")
        w2_stat = spread([w2]) if w2 else None
        return [f"llama.cpp {result.get('gguf')} GGUF: W1 {fmt(w1_stat)} tok/s (3 runs after an 8-token warm-up) · "
                f"W2 run one sequence at a time (not batched): {w2} output tok/s, {result.get('W2_total_tok_s')} total "
                f"· load {result.get('load_s', 0):.2f} s.",
                f"pagedserve (this run, bf16) / llama.cpp {result.get('gguf')}: W1 {ratio(ps_w1, w1_stat)}, "
                f"W2 {ratio(ps_w2, w2_stat)} (sequential W2)."
                + (f" pagedserve int8 / llama.cpp {result.get('gguf')}: W1 {ratio(ps_int8, w1_stat)}." if ps_int8 else ""),
                ""]
    return ["```", json.dumps(result), "```", ""]


def peer_disturbed(entry: dict[str, Any]) -> bool | None:
    """True when other processes took a measurable share of the CPU during the peer's run; None if unknown
    (runs recorded before the share was measured carry a hand-set `disturbed`, or nothing)."""
    if entry.get("others_cpu_share") is not None:
        return entry["others_cpu_share"] > BUSY_OTHERS_SHARE
    return entry.get("disturbed")


def _peer_figures(peers: list[dict[str, Any]], model: str) -> dict[str, Any]:
    """Medians the targets need, from the peers' results on `model` (None where a peer gave none)."""
    figures: dict[str, Any] = {"vllm_w1": None, "vllm_w2": None, "vllm_ready": None, "vllm_rss": None,
                               "llama_w1_bf16": None, "llama_w1_q8": None, "llama_w2": None,
                               "vllm_disturbed": None, "llama_disturbed": None}
    for entry in peers:
        if entry["model"] != model:
            continue
        figures["vllm_disturbed" if entry["peer"] == "vllm-cpu" else "llama_disturbed"] = peer_disturbed(entry)
        for result in entry["results"]:
            if entry["peer"] == "vllm-cpu":
                figures["vllm_w1"] = spread([call["out_tok_s"] for call in result.get("W1", [])[1:]])
                figures["vllm_w2"] = spread([run["out_tok_s"] for run in result.get("W2", [])])
                ready = result.get("W0_from_process_start_s")
                figures["vllm_ready"] = spread([ready] if ready else [])
                rss = result.get("peak_rss_tree_sum_MiB")
                figures["vllm_rss"] = spread([rss] if rss else [])
            elif entry["peer"] == "llama-cpp" and "W2_batched" in result:
                figures["llama_w2"] = spread([r["out_tok_s"] for r in result["W2_batched"]])
            elif entry["peer"] == "llama-cpp":
                key = "llama_w1_bf16" if result.get("gguf") == "bf16" else "llama_w1_q8"
                figures[key] = spread(result.get("W1_tok_s", []))
    return figures


PEER_CAVEATS = {True: " — but the peer ran on a busy machine: not a fair comparison",
                None: " — peer run's CPU contention unknown: indicative only", False: ""}


def _target_row(name: str, value: dict | None, other: dict | None, goal: float, inverse: bool = False,
                peer_disturbed: bool | None = False) -> str:
    """One target: pagedserve's median against `goal` x the other's (inverse: pagedserve <= goal x other)."""
    if value is None or other is None or not other["median"]:
        return f"| {name} | — | not measured in this report |"
    achieved = value["median"] / other["median"]
    met = achieved <= goal if inverse else achieved >= goal
    return f"| {name} | {achieved:.2f}x | {'met' if met else 'not met'}{PEER_CAVEATS[peer_disturbed]} |"


def render_targets(report: dict[str, Any], peers: list[dict[str, Any]]) -> list[str]:
    """The speed targets of the 'Fast on CPU' issue, on the Qwen2.5-0.5B-shaped model (bf16)."""
    record = next((m for m in report["models"] if m["kind"] == "random"), None)
    if record is None or report["meta"]["quick"]:
        return []
    table = summarize(record)
    get = lambda key, metric: spread(table.get(key, {}).get(metric, []))  # noqa: E731
    ps_w1, ps_w2 = get("pagedserve/W1", "output"), get("pagedserve/W2", "output")
    ps_int8 = get("pagedserve-int8/W1", "output")
    hf_w1, hf_w2 = get("hf-generate/W1", "output"), get("hf-generate/W2", "output")
    ready = spread([w3["marks"]["loaded"] for w3 in record["w3"]
                    if w3["system"] == "pagedserve" and "loaded" in w3.get("marks", {})])
    rss = record["systems"].get("pagedserve", {}).get("peak_rss_mib")
    peer = _peer_figures(peers, record["name"])
    absolute = "—" if ps_w1 is None else f"{ps_w1['median']:.1f} tok/s"
    met_45 = "—" if ps_w1 is None else ("met" if ps_w1["median"] >= 45 else "not met")
    return ["## Targets of the speed issue (Qwen2.5-0.5B shape, bf16, medians)", "",
            "| Target | Measured | Status |", "|---|---|---|",
            f"| W1 >= 45 tok/s | {absolute} | {met_45} |",
            _target_row("W1 >= 3x HF generate", ps_w1, hf_w1, 3.0),
            _target_row("W2 >= 1.8x HF generate", ps_w2, hf_w2, 1.8),
            _target_row("W1 >= 1.25x llama.cpp bf16", ps_w1, peer["llama_w1_bf16"], 1.25,
                        peer_disturbed=peer["llama_disturbed"]),
            _target_row("W1 `--quantization int8` >= 1.3x llama.cpp Q8_0", ps_int8, peer["llama_w1_q8"], 1.3,
                        peer_disturbed=peer["llama_disturbed"]),
            _target_row("W1 >= 1.6x vLLM-CPU", ps_w1, peer["vllm_w1"], 1.6, peer_disturbed=peer["vllm_disturbed"]),
            _target_row("W2 >= 1.5x vLLM-CPU", ps_w2, peer["vllm_w2"], 1.5, peer_disturbed=peer["vllm_disturbed"]),
            _target_row("W2 >= 1.3x llama.cpp batched (32 sequences per decode call)", ps_w2, peer["llama_w2"], 1.3,
                        peer_disturbed=peer["llama_disturbed"]),
            _target_row("process start to LLM ready <= 1/10 of vLLM-CPU", ready, peer["vllm_ready"], 0.1, inverse=True,
                        peer_disturbed=peer["vllm_disturbed"]),
            _target_row("peak RSS <= 1/3 of vLLM-CPU (W1+W2 worker vs its process tree)",
                        spread([rss] if rss else []), peer["vllm_rss"], 1 / 3, inverse=True),
            "", "Peer figures are from the dates in the Peers section, not interleaved with this run. For context, the "
            "speed issue quotes figures measured earlier on a quiet machine of this type (not reproduced here): "
            "llama.cpp W1 ~36 tok/s bf16 and ~54 Q8_0, 133-160 output tok/s for 32 parallel sequences; vLLM-CPU W1 "
            "~28 tok/s, W2 ~136 output tok/s, 75-138 s to ready, ~8.3 GiB; transformers W1 ~15 tok/s, W2 ~113.", ""]


BUSY_OTHERS_SHARE = 0.15  # other processes used more than 15 % of the machine's CPU time: figures are disturbed


def _contention_text(contention: dict[str, float] | None) -> str:
    if not contention:
        return "; CPU time of other processes meanwhile: not measured"
    return (f"; other processes used {contention['others_cpu_share']:.0%} of the machine's CPU time meanwhile "
            f"(this run {contention['own_cpu_share']:.0%})")


def render(report: dict[str, Any], peers: list[dict[str, Any]]) -> str:
    meta = report["meta"]
    machine, git = meta["machine"], meta["git"]
    lines = ["# pagedserve vs Hugging Face transformers (and peers): side-by-side figures", "",
             f"Measured {meta['date']} by `benchmarks/compare.py`{' (--quick smoke run)' if meta['quick'] else ''}.", "",
             "Reproduce (from the repository root):", "", "```", meta["command"], "```", "",
             *([f"This report was rendered again on {meta['rendered']['date']} from the run's JSON, figures unchanged "
                f"(`{meta['rendered']['command']}`).", ""] if meta.get("rendered") else []),
             "## Setting", "",
             f"- Commit: `{git['commit']}` ({git['subject']})"
             + (f"; uncommitted changes in {', '.join(git['uncommitted_engine_files'])} were in the measured tree"
                if git["uncommitted_engine_files"] else "; clean tree under pagedserve/"),
             f"- Machine: {machine['cpu']}, {machine['logical_cpus']} logical CPUs ({machine['usable_cores']} usable), "
             f"{machine['memory_gib']:.1f} GiB, kernel {machine['kernel']}"
             + (", virtual machine" if machine["hypervisor"] else ""),
             f"- CPU class `{machine.get('cpu_class', '?')}`; flags that matter here: "
             f"{' '.join(machine['flags']) or 'none of avx2/avx512/amx'}",
             f"- Load average (1 min) at start {meta['load_start'][0]:.2f}, at end {meta['load_end'][0]:.2f} "
             "(it counts the benchmark's own threads too)" + _contention_text(meta.get("contention")),
             "- Versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()),
             f"- Threads: {meta['threads']} for every system; dtype bfloat16 everywhere; greedy; EOS ignored; "
             f"{meta['repeats']} timed repeats after one warm-up call per workload; max_model_len {meta['max_model_len']}",
             "- Workloads: " + "; ".join(f"{w['name']} {w['description']}" for w in meta["workloads"])
             + f"; W3 process start to first token of a {W3_PROMPT_LEN}-token prompt (fresh process per repeat)",
             "- Thread-related environment: " + (", ".join(f"{k}={v}" for k, v in meta.get("environment", {}).items())
                                                 or "none set (OpenMP defaults: idle threads spin)"),
             f"- Wall time of the run: {meta['wall_s'] / 60:.1f} min", "",
             "## Results", ""]
    for record in report["models"]:
        lines += render_model(record)
    lines += render_targets(report, peers)
    lines += ["## Peers", ""]
    if not peers:
        lines += ["No peer results included (run with --with-llamacpp / --with-vllm, or --peer-json FILE).", ""]
    for entry in peers:
        ours = next((m for m in report["models"] if m["name"] == entry["model"]), None)
        lines += render_peer(entry, ours)
    if peers:
        lines += ["Peer figures come from their own scripts (`../shared/peers/*/run.sh`), run on the date shown, "
                  "not interleaved with the figures above: compare ratios knowing the machine noise (~±10 %).", ""]
    lines += ["## Embeddings", "",
              "Embedding throughput (all-MiniLM-L6-v2 and a decoder without LM head, pagedserve vs "
              "sentence-transformers, side by side in one process) is measured by `python benchmarks/embeddings.py`; "
              "its report is `benchmarks/RESULTS_embeddings.md`.", ""]
    lines += ["## How the figures are made", "",
              "- Each system runs in its own worker process, loaded once; the workers take turns repeat by repeat "
              "(order alternating), so noise from other work on the machine falls on all of them.",
              "- Prompts are random token ids (ordinary ids of the tokenizer, the same for every system in a repeat, "
              "new in every repeat so that no prefix cache is reused across runs).",
              "- Rates = tokens counted in the outputs / wall time of the call (prefill included). HF generate runs "
              "the batch as one padding-free batch (all prompts have equal length); HF continuous batching uses "
              "`generate_batch` with its KV cache sized for the workload (automatic sizing takes 10-20 s per call "
              "on CPU) and includes its manager start-up in each call.",
              "- W3 pagedserve: `LLM(...)` (which pages in the weights and runs its own warm-up, so the first "
              "request is not cold) then one token; HF: `from_pretrained` then `generate(max_new_tokens=1)`; "
              "`pagedserve serve`: time to /health 200 plus the first streamed request's TTFT.", ""]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from pagedserve.platform import usable_cpu_count

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny model shape and short workloads (smoke run)")
    parser.add_argument("--threads", type=int, default=usable_cpu_count())
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats (default: 3; --quick: 2)")
    parser.add_argument("--models", default="random,real",
                        help="comma list of random (Qwen2.5-0.5B shape) and real (Qwen2.5-Coder GGUF, when cached)")
    parser.add_argument("--gguf", type=Path, default=None, help="the Qwen2.5-Coder-0.5B GGUF (default: pagedserve's cache)")
    parser.add_argument("--out-dir", type=Path, default=HERE / "out", help="models, logs, JSON (not committed)")
    parser.add_argument("--results", type=Path, default=None,
                        help="Markdown report (default: benchmarks/RESULTS_<cpu class>.md; --quick: "
                             "OUT_DIR/RESULTS-quick.md)")
    parser.add_argument("--json", type=Path, default=None, help="raw figures (default: OUT_DIR/compare[-quick].json)")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-hf-cb", action="store_true", help="skip transformers' continuous batching")
    parser.add_argument("--skip-w3", action="store_true")
    parser.add_argument("--no-w3-serve", action="store_true", help="W3 without the `pagedserve serve` variant")
    parser.add_argument("--all-extras", action="store_true",
                        help="HF continuous batching and `pagedserve serve` W3 on every model, not only the first")
    parser.add_argument("--with-llamacpp", action="store_true", help="run ../shared/peers/llama-cpp/run.sh too")
    parser.add_argument("--with-vllm", action="store_true", help="run ../shared/peers/vllm-cpu/run.sh too")
    parser.add_argument("--peers-only", action="store_true", help="only run the requested peers (and save them)")
    parser.add_argument("--peer-json", type=Path, nargs="*", default=[], help="peer results saved earlier")
    parser.add_argument("--peer-save-dir", type=Path, default=HERE / "peers")
    parser.add_argument("--render", type=Path, default=None,
                        help="re-render the report from a saved JSON (with --peer-json: those peer files instead)")
    # Internal: worker and W3 child processes.
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--w3-child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-model", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--t0", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--w3-prompt", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeats is None:
        args.repeats = 2 if args.quick else 3
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.results is None:
        args.results = args.out_dir / "RESULTS-quick.md" if args.quick else HERE / f"RESULTS_{_cpu_class()}.md"
    if args.json is None:
        args.json = args.out_dir / ("compare-quick.json" if args.quick else "compare.json")
    return args


def prepare_models(args: argparse.Namespace) -> list[dict[str, Any]]:
    gguf = args.gguf or default_gguf_path()
    wanted = {name.strip() for name in args.models.split(",") if name.strip()}
    models = []
    if args.quick:
        return [build_random_model("tiny-qwen2-shape", TINY_SHAPE, args.out_dir / "models" / "tiny-qwen2", None)]
    if "random" in wanted:
        log("building (or reusing) the Qwen2.5-0.5B-shaped random model")
        models.append(build_random_model("qwen2.5-0.5b-shape-random", QWEN05_SHAPE,
                                         args.out_dir / "models" / "qwen2.5-0.5b-shape-random", gguf))
    if "real" in wanted:
        if gguf.is_file():
            log(f"preparing the real model from {gguf}")
            models.append(build_real_model(gguf, args.out_dir / "models" / "qwen2.5-coder-0.5b-instruct-bf16"))
        else:
            log(f"real model skipped: {gguf} is not cached (fetch it with `pagedserve doctor {QWEN_GGUF_NAME}`)")
    return models


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args.worker, args.worker_model, args.threads, args.max_model_len)
    if args.w3_child:
        prompt = [int(t) for t in args.w3_prompt.split(",") if t]
        return w3_child_main(args.w3_child, args.worker_model, args.threads, args.max_model_len, args.t0, prompt)
    peers = [json.loads(path.read_text()) for path in args.peer_json]
    if args.render:
        report = json.loads(args.render.read_text())
        report["meta"]["rendered"] = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                                      "command": shlex.join(["python", "benchmarks/compare.py",
                                                             *(sys.argv[1:] if argv is None else argv)])}
        # Peer files given now replace the copies saved in the JSON (their notes may have been completed since).
        args.results.write_text(render(report, peers or report.get("peers", [])) + "\n")
        log(f"wrote {args.results}")
        return 0
    args.out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": shlex.join(["python", "benchmarks/compare.py", *(sys.argv[1:] if argv is None else argv)]),
            "quick": args.quick, "threads": args.threads, "repeats": args.repeats,
            "max_model_len": args.max_model_len, "machine": machine_info(), "versions": versions(),
            "git": git_state(), "load_start": os.getloadavg(),
            "environment": {name: os.environ[name] for name in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "KMP_BLOCKTIME",
                                                                "LD_PRELOAD", "MKL_NUM_THREADS") if name in os.environ},
            "workloads": [asdict(w) for w in (QUICK_WORKLOADS if args.quick else FULL_WORKLOADS)]}
    models = prepare_models(args)
    meter = ContentionMeter()
    records = []
    if not args.peers_only:
        log_dir = args.out_dir / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        workloads = QUICK_WORKLOADS if args.quick else FULL_WORKLOADS
        for index, model in enumerate(models):
            # The full set on the first model; the slowest extras again only with --all-extras (time budget).
            records.append(measure_model(model, args, workloads, log_dir, extras=index == 0 or args.all_extras))
    peer_models = [m for m in models if m["kind"] == "random"][:1]
    for peer, wanted in (("llama-cpp", args.with_llamacpp), ("vllm-cpu", args.with_vllm)):
        for model in peer_models if wanted else []:
            peers.append(run_peer(peer, model, args.out_dir, args.peer_save_dir))
    if args.peers_only:
        return 0 if all(not p.get("failure") for p in peers) else 1
    meta["load_end"] = os.getloadavg()
    meta["contention"] = meter.stop()
    meta["wall_s"] = time.perf_counter() - started
    report = {"meta": meta, "models": records, "peers": peers}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(render(report, peers) + "\n")
    log(f"wrote {args.results} and {args.json}")
    failed = any(record["errors"] for record in records)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
