"""`pagedserve plan [MODEL] [serve flags] [--json]`: the memory budget `serve` would check, without loading.

The plan is the one `serve` computes in its "planning" phase (the same function, the same flags and
environment variables), so what this prints is what `serve` would accept or refuse. One difference: it does
not import torch, so whether pagedserve's native kernels run (for --dtype auto and a GGUF's default int8) is
told from the CPU's flags without building them; where they would fail to build (no C compiler), `serve`
decides otherwise (`pagedserve doctor` reports that). Exit code 0 when it fits, 1 when it does not, 2 for bad
flags or a model that cannot be read.
"""

from __future__ import annotations

import argparse
import json

from pagedserve.cli.common import USER_FACING_ERRORS, engine_args_from_cli, fail
from pagedserve.cli.serve import add_serve_flags, checked_options
from pagedserve.engine import vllm_compat


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan", help="Show the memory plan for a model and serve flags, without loading it.",
        description="Weights (exact, from the file headers, in the serving dtype), KV cache, activations and "
                    "runtime overhead against the memory available now (cgroup limit, MemAvailable, the "
                    "--gpu-memory-utilization fraction, VLLM_CPU_KVCACHE_SPACE / --kv-cache-memory, or free GPU "
                    "memory); the verdict, and the flags that would fit. Takes the same flags as `serve`. "
                    "Exit code 1 when it does not fit.")
    add_serve_flags(parser)  # a serve command line pastes in unchanged; only the engine's flags count here
    parser.add_argument("--json", action="store_true", help="Print the plan as JSON (every figure in bytes).")
    # Test-only: read the memory probes from a fake tree instead of /proc and /sys.
    parser.add_argument("--meminfo", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--cgroup-root", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--proc-self-cgroup", default=None, help=argparse.SUPPRESS)
    parser.set_defaults(func=run)


def _available_from_paths(args: argparse.Namespace):  # -> AvailableMemory | None
    if args.meminfo is None and args.cgroup_root is None and args.proc_self_cgroup is None:
        return None  # the engine probes the real host (or GPU)
    from pagedserve.memory import probe

    return probe.available_memory(args.meminfo or "/proc/meminfo", args.cgroup_root or "/sys/fs/cgroup",
                                  args.proc_self_cgroup or "/proc/self/cgroup")


def run(args: argparse.Namespace) -> int:
    from pagedserve.engine.setup import check_draft_of, create_engine_config
    from pagedserve.memory.plan import format_plan_table
    from pagedserve.memory.sizes import GIB

    try:
        vllm_compat.check(vars(args))  # what serve refuses, plan refuses too
        engine_args = engine_args_from_cli(args)
        checked_options(args)  # a serve command line serve would refuse (--port 99999) is refused here too
        config = create_engine_config(engine_args, available=_available_from_paths(args), check_memory=False,
                                      kernels_from_flags=True)  # no torch: the kernels as the CPU's flags promise
        check_draft_of(engine_args, config)  # a draft model with another tokenizer, as serve refuses it
    except (ValueError, OSError, *USER_FACING_ERRORS) as exc:
        if args.json:  # a script reading --json reads the refusal too
            print(json.dumps({"error": str(exc)}, indent=2))
        return fail(str(exc))
    plan = config.memory_plan
    settings = {"model": config.model.model, "dtype": config.model.dtype, "device": config.device.device,
                "kv_cache_dtype": config.cache.kv_cache_dtype, "max_model_len": config.model.max_model_len,
                "max_num_seqs": config.scheduler.max_num_seqs,
                "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
                "block_size": config.cache.block_size, "num_kv_blocks_allocated": config.cache.num_blocks,
                "tensor_parallel_size": config.parallel.tensor_parallel_size}
    if args.json:
        print(json.dumps({"settings": settings, **plan.to_dict()}, indent=2))
    else:
        print(f"{settings['model']}: {settings['dtype']} on {settings['device']}, max_model_len"
              f" {settings['max_model_len']}, max_num_seqs {settings['max_num_seqs']}, max_num_batched_tokens"
              f" {settings['max_num_batched_tokens']}"
              + ("" if settings["kv_cache_dtype"] == "auto" else f", KV cache {settings['kv_cache_dtype']}"))
        print(format_plan_table(plan))
        ranks = config.parallel.tensor_parallel_size
        if ranks > 1:  # the table is one rank's: the host holds all of them
            print(f"all {ranks} ranks: {ranks * plan.total_bytes / GIB:.2f} GiB worst case, "
                  f"{ranks * plan.steady_bytes / GIB:.2f} GiB steady (the plan above is each rank's)")
    return 0 if plan.fits else 1
