"""Well-formed UTF-8 for constrained outputs.

xgrammar matches multi-byte characters with a lenient decoder: after a lead byte E0, ED, F0 or F4 it takes any
continuation byte, so a byte-level model can write overlong forms (F0 8A AC B0) and surrogates (ED A0 80) that
the grammar counts as one character but that decode to several U+FFFD: invalid text, and a `maxLength` broken
after decoding. Utf8Guard closes that gap with the UTF-8 automaton (RFC 3629, table 3-7 of the Unicode
standard) run over every token's bytes once, per tokenizer: for each automaton state, the tokens that may follow
and the state each leaves. Each step a constrained row's logits lose the tokens its state does not allow (one
masked_fill per batch), and the state advances with the sampled token.
"""

from __future__ import annotations

import numpy as np
import torch

# States: 0 between characters; 1-3 that many continuation bytes (80-BF) due; 4 after E0 (A0-BF next);
# 5 after ED (80-9F next); 6 after F0 (90-BF next); 7 after F4 (80-8F next); 8 error.
START, ERROR, NUM_STATES = 0, 8, 9


def _transitions() -> np.ndarray:
    """[NUM_STATES, 257] next state for each byte; column 256 is padding (no byte: the state stays)."""
    table = np.full((NUM_STATES, 257), ERROR, dtype=np.uint8)
    table[:, 256] = np.arange(NUM_STATES)
    lead = table[START]
    lead[0x00:0x80] = START
    lead[0xC2:0xE0] = 1
    lead[0xE0] = 4
    lead[0xE1:0xED] = 2
    lead[0xED] = 5
    lead[0xEE:0xF0] = 2
    lead[0xF0] = 6
    lead[0xF1:0xF4] = 3
    lead[0xF4] = 7
    table[1, 0x80:0xC0] = START
    table[2, 0x80:0xC0] = 1
    table[3, 0x80:0xC0] = 2
    table[4, 0xA0:0xC0] = 1
    table[5, 0x80:0xA0] = 1
    table[6, 0x90:0xC0] = 2
    table[7, 0x80:0x90] = 2
    table[ERROR, :256] = ERROR
    return table


class Utf8Guard:
    def __init__(self, token_bytes: list[bytes], vocab_size: int) -> None:
        """token_bytes[i]: what token i writes (xgrammar's TokenizerInfo.decoded_vocab); ids beyond it write
        nothing (they keep the state; the grammar masks them anyway)."""
        lengths = np.zeros(vocab_size, dtype=np.int64)
        lengths[:len(token_bytes[:vocab_size])] = [len(b) for b in token_bytes[:vocab_size]]
        order = np.argsort(-lengths, kind="stable")  # longest first: byte j of the first n_j tokens exists
        padded = np.full((vocab_size, max(int(lengths.max(initial=0)), 1)), 256, dtype=np.int16)
        for row, index in enumerate(order[:int((lengths > 0).sum())]):
            padded[row, :lengths[index]] = np.frombuffer(token_bytes[index], dtype=np.uint8)
        table = _transitions()
        current = np.repeat(np.arange(NUM_STATES, dtype=np.uint8)[:, None], vocab_size, axis=1)  # [S, V] by order
        for column in range(padded.shape[1]):
            active = int((lengths > column).sum())
            current[:, :active] = table[current[:, :active], padded[:active, column]]
        end = np.empty_like(current)
        end[:, order] = current
        self.end_state = end  # [NUM_STATES, V]: the state after each token, from each state
        # Per state, the token ids it forbids: ~200 between characters (lone continuation bytes, ...), which is
        # where rows almost always are; most of the vocabulary mid-character, which is rare and brief.
        self.forbidden_ids = [torch.from_numpy(np.flatnonzero(end[s] == ERROR)) for s in range(NUM_STATES)]
        self._on_device: dict[tuple[int, str], torch.Tensor] = {}

    def mask(self, logits: torch.Tensor, rows: list[int], states: list[int]) -> None:
        """Forbid, in place, the tokens that would make each row's text ill-formed from its state."""
        for row, state in zip(rows, states):
            ids = self._ids(state, logits.device)
            if ids.numel():
                logits[row].index_fill_(0, ids, float("-inf"))

    def _ids(self, state: int, device: torch.device) -> torch.Tensor:
        key = (state, str(device))
        if key not in self._on_device:
            self._on_device[key] = self.forbidden_ids[state].to(device)
        return self._on_device[key]

    def advance(self, state: int, token_id: int) -> int:
        return int(self.end_state[state, token_id]) if token_id < self.end_state.shape[1] else state
