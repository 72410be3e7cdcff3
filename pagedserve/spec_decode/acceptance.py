"""The acceptance rule of a verification (pure Python; worker/model_runner.py applies it).

The target model has sampled one token per verification row: row 0 after the request's last known token, row i
after its first i drafts, each as it would be sampled one token per step. With one-hot drafts (an n-gram
proposal puts all its probability on one token), keeping draft d_i exactly when it equals the token sampled at
row i-1 is rejection sampling: d_i survives with probability p(d_i), and when it does not, that row's token was
drawn from p conditioned on not being d_i, which is the rejection residual (p - 1[d_i])+ renormalised. So the
emitted tokens are distributed as without speculation, and greedy decoding emits the same tokens.
"""

from __future__ import annotations


def accepted_tokens(sampled: list[int], drafts: list[int]) -> list[int]:
    """The tokens to emit: the drafts up to the first one that differs from the token sampled before it, then the
    token sampled at that row (the correction, or after all drafts the bonus token). len(sampled) ==
    len(drafts) + 1."""
    num = 0
    while num < len(drafts) and sampled[num] == drafts[num]:
        num += 1
    return drafts[:num] + [sampled[num]]
