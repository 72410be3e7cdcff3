"""Load a llama.cpp GGUF file as a Hugging Face checkpoint: named torch tensors and the tokenizer.

The header, config and tensor table come from `formats/gguf_hf.py` (`GGUFFile`, no torch); here the stored
tensors become torch tensors in Hugging Face row order, dequantized (or requantized to per-row int8) by
`gguf_dequant.py`, and the tokenizer is rebuilt from the metadata by `gguf_tokenizer.py`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType
from transformers import PreTrainedTokenizerFast

from pagedserve.formats.gguf import forget_gguf_header, shared_gguf_header
from pagedserve.formats.gguf_hf import GGUFFile, unpermute_rows
from pagedserve.layers.linear import QuantizedWeight
from pagedserve.models.gguf_dequant import TORCH_BLOCK_TYPES, dequantize_to_torch, requantize_int8
from pagedserve.models.gguf_tokenizer import build_tokenizer_from_metadata
from pagedserve.models.validate import validate_gguf_header


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
            if int8_matmuls and spec.qtype in TORCH_BLOCK_TYPES and _is_matmul_weight(spec.name):
                weight = requantize_int8(self.stored(spec), spec.qtype, dtype)
                if num_heads:
                    weight = QuantizedWeight(unpermute_rows(weight.qweight, num_heads).contiguous(),
                                             unpermute_rows(weight.scales, num_heads).contiguous(), dtype)
                yield spec.name, weight
                continue
            tensor = dequantize_to_torch(self.stored(spec), spec.qtype, dtype).reshape(spec.shape)
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
