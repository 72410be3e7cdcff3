"""What every proposer shares: its settings, the scheduler-facing calls and the verification counters.

The scheduler asks `propose` for a decoding request's drafts while it schedules, reports each verification to
`record`, hands over what the runner proposed (`offer`, a draft model's drafts) and the requests that left
(`drop`). `lookahead` is how many slots past this step's tokens a sampled request should hold, for a proposer
that writes K/V ahead of the target (a draft model writes its own proposals' K/V in the same blocks).

Every proposer also decides when a request should not speculate (speculation must never make a request slower):
after a verification that accepted nothing the request sits out (`waits`) 1 step, then 2, 4 ... MAX_BACKOFF_STEPS
after each further miss; one accepted draft resets that. An n-gram proposer then proposes nothing; a draft model
is given no lookahead, so it does not run for that request (and catches up when the request speculates again).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.spec_decode.config import SpeculativeConfig

MAX_BACKOFF_STEPS = 64


@dataclass
class SpecDecodeStats:
    """Verification results since the last take(), for /metrics (vLLM's spec_decode counters)."""

    num_drafts: int = 0  # verifications (requests that carried drafts in a step)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [k] accepted drafts at each draft position

    def add(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


@dataclass
class _Backoff:
    misses: int = 0  # consecutive verifications that accepted nothing
    wait: int = 0  # steps left before the request speculates again


class Proposer:
    lookahead = 0

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * self.k)  # since the last take_stats()
        self.totals = SpecDecodeStats(accepted_per_pos=[0] * self.k)  # since start
        self._backoff: dict[str, _Backoff] = {}

    def waits(self, request_id: str) -> bool:
        """Whether the request sits this step out (asked once per step it decodes in; see the module docstring)."""
        backoff = self._backoff.get(request_id)
        if backoff is None or backoff.wait <= 0:
            return False
        backoff.wait -= 1
        return True

    def propose(self, request_id: str, tokens: list[int], max_tokens: int) -> list[int]:
        """Up to min(k, max_tokens) draft tokens to follow `tokens` (all of the request's tokens so far)."""
        raise NotImplementedError

    def offer(self, request_id: str, num_tokens: int, drafts: list[int]) -> None:
        """Drafts the runner proposed to follow the request's first `num_tokens` tokens."""

    def drop(self, request_id: str, tokens: list[int] | None = None) -> None:
        """Forget a request that left (`tokens`: all of it, when it finished)."""
        self._backoff.pop(request_id, None)

    def record(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """The result of verifying one request's drafts."""
        for stats in (self.stats, self.totals):
            stats.add(num_drafts, num_accepted)
        backoff = self._backoff.setdefault(request_id, _Backoff())
        if num_accepted:
            backoff.misses = 0
        else:
            backoff.wait = min(MAX_BACKOFF_STEPS, 1 << backoff.misses)
            backoff.misses += 1

    def reset(self) -> None:
        """Forget warm-up's counts."""
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * self.k)
        self.totals = SpecDecodeStats(accepted_per_pos=[0] * self.k)
        self._backoff.clear()

    def take_stats(self) -> SpecDecodeStats:
        stats, self.stats = self.stats, SpecDecodeStats(accepted_per_pos=[0] * self.k)
        return stats
