"""The memory plan: weights + KV cache + activations + runtime overhead, counted before anything is loaded.

Pure Python (no torch): `serve` builds a ModelShape from the checkpoint's headers and config (memory/sizes.py
has it, with the weights as prepared, KV bytes per token and the runtime overhead), a PlanRequest from its
flags and the probed AvailableMemory, calls make_plan(), and refuses to start with InsufficientMemoryError
when the plan does not fit, printing format_plan_table(plan) — the numbers and the flags that would make it
fit — instead of starting and thrashing the page cache.

Formulas (T = max_num_batched_tokens, M = max_model_len, S = max_num_seqs, d = dtype_bytes, L layers,
H hidden, I intermediate, V vocab, nh / kvh attention / KV heads, hd head_dim; the per-token KV bytes, the
weights and the runtime overhead are memory/sizes.py's):

  budget = memory_fraction x available (the verdict: the total must fit in it)
  KV pool, in whole blocks, by the first rule that applies (`kv_rule`; README "Memory on a shared box"):
    explicit     --kv-cache-memory or VLLM_CPU_KVCACHE_SPACE.
    shared-box   the CPU default: the workload, S x M tokens (more could never be used at once), at most
                 CPU_DEFAULT_KV_SHARE (25 %) of the available memory, and no more than the budget leaves
                 after weights, activations and overhead.
    utilization  on a GPU, and on a CPU when --gpu-memory-utilization is given (vLLM's meaning): what the
                 budget leaves after weights, activations and overhead, at most S x M tokens.
  Both automatic rules raise the pool to one full M-token sequence (the engine cannot serve less); the
  blocks pay for their host bookkeeping too. `kv_sizing` names the bound that decided the size: "explicit",
  "workload" (S x M), "share" (the shared-box cap), "budget" (what the budget leaves) or "floor".
  Sliding-window layers with a pool of their own (sizes.ModelShape.num_window_layers; core/kv_cache_manager.py):
  the counts above are the main pool's blocks, whose bytes are the other layers'; the window pool has as many
  blocks up to what its requests can hold at once (sizes.window_pool_blocks), and the bounds in bytes count both.
  Where the bounds leave bytes beside both pools at the workload (the workload bound decided, or an explicit size
  beyond it), the window pool also takes cached windows from them, before the main pool takes more blocks
  (sizes.window_cache_blocks; none beside --num-gpu-blocks-override): the windows later requests' prefix hits
  need (core/kv_cache_manager.py).

  Peak activations, for one forward pass over T batched tokens. Inference keeps no autograd graph, so only
  one layer's transients are alive at a time; the terms are summed, which bounds the allocator's high-water
  mark from above (freed blocks stay cached, so peaks of consecutive steps add up in practice):
    hidden      2 x T x H x d           residual stream + normalised input of the current sub-layer
    attention   T x (2 nh + 2 kvh) x hd x d
                                        q, k, v projections and the attention output
    mlp         3 x T x I x d           fused gate_up output [T, 2I] + activated product [T, I], alive together
    gathered kv 2 x max(M, T) x kvh x hd x e
                                        K and V copied out of the paged blocks by one attention call
                                        (layers/attention.py): a prefill chunk gathers only its own sequence's
                                        context (at most M positions); decodes read the pool in place on the
                                        native kernel and, on the torch path, are gathered in groups of at most
                                        max(longest context, T) padded positions. e = d, or 1 + 2d for an 8-bit
                                        cache (the fp8 copy, its widening and the scaled result).
    scores      P x (1 + d) [+ nh x P x (4 + 3d)], P = min(ATTENTION_CHUNK_PAIRS (2^21), min(T, M) x M)
                                        the query x key pairs of one SDPA call of a prefill chunk (the chunk's
                                        queries are split to keep to ATTENTION_CHUNK_PAIRS): its boolean mask and
                                        SDPA's additive copy of it, plus the scores where attention materialises
                                        them: softcapped attention (Gemma 2) holds them in the model dtype three
                                        times (scores, capped, masked) and as the float32 softmax; torch's SDPA on
                                        CPU is tiled: for nh=14, 2048 queries x 8192 keys the peak RSS grew 59 MiB
                                        (fp32), not the 896 MiB of scores (ru_maxrss, torch 2.13.0+cpu).
                                        A chunk on the native kernels reads its context in place and keeps its
                                        threads' scores within this term and the one above (fewer rows share a
                                        widened context where it is long).
    decode slots 16 x min(S, T) x M     the int64 slot of every decode's context position, padded to the
                                        longest (built once per step: the table and its contiguous copy)
    logits      2 x min(S, T) x V x 4   fp32 logits of each sequence's last position + the sampler's probs
                                        (an embedding model: none)

  KV bookkeeping = number of KV blocks x host_bytes_per_block (the block pool's Python objects).

Two totals. `total_bytes` is the worst case the verdict is about: every KV block written and the largest step's
activations alive at once. `steady_bytes` is what the process holds once started and idle: weights + runtime
overhead + KV bookkeeping. The KV pool is allocated lazily (an anonymous mapping whose pages become resident
only as they are written; a fresh server has written only the few blocks warm-up used) and activation buffers
are freed after every step, so neither is in it. steady_bytes is the figure the engine logs next to the RSS
it measures after warm-up.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

from pagedserve.memory.probe import AvailableMemory
from pagedserve.memory.sizes import (CPU_RUNTIME_OVERHEAD_BYTES, GIB, MIB, ModelShape, int8_linear_delta_bytes,
                                     kv_bytes_per_token, sequence_overhead_bytes, window_cache_blocks,
                                     window_kv_bytes_per_token, window_pool_blocks)

# The block pool's Python objects (KVCacheBlock + its free-queue entry): 277 bytes per block measured with
# VmRSS around KVCacheManager(100_000, 16, True) on Python 3.11.
HOST_BYTES_PER_KV_BLOCK = 288
# The shared-box default for the CPU KV pool: at most this share of the memory available at start-up
# (MemAvailable, or the cgroup's limit minus its working set when that is less). vLLM's CPU backend, with
# VLLM_CPU_KVCACHE_SPACE unset, used a fixed 4 GiB (up to v0.10) and now takes 50 % of MemTotal per NUMA
# node (vllm/platforms/cpu.py, DEFAULT_CPU_MEM_UTILIZATION), allocated up front, whatever the neighbours hold
# and whatever the workload can use. Ours counts what is free now, not the total, and takes half of vLLM's
# share of it: the pool becomes resident as the prefix cache fills and its pages never go back, so a quarter
# of the free memory is the most it may grow into while three quarters stay for the neighbours' growth, the
# page cache and our own weights and activations. (16 GiB available gives vLLM's old 4 GiB; the default
# SmolLM2 on a 24 GiB box gets about 5.5 GiB, ~30 sequences of 8192 tokens.)
CPU_DEFAULT_KV_SHARE = 0.25
# --gpu-memory-utilization when not given: the share of the available memory the whole server may use.
DEFAULT_MEMORY_FRACTION = 0.9
# The share of the budget a suggested --max-model-len / --max-num-seqs / --max-num-batched-tokens leaves to spare.
SUGGESTION_MARGIN_FRACTION = 0.02
# The most query x key pairs one SDPA call of a prefill chunk covers (layers/attention.py keeps to it and
# imports it from here: one number, and the plan stays free of torch).
ATTENTION_CHUNK_PAIRS = 1 << 21


class InsufficientMemoryError(RuntimeError):
    """The memory plan does not fit; `plan` carries the numbers and suggestions."""

    def __init__(self, plan: MemoryPlan) -> None:
        fixes = ", ".join(f"{s.flag} {s.value}" for s in plan.suggestions)
        super().__init__(plan.summary() + (f"; any one of these would fit: {fixes}" if fixes else ""))
        self.plan = plan


@dataclass(frozen=True)
class PlanRequest:
    """The serving settings that decide memory use, and the memory available for them."""

    dtype_bytes: int
    kv_dtype_bytes: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    available: AvailableMemory
    memory_fraction: float = DEFAULT_MEMORY_FRACTION  # --gpu-memory-utilization: share of the available memory the server may use
    kv_cache_bytes: int | None = None  # explicit KV pool (--kv-cache-memory, VLLM_CPU_KVCACHE_SPACE)
    kv_source: str = "--kv-cache-memory or VLLM_CPU_KVCACHE_SPACE"  # what sized an explicit pool, in words
    # --num-gpu-blocks-override: the main pool's blocks, exactly (an explicit pool; the window pool holds its running
    # requests' blocks, no cached windows)
    num_kv_blocks: int | None = None
    # The shared-box rule's cap: the KV pool holds at most this share of the available memory. None: the
    # utilization rule (the pool takes what the budget leaves; GPUs, and --gpu-memory-utilization on a CPU).
    kv_share: float | None = None
    runtime_overhead_bytes: int = CPU_RUNTIME_OVERHEAD_BYTES
    materializes_attention_scores: bool = False  # attention that holds QK^T (softcapped: not torch SDPA)
    quantization: str | None = None  # weight quantization already applied to weight_bytes (e.g. "int8")
    host_bytes_per_block: int = 0  # resident bookkeeping per KV block (the block pool's Python objects)
    kv_scale_bytes: int = 0  # 8-bit KV caches: one scale per token, head and K/V, of this many bytes
    on_cpu: bool = True  # where the runtime overhead's parts count (sizes.sequence_overhead_bytes)
    computes_logits: bool = True  # False for an embedding model: it pools hidden states, no logits or sampler

    def __post_init__(self) -> None:
        for name in ("dtype_bytes", "kv_dtype_bytes", "max_model_len", "max_num_seqs",
                     "max_num_batched_tokens", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")
        if self.kv_share is not None and not 0 < self.kv_share <= 1:
            raise ValueError(f"kv_share must be in (0, 1], got {self.kv_share}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be positive, got {self.kv_cache_bytes}")
        if self.runtime_overhead_bytes < 0 or self.host_bytes_per_block < 0:
            raise ValueError("runtime_overhead_bytes and host_bytes_per_block must not be negative")


@dataclass(frozen=True)
class ActivationBytes:
    """Peak activation memory of one forward pass, by term (see the module docstring for the formulas)."""

    hidden: int
    attention: int
    mlp: int
    gathered_kv: int
    scores: int
    decode_slots: int
    logits: int

    @property
    def total(self) -> int:
        return (self.hidden + self.attention + self.mlp + self.gathered_kv + self.scores + self.decode_slots
                + self.logits)


@dataclass(frozen=True)
class Suggestion:
    """One flag change that would make the plan fit, with what the plan would then need."""

    flag: str
    value: str
    needs_bytes: int
    note: str = ""


@dataclass(frozen=True)
class MemoryPlan:
    """The budget: every term in bytes, the verdict, and how to make it fit."""

    shape: ModelShape
    request: PlanRequest
    weight_bytes: int
    kv_bytes_per_token: int
    block_bytes: int
    num_kv_blocks: int
    kv_pool_bytes: int
    kv_rule: str  # the rule that sized the KV pool: "explicit", "shared-box" or "utilization"
    kv_sizing: str  # the bound that decided: "explicit", "workload", "share", "budget" or "floor"
    activations: ActivationBytes
    overhead_bytes: int
    total_bytes: int
    budget_bytes: int  # memory_fraction x available
    fits: bool
    kv_bookkeeping_bytes: int = 0  # (num_kv_blocks + num_window_blocks) x host_bytes_per_block
    problems: list[str] = field(default_factory=list)
    suggestions: list[Suggestion] = field(default_factory=list)
    # The sliding-window layers' pool of their own (shape.num_window_layers > 0): its blocks and a block's bytes.
    # block_bytes and kv_bytes_per_token are then the other layers' (the main pool's).
    num_window_blocks: int = 0
    window_block_bytes: int = 0

    @property
    def activation_bytes(self) -> int:
        return self.activations.total

    @property
    def num_kv_tokens(self) -> int:
        return self.num_kv_blocks * self.request.block_size

    @property
    def max_concurrency(self) -> float:
        """How many max_model_len-token sequences the KV pool holds at once."""
        return self.num_kv_tokens / self.request.max_model_len

    @property
    def shortfall_bytes(self) -> int:
        return max(0, self.total_bytes - self.budget_bytes)

    @property
    def steady_bytes(self) -> int:
        """Resident memory once started and idle (weights + overhead + KV bookkeeping; see the module docstring)."""
        return self.weight_bytes + self.overhead_bytes + self.kv_bookkeeping_bytes

    @property
    def kv_sizing_text(self) -> str:
        """Which rule sized the KV pool and which bound decided, in words (the table, the log, /health)."""
        request = self.request
        if self.kv_rule == "explicit":
            return f"explicit ({request.kv_source})"
        if self.kv_rule == "shared-box":
            rule = f"shared-box default (<= {request.kv_share:.0%} of {_gib(request.available.num_bytes)} available)"
        else:
            rule = f"--gpu-memory-utilization {request.memory_fraction:.2f}"
        workload = f"max_num_seqs {request.max_num_seqs} x max_model_len {request.max_model_len}"
        blocks_per_seq = math.ceil(request.max_model_len / request.block_size)
        bound = {
            "workload": f"the workload, {workload}",
            "share": f"capped ({workload} would need {_gib(self.pool_bytes(request.max_num_seqs * blocks_per_seq))})",
            "budget": "what the budget leaves after weights, activations and overhead",
            "floor": f"raised to one {request.max_model_len}-token sequence",
        }[self.kv_sizing]
        return f"{rule}: {bound}"

    def pool_bytes(self, num_blocks: int) -> int:
        """The K/V bytes of `num_blocks` main-pool blocks and the window pool they bring."""
        window = window_pool(self.shape, self.request)
        return num_blocks * self.block_bytes + window.num_blocks(num_blocks) * window.block_bytes

    def kv_cache_report(self) -> dict:
        """The KV pool and how it was sized, for /health."""
        report = {"rule": self.kv_rule, "sizing": self.kv_sizing, "how": self.kv_sizing_text,
                  "num_blocks": self.num_kv_blocks, "pool_bytes": self.kv_pool_bytes}
        if self.num_window_blocks:
            report.update(sliding_window=self.shape.window, num_window_blocks=self.num_window_blocks)
        return report

    def summary(self) -> str:
        """One line: "needs 11.10 GiB, 9.32 GiB available, short by 1.78 GiB"."""
        head = f"needs {_gib(self.total_bytes)}, {_gib(self.budget_bytes)} available"
        if self.fits and self.kv_sizing == "budget":
            return (f"{head}: the KV cache takes what is left, {self.max_concurrency:.2f} x"
                    f" {self.request.max_model_len}-token sequences")
        if self.fits:
            return f"{head}, {_size(self.budget_bytes - self.total_bytes)} to spare"
        text = f"{head}, short by {_size(self.shortfall_bytes)}" if self.shortfall_bytes else head
        return "; ".join([text, *self.problems])

    def to_dict(self) -> dict:
        data = asdict(self)
        data["activations"]["total"] = self.activation_bytes
        data.update(
            activation_bytes=self.activation_bytes,
            num_kv_tokens=self.num_kv_tokens,
            max_concurrency=self.max_concurrency,
            shortfall_bytes=self.shortfall_bytes,
            steady_bytes=self.steady_bytes,
            kv_sizing_text=self.kv_sizing_text,
            summary=self.summary(),
        )
        return data


def _gib_up(size: int) -> str:
    """GiB with two decimals, rounded up: a size that holds at least `size` (0.00 would mean the default size)."""
    return f"{math.ceil(size * 100 / GIB) / 100:.2f}"


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.2f} GiB"


def _size(num_bytes: int) -> str:
    """GiB, or MiB / KiB below a tenth of a GiB (where two decimals of GiB read 0.00)."""
    if num_bytes >= GIB // 10:
        return _gib(num_bytes)
    return f"{num_bytes / MIB:.1f} MiB" if num_bytes >= MIB else f"{num_bytes / 1024:.0f} KiB"


# ----------------------------------------------------------------------------------------------- the plan


def prefill_scratch_bytes(chunk: int, context_len: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """What one prefill chunk's attention may hold beyond q/k/v: the "gathered kv" and "scores" terms of the module
    docstring for a chunk of `chunk` queries over `context_len` positions (the torch path's gathered K/V and SDPA
    mask; the native kernel's score buffers are kept within it, layers/attention.py)."""
    return (min(ATTENTION_CHUNK_PAIRS, chunk * context_len) * (1 + dtype_bytes)
            + 2 * context_len * kv_heads * head_dim * dtype_bytes)


def activation_bytes(shape: ModelShape, request: PlanRequest) -> ActivationBytes:
    """Peak activations of one step of max_num_batched_tokens tokens (formulas in the module docstring)."""
    tokens, d = request.max_num_batched_tokens, request.dtype_bytes
    max_len = request.max_model_len
    rows = min(request.max_num_seqs, tokens)  # sequences in one step
    gathered_element = d if request.kv_scale_bytes == 0 else request.kv_dtype_bytes + 2 * d
    pairs = min(ATTENTION_CHUNK_PAIRS, min(tokens, max_len) * max_len)  # of one SDPA call
    scores = pairs * (1 + d)
    if request.materializes_attention_scores:
        scores += shape.num_attention_heads * pairs * (4 + 3 * d)
    return ActivationBytes(
        hidden=2 * tokens * shape.hidden_size * d,
        attention=tokens * (2 * shape.num_attention_heads + 2 * shape.num_kv_heads) * shape.head_dim * d,
        mlp=3 * tokens * shape.intermediate_size * d,
        gathered_kv=2 * max(max_len, tokens) * shape.num_kv_heads * shape.head_dim * gathered_element,
        scores=scores,
        decode_slots=16 * rows * max_len,
        logits=2 * rows * shape.vocab_size * 4 if request.computes_logits else 0,
    )


@dataclass(frozen=True)
class KVSizing:
    """How many KV blocks, by which rule and bound (see the module docstring), and what is wrong with it."""

    num_blocks: int
    rule: str
    bound: str
    problems: list[str] = field(default_factory=list)
    num_window_blocks: int = 0  # the window pool's (WindowPool)


def kv_rule(request: PlanRequest) -> str:
    """The rule that sizes the KV pool: "explicit", "shared-box" or "utilization"."""
    if request.kv_cache_bytes is not None or request.num_kv_blocks is not None:
        return "explicit"
    return "utilization" if request.kv_share is None else "shared-box"


@dataclass(frozen=True)
class WindowPool:
    """The sliding-window layers' pool of their own: a block's K/V bytes, the most blocks its running requests
    hold (sizes.window_pool_blocks) and the blocks that keep finished requests' windows cached
    (sizes.window_cache_blocks). It holds min(main pool's blocks, what the running requests hold, plus cached
    windows where the budget leaves room for them beside the workload's pools) blocks."""

    block_bytes: int = 0
    max_blocks: int = 0
    cache_blocks: int = 0

    def num_blocks(self, num_main_blocks: int, spare_bytes: int = 0, host_bytes: int = 0) -> int:
        """With `spare_bytes` left in the bounds beside the pools, each window block its K/V + `host_bytes`."""
        if not self.block_bytes:
            return 0
        cached = min(self.cache_blocks, max(0, spare_bytes) // (self.block_bytes + host_bytes))
        return min(num_main_blocks, self.max_blocks + cached)

    def main_blocks_within(self, num_bytes: int, per_block: int, host_bytes: int = 0) -> int:
        """The most main-pool blocks whose pools fit in `num_bytes`, each block `per_block` bytes and each window
        block its K/V + `host_bytes`. A main pool of no bytes (every layer windowed, no host bookkeeping counted)
        is bounded by its window pool alone: as many blocks as there are bytes, once that pool fits."""
        per_window = self.block_bytes + host_bytes if self.block_bytes else 0
        num = num_bytes // (per_block + per_window)
        if num < self.max_blocks or not per_window:
            return num
        left = num_bytes - self.max_blocks * per_window  # the window pool stopped growing
        return left // per_block if per_block else max(num_bytes, self.max_blocks)


def _size_kv_pool(request: PlanRequest, block_bytes: int, left_bytes: int,
                  window: WindowPool = WindowPool()) -> KVSizing:
    """The KV pool for the memory left in the budget after everything else (`left_bytes`); with `window`, the
    main pool's blocks and the window pool's.

    An automatic pool pays for each block's host bookkeeping too; an explicit size counts K/V bytes only. The
    window pool's cached windows come from what the bytes leave beside the workload's pools."""
    rule = kv_rule(request)
    blocks_per_seq = math.ceil(request.max_model_len / request.block_size)
    workload = request.max_num_seqs * blocks_per_seq
    if request.num_kv_blocks is not None:
        return KVSizing(request.num_kv_blocks, rule, "explicit",
                        num_window_blocks=window.num_blocks(request.num_kv_blocks))
    if rule == "explicit":
        kv_bytes = request.kv_cache_bytes
        # Bytes beyond the workload's pools take cached windows before more main-pool blocks.
        beside = kv_bytes - workload * block_bytes - window.num_blocks(workload) * window.block_bytes
        num_cached = window.num_blocks(workload, beside) - window.num_blocks(workload)
        num_blocks = window.main_blocks_within(kv_bytes - num_cached * window.block_bytes, block_bytes)
        problems = []
        if num_blocks < blocks_per_seq:
            problems.append(
                f"the KV cache of {_gib(request.kv_cache_bytes)} holds {num_blocks * request.block_size} tokens,"
                f" fewer than one max_model_len={request.max_model_len} sequence"
            )
        return KVSizing(num_blocks, rule, "explicit", problems, window.num_blocks(num_blocks) + num_cached)
    per_block, host = block_bytes + request.host_bytes_per_block, request.host_bytes_per_block
    limit = max(0, left_bytes)
    bounds = [(workload, "workload"), (window.main_blocks_within(limit, per_block, host), "budget")]
    if rule == "shared-box":
        share = int(request.kv_share * request.available.num_bytes)
        bounds.append((window.main_blocks_within(share, per_block, host), "share"))
        limit = min(limit, share)
    num_blocks, bound = min(bounds, key=lambda b: b[0])  # the first of equals: workload before budget
    if num_blocks < blocks_per_seq:
        return KVSizing(blocks_per_seq, rule, "floor", num_window_blocks=window.num_blocks(blocks_per_seq))
    beside = limit - num_blocks * per_block - window.num_blocks(num_blocks) * (window.block_bytes + host)
    return KVSizing(num_blocks, rule, bound, num_window_blocks=window.num_blocks(num_blocks, beside, host))


def _plan(shape: ModelShape, request: PlanRequest) -> MemoryPlan:
    kv_per_token = kv_bytes_per_token(shape, request.kv_dtype_bytes, request.kv_scale_bytes)
    block_bytes = request.block_size * kv_per_token
    window = window_pool(shape, request)
    activations = activation_bytes(shape, request)
    budget = int(request.memory_fraction * request.available.num_bytes)
    fixed = shape.weight_bytes + activations.total + request.runtime_overhead_bytes
    sizing = _size_kv_pool(request, block_bytes, budget - fixed, window)
    num_blocks, problems = sizing.num_blocks, sizing.problems
    num_window_blocks = sizing.num_window_blocks
    kv_pool_bytes = num_blocks * block_bytes + num_window_blocks * window.block_bytes
    bookkeeping = (num_blocks + num_window_blocks) * request.host_bytes_per_block
    total = fixed + kv_pool_bytes + bookkeeping
    return MemoryPlan(
        shape=shape,
        request=request,
        weight_bytes=shape.weight_bytes,
        kv_bytes_per_token=kv_per_token,
        block_bytes=block_bytes,
        num_kv_blocks=num_blocks,
        kv_pool_bytes=kv_pool_bytes,
        kv_rule=sizing.rule,
        kv_sizing=sizing.bound,
        activations=activations,
        overhead_bytes=request.runtime_overhead_bytes,
        total_bytes=total,
        budget_bytes=budget,
        fits=total <= budget and not problems,
        kv_bookkeeping_bytes=bookkeeping,
        problems=problems,
        num_window_blocks=num_window_blocks,
        window_block_bytes=window.block_bytes,
    )


def window_pool_saves_nothing(plan: MemoryPlan) -> bool:
    """Whether the sliding-window layers' pool of their own holds as many blocks as the main pool (a context
    close to the window, or cached windows filling it): then it saves no K/V bytes against one pool, costs a
    second block's bookkeeping for every main block, and splits the prefix cache's LRU order in two. The engine
    plans one pool instead."""
    return bool(plan.num_window_blocks) and plan.num_window_blocks >= plan.num_kv_blocks


def window_pool(shape: ModelShape, request: PlanRequest) -> WindowPool:
    """The sliding-window layers' pool of their own where the shape has one (shape.num_window_layers)."""
    if not shape.num_window_layers:
        return WindowPool()
    return WindowPool(request.block_size * window_kv_bytes_per_token(shape, request.kv_dtype_bytes,
                                                                      request.kv_scale_bytes),
                      window_pool_blocks(shape.window, request.block_size, request.max_num_seqs,
                                         request.max_num_batched_tokens),
                      window_cache_blocks(shape.window, request.block_size, request.max_num_seqs))


def make_plan(shape: ModelShape, request: PlanRequest, *, quantizations: tuple[str, ...] = ("int8",),
              kv_cache_dtypes: tuple[str, ...] = ("fp8",)) -> MemoryPlan:
    """The memory plan for serving `shape` with `request`; when it does not fit, with suggestions.

    `quantizations` and `kv_cache_dtypes` are the options the engine supports: only those are suggested.
    """
    plan = _plan(shape, request)
    if plan.fits:
        return plan
    return replace(plan, suggestions=suggest(shape, request, quantizations, kv_cache_dtypes))


# ----------------------------------------------------------------------------------------------- suggestions


def _largest_fitting(low: int, high: int, fits: Callable[[int], bool]) -> int | None:
    """Largest n in [low, high] with fits(n), for a predicate that is monotone (true up to some n); or None."""
    if high < low or not fits(low):
        return None
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return low


def _with_setting(shape: ModelShape, request: PlanRequest, name: str, value: int) -> PlanRequest:
    """`request` with one setting changed, and the runtime overhead with it where it grows with that setting
    (max_model_len, max_num_seqs: the rotary tables and block table)."""
    changed = replace(request, **{name: value})
    if name not in ("max_model_len", "max_num_seqs"):
        return changed

    def sequences(r: PlanRequest) -> int:
        return sequence_overhead_bytes(shape, r.max_model_len, r.max_num_seqs, r.block_size, r.on_cpu)
    overhead = request.runtime_overhead_bytes - sequences(request) + sequences(changed)
    return replace(changed, runtime_overhead_bytes=max(0, overhead))


def _fits_with_margin(shape: ModelShape, request: PlanRequest) -> bool:
    """Fits in SUGGESTION_MARGIN_FRACTION less memory: what is available moves by tens of MiB between `plan` and
    `serve`, and a setting that fit to the last block was refused there a moment later."""
    available = request.available
    tighter = replace(available, num_bytes=int(available.num_bytes * (1 - SUGGESTION_MARGIN_FRACTION)))
    return _plan(shape, replace(request, available=tighter)).fits


def _largest_setting(shape: ModelShape, request: PlanRequest, name: str, step: int) -> int | None:
    """Largest multiple of `step` below the requested value of `name` with which the plan fits, with a margin."""
    current = getattr(request, name)
    n = _largest_fitting(1, (current - 1) // step,
                         lambda k: _fits_with_margin(shape, _with_setting(shape, request, name, k * step)))
    return None if n is None else n * step


def suggest(shape: ModelShape, request: PlanRequest, quantizations: tuple[str, ...] = ("int8",),
            kv_cache_dtypes: tuple[str, ...] = ("fp8",)) -> list[Suggestion]:
    """Single flag changes that would make the plan fit (every other setting unchanged)."""
    suggestions: list[Suggestion] = []

    def fitting(label: str, value: str, new_shape: ModelShape, new_request: PlanRequest, note: str = "") -> None:
        plan = _plan(new_shape, new_request)
        if plan.fits:
            suggestions.append(Suggestion(label, value, plan.total_bytes, note))

    # Each of these only grows memory use, so the largest fitting value is found by bisection.
    for name, step, note in (
        ("max_model_len", request.block_size, ""),
        ("max_num_batched_tokens", request.block_size, "smaller prefill chunks"),
        ("max_num_seqs", 1, ""),
    ):
        value = _largest_setting(shape, request, name, step)
        if value is not None:
            fitting("--" + name.replace("_", "-"), str(value), shape, _with_setting(shape, request, name, value),
                    note)
    if request.kv_cache_bytes is not None:
        base = _plan(shape, request)
        room = base.budget_bytes - (base.total_bytes - base.kv_pool_bytes - base.kv_bookkeeping_bytes)
        host = request.host_bytes_per_block
        kv_bytes = base.pool_bytes(window_pool(shape, request).main_blocks_within(max(0, room), base.block_bytes + host,
                                                                                  host))
        # Too small for one sequence: the size that holds one (a 64 MiB cache was told to take 17.8 GiB).
        one_sequence = base.pool_bytes(math.ceil(request.max_model_len / request.block_size))
        if request.kv_cache_bytes < one_sequence:
            kv_bytes = min(kv_bytes, one_sequence)
        if kv_bytes:
            fitting("--kv-cache-memory", str(kv_bytes), shape, replace(request, kv_cache_bytes=kv_bytes),
                    note=f"{_size(kv_bytes)}; VLLM_CPU_KVCACHE_SPACE={_gib_up(kv_bytes)}")
    if request.memory_fraction < DEFAULT_MEMORY_FRACTION:
        # The smallest fraction, in hundredths, up to the default, that lets the plan fit.
        for hundredths in range(math.floor(request.memory_fraction * 100) + 1,
                                round(DEFAULT_MEMORY_FRACTION * 100) + 1):
            raised = replace(request, memory_fraction=hundredths / 100)
            if _plan(shape, raised).fits:
                fitting("--gpu-memory-utilization", f"{hundredths / 100:.2f}", shape, raised,
                        note="the share of the available memory the server may use")
                break
    if request.dtype_bytes == 4:
        half = replace(shape, weight_bytes=shape.weight_bytes // 2)
        kv = 2 if request.kv_dtype_bytes == 4 else request.kv_dtype_bytes
        fitting("--dtype", "bfloat16", half, replace(request, dtype_bytes=2, kv_dtype_bytes=kv),
                note="fast with the native kernels (AVX2 or AVX-512) or bf16 instructions; see `pagedserve doctor`")
    if request.quantization is None and "int8" in quantizations:
        # The decoder's linears only; the plan's LM head stays as it is (conservative).
        int8_bytes = shape.weight_bytes + int8_linear_delta_bytes(shape, request.dtype_bytes)
        if int8_bytes < shape.weight_bytes:
            fitting("--quantization", "int8", replace(shape, weight_bytes=int8_bytes), request,
                    note="weight-only int8 for the linear layers")
    if request.kv_dtype_bytes > 1 and "fp8" in kv_cache_dtypes:
        fitting("--kv-cache-dtype", "fp8", shape,
                replace(request, kv_dtype_bytes=1, kv_scale_bytes=request.dtype_bytes))
    return suggestions


# ----------------------------------------------------------------------------------------------- output


def format_plan_table(plan: MemoryPlan) -> str:
    """The plan as a human table (GiB with 2 decimals), the verdict, and suggestions when it does not fit."""
    request, shape = plan.request, plan.shape
    per_token = f"x {plan.kv_bytes_per_token:,} B/token" if plan.kv_bytes_per_token else "(block tables only)"
    if request.kv_scale_bytes:
        per_token += " (8-bit K/V and their scales)"
    kv_detail = (
        f"{plan.num_kv_blocks} blocks x {request.block_size} tokens {per_token},"
        f" {plan.max_concurrency:.2f} x {request.max_model_len}-token sequences"
    )
    if plan.num_window_blocks:
        layers = f"{shape.num_window_layers} layer{'s' if shape.num_window_layers != 1 else ''}"
        kv_detail += (f"; {layers} with a {shape.window}-token window: {plan.num_window_blocks} blocks of their own"
                      f" x {plan.window_block_bytes // request.block_size:,} B/token")
    act = plan.activations
    rows = [
        ("weights", plan.weight_bytes, f"{shape.num_layers} layers, " + (
            f"{request.quantization} linear layers, {request.dtype_bytes} B/param elsewhere" if request.quantization
            else f"{request.dtype_bytes} B/param")),
        ("KV cache", plan.kv_pool_bytes, kv_detail),
        ("activations", plan.activation_bytes,
         f"{request.max_num_batched_tokens} batched tokens: hidden {act.hidden / MIB:.0f} MiB, attention"
         f" {(act.attention + act.gathered_kv + act.scores + act.decode_slots) / MIB:.0f} MiB,"
         f" mlp {act.mlp / MIB:.0f} MiB,"
         f" logits {act.logits / MIB:.0f} MiB"),
        ("runtime overhead", plan.overhead_bytes, "torch, Python, tokenizer, structured outputs, rotary tables, "
                                                  "block table"),
    ]
    if plan.kv_bookkeeping_bytes:
        rows.insert(2, ("KV bookkeeping", plan.kv_bookkeeping_bytes,
                        f"{request.host_bytes_per_block} B of block-pool objects per block"))
    lines = [f"  {name:<17}{num_bytes / GIB:>8.2f} GiB   {detail}" for name, num_bytes, detail in rows]
    lines.insert(2, f"  {'':<17}{'':>12}   {plan.kv_sizing_text}")
    lines.append(f"  {'total':<17}{plan.total_bytes / GIB:>8.2f} GiB   worst case: every KV block written, the"
                 " largest step's activations alive")
    lines.append(f"  {'steady':<17}{plan.steady_bytes / GIB:>8.2f} GiB   resident once started and idle (weights +"
                 " overhead + KV bookkeeping; the KV pool fills as it is used)")
    lines.append(
        f"  {'available':<17}{plan.budget_bytes / GIB:>8.2f} GiB   {request.memory_fraction:.0%} of"
        f" {_gib(request.available.num_bytes)} ({request.available.reason})"
    )
    verdict = "fits" if plan.fits else "DOES NOT FIT"
    lines.append(f"{verdict}: {plan.summary()}")
    if not plan.fits:
        if plan.suggestions:
            lines.append("any one of these would fit:")
            for s in plan.suggestions:
                note = f"  ({s.note})" if s.note else ""
                lines.append(f"  {s.flag + ' ' + s.value:<32} needs {_gib(s.needs_bytes)}{note}")
        else:
            lines.append("no single flag change fits: free memory, or use a smaller model")
    return "\n".join(["memory plan", *lines])
