"""Break one decode step down: matmuls, attention, other kernels and tensor ops, Python/dispatch overhead.

Usage: python benchmarks/profile_step.py MODEL_DIR [--threads N] [--tokens 32] [--quantization int8]
                                         [--layer-by-layer]

A decode-only step normally runs all decoder layers in one native call (the decode stack, timed as one
row); --layer-by-layer turns the stack off, so each kernel of each layer is timed on its own.

Native kernels (pagedserve/kernels, called through ctypes) are invisible to torch's profiler, so they are
timed by wrapping their Python entry points; torch ops come from the profiler (a second, profiled run).
Counts of tensor ops per step are deterministic; times depend on the machine's load.
"""

from __future__ import annotations

import argparse
import collections
import functools
import time

from torch.profiler import ProfilerActivity, profile

from pagedserve import LLM, SamplingParams
from pagedserve.kernels import CpuKernels

TORCH_CATEGORIES = {
    "matmul": ("mkldnn::_linear_pointwise", "aten::addmm", "aten::mm", "aten::_weight_int8pack_mm", "aten::linear"),
    "attention": ("aten::_scaled_dot_product_flash_attention_for_cpu",),
}
NATIVE_CATEGORIES = {"linear_bf16": "matmul", "linear_i8": "matmul", "decode_attention": "attention",
                     "rms_norm": "norms", "gate_mul": "act*up", "decode_stack": "decoder stack"}


def time_native_kernels() -> dict[str, float]:
    """Wrap CpuKernels' entry points so each call's wall time lands in the returned dict (seconds)."""
    spent: dict[str, float] = collections.defaultdict(float)
    for name, category in NATIVE_CATEGORIES.items():
        original = getattr(CpuKernels, name)

        @functools.wraps(original)
        def timed(self, *args, _original=original, _category=category, **kwargs):
            start = time.perf_counter()
            try:
                return _original(self, *args, **kwargs)
            finally:
                spent[_category] += time.perf_counter() - start

        setattr(CpuKernels, name, timed)
    return spent


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--layer-by-layer", action="store_true", help="turn the native decode stack off")
    args = parser.parse_args()
    native = time_native_kernels()
    llm = LLM(args.model, dtype=args.dtype, max_model_len=1024, num_threads=args.threads,
              quantization=args.quantization)
    prompt = {"prompt_token_ids": list(range(100, 132))}
    # Prefill once (and cache it) so the measured calls are dominated by decode steps.
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2))  # the first decode builds the stack
    if args.layer_by_layer:
        llm.engine.runner.model.model.stack = None
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    native.clear()
    start = time.perf_counter()
    llm.generate([prompt], params)
    wall_ms = (time.perf_counter() - start) * 1e3 / args.tokens
    native_ms = {name: seconds * 1e3 / args.tokens for name, seconds in native.items()}
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate([prompt], params)
    torch_ms = {name: 0.0 for name in TORCH_CATEGORIES}
    other_ms, num_ops = 0.0, 0
    for event in prof.key_averages():
        if not event.key.startswith(("aten::", "mkldnn::")):
            continue
        num_ops += event.count
        category = next((name for name, keys in TORCH_CATEGORIES.items() if event.key in keys), None)
        ms = event.self_cpu_time_total / 1e3 / args.tokens
        if category is None:
            other_ms += ms
        else:
            torch_ms[category] += ms
    rows = collections.Counter(native_ms)
    rows.update(torch_ms)
    print(f"threads {args.threads}, {args.dtype}, quantization {args.quantization}: {wall_ms:.1f} ms per token "
          f"unprofiled ({1e3 / wall_ms:.1f} tok/s)")
    for name, ms in rows.most_common():
        print(f"  {name:12s} {ms:7.2f} ms/step")
    print(f"  {'other torch ops':12s} {other_ms:7.2f} ms/step   ({num_ops / args.tokens:.0f} tensor ops per step, "
          "profiled run)")
    accounted = sum(rows.values()) + other_ms
    print(f"  the rest (Python, ctypes, scheduler, sampler glue): {max(0.0, wall_ms - accounted):.2f} ms/step")


if __name__ == "__main__":
    main()
