"""Speculative decoding's draft model (method draft_model), runner side.

A smaller model with the target's tokenizer, loaded beside it in the same dtype, with its own K/V pools of the
same number of blocks: the target's block table indexes both, so the scheduler's blocks (prefix cache,
preemption, freeing) hold the two models' K/V together and nothing else is bookkept.

Every step the draft model runs the batch the target ran (`follow`: the same tokens at the same slots, prefill
chunks and verification rows included), so its K/V hold what the target's hold. After sampling, `propose`
feeds each sampled request's last token and then its own greedy guesses, k decode steps of the draft model, and
returns the k guesses; their K/V go in the request's blocks past its known tokens (the scheduler's lookahead
slots), and the next step's `follow` writes them again from the tokens the target really computes there.
Greedy drafts are one-hot proposals, so verification keeps the target's output distribution exactly
(spec_decode/acceptance.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from pagedserve.config import EngineConfig
from pagedserve.layers.attention import AttentionMetadata, LayerKVCache
from pagedserve.models.loader import load_model
from pagedserve.platform import torch_dtype

logger = logging.getLogger(__name__)


class DraftModel:
    def __init__(self, config: EngineConfig) -> None:
        draft = config.draft_model
        self.k = config.speculative.num_speculative_tokens
        self.device = torch.device(config.device.device)
        self.model = load_model(draft.hf_config, draft.architecture, draft.model, torch_dtype(draft.dtype),
                                config.device.device, draft.max_model_len,
                                quantization=draft.quantization, reference_kernels=draft.reference_kernels)
        logger.info("draft model %s loaded", draft.model)
        self.kv_caches: list[LayerKVCache] = []  # allocated by the runner, beside the target's

    def has_room(self, position: int, num_slots: int) -> bool:
        """Whether a request holding `num_slots` slots can take the K/V of k proposals from `position` on."""
        return position + self.k <= num_slots

    def follow(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        """Run the target's batch through the draft model for its K/V (its outputs are not needed)."""
        self.model(input_ids, positions, self.kv_caches, meta)

    def propose(self, starts: list[tuple[str, int, int, int]],
                decode_meta: Callable[[torch.Tensor, torch.Tensor], AttentionMetadata]) -> dict[str, list[int]]:
        """k greedy tokens for each (request_id, block-table row, last token, its position) of `starts`."""
        rows = torch.tensor([row for _, row, _, _ in starts], dtype=torch.int64)
        tokens = torch.tensor([token for _, _, token, _ in starts], dtype=torch.int64)
        positions = torch.tensor([position for *_, position in starts], dtype=torch.int64)
        tokens = tokens.to(self.device)
        proposed = []
        for _ in range(self.k):
            meta = decode_meta(rows, positions)  # from the host's block table
            hidden = self.model(tokens, positions.to(self.device), self.kv_caches, meta)
            tokens = self.model.compute_logits(hidden).argmax(dim=-1)  # stays on the device
            proposed.append(tokens)
            positions = positions + 1
        drafts = torch.stack(proposed, dim=1).tolist()  # [requests, k]: one transfer
        return {request_id: row for (request_id, *_), row in zip(starts, drafts)}
