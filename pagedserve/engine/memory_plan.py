"""The memory plan as the engine computes it from EngineArgs: sizes from checkpoint headers and the chosen
kernels' weight format, the free memory probed now, the verdict logged (and refused) before anything loads,
and after warm-up the measured RSS next to it. The arithmetic itself is memory/'s (sizes.py, plan.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from pagedserve import envs
from pagedserve.config import ModelConfig, SchedulerConfig
from pagedserve.engine.arg_utils import SUPPORTED_KV_CACHE_DTYPES, EngineArgs
from pagedserve.memory.checkpoint import CheckpointInfo
from pagedserve.memory.plan import MemoryPlan
from pagedserve.memory.probe import AvailableMemory, cpu_flags
from pagedserve.memory.sizes import CPU_RUNTIME_BASE_BYTES, MIB
from pagedserve.models.validate import layer_windows
from pagedserve.memory.weight_format import (FILE_QUANTIZATION, SUPPORTED_QUANTIZATION, WeightFormat,
                                             expected_weight_format, kv_quantized, native_kernels_expected)

logger = logging.getLogger(__name__)


def num_kv_blocks(args: EngineArgs, plan: MemoryPlan) -> int:
    """KV pool size: --num-gpu-blocks-override (testing), else the plan's blocks + the reserved null block.

    The plan sizes the pool from --kv-cache-memory (or VLLM_CPU_KVCACHE_SPACE), else by the CPU's shared-box
    default or the GPU's --gpu-memory-utilization rule (memory/plan.py): never below one full max_model_len
    sequence (else it refuses to start), never above max_num_seqs full sequences.
    """
    return args.num_gpu_blocks_override or plan.num_kv_blocks + 1


def num_window_kv_blocks(plan: MemoryPlan) -> int:
    """The sliding-window layers' pool of their own: the plan's blocks + its null block (0: no such pool)."""
    return plan.num_window_blocks + 1 if plan.num_window_blocks else 0


def window_pool_layers(args: EngineArgs, model: ModelConfig, speculates_with_draft: bool) -> tuple[int, int] | None:
    """(window, layers with it) of the sliding-window layers' pool of their own (core/kv_cache_manager.py), or
    None where every layer's K/V stays in one pool: where layers have a window shorter than the context (Gemma 2/3
    and Qwen's max_window_layers on some layers; Mistral and Phi-3 on every layer, whose main pool then holds no
    K/V, only the block tables' bookkeeping), for generation, unless --disable-hybrid-kv-cache-manager. A draft
    model's K/V are indexed by the main block table, so it keeps one pool."""
    if args.disable_hybrid_kv_cache_manager or model.task != "generate" or speculates_with_draft:
        return None
    windows = [w for w in layer_windows(model.hf_config) if w is not None]
    if not windows or max(windows) >= model.max_model_len:  # (--disable-sliding-window caps the context so)
        return None
    return max(windows), len(windows)


def plan_memory(args: EngineArgs, checkpoint: CheckpointInfo, model: ModelConfig, scheduler: SchedulerConfig,
                device: str, available: AvailableMemory | None = None,
                draft: tuple[CheckpointInfo, ModelConfig] | None = None) -> MemoryPlan:
    """The memory plan for serving `checkpoint` with these settings against the memory free now (the host's:
    cgroup limit - usage and MemAvailable; on a GPU its free memory), from headers only. `draft`: a draft
    model for speculative decoding, whose weights and K/V come on top."""
    from dataclasses import replace

    from pagedserve.distributed.plan import per_rank_available, per_rank_shape
    from pagedserve.memory import plan as memory
    from pagedserve.memory import sizes
    from pagedserve.memory.checkpoint import dtype_bytes

    if available is None:
        available = _probe_available_memory(device)
    available = per_rank_available(available, args.tensor_parallel_size)  # the ranks share this host
    weight_dtype_bytes = dtype_bytes(model.dtype)
    # An 8-bit KV cache (fp8*) stores one byte per value plus a scale per token and head in the model dtype.
    kv_8bit = kv_quantized(args.kv_cache_dtype)
    kv_dtype_bytes, kv_scale_bytes = (1, weight_dtype_bytes) if kv_8bit else (weight_dtype_bytes, 0)

    def prepared_shape(checkpoint: CheckpointInfo, model: ModelConfig) -> sizes.ModelShape:
        shape = sizes.ModelShape.from_hf_config(checkpoint.config, checkpoint.weight_bytes(weight_dtype_bytes))
        shape = per_rank_shape(shape, model.hf_config, args.tensor_parallel_size)  # one rank's shard
        tied = bool(getattr(model.hf_config, "tie_word_embeddings", False))
        fmt = _weight_format(model, device)
        weight_bytes = sizes.prepared_weight_bytes(shape, weight_dtype_bytes, fmt.int8_linears,
                                                   fmt.logits_head(tied, computes_logits=model.task == "generate"),
                                                   tied)
        if model.quantization == FILE_QUANTIZATION and args.tensor_parallel_size == 1:  # blocks kept as stored
            weight_bytes -= checkpoint.gguf_block_savings(weight_dtype_bytes)
        return replace(shape, weight_bytes=weight_bytes)

    shape = prepared_shape(checkpoint, model)
    if draft is not None:
        draft_shape = prepared_shape(*draft)
        shape = replace(shape, weight_bytes=shape.weight_bytes + draft_shape.weight_bytes, draft=draft_shape)
    override = args.num_gpu_blocks_override
    kv_source = f"--num-gpu-blocks-override {override}" if override else memory.PlanRequest.kv_source
    on_cpu = device == "cpu"
    uses_transformers = _uses_transformers(args, model)

    def make_plan(shape: sizes.ModelShape) -> MemoryPlan:
        overhead = sizes.runtime_overhead_bytes(shape, model.max_model_len, scheduler.max_num_seqs, args.block_size,
                                                on_cpu=on_cpu, uses_transformers=uses_transformers,
                                                structured_outputs=model.task == "generate")
        request = memory.PlanRequest(
            dtype_bytes=weight_dtype_bytes, kv_dtype_bytes=kv_dtype_bytes, max_model_len=model.max_model_len,
            max_num_seqs=scheduler.max_num_seqs, max_num_batched_tokens=scheduler.max_num_batched_tokens,
            block_size=args.block_size, available=available,
            memory_fraction=memory.DEFAULT_MEMORY_FRACTION if args.gpu_memory_utilization is None
            else args.gpu_memory_utilization,
            kv_share=memory.CPU_DEFAULT_KV_SHARE if on_cpu and args.gpu_memory_utilization is None else None,
            kv_cache_bytes=None if override else args.kv_cache_memory, kv_source=kv_source,
            num_kv_blocks=override - 1 if override else None,  # minus the null block
            runtime_overhead_bytes=overhead,
            host_bytes_per_block=memory.HOST_BYTES_PER_KV_BLOCK if on_cpu else 0, kv_scale_bytes=kv_scale_bytes,
            quantization=model.quantization, on_cpu=on_cpu, computes_logits=model.task == "generate",
            materializes_attention_scores=softcapped_attention(model.architecture, model.hf_config))
        return memory.make_plan(shape, request, quantizations=tuple(q for q in SUPPORTED_QUANTIZATION if q),
                                kv_cache_dtypes=tuple(d for d in SUPPORTED_KV_CACHE_DTYPES if d != "auto"))

    windowed = window_pool_layers(args, model, draft is not None)
    plans = [make_plan(shape)] if windowed is None else [
        make_plan(replace(shape, num_window_layers=windowed[1], window=windowed[0])), lambda: make_plan(shape)]
    plan = plans[0]
    if windowed is not None and memory.window_pool_saves_nothing(plan):
        logger.info("the %d sliding-window layers' K/V stay in the main pool: a pool of their own for their %d-token "
                    "window would hold as many blocks as it (%d), saving nothing", windowed[1], windowed[0],
                    plan.num_kv_blocks)
        plan = plans[1]()
    if args.num_gpu_blocks_override:  # testing: exactly the pool asked for, even a small one
        fits = plan.total_bytes <= plan.budget_bytes
        plan = replace(plan, problems=[], fits=fits, suggestions=[] if fits else _override_suggestions(*plans))
        if plan.num_kv_tokens < model.max_model_len:  # vLLM refuses to start there; served, it is said
            logger.warning("--num-gpu-blocks-override %d holds %d tokens, fewer than one %d-token sequence "
                           "(--max-model-len): a longer request gets a 400; --max-model-len %d or less fits it",
                           args.num_gpu_blocks_override, plan.num_kv_tokens, model.max_model_len, plan.num_kv_tokens)
    return plan


def _override_suggestions(plan: MemoryPlan, one_pool: Callable[[], MemoryPlan] | None = None) -> list:
    """What fits beside --num-gpu-blocks-override, which sizes the pool whatever --kv-cache-memory says: the
    blocks that fit (where any do, with the window pool they bring where the window layers have one, or
    `one_pool`'s plan's blocks where that pool would save nothing at that size), and the plan's suggestions
    that do not resize the pool."""
    from pagedserve.memory.plan import Suggestion, window_pool

    others = [s for s in plan.suggestions if s.flag != "--kv-cache-memory"]
    host = plan.request.host_bytes_per_block
    per_block = plan.block_bytes + host  # its K/V and its host bookkeeping
    fixed = plan.total_bytes - plan.kv_pool_bytes - plan.kv_bookkeeping_bytes
    window = window_pool(plan.shape, plan.request)
    blocks = window.main_blocks_within(max(0, plan.budget_bytes - fixed), per_block, host)
    if one_pool is not None and window.num_blocks(blocks) >= blocks:  # the engine would plan one pool there
        return _override_suggestions(one_pool())
    if blocks < 1:
        return others
    needs = fixed + blocks * per_block + window.num_blocks(blocks) * (window.block_bytes + host)
    return [Suggestion("--num-gpu-blocks-override", str(blocks + 1), needs), *others]


def softcapped_attention(architecture: str, hf_config: object) -> bool:
    """The model caps its attention scores (Gemma 2's attn_logit_softcapping; Gemma and Gemma 3 ignore the field,
    as transformers does): its attention materialises them (layers/attention.attend)."""
    return architecture == "Gemma2ForCausalLM" and getattr(hf_config, "attn_logit_softcapping", None) is not None


def _uses_transformers(args: EngineArgs, model: ModelConfig) -> bool:
    """Whether serving imports transformers: a config or a tokenizer pagedserve does not read itself."""
    from pagedserve.engine.setup import PlainDecoderConfig
    from pagedserve.tokenizer import loads_without_transformers

    return not isinstance(model.hf_config, PlainDecoderConfig) or not loads_without_transformers(
        args.tokenizer or model.model)


def _weight_format(model: ModelConfig, device: str) -> WeightFormat:
    """The weight format the loader's KernelBackend.choose will pick (it decides whether weights are copied
    into another format, and whether a tied embedding shares the packed logits matrix): the same rule
    (memory/weight_format.py), told from the CPU's flags without torch. Where choose needs the native library
    to load, this assumes it does when the CPU has an ISA it is written for (nothing is compiled here; a
    failed build is predicted wrongly), and that oneDNN packs where choose would probe it."""
    flags = cpu_flags()
    native = native_kernels_expected(flags, envs.cpu_kernels_enabled())
    return expected_weight_format(device, model.dtype, model.quantization, model.reference_kernels, native, flags)


def _probe_available_memory(device: str) -> AvailableMemory:
    from pagedserve.memory import probe

    if device == "cuda":
        gpu = probe.cuda_available_memory()
        if gpu is not None:
            return gpu
    return probe.counting_own_runtime(probe.available_memory(), CPU_RUNTIME_BASE_BYTES)


def check_memory_plan(plan: MemoryPlan) -> None:
    """Log the plan; when it does not fit, log it as an error and raise InsufficientMemoryError."""
    from pagedserve.memory.plan import InsufficientMemoryError, format_plan_table

    if not plan.fits:
        logger.error("refusing to start, the model does not fit in memory:\n%s", format_plan_table(plan))
        raise InsufficientMemoryError(plan)
    logger.info("%s", format_plan_table(plan))


def log_memory_vs_plan(plan: MemoryPlan | None, device: str) -> None:
    """After warm-up: the measured resident memory next to the plan's steady figure (weights + overhead +
    KV bookkeeping; the lazily allocated KV pool is resident only as written, see memory/plan.py)."""
    from pagedserve.memory import probe

    if plan is None:
        return
    planned = (f"planned steady {plan.steady_bytes / MIB:.0f} MiB (weights {plan.weight_bytes / MIB:.0f} MiB"
               f" + overhead {plan.overhead_bytes / MIB:.0f} MiB"
               f" + KV bookkeeping {plan.kv_bookkeeping_bytes / MIB:.0f} MiB)")
    if device == "cuda":
        info = probe.cuda_free_memory()
        if info is not None:
            logger.info("memory: GPU %.0f MiB in use after warm-up; %s", (info[1] - info[0]) / MIB, planned)
        return
    rss = probe.process_rss_bytes()
    if rss is not None:
        error = (rss - plan.steady_bytes) / max(rss, 1)
        logger.info("memory: RSS %.0f MiB after warm-up, %s: %+.1f %%; worst case with every KV block written"
                    " %.0f MiB", rss / MIB, planned, 100 * error, plan.total_bytes / MIB)
