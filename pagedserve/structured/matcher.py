"""Per-request grammar state and the one masking call per step.

Each constrained request owns a RequestGrammar (an xgrammar GrammarMatcher over its compiled grammar). Every
step the runner fills one bitmask row per constrained row of the batch and applies them all to the logits in
one call (`mask_logits`) before any sampling, so greedy, random, seeded, penalised and biased rows all obey
the grammar; unconstrained rows are not touched. After sampling the matcher advances by the chosen token.
"""

from __future__ import annotations

from typing import Any

import torch


class RequestGrammar:
    def __init__(self, compiled: Any, stop_token_ids: list[int]) -> None:
        import xgrammar as xgr

        # The grammar ends on one of the request's stop tokens (EOS, stop_token_ids): the output then ends as
        # an unconstrained one would, and the stop token is what the scheduler finishes it on.
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=list(dict.fromkeys(stop_token_ids)) or None)

    def accept(self, token_id: int) -> bool:
        """Advance by the sampled token; False if the grammar does not allow it (it then stays as it was)."""
        return bool(self.matcher.accept_token(token_id))

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted: nothing more may be generated."""
        return bool(self.matcher.is_terminated())

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)


def mask_logits(logits: torch.Tensor, rows: list[tuple[int, RequestGrammar]]) -> None:
    """Set the logits of every token a row's grammar forbids to -inf, in place (only rows listed)."""
    if not rows:
        return
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[1])
    for row, grammar in rows:
        grammar.fill(bitmask, row)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=[row for row, _ in rows])
