"""Drafts from a draft model (method draft_model), scheduler side: the runner runs the draft model after each
step (worker/draft_model.py) and returns, for each request it sampled, the greedy tokens the draft model
expects next; they wait here until the scheduler schedules that request's next step.

Drafts count only if the request still has exactly the tokens they were proposed after (a stop, a preemption
or an abort in between makes them stale). The runner writes the draft model's K/V for its proposals in the
request's own blocks, past its known tokens: `lookahead` slots that the scheduler allocates with each step that
samples the request (without them the runner does not propose for it); their number is how many drafts the
runner proposes (`draft_length`: fewer after drafts that failed).
"""

from __future__ import annotations

from pagedserve.spec_decode.config import SpeculativeConfig
from pagedserve.spec_decode.proposer import Proposer


class DraftModelProposer(Proposer):
    adapts_length = True  # each draft token is a forward pass of the draft model
    backoff_growth = 4  # a try costs compute: its logits and catch-up, half a target step for a 2-layer 0.5B draft

    def __init__(self, config: SpeculativeConfig) -> None:
        super().__init__(config)
        self._drafts: dict[str, tuple[int, list[int]]] = {}  # request_id -> (its token count, drafts)

    def lookahead(self, request_id: str) -> int:
        return self.draft_length(request_id)

    def offer(self, request_id: str, num_tokens: int, drafts: list[int]) -> None:
        if self.backing_off(request_id):
            return  # proposed while this step's miss was unknown: the request sits the next step out
        self._drafts[request_id] = (num_tokens, drafts)

    def propose(self, request_id: str, tokens: list[int], max_tokens: int) -> list[int]:
        num_tokens, drafts = self._drafts.pop(request_id, (-1, []))
        return drafts[:max(0, max_tokens)] if num_tokens == len(tokens) else []

    def drop(self, request_id: str, tokens: list[int] | None = None) -> None:
        super().drop(request_id, tokens)
        self._drafts.pop(request_id, None)

    def reset(self) -> None:
        super().reset()
        self._drafts.clear()
