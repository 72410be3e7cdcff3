"""The sampler's filters on hand-made logits, as vLLM's sampler applies them: temperature, then min_p, then top_k
and top_p; top_k keeps ties at the k-th value; a row without top_p keeps every token whatever its batch; values at
the edge of float32 (temperature 1e39, repetition_penalty 1e-39) never sample a masked token."""

from __future__ import annotations

import math

import torch

from pagedserve.layers.sampler import Penalties, Sampler, SamplingBatch


def _support(logits: list[float], draws: int = 600, **settings) -> set[int]:
    """The tokens a row with these settings samples (its support, from many seeded draws of the whole batch)."""
    rows = torch.tensor([logits] * draws, dtype=torch.float32)
    batch = SamplingBatch(temperature=torch.full((draws,), settings.get("temperature", 1.0)), all_greedy=False)
    for name, dtype in (("top_k", torch.int64), ("top_p", torch.float32), ("min_p", torch.float32)):
        if name in settings:
            setattr(batch, name, torch.full((draws,), settings[name], dtype=dtype))
    return set(Sampler(torch.Generator().manual_seed(0))(rows, batch).token_ids.tolist())


def _logits_of(probs: list[float]) -> list[float]:
    return [math.log(p) for p in probs]


def test_min_p_applies_before_top_p():
    """probs 0.4 0.3 0.2 0.1: min_p 0.6 keeps {0, 1} (p >= 0.24); top_p 0.5 of that renormalised mass (0.57 + 0.43)
    keeps {0, 1} too. In the other order top_p 0.5 keeps {0, 1} of the whole and min_p then keeps {0, 1}: so take a
    case that tells them apart: min_p 0.3 keeps {0, 1, 2}; top_p 0.5 of those (0.44, 0.33, 0.22) keeps {0, 1}."""
    logits = _logits_of([0.4, 0.3, 0.2, 0.1])
    assert _support(logits, min_p=0.3) == {0, 1, 2}
    assert _support(logits, min_p=0.3, top_p=0.5) == {0, 1}
    # top_p 0.75 after min_p: 0.44 + 0.33 = 0.78 >= 0.75 -> {0, 1}; top_p first (0.4 + 0.3 = 0.7 < 0.75) -> {0, 1, 2}
    assert _support(logits, min_p=0.3, top_p=0.75) == {0, 1}


def test_top_k_keeps_ties_at_the_kth_value():
    logits = [3.0, 2.0, 2.0, 2.0, 1.0]
    assert _support(logits, top_k=2) == {0, 1, 2, 3}
    assert _support(logits, top_k=1) == {0}
    assert _support(logits, top_k=5) == {0, 1, 2, 3, 4}


def test_a_row_without_top_p_keeps_its_tail_beside_one_with_it():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 151936, generator=generator) * 3
    batch = SamplingBatch(temperature=torch.ones(2), all_greedy=False, top_p=torch.tensor([1.0, 0.5]))
    from pagedserve.layers.sampler import _apply_top_k_top_p

    filtered = _apply_top_k_top_p(logits, None, batch.top_p)
    assert torch.equal(filtered[0], logits[0])  # every token kept (float32 sums pass 1.0 in the tail)
    assert bool(torch.isinf(filtered[1]).any())


def test_float32_edge_values_never_sample_a_masked_token():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(1))
    allowed = [(0, torch.tensor([10, 11]))]
    hot = SamplingBatch(temperature=torch.tensor([1e39]), all_greedy=False, allowed=allowed)
    tokens = {Sampler(torch.Generator().manual_seed(s))(logits, hot).token_ids.item() for s in range(40)}
    assert tokens == {10, 11}  # uniform over the allowed tokens
    penalised = SamplingBatch(temperature=torch.tensor([1.0]), all_greedy=False, penalties=Penalties(
        rows=torch.tensor([0]), output_counts=torch.zeros(1, 50), prompt_mask=torch.ones(1, 50, dtype=torch.bool),
        presence=torch.zeros(1, 1), frequency=torch.zeros(1, 1), repetition=torch.tensor([[1e-39]])))
    out = Sampler(torch.Generator().manual_seed(0))(logits, penalised).token_ids.item()
    assert out == int(logits[0].argmax())  # the largest positive logit, divided by ~0, wins; no NaN
