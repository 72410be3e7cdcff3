"""Fast paths against plain reference implementations."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from pagedserve.layers import attention
from pagedserve.layers.attention import AttentionMetadata, LayerKVCache, PrefillSpan, paged_attention
from pagedserve.layers.linear import (
    Int8Linear,
    PackedLinear,
    PlainLinear,
    QuantizedWeight,
    fuse_rows,
    packing_supported,
    quantize_int8_per_channel,
)
from pagedserve.layers.norm import RMSNorm
from tests.models.kernel_reference import reference_rms_norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_bit_exact_with_transformers_formula(dtype):
    torch.manual_seed(0)
    norm = RMSNorm(96, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(96) + 0.5)
    norm = norm.to(dtype)
    x = (torch.randn(17, 96) * 3).to(dtype)
    assert torch.equal(norm(x), reference_rms_norm(x, norm.weight, 1e-6))


def test_int8_weights_dequantize_with_their_own_scales():
    """One dequantizer, two roundings: a loaded QuantizedWeight (float32 scales) is scaled in float32 and rounded
    once to the model dtype (fuse_rows of q/k/v where only some are int8); an Int8Linear uses the model-dtype
    scales its kernels use."""
    torch.manual_seed(0)
    qweight, scales = quantize_int8_per_channel(torch.randn(48, 64))
    linears = [torch.nn.Linear(64, 16, bias=False).to(torch.bfloat16) for _ in range(2)]
    linears[1].quantized_weight = QuantizedWeight(qweight[:16], scales[:16], torch.bfloat16)
    fused, bias = fuse_rows(*linears)
    assert bias is None and torch.equal(fused[:16], linears[0].weight)
    assert torch.equal(fused[16:], (qweight[:16].float() * scales[:16, None]).bfloat16())
    layer = Int8Linear(QuantizedWeight(qweight, scales, torch.bfloat16), None)  # torch's int8 kernel here
    expected = qweight.bfloat16() * scales.bfloat16()[:, None]
    assert torch.equal(layer.dequantized(), expected)
    assert not torch.equal(expected, (qweight.float() * scales[:, None]).bfloat16())  # the two do differ


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_matches_plain(dtype):
    if not packing_supported("cpu", dtype):
        pytest.skip("oneDNN packing is not available on this CPU/torch build")
    torch.manual_seed(0)
    weight, bias = torch.randn(80, 48).to(dtype), torch.randn(80).to(dtype)
    for rows in (1, 3, 64):
        x = torch.randn(rows, 48).to(dtype)
        plain = PlainLinear(weight, bias)(x).float()
        packed = PackedLinear(weight, bias)(x).float()
        # bf16: same oneDNN kernel family, identical; fp32: accumulation order may differ slightly.
        assert torch.allclose(packed, plain, rtol=1e-5, atol=1e-4 if dtype == torch.float32 else 0)


def reference_attention(q, k_ctx, v_ctx, num_past: int, scale: float) -> torch.Tensor:
    """Naive causal attention of q [Lq, Hq, D] over the whole context [Lk, Hkv, D] (GQA by repetition)."""
    groups = q.shape[1] // k_ctx.shape[1]
    k = k_ctx.repeat_interleave(groups, dim=1)
    v = v_ctx.repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    lq, lk = q.shape[0], k.shape[0]
    allowed = torch.arange(lk)[None, :] <= (num_past + torch.arange(lq))[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.float())


def test_paged_attention_mixed_batch_matches_reference(monkeypatch):
    """Two decodes (different lengths) and two prefill chunks (fresh and with prior context) in one step."""
    torch.manual_seed(0)
    hq, hkv, d, bs = 4, 2, 16, 4
    num_blocks = 32
    k_cache = torch.randn(num_blocks * bs, hkv, d)
    v_cache = torch.randn(num_blocks * bs, hkv, d)
    k_cache[:bs] = 0
    v_cache[:bs] = 0
    # Each sequence: blocks (non-contiguous), tokens already cached, tokens computed this step.
    seqs = [dict(blocks=[5, 9, 2], past=9, new=1), dict(blocks=[7], past=2, new=1),
            dict(blocks=[11, 12], past=0, new=6), dict(blocks=[20, 3, 30], past=5, new=4)]
    slots_of = lambda s, n: torch.tensor([s["blocks"][p // bs] * bs + p % bs for p in range(n)])
    total = sum(s["new"] for s in seqs)
    q = torch.randn(total, hq, d)
    k = torch.randn(total, hkv, d)
    v = torch.randn(total, hkv, d)
    slot_mapping = torch.cat([slots_of(s, s["past"] + s["new"])[s["past"]:] for s in seqs])
    lens = torch.tensor([s["past"] + 1 for s in seqs[:2]])
    lmax = int(lens.max())
    decode_slots = torch.stack([F.pad(slots_of(s, s["past"] + 1), (0, lmax - s["past"] - 1)) for s in seqs[:2]])
    ctx = seqs[3]["past"] + seqs[3]["new"]

    def run(**bounds) -> torch.Tensor:
        meta = AttentionMetadata(slot_mapping=slot_mapping, num_decodes=2, decode_kv_slots=decode_slots,
                                 decode_context_lens=lens, **bounds)
        meta.prefills.append(PrefillSpan(2, 8))
        meta.prefills.append(PrefillSpan(8, 12, context_start=5, kv_slots=slots_of(seqs[3], ctx)))
        return paged_attention(q, k, v, LayerKVCache(k_cache, v_cache), meta, 1 / math.sqrt(d))

    expected_cache_k = k_cache.clone()
    expected_cache_k[slot_mapping] = k
    out = run()
    assert torch.equal(k_cache, expected_cache_k)
    row = 0
    for s in seqs:
        n = s["past"] + s["new"]
        ctx_slots = slots_of(s, n)
        ref = reference_attention(q[row:row + s["new"]], k_cache[ctx_slots], v_cache[ctx_slots], s["past"],
                                  1 / math.sqrt(d))
        assert torch.allclose(out[row:row + s["new"]], ref, atol=1e-5), s
        row += s["new"]
    # Decodes gathered one row at a time, prefill queries a few at a time: the same attention.
    monkeypatch.setattr(attention, "ATTENTION_CHUNK_PAIRS", 10)
    assert torch.allclose(run(gather_tokens=1), out, atol=1e-6)


def test_decode_groups_hold_at_most_the_gather_budget():
    # rows x longest context per group <= budget; a row longer than the budget is a group of its own.
    groups = attention.group_rows([3, 3, 3, 3, 9, 1, 2], budget=9)
    assert [(g.first, g.last, g.width, g.is_padded) for g in groups] == [
        (0, 3, 3, False), (3, 4, 3, False), (4, 5, 9, False), (5, 7, 2, True)]
    assert attention.group_rows([20, 1], budget=9)[0].width == 20 and attention.group_rows([], 9) == []
