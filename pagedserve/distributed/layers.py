"""The vocab-parallel embedding and logits of a tensor-parallel decoder (the split: sharding.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.distributed.group import TPGroup
from pagedserve.distributed.sharding import ShardLayout


class VocabParallelEmbedding(nn.Module):
    """Rows vocab_start .. vocab_start + vocab_per_rank of the table; a lookup is this rank's rows (zeros for
    tokens outside them) summed over the ranks: exact, each token's row comes from one rank."""

    def __init__(self, layout: ShardLayout, hidden_size: int, group: TPGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(layout.vocab_per_rank, hidden_size), requires_grad=False)
        self.vocab_start, self.num_rows = layout.vocab_start, layout.vocab_per_rank
        self.embedding_dim = hidden_size
        self.group = group
        self.rows_source: nn.Module | None = None

    def use_rows_of(self, logits_proj: nn.Module) -> None:
        """A tied embedding reads its rows from the logits projection's packed weight (one copy, as
        models/llama.py's PackedRowsEmbedding does without tensor parallelism)."""
        object.__setattr__(self, "rows_source", logits_proj)  # not a submodule: it belongs to the head
        del self.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_rows)
        local = local.masked_fill(outside, 0)
        rows = self.rows_source.rows(local) if self.rows_source is not None else F.embedding(local, self.weight)
        return self.group.all_reduce(rows.masked_fill(outside.unsqueeze(-1), 0))  # [T, hidden]


def gather_logits(group: TPGroup, local_logits: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
    """[N, vocab_per_rank] on every rank -> [N, vocab] on rank 0, the one that samples (the padding rows'
    columns dropped); None on the other ranks."""
    logits = group.gather(local_logits)
    if logits is None or logits.shape[-1] == vocab_size:
        return logits
    return logits[:, :vocab_size].contiguous()
