"""Load a llama.cpp GGUF file as a Hugging Face checkpoint: named torch tensors and the tokenizer.

The header, config and tensor table come from `formats/gguf_hf.py` (`GGUFFile`, no torch); here the stored
tensors are dequantized (or requantized to per-row int8) into torch tensors in Hugging Face row order.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, TokenType
from gguf.quants import dequantize
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from pagedserve.formats.gguf import forget_gguf_header, shared_gguf_header
from pagedserve.formats.gguf_hf import GGUFFile, unpermute_rows
from pagedserve.layers.linear import QuantizedWeight, quantize_int8_per_channel
from pagedserve.models.validate import ModelValidationError, validate_gguf_header


@dataclass(frozen=True)
class RawTensor:
    """A tensor as stored: quantized blocks (uint8, one row of blocks per output row) or floats.

    Rows are already in Hugging Face order (the llama q/k permutation is undone on whole rows of
    blocks, which is exact), so a Q8_0 path can use the blocks directly.
    """

    name: str  # Hugging Face name
    qtype: GGMLQuantizationType
    data: np.ndarray  # F32/F16: float32/float16 in `shape`; BF16: uint16 bits in `shape`; else uint8 [rows, bytes]
    shape: tuple[int, ...]  # logical Hugging Face shape


class GGUFCheckpoint(GGUFFile):
    """A GGUF file opened for loading: its header checked (architecture, tensor types, truncation,
    tokenizer kind), its weights as torch tensors, its tokenizer."""

    def __init__(self, path: str | Path) -> None:
        header = shared_gguf_header(Path(path))
        validate_gguf_header(header)
        super().__init__(path, header)

    def iter_raw_tensors(self) -> Iterator[RawTensor]:
        """Every weight as stored (no dequantization), rows in Hugging Face order; data is a copy."""
        for spec in self._specs:
            stored = self.stored(spec)
            num_heads = self.permute_heads(spec)
            data = unpermute_rows(stored, num_heads) if num_heads else stored
            yield RawTensor(spec.name, spec.qtype, np.array(data, copy=True), spec.shape)

    def iter_tensors(self, dtype: torch.dtype = torch.float32, int8_matmuls: bool = False
                     ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        """Every weight dequantized to `dtype`, under its Hugging Face name and shape. With `int8_matmuls`,
        block-quantized matmul weights (`*_proj.weight`, `lm_head.weight`) come instead as per-row int8
        (QuantizedWeight), requantized from their float32 values a few rows at a time: no `dtype` copy."""
        for spec in self._specs:
            num_heads = self.permute_heads(spec)
            if int8_matmuls and spec.qtype in _TORCH_DEQUANTIZERS and _is_matmul_weight(spec.name):
                weight = _requantize_int8(self.stored(spec), spec.qtype, dtype)
                if num_heads:
                    weight = QuantizedWeight(unpermute_rows(weight.qweight, num_heads).contiguous(),
                                             unpermute_rows(weight.scales, num_heads).contiguous(), dtype)
                yield spec.name, weight
                continue
            tensor = _dequantize_to_torch(self.stored(spec), spec.qtype, dtype).reshape(spec.shape)
            if num_heads:
                tensor = unpermute_rows(tensor, num_heads).contiguous()
            yield spec.name, tensor
        forget_gguf_header(self.path)  # weights loaded: nobody needs the header again

    # -- tokenizer -------------------------------------------------------------------------------

    def build_tokenizer(self) -> PreTrainedTokenizerFast:
        """A transformers PreTrainedTokenizerFast equivalent to the model's original tokenizer."""
        return build_tokenizer_from_metadata(self.metadata, source=str(self.path))


def _is_matmul_weight(hf_name: str) -> bool:
    return hf_name.endswith("_proj.weight") or hf_name == "lm_head.weight"


_REQUANTIZE_ROWS = 1024


def _requantize_int8(stored: np.ndarray, qtype: GGMLQuantizationType, dtype: torch.dtype) -> QuantizedWeight:
    """Blocks [rows, bytes_per_row] -> per-row int8: each chunk of rows is dequantized to float32 (exactly
    as gguf.quants does) and quantized at once with scale max|row| / 127."""
    parts = [quantize_int8_per_channel(_dequantize_blocks_torch(stored[start:start + _REQUANTIZE_ROWS], qtype,
                                                                torch.float32))
             for start in range(0, stored.shape[0], _REQUANTIZE_ROWS)]
    return QuantizedWeight(torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts]), dtype)


def _dequantize_to_torch(stored: np.ndarray, qtype: GGMLQuantizationType, dtype: torch.dtype) -> torch.Tensor:
    """Decode one stored tensor into a new torch tensor of `dtype` (never a view of the file)."""
    if qtype == GGMLQuantizationType.BF16:
        # numpy has no bfloat16: reinterpret the bits in torch, exactly.
        return torch.from_numpy(np.array(stored, copy=True)).view(torch.bfloat16).to(dtype)
    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        values = torch.from_numpy(np.array(stored, copy=True))
        return values if values.dtype == dtype else values.to(dtype)
    if qtype in _TORCH_DEQUANTIZERS:
        return _dequantize_blocks_torch(stored, qtype, dtype)
    return torch.from_numpy(dequantize(stored, qtype)).to(dtype)  # float32 [rows, in_features]


# -- dequantization in torch ---------------------------------------------------------------------------
# gguf.quants does this in numpy on one core at ~80-300 M values/s, which made dequantization most of
# the start-up time (1.1 s for SmolLM2-135M Q4_1, 7 s for Qwen2.5-0.5B Q5_0/Q8_0/Q4_K/Q6_K on a 2-core
# box). The same arithmetic in torch runs on every core, chunk by chunk (cache-sized pieces, and no
# float32 copy of a whole tensor when serving a 16-bit dtype). Results equal gguf.quants bit for bit:
# each value is d * q (+ m, - dm) in float32, multiplied and added in separate roundings as numpy does.
_DEQUANT_CHUNK_VALUES = 1 << 20  # 4 MiB of float32 per step


def _block_scale(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 scale stored at byte `start` of each block, as float32 [num_blocks, 1]."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _nibbles(quants: torch.Tensor) -> torch.Tensor:
    """[n, 16] bytes -> [n, 32] values 0..15: low nibbles are values 0-15, high nibbles 16-31."""
    quants = quants.contiguous()  # bitwise ops on the strided block view are ~5x slower
    return torch.stack((quants & 0x0F, quants >> 4), dim=1).view(-1, 32)


# Byte value -> its 8 bits, each moved to bit 4, packed as the 8 bytes of one int64 (a table lookup is
# ~4x faster than shifting and masking a broadcast [n, 4, 8] view).
_HIGH_BIT_TABLE = torch.tensor([[((value >> bit) & 1) << 4 for bit in range(8)] for value in range(256)],
                               dtype=torch.uint8).view(torch.int64).view(256)


def _high_bits(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """Bit j of the little-endian uint32 at byte `start` (j = 0..31) moved to bit 4, as uint8 [n, 32]."""
    packed = blocks[:, start:start + 4].long()  # [n, 4]: bit j is bit j % 8 of byte j // 8
    return _HIGH_BIT_TABLE[packed].view(torch.uint8).view(-1, 32)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return blocks[:, 2:].contiguous().view(torch.int8).float().mul_(_block_scale(blocks, 0))


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    return (_nibbles(blocks[:, 2:]).to(torch.int8) - 8).float().mul_(_block_scale(blocks, 0))


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    return _nibbles(blocks[:, 4:]).float().mul_(_block_scale(blocks, 0)).add_(_block_scale(blocks, 2))


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    values = (_nibbles(blocks[:, 6:]) | _high_bits(blocks, 2)).to(torch.int8) - 16
    return values.float().mul_(_block_scale(blocks, 0))


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    values = _nibbles(blocks[:, 8:]) | _high_bits(blocks, 4)
    return values.float().mul_(_block_scale(blocks, 0)).add_(_block_scale(blocks, 2))


def _k_scales_mins(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: 12 bytes [n, 12] -> 6-bit scales and mins of the 8 sub-blocks, float32 [n, 8, 1] each.

    Bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes 4-7 the same for the
    mins; bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and of mins 4-7 (high nibble)."""
    low_scales, low_mins, high = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat((low_scales & 0x3F, (high & 0x0F) | ((low_scales >> 2) & 0x30)), dim=1)
    mins = torch.cat((low_mins & 0x3F, (high >> 4) | ((low_mins >> 2) & 0x30)), dim=1)
    return sc.float().unsqueeze(2), mins.float().unsqueeze(2)


def _k_nibbles(quants: torch.Tensor) -> torch.Tensor:
    """[n, 128] bytes -> [n, 8, 32]: in each 32-byte group, low nibbles are a sub-block, high ones the next."""
    groups = quants.contiguous().view(-1, 4, 32)
    return torch.stack((groups & 0x0F, groups >> 4), dim=2).view(-1, 8, 32)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:  # 144 bytes: d, dmin, 12 bytes of scales, 128 of quants
    sc, mins = _k_scales_mins(blocks[:, 4:16])
    scale, offset = _block_scale(blocks, 0).unsqueeze(2) * sc, _block_scale(blocks, 2).unsqueeze(2) * mins
    return _k_nibbles(blocks[:, 16:144]).float().mul_(scale).sub_(offset).view(-1, 256)


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:  # 176 bytes: d, dmin, scales, 32 bytes of 5th bits, quants
    sc, mins = _k_scales_mins(blocks[:, 4:16])
    scale, offset = _block_scale(blocks, 0).unsqueeze(2) * sc, _block_scale(blocks, 2).unsqueeze(2) * mins
    high = blocks[:, 16:48].contiguous().unsqueeze(1)  # [n, 1, 32]: bit j of byte i is value i of sub-block j
    bits = torch.stack([(high >> bit) & 1 for bit in range(8)], dim=1).view(-1, 8, 32) << 4
    return (_k_nibbles(blocks[:, 48:176]) | bits).float().mul_(scale).sub_(offset).view(-1, 256)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:  # 210 bytes: 128 low nibbles, 64 of 2 high bits, 16 scales, d
    low = blocks[:, 0:128].contiguous().view(-1, 2, 64)
    low = torch.stack((low & 0x0F, low >> 4), dim=2).view(-1, 8, 32)
    high = blocks[:, 128:192].contiguous().view(-1, 2, 32)
    high = torch.stack([(high >> shift) & 3 for shift in (0, 2, 4, 6)], dim=2).view(-1, 8, 32)
    values = ((low | (high << 4)).to(torch.int8) - 32).view(-1, 16, 16).float()
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()  # [n, 16]
    return values.mul_((_block_scale(blocks, 208) * scales).unsqueeze(2)).view(-1, 256)


_TORCH_DEQUANTIZERS = {
    GGMLQuantizationType.Q8_0: _q8_0,
    GGMLQuantizationType.Q4_0: _q4_0,
    GGMLQuantizationType.Q4_1: _q4_1,
    GGMLQuantizationType.Q5_0: _q5_0,
    GGMLQuantizationType.Q5_1: _q5_1,
    GGMLQuantizationType.Q4_K: _q4_k,
    GGMLQuantizationType.Q5_K: _q5_k,
    GGMLQuantizationType.Q6_K: _q6_k,
}


def _dequantize_blocks_torch(stored: np.ndarray, qtype: GGMLQuantizationType, dtype: torch.dtype) -> torch.Tensor:
    """stored [rows, bytes_per_row] of quantized blocks -> [rows, values_per_row] in `dtype`."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rows = stored.shape[0]
    num_blocks = stored.size // type_size
    blocks = torch.from_numpy(np.ascontiguousarray(stored).reshape(num_blocks, type_size))
    out = torch.empty((num_blocks, block_size), dtype=dtype)
    decode = _TORCH_DEQUANTIZERS[qtype]
    step = max(1, _DEQUANT_CHUNK_VALUES // block_size)
    for start in range(0, num_blocks, step):
        stop = min(start + step, num_blocks)
        out[start:stop] = decode(blocks[start:stop])
    return out.view(rows, -1)


# ---------------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------------

_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> how text is split before BPE (llama.cpp llama-vocab.cpp, HF tokenizer.json).
_PRE_TOKENIZER_FAMILY: dict[str, str] = {
    "default": "gpt2",
    "gpt2": "gpt2",
    "smollm": "digits+gpt2",
    "starcoder": "digits+gpt2",
    "refact": "digits+gpt2",
    "codeshell": "digits+gpt2",
    "qwen2": "qwen2",
    "deepseek-r1-qwen": "qwen2",
    "llama-bpe": "llama3",
    "llama3": "llama3",
    "smaug-bpe": "llama3",
    "falcon3": "llama3",
    "dbrx": "llama3",
}


def _pre_tokenizer(family: str) -> pre_tokenizers.PreTokenizer:
    if family == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if family == "digits+gpt2":
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    split = _QWEN2_SPLIT if family == "qwen2" else _LLAMA3_SPLIT
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _flagged_token(metadata: dict[str, Any], flag: str, key: str, tokens: list[str]) -> tuple[str, int] | None:
    """(token, id) of the BOS/EOS token when the GGUF asks for it to be added, else None."""
    token_id = metadata.get(f"tokenizer.ggml.{key}")
    if not metadata.get(f"tokenizer.ggml.{flag}") or token_id is None:
        return None
    return tokens[int(token_id)], int(token_id)


def _post_processor(metadata: dict[str, Any], tokens: list[str]) -> processors.PostProcessor:
    """Adds BOS/EOS as the GGUF's add_bos_token / add_eos_token flags say."""
    bos = _flagged_token(metadata, "add_bos_token", "bos_token_id", tokens)
    eos = _flagged_token(metadata, "add_eos_token", "eos_token_id", tokens)
    if bos is None and eos is None:
        return processors.ByteLevel(trim_offsets=False)
    head = [bos[0]] if bos else []
    tail = [eos[0]] if eos else []
    single = " ".join([*head, "$A", *tail])
    pair = " ".join([single, *(f"{t}:1" for t in head), "$B:1", *(f"{t}:1" for t in tail)])
    special = list(dict.fromkeys(t for t in (bos, eos) if t is not None))
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def _added_tokens(tokens: list[str], token_types: list[int]) -> list[AddedToken]:
    """Control tokens become special added tokens, user-defined ones plain added tokens."""
    added = []
    for token, token_type in zip(tokens, token_types, strict=False):
        if token_type == TokenType.CONTROL:
            added.append(AddedToken(token, special=True, normalized=False))
        elif token_type == TokenType.USER_DEFINED:
            added.append(AddedToken(token, special=False, normalized=False))
    return added


def _backend_tokenizer(metadata: dict[str, Any], source: str) -> Tokenizer:
    pre = str(metadata.get("tokenizer.ggml.pre", "default"))
    family = _PRE_TOKENIZER_FAMILY.get(pre)
    if metadata.get("tokenizer.ggml.model") != "gpt2" or family is None:
        raise ModelValidationError(
            f"{source}: cannot rebuild tokenizer model {metadata.get('tokenizer.ggml.model')!r} with "
            f"pre-tokenizer {pre!r} from GGUF. Use a Hugging Face model directory with tokenizer.json instead."
        )
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    merges = [tuple(merge.split(" ", 1)) for merge in metadata.get("tokenizer.ggml.merges", [])]
    vocab = {token: index for index, token in enumerate(tokens)}
    # Llama 3's tokenizer emits a whole word that is in the vocabulary without applying merges.
    bpe = models.BPE(vocab, merges, ignore_merges=(family == "llama3"))
    tokenizer = Tokenizer(bpe)
    if family == "qwen2":
        tokenizer.normalizer = normalizers.NFC()  # as in Qwen's tokenizer.json
    tokenizer.pre_tokenizer = _pre_tokenizer(family)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = _post_processor(metadata, tokens)
    tokenizer.add_tokens(_added_tokens(tokens, list(metadata.get("tokenizer.ggml.token_type", []))))
    return tokenizer


def build_tokenizer_from_metadata(
    metadata: dict[str, Any], source: str = "GGUF metadata"
) -> PreTrainedTokenizerFast:
    """A PreTrainedTokenizerFast from GGUF tokenizer metadata (byte-level BPE vocabularies).

    `metadata` is `GGUFHeader.metadata` read with string arrays kept; it may come from the first
    part of a split GGUF, since only metadata is used.
    """
    backend = _backend_tokenizer(metadata, source)
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    special: dict[str, str] = {}
    for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"), ("pad_token", "padding")):
        token_id = metadata.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None and 0 <= int(token_id) < len(tokens):
            special[name] = tokens[int(token_id)]
    context_length = next((v for k, v in metadata.items() if k.endswith(".context_length")), None)
    tokenizer = wrap_backend_tokenizer(
        backend,
        clean_up_tokenization_spaces=False,
        model_max_length=int(context_length) if context_length else int(1e30),
        **special,
    )
    template = metadata.get("tokenizer.chat_template")
    if template:
        tokenizer.chat_template = template
    return tokenizer


def wrap_backend_tokenizer(backend: Tokenizer, **kwargs: Any) -> PreTrainedTokenizerFast:
    """PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs) without its deep copy of `backend`.

    The copy is a pickle round trip of the whole vocabulary (0.7 s of start-up for a 150k-token one, more
    than building it); `backend` is ours alone, so it is used as is: __init__ keeps a backend already set
    on the instance. Should a transformers version not, the documented constructor is used instead.
    """
    tokenizer = PreTrainedTokenizerFast.__new__(PreTrainedTokenizerFast)
    tokenizer._tokenizer = backend
    try:
        tokenizer.__init__(**kwargs)
    except (TypeError, ValueError, AttributeError):
        return PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs)
    if tokenizer.backend_tokenizer is not backend:
        return PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs)
    return tokenizer


# ---------------------------------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------------------------------


def save_as_hf_dir(gguf_path: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """Write config.json, model.safetensors (dequantized to `dtype`) and tokenizer files to `out_dir`.

    The result loads with transformers' AutoModelForCausalLM / AutoTokenizer.from_pretrained(out_dir).
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with GGUFCheckpoint(gguf_path) as checkpoint:
        config = checkpoint.hf_config()
        config["torch_dtype"] = str(dtype).removeprefix("torch.")
        state_dict = dict(checkpoint.iter_tensors(dtype))
        tokenizer = checkpoint.build_tokenizer()
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    save_file(state_dict, str(out / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(str(out))
    return out
