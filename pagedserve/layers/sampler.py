"""Sampler: logits processing (bias, penalties, min_tokens) and greedy / random sampling per row.

Random sampling uses the exponential-race trick (argmax of p / q with q ~ Exp(1)), which needs no
host sync; a seeded row draws its q from its own generator, so its tokens do not depend on the rest
of the batch. Logprobs are taken from the raw model logits (as vLLM does by default).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from pagedserve.structured.matcher import apply_bitmask, fill_bitmask, is_allowed

if TYPE_CHECKING:
    from pagedserve.kernels import CpuKernels


@dataclass
class Penalties:
    rows: torch.Tensor  # [P] rows of the batch with penalties
    output_counts: torch.Tensor  # [P, V] float32 occurrences of each token in the output so far
    prompt_mask: torch.Tensor  # [P, V] bool: token appears in the prompt
    presence: torch.Tensor  # [P, 1]
    frequency: torch.Tensor  # [P, 1]
    repetition: torch.Tensor  # [P, 1]


@dataclass
class SamplingBatch:
    """Per-row sampling settings for the rows of one step's logits."""

    temperature: torch.Tensor  # [B] float32; 0 = greedy
    top_k: torch.Tensor | None = None  # [B] int64, 0 = off; None when no row uses it
    top_p: torch.Tensor | None = None  # [B] float32; None when no row uses it
    min_p: torch.Tensor | None = None  # [B] float32; None when no row uses it
    all_greedy: bool = True
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # row -> seeded generator
    # Rows after whose draw the generator's state is kept (a verification's rows: the runner rewinds the
    # generator to the last emitted row, so a seeded request draws as it would one token per step).
    checkpoint_rows: set[int] = field(default_factory=set)
    logit_bias: list[tuple[int, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    banned: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # min_tokens: ids to mask
    allowed: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # allowed_token_ids: all else masked
    penalties: Penalties | None = None
    max_num_logprobs: int = -1  # -1 = no row wants logprobs
    grammars: list[tuple[int, Any]] = field(default_factory=list)  # row -> structured.matcher.RequestGrammar


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    # Only when some row asked for logprobs:
    top_ids: torch.Tensor | None = None  # [B, K]
    top_logprobs: torch.Tensor | None = None  # [B, K]
    token_logprobs: torch.Tensor | None = None  # [B]
    token_ranks: torch.Tensor | None = None  # [B]
    generator_states: dict[int, torch.Tensor] = field(default_factory=dict)  # row -> state after its draw


def argmax_rows(x: torch.Tensor, native: CpuKernels | None = None) -> torch.Tensor:
    """The index of each row's maximum (the first one on ties; NaN counts as the maximum), as `argmax(dim=-1)`.
    With the native kernels (the model's KernelBackend.native) float32 rows on the CPU take theirs, the same
    indices at memory speed: torch.max reads a row at ~1.8 GB/s (1 x 152k logits 79 us, 5 x 49k 114 us on 2
    threads of a Zen 5), ~1-2 % of a decode or verification step. Else `torch.max`, on CPU 2.7x faster than
    `argmax` for a step's logits (32 x 152k float32 on 2 threads: 1.2 vs 3.2 ms, torch 2.13)."""
    if native is not None and x.dtype == torch.float32 and native.supports(x) and x.dim() == 2 and x.shape[1]:
        return native.argmax_rows(x.contiguous())
    return torch.max(x, dim=-1).indices


class Sampler:
    def __init__(self, generator: torch.Generator | None = None, native: CpuKernels | None = None) -> None:
        self.generator = generator  # for unseeded random rows
        self.native = native  # the model's native kernels (KernelBackend.native): its argmax

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        # logits: [B, V] float32
        generator_states: dict[int, torch.Tensor] = {}
        raw_logprobs = torch.log_softmax(logits, dim=-1) if batch.max_num_logprobs >= 0 else None
        logits = self._process(logits, batch)
        lazy, bitmask = self._mask_grammars(logits, batch)
        if batch.all_greedy:
            token_ids = argmax_rows(logits, self.native)
        else:
            token_ids = self._sample(logits, batch, generator_states)
        out = SamplerOutput(token_ids, generator_states=generator_states)
        if lazy:
            out.token_ids = _enforce_lazy_grammars(logits, out.token_ids, bitmask, lazy)
        if raw_logprobs is not None:
            _add_logprobs(out, raw_logprobs, batch.max_num_logprobs)
        return out

    def _process(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        if batch.logit_bias or batch.banned or batch.allowed or batch.penalties is not None or batch.grammars:
            logits = logits.clone()
        for row, ids in batch.allowed:
            kept = logits[row, ids]
            logits[row] = float("-inf")
            logits[row, ids] = kept
        for row, ids, values in batch.logit_bias:
            logits[row, ids] += values
        if batch.penalties is not None:
            _apply_penalties(logits, batch.penalties)
        constrained = {row for row, _ in batch.grammars}
        for row, ids in batch.banned:
            if row not in constrained:  # constrained rows: after their grammar mask (_mask_grammars)
                logits[row, ids] = float("-inf")
        return logits

    def _mask_grammars(self, logits: torch.Tensor, batch: SamplingBatch) -> tuple[list, torch.Tensor | None]:
        """Mask the constrained rows whose sample depends on the whole distribution; return the greedy ones
        (their argmax is checked against the grammar after sampling, structured/matcher.py) and the bitmask."""
        if not batch.grammars:
            return [], None
        bitmask = fill_bitmask(batch.grammars, logits.shape[0], logits.shape[1])
        greedy = (batch.temperature < 1e-5).tolist()
        banned = dict(batch.banned)
        lazy = [(row, g) for row, g in batch.grammars if greedy[row] and row not in banned]
        eager = [(row, g) for row, g in batch.grammars if not greedy[row] or row in banned]
        apply_bitmask(logits, bitmask, eager)
        for row, _ in eager:
            if row in banned:  # min_tokens must not ban the only tokens the grammar allows (its end)
                kept = logits[row].clone()
                logits[row, banned[row]] = float("-inf")
                if bool((logits[row] == float("-inf")).all()):
                    logits[row] = kept
        return lazy, bitmask

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch, generator_states: dict[int, torch.Tensor]
                ) -> torch.Tensor:
        greedy_ids = argmax_rows(logits, self.native)
        is_greedy = batch.temperature < 1e-5
        # A temperature past float32's range (1e39) would be inf, and -inf / inf a NaN that samples token 0.
        temperature = torch.where(is_greedy, torch.ones_like(batch.temperature), batch.temperature).clamp(max=1e30)
        logits = logits / temperature.unsqueeze(1)
        if batch.min_p is not None:  # vLLM's order: temperature, min_p, then top_k and top_p
            probs = torch.softmax(logits, dim=-1)
            threshold = batch.min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
            logits = logits.masked_fill(probs < threshold, float("-inf"))
        if batch.top_k is not None or batch.top_p is not None:
            logits = _apply_top_k_top_p(logits, batch.top_k, batch.top_p)
        probs = torch.softmax(logits, dim=-1)
        q = torch.empty_like(probs)
        q.exponential_(generator=self.generator)
        for row, generator in batch.generators.items():  # in row order: a request's rows draw one after another
            q[row].exponential_(generator=generator)
            if row in batch.checkpoint_rows:
                generator_states[row] = generator.get_state()
        sampled = argmax_rows(probs / q, self.native)
        return torch.where(is_greedy, greedy_ids, sampled)


def _enforce_lazy_grammars(logits: torch.Tensor, token_ids: torch.Tensor, bitmask: torch.Tensor,
                           lazy: list) -> torch.Tensor:
    """Greedy constrained rows whose argmax the grammar forbids: mask them and take the masked argmax."""
    ids = token_ids.tolist()
    bad = [(row, grammar) for row, grammar in lazy if not is_allowed(bitmask, row, grammar, ids[row])]
    if not bad:
        return token_ids
    apply_bitmask(logits, bitmask, bad)
    rows = torch.tensor([row for row, _ in bad], device=logits.device)
    token_ids = token_ids.clone()
    token_ids[rows] = argmax_rows(logits[rows])  # rare: torch's
    return token_ids


def _apply_penalties(logits: torch.Tensor, p: Penalties) -> None:
    rows = logits[p.rows]  # [P, V]
    seen = p.prompt_mask | (p.output_counts > 0)
    # Repetition penalty (CTRL paper, as transformers/vLLM): divide positive logits, multiply negative. Held where
    # float32 stays finite (1e-39 made logits inf, and 0 x inf a NaN that samples token 0).
    repetition = p.repetition.clamp(min=1e-20, max=1e20)
    penalised = torch.where(rows > 0, rows / repetition, rows * repetition)
    rows = torch.where(seen, penalised, rows)
    rows = rows - p.frequency * p.output_counts - p.presence * (p.output_counts > 0).float()
    logits[p.rows] = rows


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                       top_p: torch.Tensor | None) -> torch.Tensor:
    """As vLLM's: top_k keeps every token at least as likely as the k-th (ties at the k-th stay); top_p then keeps
    the most likely tokens up to mass p (a row with p = 1 keeps all: float32 sums may pass 1 in the tail)."""
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    mask = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).clamp(max=vocab)
        mask |= sorted_logits < sorted_logits.gather(1, (k - 1).unsqueeze(1))
    if top_p is not None:
        probs = torch.softmax(sorted_logits.masked_fill(mask, float("-inf")), dim=-1)
        cum_before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
        mask |= (cum_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    mask[:, 0] = False  # always keep the most likely token
    sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_ids, sorted_logits)


def top_logprobs(logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest logprobs of each row [rows, V] and their token ids, largest first; equal logprobs (common with
    bf16 logits) in token-id order, the lower ids taken where a tie straddles the k-th place. torch.topk's order
    among equal values is its own, and a batch-invariant server sent the same chat request alone and among 16 with
    two top_logprobs entries swapped. torch.topk of k + 1 first: where its last value is below the k-th, no value
    left out ties with the k-th; the other rows are completed from a scan of the row."""
    if k == 0:
        return logprobs.topk(0, dim=-1)
    values, ids = logprobs.topk(min(k + 1, logprobs.shape[-1]), dim=-1)
    straddles = [] if values.shape[-1] == k else (values[:, k] == values[:, k - 1]).nonzero().flatten().tolist()
    values, ids = values[:, :k].contiguous(), ids[:, :k].contiguous()
    kth = values[:, -1:]
    for row in straddles:  # the ids above the k-th value, then the lowest ids equal to it
        above = ids[row][values[row] > kth[row]]
        tied = (logprobs[row] == kth[row]).nonzero().flatten()[:k - above.numel()]
        ids[row] = torch.cat([above, tied])
        values[row] = logprobs[row, ids[row]]
    by_id = ids.argsort(dim=-1)
    values, ids = values.gather(1, by_id), ids.gather(1, by_id)
    order = values.argsort(dim=-1, descending=True, stable=True)  # equal values keep the ascending ids
    return values.gather(1, order), ids.gather(1, order)


def _add_logprobs(out: SamplerOutput, raw_logprobs: torch.Tensor, k: int) -> None:
    token_lp = raw_logprobs.gather(1, out.token_ids.unsqueeze(1)).squeeze(1)
    out.token_logprobs = token_lp
    out.token_ranks = (raw_logprobs > token_lp.unsqueeze(1)).sum(dim=-1) + 1
    out.top_logprobs, out.top_ids = top_logprobs(raw_logprobs, k)
