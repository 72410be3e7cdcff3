"""What every proposer shares: its settings, the scheduler-facing calls and the verification counters.

The scheduler asks `propose` for a decoding request's drafts while it schedules, reports each verification to
`record`, hands over what the runner proposed (`offer`, a draft model's drafts) and the requests that left
(`drop`). `lookahead` is how many slots past this step's tokens a sampled request should hold, for a proposer
that writes K/V ahead of the target (a draft model writes its own proposals' K/V in the same blocks).

Every proposer also decides when a request should not speculate (speculation must never make a request slower):
after a verification that accepted nothing the request sits out (`waits`) 1 step, then 2, 4 ... MAX_BACKOFF_STEPS
after each further miss (a draft model, whose tries cost compute: 1, 4, 16 ...); one accepted draft resets that.
An n-gram proposer then proposes nothing; a draft model is given no lookahead, so it does not run for that
request (and catches up when the request speculates again), and drafts it proposed in the step of the miss are
dropped (`backing_off`).

A draft model also pays one forward pass per draft token, so it proposes as many as the request has lately
accepted (`draft_length`): 1 after a miss, then the accepted count + 1 after a partial run, doubling (up to k)
while every draft is accepted. A model whose drafts keep failing then costs one draft step and a 2-row
verification per try instead of k draft steps and a (1 + k)-row verification. n-gram drafts are free lookups
and keep their length.
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
class _Track:
    """What a request's recent verifications decide about its next drafts."""

    misses: int = 0  # consecutive verifications that accepted nothing
    wait: int = 0  # steps left before the request speculates again
    length: int | None = None  # drafts to propose next (proposers that adapt it); None: k


class Proposer:
    adapts_length = False  # whether draft_length follows acceptance (proposers that pay per draft token)
    backoff_growth = 2  # each further miss multiplies the wait by this much

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * self.k)  # since the last take_stats()
        self.totals = SpecDecodeStats(accepted_per_pos=[0] * self.k)  # since start
        self._tracks: dict[str, _Track] = {}

    def waits(self, request_id: str) -> bool:
        """Whether the request sits this step out (asked once per step it decodes in; see the module docstring)."""
        track = self._tracks.get(request_id)
        if track is None or track.wait <= 0:
            return False
        track.wait -= 1
        return True

    def backing_off(self, request_id: str) -> bool:
        """Whether the request is sitting steps out after a miss (without counting a step, as `waits` does)."""
        track = self._tracks.get(request_id)
        return track is not None and track.wait > 0

    def draft_length(self, request_id: str) -> int:
        """How many drafts the request's next try proposes at most (k, or what acceptance left it)."""
        track = self._tracks.get(request_id)
        return self.k if track is None or track.length is None else track.length

    def lookahead(self, request_id: str) -> int:
        """Slots past a step's tokens that the request's next drafts need for their K/V: a draft model writes
        its proposals' K/V in the request's blocks; 0 for proposers that compute nothing."""
        return 0

    def propose(self, request_id: str, tokens: list[int], max_tokens: int) -> list[int]:
        """Up to min(k, max_tokens) draft tokens to follow `tokens` (all of the request's tokens so far)."""
        raise NotImplementedError

    def offer(self, request_id: str, num_tokens: int, drafts: list[int]) -> None:
        """Drafts the runner proposed to follow the request's first `num_tokens` tokens."""

    def drop(self, request_id: str, tokens: list[int] | None = None) -> None:
        """Forget a request that left (`tokens`: all of it, when it finished)."""
        self._tracks.pop(request_id, None)

    def record(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """The result of verifying one request's drafts."""
        for stats in (self.stats, self.totals):
            stats.add(num_drafts, num_accepted)
        track = self._tracks.setdefault(request_id, _Track())
        if num_accepted:
            track.misses = 0
        else:
            track.wait = min(MAX_BACKOFF_STEPS, self.backoff_growth ** track.misses)
            track.misses += 1
        if self.adapts_length:
            grown = 2 * num_drafts if num_accepted == num_drafts else num_accepted + 1
            track.length = max(1, min(self.k, grown))

    def reset(self) -> None:
        """Forget warm-up's counts."""
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * self.k)
        self.totals = SpecDecodeStats(accepted_per_pos=[0] * self.k)
        self._tracks.clear()

    def take_stats(self) -> SpecDecodeStats:
        stats, self.stats = self.stats, SpecDecodeStats(accepted_per_pos=[0] * self.k)
        return stats
