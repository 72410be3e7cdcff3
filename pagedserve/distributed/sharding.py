"""Which slice of each checkpoint tensor a tensor-parallel rank holds (Megatron-style).

- q/k/v and gate/up are split by output rows: rank r computes its own attention heads and its own slice of
  the MLP's intermediate activations, with no communication;
- o and down are split by input columns: each rank's product is a partial sum of the full output, and one
  all-reduce per layer half adds them (a bias is added by rank 0 only, so it is counted once);
- KV heads are split like q heads; where there are fewer KV heads than ranks, each is replicated on the
  ranks whose q heads read it (rank r holds KV head r * num_kv_heads // world_size);
- the vocabulary (embedding and LM head) is split by rows into world_size equal parts of
  ceil(vocab / world_size) rows, the last padded with zero rows: a lookup is an all-reduce of the one rank's
  row and zeros (exact), the logits an all-gather trimmed back to the vocabulary.

Slices of a memory-mapped checkpoint are views: a row slice touches only its own pages; a column slice is
copied (it is materialised per rank anyway, packed or fused). Nothing here needs a process group or, until
a tensor is sliced, torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedserve.memory.sizes import moe_shape

# Parameter name suffix -> (how it is split, by which count). Names are the checkpoint's (models/llama.py).
_RULES: dict[str, tuple[str, str]] = {
    "self_attn.q_proj.weight": ("rows", "heads"), "self_attn.q_proj.bias": ("rows", "heads"),
    "self_attn.k_proj.weight": ("rows", "kv_heads"), "self_attn.k_proj.bias": ("rows", "kv_heads"),
    "self_attn.v_proj.weight": ("rows", "kv_heads"), "self_attn.v_proj.bias": ("rows", "kv_heads"),
    "self_attn.o_proj.weight": ("columns", "heads"),
    "mlp.gate_proj.weight": ("rows", "intermediate"), "mlp.up_proj.weight": ("rows", "intermediate"),
    "mlp.down_proj.weight": ("columns", "intermediate"),
    "embed_tokens.weight": ("rows", "vocab"), "lm_head.weight": ("rows", "vocab"),
}


def valid_sizes(config: Any, limit: int = 64) -> list[int]:
    """The tensor-parallel sizes up to `limit` that this model's heads and MLP divide into."""
    return [n for n in range(1, limit + 1) if not _problems(config, n)]


def _problems(config: Any, world_size: int) -> list[str]:
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    problems = []
    if heads % world_size:
        problems.append(f"its {heads} attention heads do not divide by {world_size}")
    if kv_heads % world_size and world_size % kv_heads:
        problems.append(f"its {kv_heads} KV heads neither divide by {world_size} nor divide it")
    if config.intermediate_size % world_size:
        problems.append(f"its MLP width {config.intermediate_size} does not divide by {world_size}")
    if world_size > 1 and moe_shape(config) is not None:
        problems.append("it is a mixture-of-experts model, whose experts are not split across processes yet")
    return problems


def check_tensor_parallel(config: Any, world_size: int) -> None:
    """ValueError naming what does not divide, and the sizes that would work."""
    if world_size < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1, got {world_size}")
    problems = _problems(config, world_size)
    if problems:
        sizes = ", ".join(map(str, valid_sizes(config)))
        raise ValueError(f"--tensor-parallel-size {world_size} cannot split this model: {'; '.join(problems)}. "
                         f"Sizes that work: {sizes}")


@dataclass(frozen=True)
class ShardLayout:
    """The slice rank `rank` of `world_size` holds of a Llama-family decoder."""

    rank: int
    world_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    @classmethod
    def for_config(cls, config: Any, rank: int, world_size: int) -> ShardLayout:
        check_tensor_parallel(config, world_size)
        heads = config.num_attention_heads
        return cls(rank, world_size, heads, getattr(config, "num_key_value_heads", None) or heads,
                   getattr(config, "head_dim", None) or config.hidden_size // heads, config.intermediate_size,
                   config.vocab_size)

    @property
    def local_heads(self) -> int:
        return self.num_heads // self.world_size

    @property
    def local_kv_heads(self) -> int:
        return max(1, self.num_kv_heads // self.world_size)

    @property
    def kv_head_start(self) -> int:
        """First KV head of this rank; below world_size KV heads, the one its q heads read (replicated)."""
        if self.num_kv_heads >= self.world_size:
            return self.rank * self.local_kv_heads
        return self.rank * self.num_kv_heads // self.world_size

    @property
    def local_intermediate(self) -> int:
        return self.intermediate_size // self.world_size

    @property
    def vocab_per_rank(self) -> int:
        """Rows of the embedding and LM head on each rank (the padded vocabulary / world_size)."""
        return -(-self.vocab_size // self.world_size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    def _span(self, count: str) -> tuple[int, int]:
        """(first row or column, number) of this rank's part, in elements of the tensor's split dimension."""
        if count == "heads":
            return self.rank * self.local_heads * self.head_dim, self.local_heads * self.head_dim
        if count == "kv_heads":
            return self.kv_head_start * self.head_dim, self.local_kv_heads * self.head_dim
        if count == "intermediate":
            return self.rank * self.local_intermediate, self.local_intermediate
        return self.vocab_start, self.vocab_per_rank

    def shard(self, name: str, tensor: Any) -> Any:
        """This rank's slice of checkpoint tensor `name` (a torch tensor or a QuantizedWeight: int8 rows with
        one scale each); tensors no rule names are replicated and returned as they are."""
        rule = next((r for suffix, r in _RULES.items() if name.endswith(suffix)), None)
        if rule is None or self.world_size == 1:
            return tensor
        how, count = rule
        start, length = self._span(count)
        if hasattr(tensor, "qweight"):  # a QuantizedWeight: row scales follow rows, columns keep them
            qweight = _slice(tensor.qweight, how, start, length)
            scales = _slice(tensor.scales, "rows", start, length) if how == "rows" else tensor.scales
            return type(tensor)(qweight, scales, tensor.dtype)
        return _slice(tensor, how, start, length)


def _slice(tensor: Any, how: str, start: int, length: int) -> Any:
    """Rows (a view, or a zero-padded copy past the end) or columns (a contiguous copy) start..start+length of
    a torch tensor (torch is imported here only: the engine's set-up checks sizes without it)."""
    import torch

    if how == "columns":
        return tensor.narrow(1, start, length).contiguous()
    available = max(0, min(length, tensor.shape[0] - start))
    if available == length:
        return tensor.narrow(0, start, length)
    padded = torch.zeros((length, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    padded[:available] = tensor[start:start + available]  # the vocabulary's tail: zero rows after it
    return padded
