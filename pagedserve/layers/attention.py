"""Paged attention over a KV pool of fixed-size blocks.

The KV pool of one layer is a pair of tensors [num_slots, num_kv_heads, head_dim] where
slot = block_id * block_size + offset. Each step first writes the new tokens' K/V into their slots
(for the whole batch), then attends. The batch puts decode tokens (one per request) first, so they
are attended together; prefill chunks follow, one sequence at a time.

What one layer's attention materialises is bounded by the step, not by max_model_len x batch (memory/plan.py
counts these bounds):
- decodes on the native kernel read the pool in place (an fp8 one too); on the torch path (no kernels, a GPU)
  they are gathered in groups of consecutive rows holding at most `gather_tokens` padded positions
  (default: max(longest context in the step, tokens in the step)), never the whole batch at once;
- a prefill chunk on the native kernel reads its context in place too, each row as a decode row with its own
  context (kernels.prefill_attention: 2.5-3.5x torch's SDPA at 400-500 positions on the 2-core Zen 5), its
  threads' score buffers within what the torch path below is planned for;
- on the torch path a prefill chunk gathers only its own sequence's context (its current length), and where a
  query x key product would be large (SDPA's additive copy of a boolean mask; the scores themselves on an
  untiled backend) the chunk's queries are taken ATTENTION_CHUNK_PAIRS // context_len at a time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pagedserve.kernels import CpuKernels
# ATTENTION_CHUNK_PAIRS: query x key pairs per SDPA call (a 4 MiB bf16 mask)
from pagedserve.memory.plan import ATTENTION_CHUNK_PAIRS, prefill_scratch_bytes
from pagedserve.memory.weight_format import capped_prefill_on_torch


@dataclass
class PrefillSpan:
    start: int  # first row of the chunk in the flattened batch
    end: int
    context_start: int = 0  # position of the chunk's first token = tokens of prior context
    # Slots of every context position (prior context + this chunk); None when the chunk is the whole
    # sequence so far, so the fresh K/V can be used directly.
    kv_slots: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: where each new token's K/V goes
    num_decodes: int = 0  # rows 0..num_decodes-1 are single-token decodes
    decode_kv_slots: torch.Tensor | None = None  # [Bd, Lmax] int64, padded with slot 0
    decode_context_lens: torch.Tensor | None = None  # [Bd] int64: valid entries of each decode_kv_slots row
    prefills: list[PrefillSpan] = field(default_factory=list)
    gather_tokens: int | None = None  # most K/V positions one torch-path decode gather copies (None: see top)
    # The sliding-window layers' own metadata where their K/V live in a pool of their own, addressed by a block
    # table of their own (core/kv_cache_manager.py): the same step, their slots. None: every layer reads this.
    window_meta: AttentionMetadata | None = None
    _decode_groups: list[DecodeGroup] | None = field(default=None, repr=False)
    _windows: dict[int, AttentionMetadata] = field(default_factory=dict, repr=False)

    def of_layer(self, window: int | None) -> AttentionMetadata:
        """The metadata of a layer with this sliding window (None: none): window_meta where the window layers have
        a pool of their own, else this. Their K/V writes and reads both go through it."""
        return self.window_meta if window is not None and self.window_meta is not None else self

    def within(self, window: int | None) -> AttentionMetadata:
        """This step as layers attending only to the last `window` positions see it (sliding-window attention):
        of_layer(window)'s, each decode row's slots and length cut to its last `window` positions, so every decode
        path (the native kernel, the decode stack, the torch gather) reads only those. Computed once per step for
        each window and shared by its layers; the prefill spans are this step's (their attention masks by
        position)."""
        meta = self.of_layer(window)
        lens = meta.decode_context_lens
        if window is None or lens is None or meta.decode_kv_slots.shape[1] <= window:
            return meta
        if window not in meta._windows:
            starts = (lens - window).clamp_(min=0)
            columns = torch.arange(window, device=lens.device)
            slots = meta.decode_kv_slots.gather(1, starts[:, None] + columns)  # within each row: width > window
            meta._windows[window] = AttentionMetadata(meta.slot_mapping, meta.num_decodes, slots.contiguous(),
                                                      lens.clamp(max=window), meta.prefills, meta.gather_tokens)
        return meta._windows[window]

    def decode_groups(self) -> list[DecodeGroup]:
        """The torch path's groups of decodes gathered together (computed once per step, shared by layers)."""
        if self._decode_groups is None:
            lens = self.decode_context_lens.tolist()
            budget = self.gather_tokens or max(max(lens), self.slot_mapping.shape[0])
            self._decode_groups = group_rows(lens, budget)
        return self._decode_groups


@dataclass(frozen=True)
class DecodeGroup:
    first: int  # rows first .. last - 1 of the decodes
    last: int
    width: int  # the longest context among them: the gathered length
    is_padded: bool  # some row's context is shorter than width (a mask is needed)


def group_rows(lens: list[int], budget: int) -> list[DecodeGroup]:
    """Consecutive groups of rows whose count x longest length stays within `budget` (one row at least)."""
    groups: list[DecodeGroup] = []
    first = width = shortest = 0
    for row, length in enumerate(lens):
        if row > first and (row + 1 - first) * max(width, length) > budget:
            groups.append(DecodeGroup(first, row, width, shortest < width))
            first = row
        width, shortest = (length, length) if row == first else (max(width, length), min(shortest, length))
    if lens:
        groups.append(DecodeGroup(first, len(lens), width, shortest < width))
    return groups


FP8_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@dataclass
class LayerKVCache:
    """One layer's K/V pool: [num_slots, num_kv_heads, head_dim] each.

    In fp8 every (slot, head) vector is stored with its own scale (amax / fp8 max, in `scale_dtype`), so
    no value overflows the format and each vector keeps fp8's full relative precision; the scales add
    2 bytes per head_dim values (3 % for head_dim 64 in bf16)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None  # [num_slots, num_kv_heads, 1], only when quantized
    v_scale: torch.Tensor | None = None

    @property
    def is_quantized(self) -> bool:
        return self.k_scale is not None

    @property
    def scales(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(k_scale, v_scale) of an fp8 pool, for the native attention kernels (their kv_scales); else None."""
        return (self.k_scale, self.v_scale) if self.is_quantized else None

    def write(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        if not self.is_quantized:
            self.k.index_copy_(0, slots, k)  # the pool has the model dtype
            self.v.index_copy_(0, slots, v)
            return
        for cache, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            fp8_max = torch.finfo(cache.dtype).max
            scale = (x.abs().amax(dim=-1, keepdim=True).float() / fp8_max).clamp(min=1e-12)
            # CPU kernels lack fp8 index ops: move the bytes as uint8.
            cache.view(torch.uint8).index_copy_(0, slots, (x.float() / scale).to(cache.dtype).view(torch.uint8))
            scales.index_copy_(0, slots, scale.to(scales.dtype))

    def gather(self, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at `slots` (any index shape) in `dtype`: [*slots.shape, num_kv_heads, head_dim]."""
        if not self.is_quantized:
            return self.k[slots], self.v[slots]  # already in the model dtype
        k = self.k.view(torch.uint8)[slots].view(self.k.dtype)
        v = self.v.view(torch.uint8)[slots].view(self.v.dtype)
        return k.to(dtype) * self.k_scale[slots].to(dtype), v.to(dtype) * self.v_scale[slots].to(dtype)


# Where torch's SDPA runs prefill chunks faster than the native kernel (probe.sdpa_prefill), it does so from this many
# query x key pairs of a chunk on: on the AMX Xeon a 256-token prompt (65536 pairs) prefilled 1.04x faster there, 32
# prompts of 128 tokens 0.985x and 8 of 32 tokens 0.96x (per-call costs over little work).
SDPA_PREFILL_MIN_PAIRS = 256 * 256


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerKVCache,
                    meta: AttentionMetadata, scale: float, kernels: CpuKernels | None = None,
                    kv_written: bool = False, window: int | None = None,
                    softcap: float | None = None, sdpa_prefill: bool = False) -> torch.Tensor:
    """q: [T, Hq, D], k/v: [T, Hkv, D] for this step's tokens -> [T, Hq, D]. With `kernels`, decode
    tokens read their context straight from the pool (no gathered copy of it). `kv_written`: the caller
    has already stored k/v at meta.slot_mapping. `window`: each token attends only to the last `window`
    positions, itself included (sliding-window attention: keys j > i - window, as transformers' mask);
    `softcap`: scores pass through softcap * tanh(score / softcap) before the softmax (Gemma 2; its prefill chunks
    on torch ops, whose row blocks follow the chunking, except in batch-invariant mode: the native prefill kernel
    ran them at 0.4-1.0x of torch's matmuls on the AMX Xeon, head_dim 256);
    `sdpa_prefill`: prefill chunks of SDPA_PREFILL_MIN_PAIRS query x key pairs and more on torch's SDPA though
    `kernels` are given (probe.sdpa_prefill)."""
    if not kv_written:
        cache.write(k, v, meta.slot_mapping)
    native = kernels is not None
    native_prefill = native and not capped_prefill_on_torch(softcap is not None, kernels.batch_invariant)
    nd = meta.num_decodes
    od = _decode_attention(q[:nd], cache, meta.within(window), scale, kernels if native else None, softcap) \
        if nd else None
    if not meta.prefills:
        return od  # a pure decode step: no output buffer to fill
    out = torch.empty_like(q)
    if nd:
        out[:nd] = od
    for span in meta.prefills:
        num = span.end - span.start
        within = window is None or num + span.context_start <= window
        sdpa = sdpa_prefill and num * (num + span.context_start) >= SDPA_PREFILL_MIN_PAIRS
        if native_prefill and within and not sdpa:
            out[span.start:span.end] = _native_prefill_attention(q, cache, meta, span, scale, kernels, softcap)
        elif native_prefill and not within and kernels.batch_invariant:
            out[span.start:span.end] = _native_windowed_prefill(q, cache, meta, span, scale, window, kernels,
                                                                softcap)
        else:
            out[span.start:span.end] = _prefill_attention(q, k, v, cache, meta, span, scale, window, softcap)
    return out


def _decode_attention(q: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata, scale: float,
                      kernels: CpuKernels | None, softcap: float | None) -> torch.Tensor:
    """q: [Bd, Hq, D] one token per decode -> [Bd, Hq, D]."""
    if kernels is not None:
        return kernels.decode_attention(q, cache.k, cache.v, meta.decode_kv_slots, meta.decode_context_lens, scale,
                                        softcap, cache.scales)
    out = torch.empty_like(q)
    for group in meta.decode_groups():
        rows = slice(group.first, group.last)
        kd, vd = cache.gather(meta.decode_kv_slots[rows, :group.width], q.dtype)  # [b, width, Hkv, D]
        mask = None
        if group.is_padded:
            mask = torch.arange(group.width, device=q.device) < meta.decode_context_lens[rows, None]
            mask = mask[:, None, None, :]  # [b, 1, 1, width]
        od = attend(q[rows].unsqueeze(2), kd.transpose(1, 2), vd.transpose(1, 2), mask, scale, softcap)
        out[rows] = od.squeeze(2)
    return out


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
           softcap: float | None = None, is_causal: bool = False) -> torch.Tensor:
    """Attention of q [B, Hq, Tq, D] over k/v [B, Hkv, Tk, D] (grouped heads), `mask` True where a key is seen.
    SDPA, except with a softcap, which SDPA has no place for: then written out as transformers' eager attention
    computes it (scores in the model dtype, capped, softmax in float32 rounded back)."""
    gqa = q.shape[1] != k.shape[1]
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=gqa)
    if gqa:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if is_causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril_(k.shape[-2] - q.shape[-2])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def _native_prefill_attention(q: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata, span: PrefillSpan,
                              scale: float, kernels: CpuKernels, softcap: float | None = None) -> torch.Tensor:
    """One prefill chunk on the native kernel: its rows read their context from the pool in place, as decode rows
    do (the chunk's K/V are written first), in the scratch the torch path's gathered K/V and scores are planned
    for (memory/plan.py)."""
    num = span.end - span.start
    context_len = span.context_start + num
    slots = span.kv_slots if span.kv_slots is not None else meta.slot_mapping[span.start:span.end]
    scratch = prefill_scratch_bytes(num, context_len, cache.k.shape[1], cache.k.shape[2], q.element_size())
    return kernels.prefill_attention(q[span.start:span.end], cache.k, cache.v, slots, span.context_start, scale,
                                     scratch, softcap, cache.scales)


def _native_windowed_prefill(q: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata, span: PrefillSpan,
                             scale: float, window: int, kernels: CpuKernels, softcap: float | None = None
                             ) -> torch.Tensor:
    """A prefill chunk whose context outruns its layer's window, on the native decode kernel: each row a decode row
    over the last `window` positions up to its own ([rows, window] slots: what a decode step of that row reads, so its
    result does not depend on how the prompt was chunked). For batch-invariant mode only: the torch path's row blocks
    and key ranges follow the chunking, but it ran Gemma 3 270M's 2048-token prefill 1.96x as fast on the AMX Xeon
    (head_dim 256: on AMX tiles there, against the native kernel's vector FMAs; the head-size-256 register paths of
    2026-12-05 made the native kernel ~1.9x faster, still ~8x behind)."""
    num = span.end - span.start
    slots = span.kv_slots if span.kv_slots is not None else meta.slot_mapping[span.start:span.end]
    positions = torch.arange(span.context_start, span.context_start + num, device=slots.device)
    first = (positions - window + 1).clamp_(min=0)
    columns = (first[:, None] + torch.arange(window, device=slots.device)).clamp_(max=slots.shape[0] - 1)
    return kernels.decode_attention(q[span.start:span.end], cache.k, cache.v, slots[columns],
                                    (positions + 1).clamp_(max=window), scale, softcap, cache.scales)


def _prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerKVCache,
                       meta: AttentionMetadata, span: PrefillSpan, scale: float, window: int | None = None,
                       softcap: float | None = None) -> torch.Tensor:
    """One prefill chunk attending causally (within `window` positions where given) over its sequence's
    context -> [chunk, Hq, D]."""
    if span.kv_slots is None and not cache.is_quantized:
        kp, vp = k[span.start:span.end], v[span.start:span.end]
    else:
        # A quantized cache is read back even for a fresh chunk, so that prefill sees exactly the
        # K/V that later decode steps will see.
        slots = span.kv_slots if span.kv_slots is not None else meta.slot_mapping[span.start:span.end]
        kp, vp = cache.gather(slots, q.dtype)  # [context_len, Hkv, D]: this sequence's context only
    kp = kp.transpose(0, 1).unsqueeze(0)  # [1, Hkv, context_len, D]
    vp = vp.transpose(0, 1).unsqueeze(0)
    qp = q[span.start:span.end].transpose(0, 1).unsqueeze(0)  # [1, Hq, chunk, D]
    num, context_len = qp.shape[2], kp.shape[2]
    if span.context_start == 0 and num * num <= ATTENTION_CHUNK_PAIRS and (window is None or num <= window):
        return attend(qp, kp, vp, None, scale, softcap, is_causal=True).squeeze(0).transpose(0, 1)
    out = torch.empty_like(q[span.start:span.end])
    rows = max(1, ATTENTION_CHUNK_PAIRS // context_len)
    if window is not None:  # or as many as the window allows: r rows see at most r - 1 + window keys
        rows = max(rows, (math.isqrt(window * window + 4 * ATTENTION_CHUNK_PAIRS) - window) // 2)
    for first in range(0, num, rows):
        last = min(num, first + rows)
        seen = span.context_start + last  # keys the chunk's queries may see: positions 0 .. seen - 1
        low = 0 if window is None else max(0, span.context_start + first - window + 1)  # the first row's window
        positions = torch.arange(span.context_start + first, seen, device=q.device)[:, None]
        keys = torch.arange(low, seen, device=q.device)
        mask = keys <= positions if window is None else (keys <= positions) & (keys > positions - window)
        op = attend(qp[:, :, first:last], kp[:, :, low:seen], vp[:, :, low:seen], mask, scale, softcap)
        out[first:last] = op.squeeze(0).transpose(0, 1)
    return out
