"""A GGUF file read as a Hugging Face checkpoint, without torch: config, tensor names and shapes, data as stored.

GGUF stores dimensions fastest-first, so a ggml tensor of dims (in, out) is a numpy array of shape
(out, in): exactly the Hugging Face [out_features, in_features] layout. llama.cpp's converter
permutes the rows of the llama q/k projections (rotary pairs interleaved instead of split in
halves) for Llama and the converters derived from its (Granite, SmolLM3); `unpermute_rows` undoes that so that
the tensors equal the Hugging Face ones. Llama 3's rope scaling is stored as a rope_freqs tensor; `hf_config`
recovers HF's rope_scaling from it. Gemma's norm weights are stored with the 1 its norm adds to them
(`norm_shift`), and what transformers reads from Gemma's config.json (softcapping, windows, the query scale) is
metadata or llama.cpp's fixed rule per architecture (`_gemma_config`). Granite's four scales, Phi-3's window,
partial rotary and LongRoPE factors, and SmolLM3's layers without rotary (llama.cpp: every fourth) likewise
(`_extra_config`); Phi-3's fused q/k/v and gate/up matrices are stored fused, as its checkpoint holds them.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from pagedserve.formats.errors import ModelValidationError
from pagedserve.formats.gguf import GGUFHeader, GGUFTensorInfo, shared_gguf_header

# general.architecture -> (HF architecture, HF model_type)
GGUF_TO_HF_ARCHITECTURE: dict[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "gemma": ("GemmaForCausalLM", "gemma"),
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
    "granite": ("GraniteForCausalLM", "granite"),
    "phi3": ("Phi3ForCausalLM", "phi3"),
    "smollm3": ("SmolLM3ForCausalLM", "smollm3"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
}
# Mixtral's converter writes architecture "llama" with an expert count (convert_hf_to_gguf.py's MixtralModel).
MIXTRAL = ("MixtralForCausalLM", "mixtral")
# A mixture-of-experts layer's stacked tensors ([experts, rows, columns]: each expert's matrix whole, one after
# another) -> the expert matrices' Hugging Face names; the router (ffn_gate_inp) is one plain tensor.
_EXPERT_TENSOR_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_EXPERT_TENSOR_RE = re.compile(r"^blk\.(\d+)\.(ffn_(?:gate|up|down)_exps)\.weight$")
_GEMMA = frozenset({"gemma", "gemma2", "gemma3"})
# Gemma 2/3 norm the attention and MLP outputs too: llama.cpp's names for those four norms of a layer.
_SANDWICH_NORM_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Architectures whose converter permutes attn_q / attn_k rows (convert_hf_to_gguf.py LlamaModel.permute, which
# GraniteModel and SmolLM3Model inherit).
_PERMUTED_ARCHITECTURES = frozenset({"llama", "granite", "smollm3"})
# llama.cpp's SmolLM3 leaves rotary out of every fourth layer (n_no_rope_layer_step); its GGUF does not say so.
SMOLLM3_NO_ROPE_LAYER_INTERVAL = 4

_GLOBAL_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSOR_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # a mixture-of-experts router; Qwen2-MoE's shared expert and its gate
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_SANDWICH_LAYER_TENSOR_NAMES = {**_LAYER_TENSOR_NAMES, **_SANDWICH_NORM_NAMES}
# Phi-3 keeps its checkpoint's fused matrices: q/k/v as attn_qkv, gate/up (gate first) as ffn_up.
_PHI3_LAYER_TENSOR_NAMES = {**_LAYER_TENSOR_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
_LAYER_TENSOR_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# Stored float encodings and the numpy type to view them as (numpy has no bfloat16: raw bits).
_FLOAT_VIEWS = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.BF16: np.uint16,
}
# Tensors that carry no weights of their own: folded into the config instead.
_CONFIG_ONLY_TENSORS = frozenset({"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"})


def hf_tensor_name(gguf_name: str, architecture: str) -> str | None:
    """The Hugging Face checkpoint name for a GGUF tensor name, or None if it has no counterpart."""
    if gguf_name in _GLOBAL_TENSOR_NAMES:
        return _GLOBAL_TENSOR_NAMES[gguf_name]
    match = _LAYER_TENSOR_RE.match(gguf_name)
    names = (_SANDWICH_LAYER_TENSOR_NAMES if architecture in ("gemma2", "gemma3") else
             _PHI3_LAYER_TENSOR_NAMES if architecture == "phi3" else _LAYER_TENSOR_NAMES)
    if match is None or match.group(2) not in names:
        return None
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{names[part]}.{kind}"


@dataclass(frozen=True)
class GGUFTensorSpec:
    """Where one tensor lives and how big it is, under its Hugging Face name (no data read)."""

    name: str  # Hugging Face name
    gguf_name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # Hugging Face shape, e.g. [out_features, in_features]
    nbytes: int  # bytes stored in the file
    file_offset: int  # absolute offset of the data in the file

    @property
    def num_elements(self) -> int:
        """Number of values once dequantized."""
        return math.prod(self.shape)


def _as_decimal(value: float) -> float:
    """A float32 metadata value as the decimal it was written from (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


def unpermute_rows(rows: Any, num_heads: int) -> Any:
    """Inverse of convert_hf_to_gguf's LlamaModel.permute, on the first dimension (numpy or torch)."""
    head_rows = rows.shape[0] // num_heads
    # [num_heads, head_dim/2, 2, ...] -> [num_heads, 2, head_dim/2, ...]
    return rows.reshape(num_heads, head_rows // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


_File = TypeVar("_File", bound="GGUFFile")


class GGUFFile:
    """A GGUF file opened for reading as a Hugging Face checkpoint: config, tensor table under Hugging Face
    names, each tensor's data as stored (memory-mapped, lazy). `models/gguf_loader.py` turns it into tensors."""

    def __init__(self, path: str | Path, header: GGUFHeader | None = None) -> None:
        self.path = Path(path)
        self.header: GGUFHeader = header or shared_gguf_header(self.path)  # parsed once per start
        self.metadata: dict[str, Any] = self.header.metadata
        # Copy-on-write ("c"): writable views that torch.from_numpy accepts without a warning; nothing
        # writes to them, so the pages stay shared with the page cache.
        self._data: np.ndarray | None = np.memmap(self.path, mode="c", dtype=np.uint8)
        self._specs = self._build_specs()

    # -- lifecycle -------------------------------------------------------------------------------

    def close(self) -> None:
        """Drop the memory map (tensors already returned stay valid: they are copies)."""
        self._data = None

    def __enter__(self: _File) -> _File:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- metadata --------------------------------------------------------------------------------

    @property
    def architecture(self) -> str:
        """GGUF architecture name: a key of GGUF_TO_HF_ARCHITECTURE."""
        return self.header.architecture

    def _arch_value(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def _required(self, key: str) -> Any:
        value = self._arch_value(key)
        if value is None:
            raise ModelValidationError(
                f"GGUF file {self.path} lacks metadata key {self.architecture}.{key}. "
                "Convert the model again with a current llama.cpp."
            )
        return value

    @property
    def num_experts(self) -> int:
        """Experts per mixture-of-experts layer (0: a dense model)."""
        return int(self._arch_value("expert_count", 0) or 0)

    def hf_config(self) -> dict[str, Any]:
        """A Hugging Face config.json-style dict describing this model."""
        hf_arch, model_type = MIXTRAL if self.architecture == "llama" and self.num_experts else \
            GGUF_TO_HF_ARCHITECTURE[self.architecture]
        hidden_size = int(self._required("embedding_length"))
        num_heads = int(self._required("attention.head_count"))
        config: dict[str, Any] = {
            "architectures": [hf_arch],
            "model_type": model_type,
            "hidden_size": hidden_size,
            "intermediate_size": int(self._required("feed_forward_length")),
            "num_hidden_layers": int(self._required("block_count")),
            "num_attention_heads": num_heads,
            "num_key_value_heads": int(self._arch_value("attention.head_count_kv", num_heads)),
            "head_dim": int(self._arch_value("attention.key_length", hidden_size // num_heads)),
            "rms_norm_eps": _as_decimal(self._required("attention.layer_norm_rms_epsilon")),
            "rope_theta": _as_decimal(self._arch_value("rope.freq_base", 10000.0)),
            "max_position_embeddings": int(self._required("context_length")),
            "vocab_size": self._vocab_size(),
            "tie_word_embeddings": "output.weight" not in self._gguf_names(),
            "attention_bias": "blk.0.attn_q.bias" in self._gguf_names(),
            "hidden_act": "silu",
        }
        if any(f"blk.0.{name}.bias" in self._gguf_names() for name in ("ffn_gate", "ffn_up", "ffn_down")):
            config["mlp_bias"] = True  # (refused by validate.py as a model pagedserve does not serve, by name)
        for key in ("bos_token_id", "eos_token_id"):
            if f"tokenizer.ggml.{key}" in self.metadata:
                config[key] = int(self.metadata[f"tokenizer.ggml.{key}"])
        rope_scaling = self._rope_scaling(config)
        if rope_scaling is not None:
            config["rope_scaling"] = rope_scaling
        if self.architecture in _GEMMA:
            config.update(self._gemma_config(config))
        config.update(self._extra_config(config))
        return config

    def _extra_config(self, config: dict[str, Any]) -> dict[str, Any]:
        """What Granite's, Phi-3's and SmolLM3's config.json say beyond a Llama's, from the metadata their
        converters write (convert_hf_to_gguf.py) or llama.cpp's fixed rule (llama-model.cpp)."""
        if self.architecture == "granite":  # GraniteModel.set_gguf_parameters; llama.cpp reads a scale left out
            # as 1, and a missing attention scale as 1 / sqrt(head_dim)
            scales = {name: _as_decimal(self._arch_value(key, 1.0)) for name, key in (
                ("embedding_multiplier", "embedding_scale"), ("residual_multiplier", "residual_scale"),
                ("logits_scaling", "logit_scale"))}
            attention = self._arch_value("attention.scale")
            scales["attention_multiplier"] = (_as_decimal(attention) if attention is not None
                                              else config["head_dim"] ** -0.5)
            return scales
        if self.architecture == "smollm3":
            return {"no_rope_layer_interval": SMOLLM3_NO_ROPE_LAYER_INTERVAL}
        if self.num_experts:  # Mixtral (its feed_forward_length is the experts' width), Qwen2-MoE and Qwen3-MoE
            experts = {"num_experts_per_tok": int(self._required("expert_used_count"))}
            if self.architecture == "llama":
                return {**experts, "num_local_experts": self.num_experts}
            experts.update(num_experts=self.num_experts,
                           moe_intermediate_size=int(self._required("expert_feed_forward_length")),
                           norm_topk_prob=self.architecture == "qwen3moe")  # llama.cpp's rule for each
            if self.architecture == "qwen2moe":
                experts["shared_expert_intermediate_size"] = int(self._required("expert_shared_feed_forward_length"))
            return experts
        if self.architecture != "phi3":
            return {}
        extra: dict[str, Any] = {"sliding_window": int(self._arch_value("attention.sliding_window", 0)) or None}
        rotary = self._arch_value("rope.dimension_count")
        if rotary is not None and int(rotary) != config["head_dim"]:  # Phi-4-mini rotates 3/4 of each head
            extra["partial_rotary_factor"] = int(rotary) / config["head_dim"]
        original = self._arch_value("rope.scaling.original_context_length")
        if original is not None:
            extra["original_max_position_embeddings"] = int(original)
        if "rope_factors_long.weight" in self._gguf_names():  # Phi3MiniModel's LongRoPE tensors
            extra["rope_scaling"] = {"rope_type": "longrope",
                                     "long_factor": self._read_f32("rope_factors_long.weight").tolist(),
                                     "short_factor": self._read_f32("rope_factors_short.weight").tolist()}
        return extra

    def _gemma_config(self, config: dict[str, Any]) -> dict[str, Any]:
        """What a Gemma's config.json says beyond a Llama's, as llama.cpp reads it (llama-model.cpp): the GELU,
        Gemma 2's softcaps, and for Gemma 2/3 the sliding window on layers il % n < n - 1 (n = 2 for Gemma 2,
        6 for Gemma 3), the query scale (head_dim; hidden_size / heads for the 27B models), and Gemma 3's rotary
        base of 10000 for its sliding-window layers (rope scaling applies to its global layers only)."""
        extra: dict[str, Any] = {"hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh"}
        if self.architecture == "gemma":
            return extra
        layers = config["num_hidden_layers"]
        pattern = 2 if self.architecture == "gemma2" else 6
        is_27b = layers == (46 if self.architecture == "gemma2" else 62)
        extra.update(
            sliding_window=int(self._required("attention.sliding_window")),
            layer_types=["sliding_attention" if i % pattern < pattern - 1 else "full_attention" for i in range(layers)],
            query_pre_attn_scalar=config["hidden_size"] // config["num_attention_heads"] if is_27b
            else config["head_dim"])
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if self._arch_value(key) is not None:
                extra[key] = _as_decimal(self._arch_value(key))
        if self.architecture == "gemma3":
            full = {"rope_type": "default", "rope_theta": config["rope_theta"], **config.pop("rope_scaling", {})}
            extra["rope_parameters"] = {"full_attention": full,
                                        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
            extra["attn_logit_softcapping"] = None  # Gemma 3 has none (transformers would ignore it anyway)
        return extra

    def _gguf_names(self) -> set[str]:
        return {info.name for info in self.header.tensors}

    def _vocab_size(self) -> int:
        if self._arch_value("vocab_size") is not None:
            return int(self._arch_value("vocab_size"))
        embed = next(info for info in self.header.tensors if info.name == "token_embd.weight")
        return embed.shape[0]

    def _rope_scaling(self, config: dict[str, Any]) -> dict[str, Any] | None:
        kind = self._arch_value("rope.scaling.type")
        factor = self._arch_value("rope.scaling.factor")
        if "rope_freqs.weight" in self._gguf_names():
            return _llama3_rope_scaling(self._read_f32("rope_freqs.weight"), config, self.path)
        if kind in (None, "none") or factor is None:
            return None
        scaling: dict[str, Any] = {"rope_type": kind, "factor": float(factor)}
        original = self._arch_value("rope.scaling.original_context_length")
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)
        return scaling

    # -- tensors ---------------------------------------------------------------------------------

    def _build_specs(self) -> list[GGUFTensorSpec]:
        unknown = [
            info.name
            for info in self.header.tensors
            if hf_tensor_name(info.name, self.architecture) is None and info.name not in _CONFIG_ONLY_TENSORS
            and not (self.num_experts and _EXPERT_TENSOR_RE.match(info.name))
        ]
        if unknown:
            raise ModelValidationError(
                f"GGUF file {self.path} holds tensors pagedserve does not know ({', '.join(unknown[:5])}"
                f"{', ...' if len(unknown) > 5 else ''}): it is not a plain {self.architecture} model. "
                "Use a supported model."
            )
        return [spec for info in self.header.tensors if info.name not in _CONFIG_ONLY_TENSORS
                for spec in self._specs_of(info)]

    def _specs_of(self, info: GGUFTensorInfo) -> list[GGUFTensorSpec]:
        """A tensor's spec; a stacked expert tensor's, one per expert (its slice of the data: whole rows)."""
        match = _EXPERT_TENSOR_RE.match(info.name) if self.num_experts else None
        if match is None:
            return [self._spec(info)]
        experts, *shape = info.shape
        if experts != self.num_experts or info.nbytes % experts:
            raise ModelValidationError(f"GGUF file {self.path}: tensor {info.name!r} has shape {list(info.shape)}, "
                                       f"not {self.num_experts} experts' matrices. Convert the model again.")
        layer, kind = match.groups()
        size = info.nbytes // experts
        start = self.header.data_offset + info.offset
        return [GGUFTensorSpec(f"model.layers.{layer}.mlp.experts.{e}.{_EXPERT_TENSOR_NAMES[kind]}.weight",
                               info.name, GGMLQuantizationType(info.type_id), tuple(shape), size, start + e * size)
                for e in range(experts)]

    def _spec(self, info: GGUFTensorInfo) -> GGUFTensorSpec:
        return GGUFTensorSpec(
            name=str(hf_tensor_name(info.name, self.architecture)),
            gguf_name=info.name,
            qtype=GGMLQuantizationType(info.type_id),
            shape=info.shape,
            nbytes=info.nbytes,
            file_offset=self.header.data_offset + info.offset,
        )

    def tensor_specs(self) -> list[GGUFTensorSpec]:
        """Every weight tensor, in file order, with its Hugging Face name, type, shape and size."""
        return list(self._specs)

    def layer_types(self, num_layers: int) -> list[dict[str, str]]:
        """Per decoder layer, the ggml type names of its matrices by their last Hugging Face name part ("q_proj",
        ...), and of an untied logits head ("lm_head", in each): what weight_format.gguf_block_linears reads (a file's
        types may differ from layer to layer: Q4_K_M files give half the layers' v and down Q6_K)."""
        layers: list[dict[str, str]] = [{} for _ in range(num_layers)]
        head = {}
        for spec in self._specs:
            parts = spec.name.split(".")
            if spec.name.startswith("model.layers.") and spec.name.endswith(".weight") and int(parts[2]) < num_layers:
                layers[int(parts[2])][parts[-2]] = spec.qtype.name
            elif spec.name == "lm_head.weight":
                head["lm_head"] = spec.qtype.name
        return [types | head for types in layers]

    @property
    def num_tensors(self) -> int:
        """Number of weight tensors `iter_tensors` yields."""
        return len(self._specs)

    def num_parameters(self) -> int:
        """Total number of weight values (dequantized)."""
        return sum(spec.num_elements for spec in self._specs)

    def stored(self, spec: GGUFTensorSpec) -> np.ndarray:
        """One tensor's data as a memmap view: floats in the logical shape, blocks as [rows, bytes_per_row]."""
        if self._data is None:
            raise RuntimeError(f"GGUF checkpoint {self.path} is closed")
        raw = self._data[spec.file_offset : spec.file_offset + spec.nbytes]
        if spec.qtype in _FLOAT_VIEWS:
            return raw.view(_FLOAT_VIEWS[spec.qtype]).reshape(spec.shape)
        block_size, type_size = GGML_QUANT_SIZES[spec.qtype]
        return raw.reshape(math.prod(spec.shape[:-1]), spec.shape[-1] // block_size * type_size)

    def norm_shift(self, spec: GGUFTensorSpec) -> float:
        """What to subtract from a tensor as stored: llama.cpp's converter stores Gemma's norm weights plus one
        (its norm scales by 1 + weight, llama.cpp's by the weight), q/k norms included."""
        return 1.0 if self.architecture in _GEMMA and spec.gguf_name.endswith("norm.weight") else 0.0

    def permute_heads(self, spec: GGUFTensorSpec) -> int | None:
        """Number of heads to un-permute over for this tensor, or None."""
        if self.architecture not in _PERMUTED_ARCHITECTURES:
            return None
        if ".self_attn.q_proj." in spec.name:
            return int(self._required("attention.head_count"))
        if ".self_attn.k_proj." in spec.name:
            return int(self._arch_value("attention.head_count_kv", self._required("attention.head_count")))
        return None

    def _read_f32(self, gguf_name: str) -> np.ndarray:
        info = next(info for info in self.header.tensors if info.name == gguf_name)
        if self._data is None:
            raise RuntimeError(f"GGUF checkpoint {self.path} is closed")
        start = self.header.data_offset + info.offset
        return np.array(self._data[start : start + info.nbytes].view(np.float32))


# -- rope scaling -------------------------------------------------------------------------------------


def _llama3_rope_factors(config: dict[str, Any], scaling: dict[str, Any]) -> np.ndarray:
    """The rope_freqs tensor convert_hf_to_gguf.py writes for Llama 3.x 'llama3' rope scaling."""
    dim, base = config["head_dim"], config["rope_theta"]
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    old_len = scaling["original_max_position_embeddings"]
    low, high, factor = scaling["low_freq_factor"], scaling["high_freq_factor"], scaling["factor"]
    wavelen = 2 * math.pi / freqs
    smooth = (old_len / wavelen - low) / (high - low)
    middle = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old_len / high, 1.0, np.where(wavelen > old_len / low, factor, middle))


def _llama3_rope_scaling(rope_freqs: np.ndarray, config: dict[str, Any], path: Path) -> dict[str, Any]:
    """Recover HF's llama3 rope_scaling from the rope_freqs tensor (Llama 3.x constants)."""
    scaling = {
        "rope_type": "llama3",
        "factor": float(rope_freqs.max()),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    expected = _llama3_rope_factors(config, scaling)
    if expected.shape != rope_freqs.shape or not np.allclose(expected, rope_freqs, rtol=1e-4):
        raise ModelValidationError(
            f"GGUF file {path} carries rope frequency factors (rope_freqs) that are not Llama 3's "
            "standard rope scaling; pagedserve cannot reproduce them. Use the Hugging Face model directory."
        )
    return scaling
