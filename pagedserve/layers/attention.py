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
    prefills: list[PrefillSpan] = field(default_factory=list)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    k_cache.index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, Hq, D], k/v: [T, Hkv, D] for this step's tokens -> [T, Hq, D]."""
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    out = torch.empty_like(q)
    gqa = q.shape[1] != k.shape[1]
    nd = meta.num_decodes
    if nd:
        qd = q[:nd].unsqueeze(2)  # [Bd, Hq, 1, D]
        kd = k_cache[meta.decode_kv_slots].to(q.dtype).transpose(1, 2)  # [Bd, Hkv, L, D]
        vd = v_cache[meta.decode_kv_slots].to(q.dtype).transpose(1, 2)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale,
                                            enable_gqa=gqa)
        out[:nd] = od.squeeze(2)
    for span in meta.prefills:
        qp = q[span.start:span.end].transpose(0, 1).unsqueeze(0)  # [1, Hq, Lq, D]
        if span.kv_slots is None:
            kp = k[span.start:span.end]
            vp = v[span.start:span.end]
        else:
            kp = k_cache[span.kv_slots].to(q.dtype)
            vp = v_cache[span.kv_slots].to(q.dtype)
        kp = kp.transpose(0, 1).unsqueeze(0)  # [1, Hkv, Lk, D]
        vp = vp.transpose(0, 1).unsqueeze(0)
        op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=span.mask,
                                            is_causal=span.kv_slots is None, scale=scale, enable_gqa=gqa)
        out[span.start:span.end] = op.squeeze(0).transpose(0, 1)
    return out
