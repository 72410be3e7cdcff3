"""Load a llama.cpp GGUF file as a Hugging Face checkpoint: named torch tensors and the tokenizer.

The header, config and tensor table come from `formats/gguf_hf.py` (`GGUFFile`, no torch); here the stored
tensors become torch tensors in Hugging Face row order, dequantized (or requantized to per-row int8) by
`gguf_dequant.py`, and the tokenizer is rebuilt from the metadata by `gguf_tokenizer.py`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from pagedserve import envs
from pagedserve.formats.gguf import file_key, forget_gguf_header, read_gguf_header, shared_gguf_header
from pagedserve.formats.gguf_hf import GGUFFile, unpermute_rows
from pagedserve.kernels import CpuKernels
from pagedserve.layers.linear import BlockWeight, QuantizedWeight
from pagedserve.memory.weight_format import NATIVE_GGUF_BLOCKS
from pagedserve.models.gguf_dequant import TORCH_BLOCK_TYPES, dequantize_to_torch, requantize_int8
from pagedserve.models.gguf_tokenizer import build_tokenizer_from_metadata, cached_tokenizer
from pagedserve.models.validate import validate_gguf_header
from pagedserve.tokenizer import Tokenizer


class GGUFCheckpoint(GGUFFile):
    """A GGUF file opened for loading: its header checked (architecture, tensor types, truncation,
    tokenizer kind), its weights as torch tensors, its tokenizer."""

    def __init__(self, path: str | Path) -> None:
        header = shared_gguf_header(Path(path))
        validate_gguf_header(header)
        super().__init__(path, header)

    def iter_tensors(self, dtype: torch.dtype = torch.float32, int8_matmuls: bool = False,
                     kernels: CpuKernels | None = None, block_matmuls: bool = False
                     ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight | BlockWeight]]:
        """Every weight dequantized to `dtype`, under its Hugging Face name and shape. With `int8_matmuls`,
        block-quantized matmul weights (`*_proj.weight`, `lm_head.weight`) come instead as per-row int8
        (QuantizedWeight), requantized from their float32 values a few rows at a time (by `kernels`, the
        model's native kernels, where given): no `dtype` copy. With `block_matmuls` and `kernels` too, those of
        the types the native block kernel takes (Q4_0, Q4_1, Q5_0, Q5_1) come as they are stored (BlockWeight)."""
        for spec in self._specs:
            num_heads = self.permute_heads(spec)
            if (block_matmuls and kernels is not None and spec.qtype in NATIVE_BLOCK_TYPES
                    and _is_matmul_weight(spec.name)):
                weight = _block_weight(self.stored(spec), spec.qtype, dtype, kernels)
                if weight is not None:
                    yield spec.name, weight.map_rows(lambda t: unpermute_rows(t, num_heads)) if num_heads else weight
                    continue
            if int8_matmuls and spec.qtype in TORCH_BLOCK_TYPES and _is_matmul_weight(spec.name):
                weight = requantize_int8(self.stored(spec), spec.qtype, dtype, kernels)
                if num_heads:
                    weight = QuantizedWeight(unpermute_rows(weight.qweight, num_heads).contiguous(),
                                             unpermute_rows(weight.scales, num_heads).contiguous(), dtype)
                yield spec.name, weight
                continue
            shift = self.norm_shift(spec)
            if shift:  # in float32, where the stored weight + 1 was rounded, before the model dtype's rounding
                tensor = (dequantize_to_torch(self.stored(spec), spec.qtype, torch.float32) - shift).to(dtype)
            else:
                tensor = dequantize_to_torch(self.stored(spec), spec.qtype, dtype)
            tensor = tensor.reshape(spec.shape)
            if num_heads:
                tensor = unpermute_rows(tensor, num_heads).contiguous()
            yield spec.name, tensor
        forget_gguf_header(self.path)  # weights loaded: nobody needs the header again

    # -- tokenizer -------------------------------------------------------------------------------

    def build_tokenizer(self) -> Tokenizer:
        """A tokenizer equivalent to the model's original one (pagedserve.tokenizer; to_transformers() for
        transformers' PreTrainedTokenizerFast), rebuilt from the metadata's string arrays (which the shared
        header skips) once per file and then read from the cache directory (gguf_tokenizer.cached_tokenizer)."""
        def build() -> Tokenizer:
            metadata = read_gguf_header(self.path, keep_string_arrays=True).metadata
            return build_tokenizer_from_metadata(metadata, source=str(self.path))

        return cached_tokenizer(file_key(Path(self.path)), envs.cache_dir() / "tokenizers", build)


# The block types the native block kernel runs as stored (cpu_kernels.c's ps_linear_q; weight_format's names).
NATIVE_BLOCK_TYPES = tuple(GGMLQuantizationType[name] for name in NATIVE_GGUF_BLOCKS)


def _block_weight(stored: np.ndarray, qtype: GGMLQuantizationType, dtype: torch.dtype, kernels: CpuKernels
                  ) -> BlockWeight | None:
    """A stored matrix of ggml blocks [rows, bytes per row] as the block kernel's BlockWeight, or None where the
    kernel refuses it (an implied m that fp16 cannot hold)."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = torch.from_numpy(np.ascontiguousarray(stored).view(np.uint8).reshape(stored.shape[0], -1))
    rows = kernels.pack_gguf_q(blocks, int(qtype), blocks.shape[1] // type_size * block_size)
    return None if rows is None else BlockWeight(*rows, dtype)


def _is_matmul_weight(hf_name: str) -> bool:
    return hf_name.endswith("_proj.weight") or hf_name == "lm_head.weight"
