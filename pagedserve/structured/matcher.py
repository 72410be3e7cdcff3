"""Per-request grammar state and the masking of a step's logits.

Each constrained request owns a RequestGrammar (an xgrammar GrammarMatcher over its compiled grammar, and its
UTF-8 state, see utf8.py). Every step the sampler fills one bitmask row per constrained row of the batch
(`fill_bitmask`) and masks the logits of those rows with it (`apply_bitmask`) before sampling, so random,
seeded, penalised and biased rows all obey the grammar; unconstrained rows are not touched. A greedy row needs
its mask only if its argmax is a token the grammar forbids (`is_allowed`): the sampler checks that first and
masks only such rows, which saves touching the whole vocabulary of most rows (the argmax of the masked logits
is the same token whenever the unmasked argmax is allowed). After sampling the matcher advances by the token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pagedserve.structured.utf8 import ERROR, START, Utf8Guard


@dataclass(frozen=True)
class CompiledGrammar:
    """What the compiler hands a constrained request: xgrammar's compiled grammar and its tokenizer's guard."""

    xgrammar: Any  # xgrammar.CompiledGrammar
    utf8: Utf8Guard
    # Ids no grammar accepts (xgrammar's special tokens, e.g. the padding rows past the tokenizer's vocabulary);
    # xgrammar writes a warning to stderr for each one offered to a matcher.
    special_ids: frozenset[int] = frozenset()

    @property
    def num_bytes(self) -> int:
        """What the compiled grammar holds in memory (xgrammar's count; 0 where it gives none)."""
        return int(getattr(self.xgrammar, "memory_size_bytes", 0))


class RequestGrammar:
    def __init__(self, compiled: CompiledGrammar, stop_token_ids: list[int]) -> None:
        import xgrammar as xgr

        # The grammar ends on one of the request's stop tokens (EOS, stop_token_ids): the output then ends as
        # an unconstrained one would, and the stop token is what the scheduler finishes it on.
        self.matcher = xgr.GrammarMatcher(compiled.xgrammar,
                                          override_stop_tokens=list(dict.fromkeys(stop_token_ids)) or None)
        self.compiled = compiled  # alive as long as its matchers: its end is when xgrammar's memory is freed
        self.utf8 = compiled.utf8
        self.utf8_state = START

    def accept(self, token_id: int) -> bool:
        """Advance by the sampled token; False if the grammar does not allow it (it then stays as it was)."""
        if not self.matcher.accept_token(token_id):
            return False
        self.utf8_state = self.utf8.advance(self.utf8_state, token_id)
        return True

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted: nothing more may be generated."""
        return bool(self.matcher.is_terminated())

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def num_valid_drafts(self, drafts: list[int]) -> int:
        """How many leading draft tokens (speculative decoding) the grammar allows with more to follow: each one
        accepted, its text well-formed, the grammar not ended by it. Only the rows after those can be masked."""
        num_valid = num_accepted = 0
        state = self.utf8_state
        special = self.compiled.special_ids
        for token_id in drafts:
            state = self.utf8.advance(state, token_id)
            # A special id is refused without asking the matcher (a draft model proposes them; xgrammar would log
            # each refusal to stderr); a rejected token leaves the matcher as it was.
            if state == ERROR or token_id in special or not self.matcher.accept_token(token_id):
                break
            num_accepted += 1
            if self.matcher.is_terminated():
                break
            num_valid += 1
        if num_accepted:
            self.matcher.rollback(num_accepted)
        return num_valid

    def at(self, drafts: list[int]) -> "RequestGrammar | DraftedGrammar":
        """This grammar as it will be once `drafts` (valid ones) are accepted: the mask of a verification row
        (itself for a row with no drafts before it)."""
        return DraftedGrammar(self, drafts) if drafts else self


class DraftedGrammar:
    """A request's grammar after some draft tokens, without moving it: `fill` advances the matcher over the
    drafts, fills the row and rolls back; `utf8_state` is the guard's state after them."""

    def __init__(self, grammar: RequestGrammar, drafts: list[int]) -> None:
        self.grammar, self.drafts = grammar, drafts
        self.utf8 = grammar.utf8
        state = grammar.utf8_state
        for token_id in drafts:
            state = self.utf8.advance(state, token_id)
        self.utf8_state = state

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        matcher = self.grammar.matcher
        for token_id in self.drafts:
            if not matcher.accept_token(token_id):
                raise RuntimeError(f"draft token {token_id} was checked against the grammar but is rejected")
        matcher.fill_next_token_bitmask(bitmask, row)
        matcher.rollback(len(self.drafts))


def fill_bitmask(rows: list[tuple[int, RequestGrammar]], num_rows: int, vocab_size: int) -> torch.Tensor:
    """[num_rows, ceil(V / 32)] int32: bit t of row r set when row r's grammar allows token t (all set for rows
    not listed)."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(num_rows, vocab_size)
    for row, grammar in rows:
        grammar.fill(bitmask, row)
    return bitmask


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[tuple[int, RequestGrammar]]) -> None:
    """Set, in place, the logits of every token a listed row's grammar forbids, or that would make its text
    ill-formed UTF-8, to -inf."""
    if not rows:
        return
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=[row for row, _ in rows])
    guard = rows[0][1].utf8  # one tokenizer per engine, so one guard
    guard.mask(logits, [row for row, _ in rows], [grammar.utf8_state for _, grammar in rows])


def is_allowed(bitmask: torch.Tensor, row: int, grammar: RequestGrammar, token_id: int) -> bool:
    """The row's grammar (and the UTF-8 guard) allow `token_id` next."""
    word = int(bitmask[row, token_id >> 5])
    return bool((word >> (token_id & 31)) & 1) and grammar.utf8.end_state[grammar.utf8_state, token_id] != ERROR
