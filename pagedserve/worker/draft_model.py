"""Speculative decoding's draft model (method draft_model), runner side.

A smaller model with the target's tokenizer, loaded beside it in the same dtype, with its own K/V pools of the
same number of blocks: the target's block table indexes both, so the scheduler's blocks (prefix cache,
preemption, freeing) hold the two models' K/V together.

Every step in which some request speculates, the draft model runs the batch the target ran (`follow`: the same
tokens at the same slots, prefill chunks and verification rows included), so its K/V hold what the target's hold;
in a decode-only step it runs, after sampling, only the rows its last proposal did not already feed it and
whose tokens the target kept (`DraftKV.step`: of a verification, only the last draft, and only when every draft
was accepted).
A step in which nobody speculates (the batch is above disable_by_batch_size) is not followed: the draft model's
forward would be pure cost there. `DraftKV` keeps what that leaves behind, per request the positions whose draft
K/V are right and the tokens after them, and per block whether the target wrote it unfollowed; before the next
followed step the runner runs the draft model over each lagging request's missing positions (`DraftKV.catch_up`),
and a request admitted onto cached blocks trusts only those the draft model followed. After sampling, `propose`
feeds each sampled request's last token and then its own greedy guesses, up to k decode steps of the draft model
(as many as the scheduler gave the request lookahead slots: fewer after drafts that failed), and returns the
guesses; their K/V go in the request's blocks past its known tokens (the scheduler's lookahead
slots); the next step's `follow` computes those whose token the target does not confirm there.
Greedy drafts are one-hot proposals, so verification keeps the target's output distribution exactly
(spec_decode/acceptance.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pagedserve.config import EngineConfig
from pagedserve.layers.attention import AttentionMetadata, LayerKVCache
from pagedserve.layers.sampler import argmax_rows
from pagedserve.models.loader import ProgressFn, load_model
from pagedserve.platform import torch_dtype

logger = logging.getLogger(__name__)


class DraftModel:
    def __init__(self, config: EngineConfig, progress: ProgressFn | None = None) -> None:
        """The draft model of `config`, loaded after the target. `progress`: the start-up tracker's, so /health goes
        through loading_weights and preparing_weights again for the draft's weights, which can take seconds (a
        1.5B draft for a 7B target) where it would otherwise sit at the target's 100 %."""
        draft = config.draft_model
        self.device = torch.device(config.device.device)
        if progress is not None:
            logger.info("the draft model's weights (%s) load now", draft.model)
        self.model = load_model(draft.hf_config, draft.architecture, draft.model, torch_dtype(draft.dtype),
                                config.device.device, draft.max_model_len, progress,
                                quantization=draft.quantization, reference_kernels=draft.reference_kernels)
        logger.info("draft model %s loaded", draft.model)
        self.vocab_size, self.target_vocab_size = draft.hf_config.vocab_size, config.model.hf_config.vocab_size
        self.kv_caches: list[LayerKVCache] = []  # allocated by the runner, beside the target's
        self.kv = DraftKV(config.cache.block_size)

    def follow(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        """Run the target's batch through the draft model for its K/V (its outputs are not needed)."""
        self.model(self._in_vocabulary(input_ids), positions, self.kv_caches, meta)

    def _in_vocabulary(self, ids: torch.Tensor) -> torch.Tensor:
        """The target's ids as the draft model's rows: a target padded past the draft's vocabulary (one tokenizer)
        may sample a padding id, which only loses that draft (verification keeps the target's output)."""
        return ids.clamp(max=self.vocab_size - 1) if self.vocab_size < self.target_vocab_size else ids

    def propose(self, starts: list[tuple[str, int, int, int, int]],
                decode_meta: Callable[[torch.Tensor, torch.Tensor], AttentionMetadata]) -> dict[str, list[int]]:
        """`length` greedy tokens for each (request_id, block-table row, last token, its position, length) of
        `starts`: decode steps of the draft model, each over the requests that still want a token (longest
        first, so a step's batch is the leading rows of the one before)."""
        starts = sorted(starts, key=lambda start: -start[4])  # stable: batch order among equal lengths
        lengths = [length for *_, length in starts]
        rows = torch.tensor([row for _, row, *_ in starts], dtype=torch.int64)
        tokens = self._in_vocabulary(torch.tensor([token for _, _, token, *_ in starts], dtype=torch.int64)
                                     ).to(self.device)
        positions = torch.tensor([position for *_, position, _ in starts], dtype=torch.int64)
        proposed = []
        for step in range(lengths[0]):
            active = sum(length > step for length in lengths)
            rows, tokens, positions = rows[:active], tokens[:active], positions[:active]
            meta = decode_meta(rows, positions)  # from the host's block table
            hidden = self.model(tokens, positions.to(self.device), self.kv_caches, meta)
            tokens = argmax_rows(self.model.compute_logits(hidden), self.model.kernel_backend.native)  # on the device
            if self.vocab_size > self.target_vocab_size:  # a draft padded past the target: a padding id is no guess
                tokens = tokens.clamp(max=self.target_vocab_size - 1)
            proposed.append(tokens)
            positions = positions + 1
        flat = torch.cat(proposed).tolist()  # one transfer; step by step, each step's rows in order
        drafts: dict[str, list[int]] = {request_id: [] for request_id, *_ in starts}
        offset = 0
        for step_tokens in proposed:
            for (request_id, *_), token in zip(starts, flat[offset:offset + len(step_tokens)]):
                drafts[request_id].append(token)
            offset += len(step_tokens)
        for request_id, _, token, position, _ in starts:  # the K/V these steps wrote: the last token, then guesses
            self.kv.proposed[request_id] = (position, [token] + drafts[request_id][:-1])
        return drafts


@dataclass
class DraftKV:
    """Where the draft model's K/V follow the target's, so that steps nobody speculates in can skip it.

    `valid[r]`: request r's leading positions whose draft K/V were computed from its real tokens; `tokens[r]`:
    its tokens, at least up to the positions the target has computed; `stale_blocks`: blocks the target wrote
    while the draft model did not follow (a later request that finds one in the prefix cache must recompute
    the draft's K/V from there). Positions a step recomputes (`start` on) stop counting as valid first: the
    target rewrites them, e.g. after rejected drafts."""

    block_size: int
    valid: dict[str, int] = field(default_factory=dict)
    tokens: dict[str, list[int]] = field(default_factory=dict)
    stale_blocks: set[int] = field(default_factory=set)
    # The last proposal's K/V, until the next step: request -> (first position, the tokens fed there).
    proposed: dict[str, tuple[int, list[int]]] = field(default_factory=dict)
    num_followed_tokens: int = 0
    num_skipped_tokens: int = 0
    num_held_tokens: int = 0  # positions a step's follow left out: the proposal had written them
    num_dropped_tokens: int = 0  # positions it left out as past what the target kept (rejected drafts)

    def admit(self, request_id: str, token_ids: list[int], num_computed: int, block_ids: list[int]) -> None:
        """A request given blocks (first schedule, or resumed): its first `num_computed` positions come from
        the prefix cache, valid for the draft model up to the first stale block among them."""
        valid = num_computed
        for index in range(num_computed // self.block_size):
            if block_ids[index] in self.stale_blocks:
                valid = index * self.block_size
                break
        self.valid[request_id] = valid
        self.tokens[request_id] = list(token_ids)
        self.proposed.pop(request_id, None)  # resumed: its blocks may be others now

    def forget(self, request_id: str) -> None:
        self.valid.pop(request_id, None)
        self.tokens.pop(request_id, None)
        self.proposed.pop(request_id, None)

    def step(self, request_id: str, start: int, chunk: list[int]) -> int:
        """The target computes `chunk` at positions start.. this step. Returns where the positions whose draft
        K/V are already written end: the request's last proposal fed the draft model the same tokens from `start`
        on (a verification's inputs are the last token and the drafts: all but the last draft were fed)."""
        tokens = self.tokens[request_id]
        del tokens[start:]
        tokens.extend(chunk)
        self.valid[request_id] = min(self.valid[request_id], start)
        position, fed = self.proposed.pop(request_id, (None, []))
        held = 0
        if position == start and self.valid[request_id] == start:
            while held < min(len(fed), len(chunk)) and fed[held] == chunk[held]:
                held += 1
        return start + held

    def catch_up(self, request_id: str, start: int) -> tuple[int, list[int]]:
        """(first position, tokens) the draft model must compute before following a step that starts at
        `start`: (start, []) when it is up to date."""
        valid = self.valid[request_id]
        return valid, self.tokens[request_id][valid:start]

    def followed(self, request_id: str, first: int, end: int, block_ids: list[int]) -> None:
        """The draft model computed positions first..end-1 from the real tokens (a catch-up and this step):
        the whole blocks among them hold its K/V again."""
        self.valid[request_id] = end
        self.num_followed_tokens += end - first
        for index in range(first // self.block_size, end // self.block_size):
            self.stale_blocks.discard(block_ids[index])

    def skipped(self, request_id: str, start: int, end: int, block_ids: list[int]) -> None:
        """The target computed positions start..end-1 and the draft model did not."""
        self.num_skipped_tokens += end - start
        for index in range(start // self.block_size, (end - 1) // self.block_size + 1):
            self.stale_blocks.add(block_ids[index])
