"""What a model occupies, from its shape and before anything is loaded: the weights as the kernels will hold
them, the KV cache per token, and the runtime besides (interpreter, tokenizer, tables), with the measurements
behind the constants. memory/plan.py adds the step's activations and sizes the KV pool against the memory
available. Pure Python (no torch).

Formulas (M = max_model_len, S = max_num_seqs, L layers, V vocab, kvh KV heads, hd head_dim):

  KV bytes per token = 2 (K and V) x L x kvh x (hd x kv_dtype_bytes + kv_scale_bytes of an 8-bit cache)
  weights            = the checkpoint's tensors in the serving dtype, re-laid out for the linear kernels
                       (prepared_weight_bytes: int8 linears, the logits head's layout)
  runtime overhead   = on a CPU: the interpreter with torch, the HTTP stack and the engine code
                       (CPU_RUNTIME_BASE_BYTES; + TRANSFORMERS_RUNTIME_BYTES where it is loaded) + the tokenizer (TOKENIZER_BYTES_PER_TOKEN x V) + the rotary
                       cos/sin tables (2 x M x hd x 4) + the block table (S x ceil(M / block) x 8);
                       on a GPU: the CUDA context (CUDA_RUNTIME_OVERHEAD_BYTES) + the rotary tables.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

GIB = 1 << 30  # the byte units, defined here only (probe, rss, pressure, the CLI import them)
MIB = 1 << 20

# Resident memory of the runtime before any weight is loaded. Measured on the dev box (Python 3.11,
# torch 2.13.0+cpu, transformers 5.24) with VmRSS from /proc/self/status, three runs each:
#   python -c "import torch, transformers"                                  245,020 KiB (239 MiB)
#   + fastapi, uvicorn, safetensors, tokenizers, AutoTokenizer               272,820 KiB (266 MiB)
#   + a byte-level BPE tokenizer of Qwen2's size (151,643 tokens) loaded
#     with PreTrainedTokenizerFast and run once                              373,152 KiB (364 MiB)
# rounded up to 384 MiB for thread stacks and allocator arenas. On a GPU, pass the device-side overhead
# (CUDA context, cuBLAS workspace) instead, measured with torch.cuda.mem_get_info around initialisation.
CPU_RUNTIME_OVERHEAD_BYTES = 384 * MIB

# The engine's runtime overhead (runtime_overhead_bytes()), calibrated on `pagedserve serve` after warm-up
# (VmRSS in the engine's "memory:" log line; default flags on the AVX2 Zen 3 box: int8 for the GGUFs, bf16
# native-packed linears for the directory; torch 2.13.0+cpu, Python 3.11), as RSS minus the other steady terms:
#   model (vocab)                        RSS     weights  rotary + block table  KV bookkeeping  rest
#   tiny llama dir (512)                 275     0.3      0.1                   2               ~273 MiB
#   SmolLM2-135M GGUF (49,152)           487-489 183      5                     4               ~296 MiB
#   Qwen2.5-0.5B shape dir (151,936)     1310    942      20                    7               ~341 MiB
#   Qwen2.5-Coder-0.5B GGUF (151,936)    1101-1105 732    20                    7               ~344 MiB
# The rest grows with the vocabulary (the tokenizer's vocab and merges, the warm-up's logits and sampler
# buffers that the allocator keeps): 272 MiB + 494 B per vocabulary token is within 1 % of all four. A model
# whose tokenizer or config loads through transformers (AutoTokenizer, AutoConfig: e.g. BERT embedders) adds
# TRANSFORMERS_RUNTIME_BYTES: all-MiniLM-L6-v2 (30,522) has 350 MiB RSS after warm-up for 43 MiB of weights
# (`serve --max-num-seqs 4`, 2 Zen 5 vCPUs, 2026-12-05), ~21 MiB above the rule; importing transformers and its
# BERT tokenizer measured 43 MiB in one process, which is the figure taken. (It was 160 MiB, measured while
# building BERT's layers imported torch._dynamo and triton: 491 MiB on the Zen 3, 584 MiB on the Zen 5. The rule
# was 384 MiB + 1600 B per token while serving imported transformers and dequantized GGUF weights through torch
# temporaries.)
CPU_RUNTIME_BASE_BYTES = 272 * MIB
TOKENIZER_BYTES_PER_TOKEN = 494
TRANSFORMERS_RUNTIME_BYTES = 48 * MIB
# Structured outputs load on a generative model's first constrained request (json_schema, tools, ...): xgrammar,
# transformers' tokenizer it reads, and its vocabulary tables. RSS after the first json_schema request minus before,
# in one process (2 Zen 5 vCPUs, 2026-12-05): SmolLM2 (49,152 tokens) 61 MiB, Qwen2.5-Coder (151,936) 74 MiB. The
# plan counts them from the start: a server at --max-num-seqs 2 ran 7-13 % over its plan (and warned) once a
# client asked for JSON.
STRUCTURED_OUTPUTS_BASE_BYTES = 56 * MIB
STRUCTURED_OUTPUTS_BYTES_PER_TOKEN = 132
# The compiled grammars kept for reuse (structured/compiler.py keeps at most this many bytes of them; a JSON schema
# over a 152k vocabulary is ~1.8 MiB): part of the structured-outputs overhead.
GRAMMAR_CACHE_BYTES = 32 * MIB
# CUDA context and cuBLAS workspace on the device: an estimate (vLLM's profiler typically finds 0.5-1 GiB of
# non-torch memory); not measured on this project's CPU-only machines.
CUDA_RUNTIME_OVERHEAD_BYTES = 768 * MIB


@dataclass(frozen=True)
class MoEShape:
    """A mixture-of-experts model's MLPs (Mixtral, Qwen2-MoE, Qwen3-MoE), from its config.json: experts per layer, how
    many run for each token, each one's intermediate width, the layers that keep a plain MLP, a shared expert's."""

    num_experts: int
    top_k: int
    width: int
    dense_layers: frozenset[int] = frozenset()
    shared_width: int = 0  # a shared expert every token takes (Qwen2-MoE), 0 where there is none


def moe_shape(config: Any) -> MoEShape | None:
    """MoEShape of a config (config.json's dict or a transformers config); None for a model without experts or
    without a sparse layer (a dense model, as transformers builds it). ValueError for experts per token that are not
    1..experts."""
    get = config.get if isinstance(config, dict) else (lambda key: getattr(config, key, None))
    num_experts = get("num_local_experts") or get("num_experts")
    if not num_experts:
        return None
    layers = get("num_hidden_layers")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (num_experts, layers)):
        raise ValueError(f"num_experts {num_experts!r} and num_hidden_layers {layers!r} must be integers")
    step, only = get("decoder_sparse_step") or 1, set(get("mlp_only_layers") or ())
    dense = frozenset(i for i in range(layers) if i in only or (i + 1) % step)
    if len(dense) == layers:
        return None
    top_k = get("num_experts_per_tok")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok {top_k!r} must be an integer from 1 to the number of experts "
                         f"({num_experts})")
    return MoEShape(int(num_experts), top_k, int(get("moe_intermediate_size") or get("intermediate_size")), dense,
                    int(get("shared_expert_intermediate_size") or 0))


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs to know about a model; weight_bytes is exact, from file headers, in the serving dtype."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    weight_bytes: int
    # Speculative decoding's draft model: its K/V live in the same blocks (one pool per model, one block table),
    # so a token's K/V bytes are both models'; weight_bytes then includes the draft's weights.
    draft: ModelShape | None = None
    # Sliding-window layers whose K/V have a pool of their own (core/kv_cache_manager.py): how many of num_layers,
    # and their window; 0 where every layer's K/V is in the one pool.
    num_window_layers: int = 0
    window: int = 0
    moe: MoEShape | None = None  # experts in place of the MLP (layers other than moe.dense_layers)

    @classmethod
    def from_hf_config(cls, config: dict, weight_bytes: int) -> ModelShape:
        """Build from a Hugging Face config.json dict (text_config for multimodal wrappers)."""
        config = config.get("text_config", config)
        num_heads = config["num_attention_heads"]
        return cls(
            num_layers=config["num_hidden_layers"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_attention_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // num_heads,
            vocab_size=config["vocab_size"],
            weight_bytes=weight_bytes,
            moe=moe_shape(config),
        )

    @property
    def num_linear_params(self) -> int:
        """Parameters of the decoder layers' linear projections (what int8 weight-only quantization shrinks)."""
        qkv_out = (self.num_attention_heads + 2 * self.num_kv_heads) * self.head_dim
        attention = self.hidden_size * qkv_out + self.num_attention_heads * self.head_dim * self.hidden_size
        return self.num_layers * attention + self._mlps(lambda width: 3 * self.hidden_size * width)

    @property
    def num_linear_output_channels(self) -> int:
        """Output channels of the decoder layers' linear projections (fused q/k/v, o, fused gate/up, down)."""
        qkv_out = (self.num_attention_heads + 2 * self.num_kv_heads) * self.head_dim
        return (self.num_layers * (qkv_out + self.hidden_size)
                + self._mlps(lambda width: 2 * width + self.hidden_size))

    def _mlps(self, per_mlp: Callable[[int], int]) -> int:
        """`per_mlp(width)` summed over every layer's MLPs: one per layer, or each expert of the sparse layers, the
        shared one too (the router and the shared expert's gate stay in the serving dtype)."""
        if self.moe is None:
            return self.num_layers * per_mlp(self.intermediate_size)
        dense = len(self.moe.dense_layers)
        shared = per_mlp(self.moe.shared_width) if self.moe.shared_width else 0
        return (dense * per_mlp(self.intermediate_size)
                + (self.num_layers - dense) * (self.moe.num_experts * per_mlp(self.moe.width) + shared))


def kv_bytes_per_token(shape: ModelShape, kv_dtype_bytes: int, kv_scale_bytes: int = 0) -> int:
    """A token's K/V in the main pool: 2 (K and V) x layers x KV heads x (head_dim x KV dtype bytes + the scale of
    an 8-bit cache), the layers with a window pool of their own left out, plus the draft model's where one
    speculates."""
    layers = shape.num_layers - shape.num_window_layers
    own = 2 * layers * shape.num_kv_heads * (shape.head_dim * kv_dtype_bytes + kv_scale_bytes)
    return own + (kv_bytes_per_token(shape.draft, kv_dtype_bytes, kv_scale_bytes) if shape.draft else 0)


def window_kv_bytes_per_token(shape: ModelShape, kv_dtype_bytes: int, kv_scale_bytes: int = 0) -> int:
    """A token's K/V in the window pool: kv_bytes_per_token's terms for the layers that have it (0: none)."""
    return 2 * shape.num_window_layers * shape.num_kv_heads * (shape.head_dim * kv_dtype_bytes + kv_scale_bytes)


def window_pool_blocks(window: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """The window pool's blocks (the null block left out) that its requests can hold at once
    (core/kv_cache_manager.py): each running request its window's blocks before its new tokens (window - 1
    positions, over one more block where they straddle one) and its new tokens' (over one more block where
    they do), and a step's new tokens are max_num_batched_tokens at most."""
    per_request = -(-(window - 1) // block_size) + 2
    return max_num_seqs * per_request + -(-max_num_batched_tokens // block_size)


# Windows the window pool keeps cached per running request where the memory budget has room beside the workload
# (core/kv_cache_manager.py): a finished request's last window, which its conversation's next turn hits; the
# window before a prompt's end, which a new question about the same document hits. A pool with room for the
# running requests alone reuses them as soon as others start. With four, multi-turn chat's prefix-hit rate stayed
# level with one pool's while up to four times as many conversations took turns as ran at once
# (benchmarks/window_prefix_hits.py).
CACHED_WINDOWS_PER_SEQ = 4


def window_cache_blocks(window: int, block_size: int, max_num_seqs: int) -> int:
    """The window pool's blocks beyond window_pool_blocks for CACHED_WINDOWS_PER_SEQ windows per running request
    (a window's positions over one more block where they straddle one)."""
    return CACHED_WINDOWS_PER_SEQ * max_num_seqs * (-(-window // block_size) + 1)


# How prepare() holds the logits projection (weight_format.WeightFormat.logits_head says which, by kernel):
LOGITS_HEADS = ("none",    # no logits (an embedding model)
                "shared",  # reads tensors already counted: the checkpoint's, or its untied lm_head repacked
                "copy",    # a second copy of a tied embedding in the serving dtype (the plain one stays for lookups)
                "int8")    # int8 weights and one scale per row (for a tied embedding, beside the plain one)


def int8_linear_delta_bytes(shape: ModelShape, dtype_bytes: int) -> int:
    """What weight-only int8 changes in the decoder's linears: 1 byte per weight instead of dtype_bytes, plus
    one scale per output channel in the serving dtype (a negative number: the bytes saved)."""
    return shape.num_linear_params * (1 - dtype_bytes) + shape.num_linear_output_channels * dtype_bytes


def prepared_weight_bytes(shape: ModelShape, dtype_bytes: int, int8_linears: bool, logits_head: str,
                          tied_embeddings: bool) -> int:
    """Weights as the model holds them after prepare() (models/llama.py, layers/linear.py), from the
    checkpoint's bytes in the serving dtype (shape.weight_bytes): the decoder's linears in int8 or as stored,
    and the logits projection as `logits_head` (one of LOGITS_HEADS) says."""
    if logits_head not in LOGITS_HEADS:
        raise ValueError(f"logits_head {logits_head!r} is not one of {LOGITS_HEADS}")
    total = shape.weight_bytes + (int8_linear_delta_bytes(shape, dtype_bytes) if int8_linears else 0)
    head = shape.vocab_size * shape.hidden_size
    if logits_head == "int8":
        int8_head = head + shape.vocab_size * dtype_bytes
        total += int8_head if tied_embeddings else int8_head - head * dtype_bytes
    elif logits_head == "copy":
        total += head * dtype_bytes
    return total


def runtime_overhead_bytes(shape: ModelShape, max_model_len: int, max_num_seqs: int, block_size: int,
                           on_cpu: bool = True, uses_transformers: bool = False,
                           structured_outputs: bool = True) -> int:
    """Memory besides weights, KV cache and activations: the runtime, the tokenizer, rotary tables, block table;
    `uses_transformers`: the tokenizer or config loads through transformers (TRANSFORMERS_RUNTIME_BYTES);
    `structured_outputs`: a generative model, which loads xgrammar on its first constrained request.

    On a GPU the host-side parts do not count against the device; the CUDA context does.
    """
    sequences = sequence_overhead_bytes(shape, max_model_len, max_num_seqs, block_size, on_cpu)
    if not on_cpu:
        return CUDA_RUNTIME_OVERHEAD_BYTES + sequences
    runtime = CPU_RUNTIME_BASE_BYTES + (TRANSFORMERS_RUNTIME_BYTES if uses_transformers else 0)
    if structured_outputs:
        runtime += (STRUCTURED_OUTPUTS_BASE_BYTES + GRAMMAR_CACHE_BYTES
                    + STRUCTURED_OUTPUTS_BYTES_PER_TOKEN * shape.vocab_size)
    return runtime + TOKENIZER_BYTES_PER_TOKEN * shape.vocab_size + sequences


def sequence_overhead_bytes(shape: ModelShape, max_model_len: int, max_num_seqs: int, block_size: int,
                            on_cpu: bool = True) -> int:
    """The part of the runtime overhead that grows with max_model_len and max_num_seqs: the rotary tables, and
    on a CPU the block table (host memory, which does not count against a GPU)."""
    rotary = 2 * max_model_len * shape.head_dim * 4  # float32 cos and sin for every position
    block_table = max_num_seqs * math.ceil(max_model_len / block_size) * 8  # int64, on the host
    return rotary + (block_table if on_cpu else 0)
