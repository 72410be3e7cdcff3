"""Paged attention over a KV pool of fixed-size blocks.

The KV pool of one layer is a pair of tensors [num_slots, num_kv_heads, head_dim] where
slot = block_id * block_size + offset. Each step first writes the new tokens' K/V into their slots
(for the whole batch), then attends. The batch puts decode tokens (one per request) first, so they
are attended together; prefill chunks follow, one SDPA call each.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pagedserve.kernels import CpuKernels


@dataclass
class PrefillSpan:
    start: int  # first row of the chunk in the flattened batch
    end: int
    # Slots of every context position (prior context + this chunk); None when the chunk is the whole
    # sequence so far, so the fresh K/V can be used directly with a plain causal mask.
    kv_slots: torch.Tensor | None = None
    mask: torch.Tensor | None = None  # [q_len, context_len] bool, True = may attend


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: where each new token's K/V goes
    num_decodes: int = 0  # rows 0..num_decodes-1 are single-token decodes
    decode_kv_slots: torch.Tensor | None = None  # [Bd, Lmax] int64, padded with slot 0
    decode_mask: torch.Tensor | None = None  # [Bd, 1, 1, Lmax] bool; None when no padding
    decode_context_lens: torch.Tensor | None = None  # [Bd] int64: valid entries of each decode_kv_slots row
    prefills: list[PrefillSpan] = field(default_factory=list)


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


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerKVCache,
                    meta: AttentionMetadata, scale: float, kernels: CpuKernels | None = None,
                    kv_written: bool = False) -> torch.Tensor:
    """q: [T, Hq, D], k/v: [T, Hkv, D] for this step's tokens -> [T, Hq, D]. With `kernels`, decode
    tokens read their context straight from the pool (no gathered copy of it). `kv_written`: the caller
    has already stored k/v at meta.slot_mapping."""
    if not kv_written:
        cache.write(k, v, meta.slot_mapping)
    gqa = q.shape[1] != k.shape[1]
    nd = meta.num_decodes
    if nd:
        if kernels is not None and not cache.is_quantized and meta.decode_context_lens is not None:
            od = kernels.decode_attention(q[:nd], cache.k, cache.v, meta.decode_kv_slots,
                                          meta.decode_context_lens, scale)  # [Bd, Hq, D]
        else:
            qd = q[:nd].unsqueeze(2)  # [Bd, Hq, 1, D]
            kd, vd = cache.gather(meta.decode_kv_slots, q.dtype)  # [Bd, L, Hkv, D]
            od = F.scaled_dot_product_attention(qd, kd.transpose(1, 2), vd.transpose(1, 2),
                                                attn_mask=meta.decode_mask, scale=scale, enable_gqa=gqa).squeeze(2)
        if not meta.prefills:
            return od  # a pure decode step: no output buffer to fill
    out = torch.empty_like(q)
    if nd:
        out[:nd] = od
    for span in meta.prefills:
        qp = q[span.start:span.end].transpose(0, 1).unsqueeze(0)  # [1, Hq, Lq, D]
        if span.kv_slots is None and not cache.is_quantized:
            kp, vp = k[span.start:span.end], v[span.start:span.end]
        else:
            # A quantized cache is read back even for a fresh chunk, so that prefill sees exactly the
            # K/V that later decode steps will see.
            slots = span.kv_slots if span.kv_slots is not None else meta.slot_mapping[span.start:span.end]
            kp, vp = cache.gather(slots, q.dtype)
        kp = kp.transpose(0, 1).unsqueeze(0)  # [1, Hkv, Lk, D]
        vp = vp.transpose(0, 1).unsqueeze(0)
        op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=span.mask,
                                            is_causal=span.mask is None, scale=scale, enable_gqa=gqa)
        out[span.start:span.end] = op.squeeze(0).transpose(0, 1)
    return out
