"""Llama-family decoders: Llama 2/3, SmolLM2, Mistral, Qwen2 (QKV bias), Qwen3 (per-head q/k RMSNorm), Granite
(scaling multipliers), Phi-3/Phi-4-mini (fused checkpoint matrices, partial rotary, LongRoPE), and the
mixture-of-experts Mixtral, Qwen2-MoE and Qwen3-MoE (SparseMoE in place of the MLP).

Parameter names equal the Hugging Face checkpoint's, so loading is a direct name match (Phi-3's fused q/k/v and
gate/up matrices are read as the parts they hold: checkpoint_parts). After loading,
`prepare()` fuses q/k/v and gate/up into single matmuls and hands every linear its kernel
(layers/linear.py); forward passes run on the prepared model only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.distributed.group import TPGroup
from pagedserve.distributed.layers import VocabParallelEmbedding, gather_logits
from pagedserve.distributed.sharding import ShardLayout
from pagedserve.kernels import FP8_FORMATS, CpuKernels
from pagedserve.layers.attention import AttentionMetadata, LayerKVCache, paged_attention
from pagedserve.layers.backend import KernelBackend
from pagedserve.layers.linear import BlockWeight, weight_of
from pagedserve.layers.norm import RMSNorm
from pagedserve.layers.rotary import RotaryEmbedding, apply_rotary
from pagedserve.memory.sizes import MoEShape, moe_shape
from pagedserve.memory.weight_format import (NATIVE_ACTIVATIONS, LayerKernels, LinearKernel, capped_prefill_on_torch,
                                             fused_rotary, layer_words, linear_words, rotary_dim)
from pagedserve.models.validate import layer_windows



def head_dim_of(cfg: Any) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


@dataclass(frozen=True)
class MoESpec:
    """A mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE): a router's softmax picks each token's top-k experts."""

    shape: MoEShape  # experts, how many per token, their width, the layers with a plain MLP (from the config)
    normalize: bool  # the top-k weights rescaled to sum to 1
    weights_in_model_dtype: bool  # Qwen3-MoE rounds the weights to the model dtype before scaling; Mixtral does not


@dataclass(frozen=True)
class DecoderSpec:
    """What a model's decoder layers are made of, where the Llama-family models differ (the model class says)."""

    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False  # per-head q/k norms before rotary (Qwen3, Gemma 3)
    norm: type[RMSNorm] = RMSNorm  # Gemma's scales by 1 + weight (models/gemma.py)
    activation: str = "silu"  # the MLP's gate (ACTIVATIONS)
    sandwich_norms: bool = False  # Gemma 2/3: attention and MLP outputs normed before they join the residual
    local_rotary: bool = False  # Gemma 3: rope_parameters per layer type, the sliding-window layers' of their own
    moe: MoESpec | None = None  # mixture-of-experts MLPs (SparseMoE)

    @property
    def qk_norm_gain(self) -> bool:
        """q/k norms that scale by a float32 gain (Gemma 3's 1 + weight; the fused rotary kernel's `gain`)."""
        return self.qk_norm and self.norm.gain_in_float32


class Attention(nn.Module):
    def __init__(self, cfg: Any, spec: DecoderSpec, tp: TPGroup | None = None, layout: ShardLayout | None = None
                 ) -> None:
        """With `tp`, this rank's heads of `layout` (distributed/sharding.py) and an all-reduce after o."""
        super().__init__()
        self.num_heads = cfg.num_attention_heads if layout is None else layout.local_heads
        self.num_kv_heads = (getattr(cfg, "num_key_value_heads", None) or self.num_heads) if layout is None \
            else layout.local_kv_heads
        self.head_dim = head_dim_of(cfg)
        self.partial_rotary = rotary_dim(cfg, self.head_dim) < self.head_dim
        self.tp = tp
        self.scale = self.head_dim ** -0.5  # Granite: its attention_multiplier (set by the model)
        self.window: int | None = None  # sliding-window attention (layer_windows, set by the model)
        self.rotary = True  # SmolLM3's NoPE layers: False (set by the model)
        self.softcap: float | None = None  # Gemma 2's attention logit softcapping (set by the model)
        hidden = cfg.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=spec.qkv_bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=spec.qkv_bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=spec.o_bias)
        if spec.qk_norm:
            self.q_norm = spec.norm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = spec.norm(self.head_dim, cfg.rms_norm_eps)
        self.qk_norm, self.qk_norm_gain = spec.qk_norm, spec.qk_norm_gain
        self.kernels: CpuKernels | None = None
        self.sdpa_prefill = False  # prefill chunks on torch's SDPA though the native kernels run (set by prepare)

    def prepare(self, backend: KernelBackend, kernels: CpuKernels | None) -> None:
        self.kernels = kernels
        # rotary + KV write in one native call (its vectors cover half a head: up to 16 lanes); a layer without
        # rotary (SmolLM3's NoPE layers) writes K/V there unrotated
        self.fused_rope = (self.qk_norm_eps_agree()
                           and fused_rotary(kernels is not None, self.head_dim, self.partial_rotary))
        self.sdpa_prefill = kernels is not None and backend.sdpa_prefill
        self.qkv_proj = backend.make_fused_linear(self.q_proj, self.k_proj, self.v_proj)
        o_bias = self.o_proj.bias if self.tp is None or self.tp.rank == 0 else None  # added once to the sum
        self.o_proj = backend.make_linear(weight_of(self.o_proj), o_bias)
        del self.q_proj, self.k_proj, self.v_proj
        self.q_size = self.num_heads * self.head_dim

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: LayerKVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        meta = meta.of_layer(self.window)  # a sliding-window layer's own pool where it has one
        qkv = self.qkv_proj.forward(x).view(num_tokens, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        kv_written = self.fused_rope and qkv.is_contiguous()
        if kv_written:  # one native call (norms q and k,) rotates them in place and writes K/V to the pool
            self.kernels.rope_kv_write(qkv, *(rope if self.rotary else (None, None)), kv_cache.k, kv_cache.v,
                                       meta.slot_mapping, self.num_heads, self.native_qk_norm(), self.qk_norm_gain,
                                       kv_cache.scales)
            q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        else:
            if self.qk_norm:
                q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
                qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
            else:
                qk, v = qkv.split([self.num_heads + self.num_kv_heads, self.num_kv_heads], dim=1)
            if self.rotary:
                qk = apply_rotary(qk, *rope)  # q and k heads rotated together: [T, Hq + Hkv, D]
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        out = paged_attention(q, k, v, kv_cache, meta, self.scale, self.kernels, kv_written, self.window, self.softcap,
                              self.sdpa_prefill)
        out = self.o_proj.forward(out.reshape(num_tokens, self.q_size))
        return out if self.tp is None else self.tp.all_reduce(out)  # the heads' partial sums


    def qk_norm_eps_agree(self) -> bool:
        """The fused kernel takes one eps for both per-head norms (transformers gives both the config's)."""
        return not self.qk_norm or self.q_norm.eps == self.k_norm.eps

    def native_qk_norm(self) -> tuple[torch.Tensor, torch.Tensor, float] | None:
        """(q_norm weight, k_norm weight, eps) for the fused rotary kernel, where the heads are normalised first
        (read at each call: the parameters the loader bound last; Gemma 3's: the float32 gains, qk_norm_gain)."""
        return (self.q_norm.native_weight(), self.k_norm.native_weight(), self.q_norm.eps) if self.qk_norm else None


class MLP(nn.Module):
    def __init__(self, cfg: Any, activation: str, tp: TPGroup | None = None, layout: ShardLayout | None = None,
                 width: int | None = None) -> None:
        """`activation`: the gate's (ACTIVATIONS). With `tp`, this rank's slice of the intermediate width and an
        all-reduce after down. `width`: the intermediate size where it is not the config's (an expert's)."""
        super().__init__()
        width = width or (cfg.intermediate_size if layout is None else layout.local_intermediate)
        self.gate_proj = nn.Linear(cfg.hidden_size, width, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, width, bias=False)
        self.down_proj = nn.Linear(width, cfg.hidden_size, bias=False)
        self.tp = tp
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation {activation!r} is not supported (only {', '.join(ACTIVATIONS)})")
        self.activation = activation
        if getattr(cfg, "mlp_bias", False):  # else its bias tensors read as "config.json does not match the weights"
            raise ValueError("mlp_bias: true (biases in the MLP's linears) is not supported")

    def prepare(self, backend: KernelBackend, kernels: CpuKernels | None) -> None:
        self.kernels = kernels if self.activation in NATIVE_ACTIVATIONS else None  # the native act(gate) x up
        self.intermediate_size = self.gate_proj.out_features
        self.gate_up_proj = backend.make_fused_linear(self.gate_proj, self.up_proj)
        self.down_proj = backend.make_linear(weight_of(self.down_proj), None)
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj.forward(x)  # [T, 2I]
        if self.kernels is not None:
            out = self.down_proj.forward(self.kernels.gate_mul(gate_up, self.activation))
        else:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            out = self.down_proj.forward(ACTIVATIONS[self.activation](gate) * up)
        return out if self.tp is None else self.tp.all_reduce(out)  # the intermediate slices' partial sums


class SparseMoE(nn.Module):
    """A mixture-of-experts MLP, as transformers runs Mixtral's and Qwen2/3-MoE's: the router (`gate`) scores the
    experts, a softmax in float32 and its top k pick each token's experts (renormalised where the model does), and
    each picked expert's MLP output, scaled by its weight, is added to the token's output, experts in ascending
    order. Each expert is an MLP on the kernels every MLP runs; the router stays a plain matmul in the model dtype
    (its scores decide which experts run)."""

    def __init__(self, cfg: Any, activation: str, moe: MoESpec) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.hidden_size, moe.shape.num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(cfg, activation, width=moe.shape.width) for _ in range(moe.shape.num_experts))
        if moe.shape.shared_width:  # Qwen2-MoE: an expert every token takes, scaled by a sigmoid gate of its own
            self.shared_expert = MLP(cfg, activation, width=moe.shape.shared_width)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        self.moe = moe
        self.activation = activation
        self.kernels = None  # not one MLP: the native decode stack leaves these layers (NativeDecodeStack.build)

    def prepare(self, backend: KernelBackend, kernels: CpuKernels | None) -> None:
        for expert in experts_of(self):
            expert.prepare(backend, kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._routed(x)
        if self.moe.shape.shared_width:  # transformers' order: routed + sigmoid(gate) x shared, in the model dtype
            out = out + torch.sigmoid(F.linear(x, self.shared_expert_gate.weight)) * self.shared_expert.forward(x)
        return out

    def _routed(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(F.linear(x, self.gate.weight), dim=-1, dtype=torch.float32)  # [T, E]
        weights, chosen = torch.topk(probs, self.moe.shape.top_k, dim=-1)  # [T, k]
        if self.moe.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.moe.weights_in_model_dtype:
            weights = weights.to(x.dtype)
        if x.shape[0] == 1:  # batch-1 decode: no grouping of rows by expert, the same sums in the same order
            out = None
            for expert, slot in sorted(zip(chosen[0].tolist(), range(self.moe.shape.top_k))):
                # scaled as the grouped path scales (a [1, 1] weight: Mixtral's products in float32, then rounded)
                y = (self.experts[expert].forward(x) * weights[:, slot, None]).to(x.dtype)
                out = y if out is None else out + y
            return out
        out = torch.zeros_like(x)
        for expert in chosen.unique().tolist():  # ascending, as transformers adds them
            rows, slot = (chosen == expert).nonzero(as_tuple=True)
            y = self.experts[expert].forward(x[rows]) * weights[rows, slot, None]
            out.index_add_(0, rows, y.to(out.dtype))
        return out


def experts_of(mlp: nn.Module) -> list[MLP]:
    """A layer's MLPs: a SparseMoE's experts (its shared one last), or the MLP itself."""
    if not isinstance(mlp, SparseMoE):
        return [mlp]
    return [*mlp.experts, *([mlp.shared_expert] if mlp.moe.shape.shared_width else [])]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Any, spec: DecoderSpec, tp: TPGroup | None = None, layout: ShardLayout | None = None,
                 index: int = 0) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, spec, tp, layout)
        sparse = spec.moe is not None and index not in spec.moe.shape.dense_layers
        self.mlp = SparseMoE(cfg, spec.activation, spec.moe) if sparse else MLP(cfg, spec.activation, tp, layout)
        self.input_layernorm = spec.norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = spec.norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.sandwich_norms = spec.sandwich_norms
        if spec.sandwich_norms:  # post_attention_layernorm then norms the attention's output
            self.pre_feedforward_layernorm = spec.norm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_feedforward_layernorm = spec.norm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: tuple[torch.Tensor, torch.Tensor],
                kv_cache: LayerKVCache, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it); the next norm adds the two, so each
        residual add happens inside a norm (one fused kernel where the native kernels run)."""
        h, residual = self.input_layernorm.add_and_norm(x, residual)
        h = self.self_attn.forward(h, rope, kv_cache, meta)
        if self.sandwich_norms:
            h = self.post_attention_layernorm.forward(h)
            h, residual = self.pre_feedforward_layernorm.add_and_norm(h, residual)
            return self.post_feedforward_layernorm.forward(self.mlp.forward(h)), residual
        h, residual = self.post_attention_layernorm.add_and_norm(h, residual)
        return self.mlp.forward(h), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: Any, spec: DecoderSpec, max_position: int, tp: TPGroup | None = None,
                 layout: ShardLayout | None = None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if tp is None else \
            VocabParallelEmbedding(layout, cfg.hidden_size, tp)
        self.rotary_emb = RotaryEmbedding(cfg, head_dim_of(cfg), max_position,
                                          layer_type="full_attention" if spec.local_rotary else None)
        self.local_rotary_emb = RotaryEmbedding(cfg, head_dim_of(cfg), max_position, layer_type="sliding_attention") \
            if spec.local_rotary else None  # the sliding-window layers' (Gemma 3)
        self.layers = nn.ModuleList(DecoderLayer(cfg, spec, tp, layout, i) for i in range(cfg.num_hidden_layers))
        for layer, window in zip(self.layers, layer_windows(cfg)):
            layer.self_attn.window = window
        self.norm = spec.norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.embedding_multiplier = 1.0  # Granite's scale of the token embeddings, Gemma's sqrt(hidden_size)
        self.embedding_multiplier_rounded = False  # Gemma: the scale rounded to the model dtype before it multiplies
        self.tp = tp
        self.stack: NativeDecodeStack | None = None
        self._stack_kernels: CpuKernels | None = None  # set: build the stack at the next forward

    def prepare_stack(self, kernels: CpuKernels | None) -> None:
        """Use the native decode stack for decode-only steps where every layer can run in it. Its table
        holds data pointers, so it is built at the first forward, after the loader has settled every
        parameter (it replaces the norms' checkpoint-mapped tensors after prepare())."""
        self.stack, self._stack_kernels = None, kernels

    def _apply(self, fn, recurse=True):
        result = super()._apply(fn, recurse)
        if self.stack is not None:  # tensors moved: read their pointers again
            self.prepare_stack(self.stack.kernels)
        return result

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[LayerKVCache],
                meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, hidden]
        if self.embedding_multiplier != 1.0:
            scale = self.embedding_multiplier
            x = x * (torch.tensor(scale, dtype=x.dtype) if self.embedding_multiplier_rounded else scale)
        rope = self.rotary_emb.lookup(positions, x.dtype)  # once per step, shared by every layer
        local = rope if self.local_rotary_emb is None else self.local_rotary_emb.lookup(positions, x.dtype)
        if self._stack_kernels is not None:
            self.stack, self._stack_kernels = NativeDecodeStack.build(self, self._stack_kernels), None
        if self.stack is not None and self.stack.runs(x, kv_caches, meta):
            return self.stack.forward(x, rope, local, kv_caches, meta)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):  # .forward: skip nn.Module call overhead
            x, residual = layer.forward(x, residual, rope if layer.self_attn.window is None else local, kv_cache, meta)
        return self.norm.add_and_norm(x, residual)[0]


class PackedRowsEmbedding(nn.Module):
    """A tied embedding that reads its rows from the logits projection's packed weight (one copy)."""

    def __init__(self, logits_proj: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "source", logits_proj)  # not a submodule: it belongs to the model's head
        self.embedding_dim = logits_proj.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.source.rows(ids)


class NativeDecodeStack:
    """All decoder layers of a decode-only step on the native kernels: the C decoder layer (its attention and
    MLP halves, cpu_kernels.c) over every layer, the per-layer path's kernels in the same order. Without
    tensor parallelism in one native call (kernels.decode_stack), without ~10 Python calls and their tensors
    per layer (about 3 ms of a 30 ms bf16 step on the 2-core Zen 5; see benchmarks/PROFILE.md); with it, two
    calls per layer with this rank's all-reduce after each half. Used where every layer runs native kernels
    with rotary fused into the KV write (Qwen3's and Gemma 3's q/k norms with it), a native MLP gate (SiLU, Gemma's
    GELU), the KV pool in the model dtype or fp8 (its scales and format the table's too). Gemma's norms (float32
    gains, sandwich norms) are the table's flags and columns; layers with a sliding window of their own (Gemma 2/3,
    Qwen's max_window_layers) or a rotary of their own (Gemma 3's sliding-window layers, SmolLM3's layers without
    one) read a step view of their own: the step's context cut to their window and their rotary tables."""

    def __init__(self, kernels: CpuKernels, model: DecoderModel, table: torch.Tensor, int8: bool,
                 tensors: list[torch.Tensor], views: list[tuple[int | None, str | None]]) -> None:
        self.kernels = kernels
        self.tp = model.tp
        self.table = table  # [layers, kernels.layer_fields] int64; the K/V pool columns filled per pool
        self._tensors = tensors  # what the table points at, kept alive with it
        self.max_rows = kernels.int8_max_rows(model.norm.weight.dtype) if int8 else None
        attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
        self.dims = (attn.num_heads, attn.num_kv_heads, attn.head_dim, mlp.intermediate_size)
        self.eps, self.scale, self.softcap = model.norm.eps, attn.scale, attn.softcap  # every layer's (build checks)
        self.views = views  # (window, rotary: "global", "local" or None) per step view, a layer's view its column
        local = model.local_rotary_emb is not None
        self.view_of = [views.index(self.view_key(layer, local)) for layer in model.layers]
        self.final_norm = model.norm.native_weight()
        self.norm_gain = model.norm.gain_in_float32
        self.mlp_out_norms = [getattr(layer, "post_feedforward_layernorm", None) if layer.sandwich_norms else None
                              for layer in model.layers]  # with tensor parallelism: applied here, after reducing
        self._pools: list[LayerKVCache] | None = None

    @classmethod
    def build(cls, model: DecoderModel, kernels: CpuKernels) -> NativeDecodeStack | None:
        if model.norm.weight.device.type != "cpu":
            return None  # the native kernels read host memory
        layout = kernels.layer_layout  # the library's own column of each field
        rows, int8, tensors = [], False, []
        local = model.local_rotary_emb is not None
        views = list(dict.fromkeys(cls.view_key(layer, local) for layer in model.layers))
        first = model.layers[0]
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qk_norm = attn.native_qk_norm()
            norms = cls._norms(layer)
            if (not attn.fused_rope or attn.softcap != first.self_attn.softcap or mlp.kernels is None
                    or mlp.activation not in NATIVE_ACTIVATIONS or attn.scale != first.self_attn.scale
                    or any(norm.eps != model.norm.eps or norm.gain_in_float32 != model.norm.gain_in_float32
                           for norm in norms.values())
                    or (qk_norm is not None and qk_norm[2] != model.norm.eps)):
                return None
            row = [0] * layout["layer_fields"]  # K/V pools: set by _bind_pools
            for name, norm in norms.items():
                row[layout[name]] = norm.native_weight().data_ptr()
                tensors.append(norm.native_weight())
            if qk_norm is not None:  # Qwen3's and Gemma 3's per-head norms, applied by the fused rotary
                row[layout["q_norm"]], row[layout["k_norm"]] = qk_norm[0].data_ptr(), qk_norm[1].data_ptr()
                tensors += [qk_norm[0], qk_norm[1]]
            row[layout["flags"]] = ((layout["norm_gain"] if model.norm.gain_in_float32 else 0)
                                    | (layout["gelu_tanh"] if mlp.activation == "gelu_pytorch_tanh" else 0))
            row[layout["view"]] = views.index(cls.view_key(layer, local))
            for name, linear in (("qkv", attn.qkv_proj), ("o", attn.o_proj), ("gate_up", mlp.gate_up_proj),
                                 ("down", mlp.down_proj)):
                entry = linear.native_fields() if hasattr(linear, "native_fields") else None
                if entry is None:
                    return None
                if len(entry) != layout["linear_fields"]:
                    raise RuntimeError(f"{type(linear).__name__} gives {len(entry)} fields, the library reads "
                                       f"{layout['linear_fields']}")
                int8 = int8 or entry[0] == 1
                row[layout[name]:layout[name] + len(entry)] = entry
                tensors += list(linear.buffers())
            rows.append(row)
        return cls(kernels, model, torch.tensor(rows, dtype=torch.int64), int8, tensors, views)

    @staticmethod
    def view_key(layer: DecoderLayer, local_rotary: bool) -> tuple[int | None, str | None]:
        """(window, rotary) of the step view `layer` reads: its sliding window (None: the whole context) and its
        rotary tables, as DecoderModel.forward picks them: "local" for a sliding-window layer of a model with a
        `local_rotary` of its own for those (Gemma 3), None for a layer without rotary, else "global"."""
        attn = layer.self_attn
        if not attn.rotary:
            return attn.window, None
        return attn.window, "local" if attn.window is not None and local_rotary else "global"

    @staticmethod
    def _norms(layer: DecoderLayer) -> dict[str, RMSNorm]:
        """The layer's norms by their table column: with sandwich norms (Gemma 2/3) post_attention_layernorm norms
        the attention's output and pre_feedforward_layernorm is the one before the MLP."""
        if not layer.sandwich_norms:
            return {"in_norm": layer.input_layernorm, "post_norm": layer.post_attention_layernorm}
        return {"in_norm": layer.input_layernorm, "attn_out_norm": layer.post_attention_layernorm,
                "post_norm": layer.pre_feedforward_layernorm, "mlp_out_norm": layer.post_feedforward_layernorm}

    def runs(self, x: torch.Tensor, kv_caches: list[LayerKVCache], meta: AttentionMetadata) -> bool:
        """This step is decode-only and within what the stack handles."""
        return (not meta.prefills and meta.num_decodes == x.shape[0] and meta.decode_context_lens is not None
                and (self.max_rows is None or x.shape[0] <= self.max_rows))

    def _bind_pools(self, kv_caches: list[LayerKVCache]) -> None:
        if kv_caches is self._pools:
            return
        layout = self.kernels.layer_layout
        self.table[:, layout["k_cache"]] = torch.tensor([c.k.data_ptr() for c in kv_caches], dtype=torch.int64)
        self.table[:, layout["v_cache"]] = torch.tensor([c.v.data_ptr() for c in kv_caches], dtype=torch.int64)
        for name in ("k_scale", "v_scale"):  # an fp8 pool's, else 0
            pointers = [0 if getattr(c, name) is None else getattr(c, name).data_ptr() for c in kv_caches]
            self.table[:, layout[name]] = torch.tensor(pointers, dtype=torch.int64)
        formats = [FP8_FORMATS.get(c.k.dtype, 0) for c in kv_caches]  # the C code's FP8_*: 0 a 16/32-bit pool
        self.table[:, layout["kv_format"]] = torch.tensor(formats, dtype=torch.int64)
        self._pools = kv_caches  # the runner keeps one list of pools for the engine's life

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                local_rope: tuple[torch.Tensor, torch.Tensor], kv_caches: list[LayerKVCache],
                meta: AttentionMetadata) -> torch.Tensor:
        """`local_rope`: the sliding-window layers' rotary tables where they have their own (Gemma 3), else `rope`."""
        self._bind_pools(kv_caches)
        views = []
        for window, rotary in self.views:
            cut = meta.within(window)
            cos, sin = (None, None) if rotary is None else (local_rope if rotary == "local" else rope)
            if cos is not None:
                cos, sin = cos.contiguous(), sin.contiguous()
            views.append((cos, sin, cut.slot_mapping.contiguous(), cut.decode_kv_slots, cut.decode_context_lens))
        if self.tp is None:
            return self.kernels.decode_stack(x.contiguous(), self.table, self.final_norm, views, *self.dims,
                                             self.eps, self.scale, self.softcap)
        heads, kv_heads, head_dim, intermediate = self.dims
        h, residual = x.contiguous(), torch.empty_like(x)
        for index in range(self.table.shape[0]):
            row = self.table[index]
            cos, sin, slots, ctx_slots, lens = views[self.view_of[index]]
            y = self.kernels.layer_attention(row, h, residual, index == 0, cos, sin, slots, ctx_slots, lens, heads,
                                             kv_heads, head_dim, self.eps, self.scale, self.softcap)
            y = self.tp.all_reduce(y)  # the heads' partial sums
            h = self.tp.all_reduce(self.kernels.layer_mlp(row, y, residual, intermediate, self.eps))
            out_norm = self.mlp_out_norms[index]
            if out_norm is not None:  # Gemma 2/3's norm of the whole MLP output
                h = self.kernels.rms_norm(h, out_norm.native_weight(), self.eps, gain=self.norm_gain)[0]
        return self.kernels.rms_norm(h, self.final_norm, self.eps, residual, gain=self.norm_gain)[0]


class LlamaForCausalLM(nn.Module):
    """Also serves Mistral; subclasses switch on QKV bias (Qwen2) and q/k norm (Qwen3), add Granite's scales and
    read Phi-3's fused checkpoint matrices."""

    qkv_bias = False
    o_bias: bool | None = None  # None: follow config.attention_bias, as Llama and Qwen3 do
    qk_norm = False
    logits_scaling = 1.0  # Granite divides its logits by this

    def __init__(self, cfg: Any, max_position: int, tp: TPGroup | None = None) -> None:
        """`tp`: this rank's group; the model then holds the rank's shard (distributed/sharding.py). Built by
        models/loader.load_model, on the meta device and without initialising layers (layers/skip_init)."""
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.layout = None if tp is None else ShardLayout.for_config(cfg, tp.rank, tp.world_size)
        spec = self.decoder_spec(cfg)
        self.moe = spec.moe
        self.model = DecoderModel(cfg, spec, max_position, tp, self.layout)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            vocab_rows = cfg.vocab_size if self.layout is None else self.layout.vocab_per_rank
            self.lm_head = nn.Linear(cfg.hidden_size, vocab_rows, bias=False)

    @classmethod
    def decoder_spec(cls, cfg: Any) -> DecoderSpec:
        attention_bias = bool(getattr(cfg, "attention_bias", False))
        return DecoderSpec(qkv_bias=cls.qkv_bias or attention_bias,
                           o_bias=attention_bias if cls.o_bias is None else cls.o_bias, qk_norm=cls.qk_norm,
                           activation=getattr(cfg, "hidden_act", "silu"), moe=cls.moe_spec(cfg))

    @classmethod
    def moe_spec(cls, cfg: Any) -> MoESpec | None:
        """The mixture-of-experts MLPs of the models that have them (their classes say how they route)."""
        return None

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    @property
    def num_kv_heads(self) -> int:
        return self.model.layers[0].self_attn.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.model.layers[0].self_attn.head_dim

    @property
    def layer_windows(self) -> list[int | None]:
        """Each layer's sliding window (None: the whole context)."""
        return [layer.self_attn.window for layer in self.model.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[LayerKVCache],
                meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, meta)

    def prepare(self, backend: KernelBackend) -> None:
        """Fuse and pack for inference with `backend`'s kernels; call once after loading, before any forward."""
        self.prepare_decoder(backend)
        # Tied models: the logits need the embedding in the kernel's format. Where that is the native bf16
        # layout, lookups read rows from it and the plain table goes; otherwise both copies stay.
        weight = self.model.embed_tokens.weight if self.tie_word_embeddings else weight_of(self.lm_head)
        self.logits_proj = backend.make_linear(weight, None)
        if not self.tie_word_embeddings:
            del self.lm_head
        elif self.logits_proj.implementation == "native-bf16":  # rows readable from its packed layout
            if self.tp is None:
                self.model.embed_tokens = PackedRowsEmbedding(self.logits_proj)
            else:
                self.model.embed_tokens.use_rows_of(self.logits_proj)

    def prepare_decoder(self, backend: KernelBackend) -> None:
        """The decoder stack's part of prepare(): fused linears from `backend`, and its native CPU kernels
        for norms, SiLU, rotary and decode attention where this model's sizes fit them."""
        attn = self.model.layers[0].self_attn
        widths = {expert.gate_proj.out_features for layer in self.model.layers for expert in experts_of(layer.mlp)}
        found = [backend.decoder_kernels(self.config.hidden_size, width, attn.head_dim) for width in sorted(widths)]
        kernels = found[0] if all(k is not None for k in found) else None
        for layer in self.model.layers:
            layer.self_attn.prepare(backend, kernels)
            layer.mlp.prepare(backend, kernels)
            for norm in layer.modules():  # q/k norms (3-D inputs): in the fused rotary kernel, else torch ops
                if isinstance(norm, RMSNorm):
                    norm.kernels = kernels
        self.model.norm.kernels = kernels
        # with tensor parallelism: layer by layer, all-reducing between
        self.model.prepare_stack(kernels if self.layer_kernels().stack else None)

    def layer_kernels(self) -> LayerKernels:
        """What the prepared layers run (the same rule and words as `pagedserve doctor`'s prediction)."""
        attn, norm = self.model.layers[0].self_attn, self.model.layers[0].input_layernorm
        mlp = experts_of(self.model.layers[0].mlp)[0]  # an expert's kernels stand for a mixture's (each layer's below)
        rotary_fused = all(layer.self_attn.fused_rope for layer in self.model.layers)  # SmolLM3's NoPE layers: not
        mlps = [experts_of(layer.mlp)[0] for layer in self.model.layers]
        per_layer = {"qkv": [layer.self_attn.qkv_proj for layer in self.model.layers],  # a GGUF's types may differ
                     "o": [layer.self_attn.o_proj for layer in self.model.layers],  # from layer to layer
                     "gate_up": [m.gate_up_proj for m in mlps], "down": [m.down_proj for m in mlps]}
        if getattr(self, "logits_proj", None) is not None:
            per_layer["logits"] = [self.logits_proj]
        linears = tuple(linear_kernel_of(name, modules) for name, modules in per_layer.items())
        attention_native = attn.kernels is not None
        capped_on_torch = attention_native and capped_prefill_on_torch(attn.softcap is not None,
                                                                       attn.kernels.batch_invariant)
        return LayerKernels(len(self.model.layers), linears, norm.kernels is not None, rotary_fused,
                            None if self.tp is None else (self.tp.rank, self.tp.world_size), mlp.activation,
                            None if attention_native == (norm.kernels is not None) else attention_native,
                            sdpa_prefill=attn.sdpa_prefill, softcapped=capped_on_torch,
                            experts=None if self.moe is None else (self.moe.shape.num_experts, self.moe.shape.top_k))

    def kernel_report(self) -> list[str]:
        """What each part of the model runs, for the start-up log (one line per kind of layer)."""
        return self.layer_kernels().lines()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> float32 logits [N, vocab] (with tensor parallelism: on rank 0, None elsewhere)."""
        logits = self.logits_proj(hidden).float()
        if self.logits_scaling != 1.0:
            logits /= self.logits_scaling
        return logits if self.tp is None else gather_logits(self.tp, logits, self.config.vocab_size)

    def shard_checkpoint_tensor(self, param_name: str, tensor: Any) -> Any:
        """This rank's slice of a checkpoint tensor (the whole tensor without tensor parallelism)."""
        return tensor if self.layout is None else self.layout.shard(param_name, tensor)

    def checkpoint_parts(self, name: str, rows: int) -> list[tuple[str, int, int]]:
        """A checkpoint tensor as the parameters it fills: [(checkpoint name of the part, first row, rows)]. One
        part, the whole tensor, but where a checkpoint stores matrices fused (Phi-3)."""
        return [(name, 0, rows)]

    def checkpoint_name_to_param(self, name: str) -> str | None:
        """Our parameter name for a checkpoint tensor, or None to skip it."""
        if "rotary_emb.inv_freq" in name:
            return None
        if name == "lm_head.weight" and self.tie_word_embeddings:
            return None
        return name


def linear_kernel_of(name: str, modules: list[nn.Module]) -> LinearKernel:
    """The kernel a prepared linear (layers/linear.py) runs in each layer (`modules`: one a layer), as they say."""
    words = [linear_words(m.implementation, None if m.native is None else m.native.isa) for m in modules]
    return LinearKernel(name, layer_words(words), all(m.native is not None for m in modules))


class SmolLM3ForCausalLM(LlamaForCausalLM):
    """SmolLM3: Llama layers, some without rotary position embeddings (no_rope_layers: 0 = NoPE; every fourth by
    default). Those layers write their K/V unrotated (the fused rotary kernel without tables; in the decode stack a
    step view without them)."""

    def __init__(self, cfg: Any, max_position: int, tp: TPGroup | None = None) -> None:
        super().__init__(cfg, max_position, tp)
        for layer, rotary in zip(self.model.layers, cfg.no_rope_layers):
            layer.self_attn.rotary = bool(rotary)


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True  # q/k/v always have biases; o_proj never (a GGUF's attention_bias means the former)
    o_bias = False


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True


def _moe_spec(cfg: Any, normalize: bool, weights_in_model_dtype: bool) -> MoESpec | None:
    """None where the config has no sparse layer (no experts, or every layer a plain MLP): a dense model, as
    transformers builds it."""
    shape = moe_shape(cfg)
    return None if shape is None else MoESpec(shape, normalize, weights_in_model_dtype)


class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    """Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention; MoE MLPs routed as Qwen3-MoE's, plus a
    shared expert every token takes, scaled by the sigmoid of a gate of its own."""

    @classmethod
    def moe_spec(cls, cfg: Any) -> MoESpec | None:
        return _moe_spec(cfg, normalize=bool(getattr(cfg, "norm_topk_prob", False)), weights_in_model_dtype=True)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen3-MoE (Qwen3-30B-A3B and the like): Qwen3's attention; MoE MLPs whose top-k weights are renormalised
    where norm_topk_prob says, and rounded to the model dtype; mlp_only_layers and decoder_sparse_step keep a plain
    MLP in some layers."""

    @classmethod
    def moe_spec(cls, cfg: Any) -> MoESpec | None:
        return _moe_spec(cfg, normalize=bool(getattr(cfg, "norm_topk_prob", False)), weights_in_model_dtype=True)


class MixtralForCausalLM(LlamaForCausalLM):
    """Mixtral: Mistral's attention; MoE MLPs (the softmax of the top-k router scores weighs the experts, in float32).
    Its checkpoint names the experts' matrices w1 (gate), w2 (down) and w3 (up) under block_sparse_moe (a GGUF's
    come as mlp.experts.E.*: formats/gguf_hf.py)."""

    _NAMES = ((".block_sparse_moe.", ".mlp."), (".w1.", ".gate_proj."), (".w2.", ".down_proj."), (".w3.", ".up_proj."))

    @classmethod
    def moe_spec(cls, cfg: Any) -> MoESpec | None:
        return _moe_spec(cfg, normalize=True, weights_in_model_dtype=False)

    def checkpoint_name_to_param(self, name: str) -> str | None:
        name = super().checkpoint_name_to_param(name)
        if name is not None and ".block_sparse_moe." in name:
            for old, new in self._NAMES:
                name = name.replace(old, new)
        return name


class GraniteForCausalLM(LlamaForCausalLM):
    """IBM Granite 3.x: Llama with four scales. The residual multiplier, applied to each attention and MLP output
    before it joins the residual stream, is folded into o_proj and down_proj at prepare(), so every kernel
    (the native decode stack included) runs the plain Llama layer."""

    def __init__(self, cfg: Any, max_position: int, tp: TPGroup | None = None) -> None:
        super().__init__(cfg, max_position, tp)
        self.model.embedding_multiplier = float(cfg.embedding_multiplier)
        self.logits_scaling = float(cfg.logits_scaling)
        for layer in self.model.layers:
            layer.self_attn.scale = float(cfg.attention_multiplier)

    def prepare(self, backend: KernelBackend) -> None:
        scale = float(self.config.residual_multiplier)
        if scale != 1.0:
            for layer in self.model.layers:
                for linear in (layer.self_attn.o_proj, layer.mlp.down_proj):
                    _scale_parameters(linear, scale)
        super().prepare(backend)


def _scale_parameters(linear: nn.Module, scale: float) -> None:
    """Multiply a loaded linear's weight (and bias) by `scale` into new tensors: the loaded ones may view the
    memory-mapped checkpoint, which must not be written. Int8 rows that arrive quantized (a GGUF's blocks under
    int8 matmuls) take it in their per-row scales."""
    quantized = getattr(linear, "quantized_weight", None)
    if isinstance(quantized, BlockWeight):  # fp16 block scales times `scale` would round: per-row int8 takes it
        quantized = quantized.to_int8()
    if quantized is not None:
        linear.quantized_weight = dataclasses.replace(quantized, scales=quantized.scales * scale)
    for name in ("bias",) if quantized is not None else ("weight", "bias"):
        param = getattr(linear, name, None)
        if param is not None:
            setattr(linear, name, nn.Parameter(param.detach() * scale, requires_grad=False))


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3, Phi-3.5 and Phi-4-mini: Llama layers whose checkpoint fuses q/k/v (`qkv_proj`) and gate/up
    (`gate_up_proj`) into one matrix each; they are bound as views of their rows. Partial rotary
    (`partial_rotary_factor`) and LongRoPE come from the config (layers/rotary.py)."""

    def checkpoint_parts(self, name: str, rows: int) -> list[tuple[str, int, int]]:
        cfg = self.config
        if name.endswith(".self_attn.qkv_proj.weight"):
            prefix = name.removesuffix("qkv_proj.weight")
            heads = cfg.num_attention_heads
            q_rows = heads * head_dim_of(cfg)
            kv_rows = (getattr(cfg, "num_key_value_heads", None) or heads) * head_dim_of(cfg)
            return [(prefix + "q_proj.weight", 0, q_rows), (prefix + "k_proj.weight", q_rows, kv_rows),
                    (prefix + "v_proj.weight", q_rows + kv_rows, kv_rows)]
        if name.endswith(".mlp.gate_up_proj.weight"):
            prefix = name.removesuffix("gate_up_proj.weight")
            width = cfg.intermediate_size
            return [(prefix + "gate_proj.weight", 0, width), (prefix + "up_proj.weight", width, width)]
        return [(name, 0, rows)]
