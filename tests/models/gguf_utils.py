"""Write tiny GGUF files from tiny random transformers models, the way llama.cpp's converter does.

Independent of pagedserve's loader on purpose (own name mapping, own permutation), so that a
round trip checks the loader against llama.cpp's conventions rather than against itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QType
from gguf.quants import quantize

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TINY_MERGES = (("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("Ġ", "w"), ("o", "r"))

_LAYER_PARTS = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",  # a mixture-of-experts router, and its stacked experts (_expert_stacks)
    "mlp.experts.gate_exps": "ffn_gate_exps",
    "mlp.experts.up_exps": "ffn_up_exps",
    "mlp.experts.down_exps": "ffn_down_exps",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",  # Qwen2-MoE's shared expert and its gate
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}


def gguf_name(hf_name: str) -> str:
    """llama.cpp's tensor name for a Hugging Face one."""
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    part, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER_PARTS[part]}.{kind}"


def llama_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (rows: split halves -> interleaved pairs)."""
    return (
        weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = list(printable), 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars, strict=True)}


def tiny_vocab(vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token_types, merges): specials, 256 byte tokens, a few merges, padding to `vocab_size`."""
    tokens = list(SPECIAL_TOKENS) + list(bytes_to_unicode().values())
    types = [gguf.TokenType.CONTROL] * len(SPECIAL_TOKENS) + [gguf.TokenType.NORMAL] * 256
    for left, right in TINY_MERGES:
        tokens.append(left + right)
        types.append(gguf.TokenType.NORMAL)
    if len(tokens) > vocab_size:
        raise ValueError(f"tiny vocabulary needs vocab_size >= {len(tokens)}")
    for index in range(len(tokens), vocab_size):
        tokens.append(f"[PAD{index}]")
        types.append(gguf.TokenType.UNUSED)
    return tokens, [int(t) for t in types], [f"{left} {right}" for left, right in TINY_MERGES]


def _add_shape(writer: gguf.GGUFWriter, config: object) -> None:
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)


def _finish(writer: gguf.GGUFWriter, path: str | Path) -> Path:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def _add_hparams(writer: gguf.GGUFWriter, config: object) -> None:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    _add_shape(writer, config)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(head_dim)
    if head_dim != config.hidden_size // config.num_attention_heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    rope = config.rope_parameters
    if rope.get("rope_type") in ("linear", "yarn"):  # as convert_hf_to_gguf.py writes rope_scaling
        writer.add_rope_scaling_type(gguf.RopeScalingType(rope["rope_type"]))
        writer.add_rope_scaling_factor(rope["factor"])
        if "original_max_position_embeddings" in rope:
            writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])


def _add_tokenizer(writer: gguf.GGUFWriter, vocab_size: int, pre: str, eos_token_id: int = 2,
                   eot_token_id: int | None = None) -> None:
    tokens, types, merges = tiny_vocab(vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(eos_token_id)
    if eot_token_id is not None:
        writer.add_eot_token_id(eot_token_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML_TEMPLATE)


def _encode(array: np.ndarray, qtype: QType) -> tuple[np.ndarray, QType | None]:
    """Stored array and raw_dtype for GGUFWriter.add_tensor."""
    if qtype == QType.F32:
        return array.astype(np.float32), None
    if qtype == QType.F16:
        return array.astype(np.float16), None
    if qtype in (QType.Q4_K, QType.Q5_K):  # gguf.quants has no K-quant encoder
        return quantize_k(array.astype(np.float32), qtype), qtype
    return quantize(array.astype(np.float32), qtype), qtype


def quantize_k(array: np.ndarray, qtype: QType) -> np.ndarray:
    """A plain Q4_K / Q5_K encoder (ggml's block layout, not llama.cpp's search for the best scales): per block of 32
    an offset and a step over its range, as 6-bit multiples of the superblock's D and Dmin. [..., rows, cols] float32
    (a stack of experts too) -> uint8 [..., rows, cols / 256 * (144 or 176)], which gguf.quants dequantizes."""
    top = 15 if qtype == QType.Q4_K else 31
    *rows, cols = array.shape
    if cols % 256:
        raise ValueError(f"{qtype.name} rows come in superblocks of 256 values; these have {cols}")
    blocks = array.reshape(-1, 8, 32).astype(np.float64)
    low = np.minimum(blocks.min(axis=2), 0.0)  # [superblocks, 8]: the offset is -Dmin mn <= 0
    step = np.maximum(blocks.max(axis=2) - low, 1e-8) / top
    big = (step.max(axis=1, keepdims=True) / 63).astype(np.float16).astype(np.float64)
    big_min = (np.maximum(-low.min(axis=1, keepdims=True), 1e-8) / 63).astype(np.float16).astype(np.float64)
    sc = np.clip(np.round(step / big), 1, 63).astype(np.uint8)
    mn = np.clip(np.round(-low / big_min), 0, 63).astype(np.uint8)
    q = np.clip(np.round((blocks + (mn * big_min)[..., None]) / (sc * big)[..., None]), 0, top).astype(np.uint8)
    scales = np.zeros((len(blocks), 12), dtype=np.uint8)
    scales[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 0xF) | ((mn[:, 4:] & 0xF) << 4)
    pairs = q.reshape(-1, 4, 2, 32)  # chunk c: blocks 2c (low nibbles) and 2c + 1 (high nibbles) of 32 bytes
    qs = ((pairs[:, :, 0] & 0xF) | ((pairs[:, :, 1] & 0xF) << 4)).reshape(-1, 128).astype(np.uint8)
    parts = [big.astype(np.float16).view(np.uint8), big_min.astype(np.float16).view(np.uint8), scales]
    if qtype == QType.Q5_K:  # byte l, bit j: the fifth bit of block j's weight l
        fifth = (q >> 4).astype(np.uint8)  # [superblocks, 8, 32]
        parts.append(sum(fifth[:, j, :] << j for j in range(8)).astype(np.uint8))
    parts.append(qs)
    return np.concatenate(parts, axis=1).reshape(*rows, -1)


def llama3_rope_freqs(config: object) -> np.ndarray:
    """The rope_freqs tensor llama.cpp writes for 'llama3' rope scaling (from convert_hf_to_gguf.py)."""
    params = config.rope_parameters
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    freqs = 1.0 / (params["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    old_len = params.get("original_max_position_embeddings", 8192)
    low, high, factor = params["low_freq_factor"], params["high_freq_factor"], params["factor"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            factors.append(1.0)
        elif wavelen > old_len / low:
            factors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def write_test_gguf(
    model: torch.nn.Module,
    path: str | Path,
    qtype: QType = QType.F32,
    qtype_per_tensor: Mapping[str, QType] | None = None,
    tokenizer_pre: str = "smollm",
    eos_token_id: int = 2,
    eot_token_id: int | None = None,
    extra_metadata: Callable[[gguf.GGUFWriter], None] | None = None,
    sp_model: Path | None = None,
) -> Path:
    """Write `model` (a transformers Llama/Qwen2/Qwen3 ForCausalLM) as a GGUF file.

    2-D weights are stored as `qtype` (or `qtype_per_tensor[hf_name]`), 1-D ones (norms, biases) as
    F32, as llama.cpp does. A tied lm_head is not written. Llama q/k rows are permuted.
    """
    config = model.config
    arch = {"qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "mixtral": "llama"}.get(config.model_type,
                                                                                    config.model_type)  # llama.cpp's
    writer = gguf.GGUFWriter(str(path), arch)
    _add_hparams(writer, config)
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if experts:  # as convert_hf_to_gguf.py's MixtralModel and Qwen3MoeModel write them
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        if arch in ("qwen2moe", "qwen3moe"):
            writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        if arch == "qwen2moe":
            writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    if sp_model is None:
        _add_tokenizer(writer, config.vocab_size, tokenizer_pre, eos_token_id, eot_token_id)
    else:  # a SentencePiece vocabulary (Llama 2, Mistral) instead of the tiny byte-level one
        add_sentencepiece_vocab(writer, sp_model)
    if extra_metadata is not None:
        extra_metadata(writer)
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    if (config.rope_parameters or {}).get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_freqs(config))
    for name, array in _expert_stacks(state):
        if arch == "llama" and ".q_proj." in name:
            array = llama_permute(array, config.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            array = llama_permute(array, config.num_key_value_heads)
        chosen = (qtype_per_tensor or {}).get(name, qtype if array.ndim >= 2 else QType.F32)
        stored, raw_dtype = _encode(array, chosen)
        writer.add_tensor(gguf_name(name), stored, raw_dtype=raw_dtype)
    return _finish(writer, path)


def _expert_stacks(state: dict[str, np.ndarray]) -> list[tuple[str, np.ndarray]]:
    """transformers' fused expert tensors (gate_up_proj [E, 2I, H], down_proj [E, H, I]) as llama.cpp's stacks
    (ffn_gate_exps, ffn_up_exps [E, I, H]; ffn_down_exps [E, H, I]), under stand-in names gguf_name maps."""
    out = []
    for name, array in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            half = array.shape[1] // 2
            out += [(name.replace("gate_up_proj", "gate_exps.weight"), array[:, :half]),
                    (name.replace("gate_up_proj", "up_exps.weight"), array[:, half:])]
        elif name.endswith("mlp.experts.down_proj"):
            out.append((name.replace("down_proj", "down_exps.weight"), array))
        else:
            out.append((name, array))
    return out


def tiny_model(arch: str, seed: int = 0, **overrides: object) -> torch.nn.Module:
    """A tiny random Llama / Qwen2 / Qwen3 / Qwen2-MoE / Qwen3-MoE / Mixtral causal LM (float32, eval mode)."""
    import transformers

    config_class = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                    "qwen3": transformers.Qwen3Config, "qwen3_moe": transformers.Qwen3MoeConfig,
                    "qwen2_moe": transformers.Qwen2MoeConfig,
                    "mixtral": transformers.MixtralConfig}[arch]
    kwargs: dict[str, object] = dict(
        vocab_size=288, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2,
    )
    if arch in ("qwen3", "qwen3_moe"):
        kwargs["head_dim"] = 32  # != hidden_size / heads, as in real Qwen3 models
    if arch == "qwen3_moe":  # every layer sparse: a GGUF has no mlp_only_layers
        kwargs.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True)
    elif arch == "qwen2_moe":
        kwargs.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                      shared_expert_intermediate_size=128)
    elif arch == "mixtral":
        kwargs.update(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model_class = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
                   "qwen3": transformers.Qwen3ForCausalLM, "qwen3_moe": transformers.Qwen3MoeForCausalLM,
                   "qwen2_moe": transformers.Qwen2MoeForCausalLM,
                   "mixtral": transformers.MixtralForCausalLM}[arch]
    model = model_class(config_class(**kwargs)).eval()
    with torch.no_grad():  # norms initialise to ones; make them random so that mapping errors show
        for param in model.parameters():
            if param.ndim == 1:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
    return model


# -- Gemma: a SentencePiece vocabulary and llama.cpp's Gemma conversion --------------------------------------------

GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<start_of_turn>' + message['role'] + '\n' + message['content'] "
    "+ '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
_GEMMA_SANDWICH = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                   "post_feedforward_layernorm": "post_ffw_norm"}


def train_sentencepiece(out_dir: Path, vocab_size: int, llama: bool = False) -> Path:
    """A SentencePiece BPE model as Gemma's is made (byte fallback, no dummy prefix, whitespace pieces, digits split;
    <pad> <eos> <bos> <unk> at 0-3, two user-defined turn markers), or with `llama` as Llama 2's and Mistral's
    (a dummy prefix: a space before the text; <unk> <s> </s> at 0-2), trained on tiny_models' corpus."""
    import sentencepiece as spm

    from tests.tiny_models import _CORPUS

    out_dir.mkdir(parents=True, exist_ok=True)
    corpus = out_dir / "corpus.txt"
    corpus.write_text("\n".join(_CORPUS), encoding="utf-8")
    kind = (dict(unk_id=0, bos_id=1, eos_id=2, pad_id=-1, add_dummy_prefix=True) if llama else
            dict(user_defined_symbols=["<start_of_turn>", "<end_of_turn>"], pad_id=0, eos_id=1, bos_id=2, unk_id=3,
                 pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>", add_dummy_prefix=False))
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(out_dir / "sp"), vocab_size=vocab_size, model_type="bpe",
        byte_fallback=True, split_digits=True, allow_whitespace_only_pieces=True, remove_extra_whitespaces=False,
        normalization_rule_name="identity", character_coverage=0.9995, minloglevel=2, **kind)
    return out_dir / "sp.model"


def add_sentencepiece_vocab(writer: gguf.GGUFWriter, sp_model: Path) -> None:
    """convert_hf_to_gguf.py's _set_vocab_sentencepiece: every piece, its score and its type, the special ids, and
    add_space_prefix as the model's dummy prefix says (a Gemma vocabulary has turn markers and a chat template)."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    types = []
    for i in range(sp.get_piece_size()):
        if sp.is_unknown(i):
            types.append(gguf.TokenType.UNKNOWN)
        elif sp.is_control(i):
            types.append(gguf.TokenType.CONTROL)
        elif sp.is_byte(i):
            types.append(gguf.TokenType.BYTE)
        elif sp.is_unused(i):
            types.append(gguf.TokenType.UNUSED)
        elif sp.id_to_piece(i) in ("<start_of_turn>", "<end_of_turn>"):
            types.append(gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([sp.id_to_piece(i) for i in range(sp.get_piece_size())])
    writer.add_token_scores([sp.get_score(i) for i in range(sp.get_piece_size())])
    writer.add_token_types([int(t) for t in types])
    writer.add_bos_token_id(sp.bos_id())
    writer.add_eos_token_id(sp.eos_id())
    writer.add_unk_token_id(sp.unk_id())
    if sp.pad_id() >= 0:
        writer.add_pad_token_id(sp.pad_id())
    writer.add_add_bos_token(True)
    gemma = sp.piece_to_id("<end_of_turn>") != sp.unk_id()
    writer.add_add_space_prefix(not gemma)  # SentencePiece's add_dummy_prefix, as the two vocabularies were trained
    if gemma:
        writer.add_eot_token_id(sp.piece_to_id("<end_of_turn>"))
        writer.add_chat_template(GEMMA_TEMPLATE)


def write_gemma_gguf(model: torch.nn.Module, path: str | Path, sp_model: Path, qtype: QType = QType.F32) -> Path:
    """Write a transformers Gemma / Gemma 2 / Gemma 3 (text) causal LM as llama.cpp's converter does: Gemma 2/3's
    four norms per layer under their llama.cpp names, every norm weight stored plus one (GemmaModel.modify_tensors),
    softcaps and the sliding window as metadata, no tied lm_head."""
    config = model.config
    arch = {"gemma": "gemma", "gemma2": "gemma2", "gemma3_text": "gemma3"}[config.model_type]
    writer = gguf.GGUFWriter(str(path), arch)
    _add_shape(writer, config)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    rope = config.rope_parameters.get("full_attention", config.rope_parameters)
    writer.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if arch != "gemma":
        writer.add_sliding_window(config.sliding_window)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    add_sentencepiece_vocab(writer, sp_model)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied
        array = tensor.detach().float().numpy()
        if name.endswith("norm.weight"):
            array = array + 1.0
        _, _, rest = name.partition("model.")
        if rest.startswith("layers.") and arch != "gemma":
            _, layer, part = rest.split(".", 2)
            module, kind = part.rsplit(".", 1)
            if module in _GEMMA_SANDWICH:
                writer.add_tensor(f"blk.{layer}.{_GEMMA_SANDWICH[module]}.{kind}", array.astype(np.float32))
                continue
        stored, raw_dtype = _encode(array, qtype if array.ndim == 2 else QType.F32)
        writer.add_tensor(gguf_name(name), stored, raw_dtype=raw_dtype)
    return _finish(writer, path)


# -- Granite, Phi-3 and SmolLM3: llama.cpp's conversions of the Llama-like models -----------------------------------

_PHI3_FUSED = {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}


def write_llama_like_gguf(model: torch.nn.Module, path: str | Path, qtype: QType = QType.F32) -> Path:
    """Write a transformers Granite / Phi-3 / SmolLM3 causal LM as llama.cpp's converter does: GraniteModel and
    SmolLM3Model are LlamaModels (q/k rows permuted), Granite adds its four scales as metadata; Phi3MiniModel keeps
    the fused qkv_proj / gate_up_proj as attn_qkv / ffn_up, writes its window (0 for none), rotary dimensions and
    original context, and LongRoPE's factors as rope_factors_long / rope_factors_short tensors."""
    config = model.config
    arch = config.model_type
    writer = gguf.GGUFWriter(str(path), arch)
    _add_shape(writer, config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = config.rope_parameters
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_vocab_size(config.vocab_size)
    if arch == "granite":
        writer.add_attention_scale(config.attention_multiplier)
        writer.add_embedding_scale(config.embedding_multiplier)
        writer.add_residual_scale(config.residual_multiplier)
        writer.add_logit_scale(config.logits_scaling)
    if arch == "phi3":
        writer.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * head_dim))
        writer.add_rope_scaling_orig_ctx_len(config.original_max_position_embeddings)
        writer.add_sliding_window(config.sliding_window or 0)
        if rope.get("rope_type") == "longrope":
            writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
            writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    else:
        writer.add_rope_dimension_count(head_dim)
    _add_tokenizer(writer, config.vocab_size, "smollm")
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        array = tensor.detach().float().numpy()
        if arch != "phi3" and ".q_proj." in name:
            array = llama_permute(array, config.num_attention_heads)
        elif arch != "phi3" and ".k_proj." in name:
            array = llama_permute(array, config.num_key_value_heads)
        stored, raw_dtype = _encode(array, qtype if array.ndim == 2 else QType.F32)
        module, kind = name.rsplit(".", 1)
        fused = next((part for part in _PHI3_FUSED if module.endswith(part)), None)
        if fused is not None:
            layer = module.split(".")[2]
            writer.add_tensor(f"blk.{layer}.{_PHI3_FUSED[fused]}.{kind}", stored, raw_dtype=raw_dtype)
        else:
            writer.add_tensor(gguf_name(name), stored, raw_dtype=raw_dtype)
    return _finish(writer, path)
