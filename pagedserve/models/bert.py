"""BERT encoder (`BertModel`): absolute positions, token types, post-LayerNorm, GELU, bidirectional attention.

Parameter names equal the Hugging Face checkpoint's (`embeddings.word_embeddings`,
`encoder.layer.N.attention.self.query`, ...). A batch is a flat run of whole sequences, [T, hidden]:
the linear layers see only real tokens; attention pads each group of similar-length sequences to its
longest one (a key mask hides the padding; the encoder runner orders a step's prompts by length).
There is no KV cache: every request is computed in one pass. After loading, `prepare()` fuses
query/key/value into one matmul and hands every linear the kernel the loader chose (layers/linear.py:
oneDNN-packed on CPU, int8 with --quantization int8); forward passes run on the prepared model only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.layers.backend import KernelBackend

_ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


# A group's padded size may exceed its real tokens by this fraction before a new group starts.
MAX_PADDING_FRACTION = 0.25


@dataclass
class AttentionGroup:
    """Consecutive sequences of the flat batch (rows start .. end), padded together for one SDPA call."""

    start: int
    end: int
    seq_lens: list[int]
    max_len: int
    # [end - start] int64: row of each token in the padded [len(seq_lens) * max_len] layout; None when
    # every sequence of the group has max_len tokens (a plain reshape, no padding).
    padded_index: torch.Tensor | None = None
    key_mask: torch.Tensor | None = None  # [B, 1, 1, max_len] bool, True = a real token; None: no padding


@dataclass
class EncoderMetadata:
    """Whole sequences laid end to end, cut into groups of similar length (sorted input groups best)."""

    seq_lens: list[int]
    groups: list[AttentionGroup]


def encoder_metadata(seq_lens: list[int], device: torch.device | str = "cpu") -> EncoderMetadata:
    """Group consecutive sequences while the padding stays under MAX_PADDING_FRACTION of the real tokens:
    attention costs B x max_len^2 per group, so one long prompt does not make every short one pay for it."""
    groups: list[list[int]] = []
    for n in seq_lens:
        if groups:
            group = groups[-1]
            padded = max(max(group), n) * (len(group) + 1)
            if padded <= (1 + MAX_PADDING_FRACTION) * (sum(group) + n):
                group.append(n)
                continue
        groups.append([n])
    result, row = [], 0
    for lens in groups:
        result.append(_attention_group(row, lens, device))
        row += sum(lens)
    return EncoderMetadata(seq_lens, result)


def _attention_group(start: int, seq_lens: list[int], device: torch.device | str) -> AttentionGroup:
    max_len = max(seq_lens)
    group = AttentionGroup(start, start + sum(seq_lens), seq_lens, max_len)
    if all(n == max_len for n in seq_lens):
        return group
    lens = torch.tensor(seq_lens, dtype=torch.int64)
    starts = torch.arange(len(seq_lens), dtype=torch.int64) * max_len
    offsets = torch.arange(int(lens.sum())) - torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)
    group.padded_index = (torch.repeat_interleave(starts, lens) + offsets).to(device)
    mask = torch.arange(max_len).unsqueeze(0) < lens.unsqueeze(1)  # [B, L]
    group.key_mask = mask[:, None, None, :].to(device)
    return group


def encoder_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: EncoderMetadata) -> torch.Tensor:
    """q, k, v: [T, heads, head_dim] -> [T, heads, head_dim]; each token attends to its whole sequence."""
    if len(meta.groups) == 1:
        return _group_attention(q, k, v, meta.groups[0])
    out = torch.empty_like(q)
    for group in meta.groups:
        rows = slice(group.start, group.end)
        out[rows] = _group_attention(q[rows], k[rows], v[rows], group)
    return out


def _group_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: AttentionGroup) -> torch.Tensor:
    num_tokens, num_heads, head_dim = q.shape
    batch = len(group.seq_lens)
    shape = (batch, group.max_len, num_heads, head_dim)

    def pad(x: torch.Tensor) -> torch.Tensor:  # [T, H, D] -> [B, H, L, D]
        if group.padded_index is None:
            return x.reshape(shape).transpose(1, 2)
        padded = x.new_zeros(batch * group.max_len, num_heads, head_dim)
        padded[group.padded_index] = x
        return padded.view(shape).transpose(1, 2)

    out = F.scaled_dot_product_attention(pad(q), pad(k), pad(v), attn_mask=group.key_mask)  # [B, H, L, D]
    out = out.transpose(1, 2).reshape(batch * group.max_len, num_heads, head_dim)
    return out if group.padded_index is None else out[group.padded_index]


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        return self.LayerNorm(x + self.token_type_embeddings(token_type_ids))


class BertSelfAttention(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.query = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.key = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.value = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def prepare(self, backend: KernelBackend) -> None:
        self.qkv_proj = backend.make_fused_linear(self.query, self.key, self.value)
        del self.query, self.key, self.value

    def forward(self, x: torch.Tensor, meta: EncoderMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x).view(x.shape[0], 3, self.num_heads, self.head_dim)  # [T, 3, H, D]
        out = encoder_attention(qkv[:, 0], qkv[:, 1], qkv[:, 2], meta)
        return out.reshape(x.shape[0], -1)


class BertSelfOutput(nn.Module):
    """dense + residual + LayerNorm (post-LN), after attention and after the MLP alike."""

    def __init__(self, cfg: Any, in_features: int) -> None:
        super().__init__()
        self.dense = nn.Linear(in_features, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def prepare(self, backend: KernelBackend) -> None:
        self.dense = backend.make_linear(self.dense.weight, self.dense.bias)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(hidden) + residual)


class BertAttention(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.self = BertSelfAttention(cfg)
        self.output = BertSelfOutput(cfg, cfg.hidden_size)

    def forward(self, x: torch.Tensor, meta: EncoderMetadata) -> torch.Tensor:
        return self.output(self.self(x, meta), x)


class BertIntermediate(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        act = getattr(cfg, "hidden_act", "gelu")
        if act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act {act!r} is not supported; supported: {', '.join(_ACTIVATIONS)}")
        self.act = _ACTIVATIONS[act]

    def prepare(self, backend: KernelBackend) -> None:
        self.dense = backend.make_linear(self.dense.weight, self.dense.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.attention = BertAttention(cfg)
        self.intermediate = BertIntermediate(cfg)
        self.output = BertSelfOutput(cfg, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, meta: EncoderMetadata) -> torch.Tensor:
        x = self.attention(x, meta)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_hidden_layers))


class BertModel(nn.Module):
    """The encoder only; the checkpoint's `pooler` (a tanh layer over CLS) is not used by embedding models."""

    def __init__(self, cfg: Any, max_position: int) -> None:
        super().__init__()
        self.config = cfg
        position_type = getattr(cfg, "position_embedding_type", "absolute") or "absolute"
        if position_type != "absolute":
            raise ValueError(f"position_embedding_type {position_type!r} is not supported (only absolute)")
        if getattr(cfg, "is_decoder", False):
            raise ValueError("BertModel with is_decoder=true is not supported (encoders only)")
        self.embeddings = BertEmbeddings(cfg)
        self.encoder = BertEncoder(cfg)

    def prepare(self, backend: KernelBackend) -> None:
        """Fuse and pack for inference with `backend`'s linears; call once after loading."""
        for layer in self.encoder.layer:
            layer.attention.self.prepare(backend)
            layer.attention.output.prepare(backend)
            layer.intermediate.prepare(backend)
            layer.output.prepare(backend)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: EncoderMetadata,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions: [T] for whole sequences laid end to end -> hidden [T, hidden]."""
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        x = self.embeddings(input_ids, positions, token_type_ids)
        for layer in self.encoder.layer:
            x = layer(x, meta)
        return x

    def checkpoint_name_to_param(self, name: str) -> str | None:
        """Our parameter name for a checkpoint tensor, or None to skip it (pooler, MLM heads, buffers)."""
        name = name.removeprefix("bert.")
        if name.startswith(("pooler.", "cls.")) or name.endswith(("position_ids", "token_type_ids")):
            return None
        return name
