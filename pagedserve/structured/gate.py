"""A grammar that begins after a thinking model's reasoning (`--reasoning-parser` with structured outputs, as vLLM
applies a request's grammar only to what follows the think block).

A gated request's output runs through three phases, each decided by the token ids alone:
- first: the prompt left no block open; the first token is either the tag that opens one (`<think>`: the grammar
  waits for the block's end) or the grammar's first token (the model does not think here). Its mask is the
  grammar's with the opening tag added.
- reasoning: inside the block, nothing masked; the closing tag (`</think>`) ends it.
- grammar: the request's grammar, from the token after the closing tag on.
The tags must be single tokens (as in the Qwen3, QwQ and DeepSeek-R1 vocabularies); elsewhere no gate is made and
the grammar writes the whole output. A model that never closes its block is never constrained (vLLM's too).
"""

from __future__ import annotations

import torch

from pagedserve.structured.matcher import DraftedGrammar, RequestGrammar
from pagedserve.structured.params import ReasoningGate

FIRST, REASONING, GRAMMAR = "first", "reasoning", "grammar"


class GatedGrammar:
    """A RequestGrammar behind a ReasoningGate, with RequestGrammar's interface for the model runner: `accept`,
    `is_terminated`, `num_valid_drafts`, and `at(drafts)`, the mask of the row after some drafts (None where that
    row is inside the reasoning: not masked)."""

    def __init__(self, grammar: RequestGrammar, gate: ReasoningGate) -> None:
        self.grammar, self.gate = grammar, gate
        self.phase = REASONING if gate.opened else FIRST

    def _read(self, token_ids: list[int]) -> tuple[str, int]:
        """The phase after `token_ids`, and how many of them the gate read (the rest are the grammar's)."""
        phase = self.phase
        for i, token_id in enumerate(token_ids):
            if phase == GRAMMAR:
                return phase, i
            if phase == FIRST:
                if token_id != self.gate.start_id:
                    return GRAMMAR, i  # the grammar's first token
                phase = REASONING
            elif token_id == self.gate.end_id:
                phase = GRAMMAR
        return phase, len(token_ids)

    def accept(self, token_id: int) -> bool:
        phase, read = self._read([token_id])
        self.phase = phase
        return True if read else self.grammar.accept(token_id)

    @property
    def is_terminated(self) -> bool:
        return self.phase == GRAMMAR and self.grammar.is_terminated

    def num_valid_drafts(self, drafts: list[int]) -> int:
        phase, read = self._read(drafts)
        return read + self.grammar.num_valid_drafts(drafts[read:]) if phase == GRAMMAR else len(drafts)

    def at(self, drafts: list[int]) -> RequestGrammar | DraftedGrammar | FirstToken | None:
        phase, read = self._read(drafts)
        if phase == REASONING:
            return None
        if phase == FIRST:
            return FirstToken(self.grammar, self.gate.start_id)
        return self.grammar.at(drafts[read:])


class FirstToken:
    """The first row of a request whose prompt opened no block: the grammar's mask and the opening tag."""

    def __init__(self, grammar: RequestGrammar, start_id: int) -> None:
        self.grammar, self.start_id = grammar, start_id
        self.utf8, self.utf8_state = grammar.utf8, grammar.utf8_state

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.grammar.fill(bitmask, row)
        word, bit = self.start_id >> 5, self.start_id & 31
        value = int(bitmask[row, word]) | (1 << bit)
        bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value  # int32 words
