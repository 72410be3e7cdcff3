"""Mixture-of-experts decode against its dense twin: a random Qwen3-MoE with Qwen3-30B-A3B's layer shape (hidden
2048, 32/4 heads of 128, 128 experts of width 768, 8 a token) but few layers, and a dense Qwen3 with the same
attention and one MLP as wide as the 8 chosen experts together (6144, Qwen3-30B-A3B's own dense width), so both read
the same weight bytes per token at batch 1. The ratio MoE / dense says what routing costs (the router, the per-expert
calls, the gather and scatter); at larger batches the MoE reads more experts per step (up to all of them).

    python benchmarks/moe_decode.py [--layers 4] [--rounds 3] [--quantization int8]

Each round runs the two models in fresh processes, one after the other (the VM's memory bandwidth drifts), greedy,
EOS ignored, 32-token prompts, 64 new tokens; prints tok/s per model and batch, and the ratios.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from comparison.children import run as run_child, stop_on_sigterm  # (this script's folder is on sys.path)

OUT = Path(__file__).parent / "out" / "models"
COMMON = dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=32000,
              max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False)
MOE = dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
           intermediate_size=6144)
BATCHES = (1, 8)


def build(kind: str, layers: int) -> Path:
    out = OUT / f"{kind}-{layers}l-random"
    if (out / "model.safetensors.index.json").is_file() or (out / "model.safetensors").is_file():
        return out
    import torch
    import transformers

    from comparison.models import save_tokenizer  # (this script's folder is on sys.path)

    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        if kind == "moe":
            model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(num_hidden_layers=layers,
                                                                                 **COMMON, **MOE))
        else:
            model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(num_hidden_layers=layers,
                                                                           intermediate_size=6144, **COMMON))
    finally:
        torch.set_default_dtype(previous)
    model.save_pretrained(out)
    save_tokenizer(out, COMMON["vocab_size"], None)
    return out


def measure(path: Path, quantization: str | None) -> dict[str, float]:
    """tok/s per batch size, in a fresh process."""
    code = f"""
import json, time
from pagedserve import LLM, SamplingParams
llm = LLM({str(path)!r}, dtype="bfloat16", quantization={quantization!r}, max_model_len=256, device="cpu")
params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
result = {{}}
for batch in {BATCHES!r}:
    prompts = [{{"prompt_token_ids": [(7 * i + j) % 1000 + 10 for j in range(32)]}} for i in range(batch)]
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm
    start = time.perf_counter()
    llm.generate(prompts, params)
    result[batch] = batch * 64 / (time.perf_counter() - start)
print(json.dumps(result))
"""
    run = run_child([sys.executable, "-c", code], timeout=1800, cwd=Path(__file__).parents[1])
    if run.returncode:
        raise RuntimeError(run.stderr[-3000:])
    return {int(k): v for k, v in json.loads(run.stdout.strip().splitlines()[-1]).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quantization", choices=["int8"], default=None)
    args = parser.parse_args()
    stop_on_sigterm()

    paths = {kind: build(kind, args.layers) for kind in ("moe", "dense")}
    results: dict[str, list[dict[int, float]]] = {"moe": [], "dense": []}
    for round_ in range(args.rounds):
        for kind in ("moe", "dense"):
            start = time.perf_counter()
            results[kind].append(measure(paths[kind], args.quantization))
            print(f"round {round_ + 1} {kind}: " + ", ".join(f"batch {b} {v:.1f} tok/s" for b, v in
                                                             results[kind][-1].items())
                  + f" ({time.perf_counter() - start:.0f} s)", flush=True)
    for batch in BATCHES:
        moe = sorted(r[batch] for r in results["moe"])[len(results["moe"]) // 2]
        dense = sorted(r[batch] for r in results["dense"])[len(results["dense"]) // 2]
        print(f"batch {batch}: MoE {moe:.1f} tok/s, dense twin {dense:.1f} tok/s, MoE / dense {moe / dense:.2f} "
              "(medians)")


if __name__ == "__main__":
    main()
