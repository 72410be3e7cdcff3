"""Pooling hidden states into one vector per request, as sentence-transformers' Pooling module does.

A step's batch holds chunks of requests laid end to end. Each chunk is reduced on its own (segment
sums / maxima / picked rows, one vectorised call for the whole batch); a request whose prompt spans
several steps (chunked prefill of a decoder) keeps a `PartialPool` between steps, and the vector is
finished on its last chunk. Every mode is a reduction that merges exactly across chunks, so chunked
and whole-prompt pooling give the same vector up to float rounding. Normalising (the model's Normalize module,
or a request's `normalize`) is per request, after Matryoshka truncation: pooling_params.finish_embedding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.config import PoolerConfig


@dataclass
class ChunkSpan:
    """One request's rows in this step: hidden[first:first + num] are positions start .. start + num - 1."""

    request_id: str
    first: int
    num: int
    start: int
    is_last: bool  # the prompt's final chunk: the vector is due after this step


@dataclass
class PartialPool:
    value: torch.Tensor  # [hidden] float32: a (weighted) sum, a running max, or a picked row
    weight: float  # tokens (mean), sum of position weights (weightedmean); unused otherwise


class Pooler:
    def __init__(self, config: PoolerConfig) -> None:
        self.pooling_type = config.pooling_type
        self.partials: dict[str, PartialPool] = {}

    def drop(self, request_ids: list[str]) -> None:
        """Forget requests that finished or were aborted mid-prompt."""
        for request_id in request_ids:
            self.partials.pop(request_id, None)

    def __call__(self, hidden: torch.Tensor, spans: list[ChunkSpan]) -> dict[str, list[float]]:
        """hidden [T, H] -> {request_id: vector} for the requests whose last chunk ran this step."""
        if not spans:
            return {}
        values, weights = self._reduce_chunks(hidden.float(), spans)  # [S, H], [S]
        done_ids: list[str] = []
        done_rows: list[torch.Tensor] = []
        done_weights: list[float] = []
        for i, span in enumerate(spans):
            value, weight = values[i], float(weights[i])
            if span.start > 0 or not span.is_last:
                value, weight = self._merge(span, value, weight)
                if not span.is_last:
                    self.partials[span.request_id] = PartialPool(value, weight)
                    continue
            done_ids.append(span.request_id)
            done_rows.append(value)
            done_weights.append(weight)
        if not done_ids:
            return {}
        vectors = self._finish(torch.stack(done_rows), torch.tensor(done_weights, dtype=torch.float32,
                                                                     device=hidden.device))
        return dict(zip(done_ids, vectors.tolist()))

    def _reduce_chunks(self, h: torch.Tensor, spans: list[ChunkSpan]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per chunk: the value this mode keeps ([S, H]) and its weight ([S])."""
        device = h.device
        firsts = torch.tensor([s.first for s in spans], dtype=torch.int64, device=device)
        nums = torch.tensor([s.num for s in spans], dtype=torch.int64, device=device)
        mode = self.pooling_type
        if mode == "cls":
            return h[firsts], torch.ones(len(spans))
        if mode == "lasttoken":
            return h[firsts + nums - 1], torch.ones(len(spans))
        rows = torch.cat([torch.arange(s.first, s.first + s.num) for s in spans]).to(device)  # [N]
        segment = torch.repeat_interleave(torch.arange(len(spans), device=device), nums)  # [N]
        picked = h[rows]
        if mode == "max":
            out = h.new_full((len(spans), h.shape[1]), float("-inf"))
            index = segment.unsqueeze(1).expand(-1, h.shape[1])
            return out.scatter_reduce_(0, index, picked, "amax"), torch.ones(len(spans))
        if mode == "weightedmean":  # sentence-transformers weighs position p (0-based) by p + 1
            pos_weight = torch.cat([torch.arange(s.start + 1, s.start + s.num + 1) for s in spans]).to(device)
            picked = picked * pos_weight.unsqueeze(1).to(h.dtype)
            weights = torch.zeros(len(spans), device=device).index_add_(0, segment, pos_weight.float())
        else:  # mean, mean_sqrt_len_tokens
            weights = nums.float()
        sums = h.new_zeros(len(spans), h.shape[1]).index_add_(0, segment, picked)
        return sums, weights.cpu()

    def _merge(self, span: ChunkSpan, value: torch.Tensor, weight: float) -> tuple[torch.Tensor, float]:
        """Fold this chunk into the request's earlier chunks (a chunk at position 0 starts afresh)."""
        previous = self.partials.pop(span.request_id, None) if span.start > 0 else None
        if previous is None:
            # Only last-token pooling may start past 0 with nothing kept (a prefix-cache hit).
            assert span.start == 0 or self.pooling_type == "lasttoken", "pooling lost its earlier chunks"
            return value, weight
        mode = self.pooling_type
        if mode == "cls":
            return previous.value, previous.weight
        if mode == "lasttoken":
            return value, weight
        if mode == "max":
            return torch.maximum(previous.value, value), 1.0
        return previous.value + value, previous.weight + weight

    def _finish(self, values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.pooling_type in ("mean", "weightedmean"):
            values = values / weights.clamp(min=1e-9).unsqueeze(1)
        elif self.pooling_type == "mean_sqrt_len_tokens":
            values = values / weights.sqrt().unsqueeze(1)
        return values
