"""What the memory plan needs from a checkpoint before it is loaded: its config and exact weight sizes.

Headers only: safetensors headers (JSON before the data) or the GGUF metadata and tensor table. No tensor data
is read, so `serve` can refuse a model that does not fit before paying for reading it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedserve.formats import is_gguf_path
from pagedserve.formats.multimodal import language_model_name
from pagedserve.formats.safetensors import (
    FLOAT_DTYPES,
    SAFETENSORS_DTYPE_BYTES,
    read_safetensors_header,
    safetensors_files,
)

# fp8 KV caches also keep one 2-byte scale per token and head (3 % more for head_dim 64), not counted here.
DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2,
               "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}


FLOAT_GGUF_TYPES = frozenset({"F32", "F16", "BF16", "F64"})


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype name as the engine resolves them ("float32", "bfloat16", ...)."""
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPE_BYTES)}") from None


@dataclass
class CheckpointInfo:
    """A checkpoint seen through its headers: a config.json-style dict and a weight-size rule."""

    path: str
    config: dict[str, Any]
    is_gguf: bool
    gguf: Any = None  # the GGUFFile (header parsed, data memory-mapped lazily) for .gguf files
    num_gguf_parameters: int = 0

    def weight_bytes(self, serving_dtype_bytes: int) -> int:
        """Bytes of the weights once loaded in the serving dtype (what the model will hold)."""
        if self.is_gguf:
            # Every GGUF tensor, quantized or not, is dequantized to the serving dtype on load.
            return self.num_gguf_parameters * serving_dtype_bytes
        return weight_bytes_from_safetensors_dir(self.path, serving_dtype_bytes, skip=self._skipped_tensor)

    def stores_quantized_matmuls(self) -> bool:
        """A GGUF whose matrices (most of their elements) are block-quantized (Q8_0, Q4_K, ...), not floats."""
        if not self.is_gguf:
            return False
        matrices = [spec for spec in self.gguf.tensor_specs() if len(spec.shape) == 2]
        quantized = sum(math.prod(s.shape) for s in matrices if s.qtype.name not in FLOAT_GGUF_TYPES)
        return quantized * 2 > sum(math.prod(s.shape) for s in matrices)

    def gguf_block_savings(self, serving_dtype_bytes: int) -> int:
        """Bytes that --quantization gguf saves against the int8 rows the plan counts (memory/sizes.py: a byte a
        weight and a scale a row) for the matrices that keep their 4- or 5-bit blocks (weight_format's rule, per
        layer): each such row holds K / 2 bytes of nibbles, 16 bytes of scales per 128 columns, and for 5 bits a
        bit a weight more (cpu_kernels.c's ps_linear_q layout)."""
        from pagedserve.memory.weight_format import LINEAR_PARTS, NATIVE_GGUF_BLOCKS, gguf_block_linears

        if not self.is_gguf:
            return 0
        layers: dict[str, dict[str, Any]] = {}  # layer prefix -> last name part -> spec
        for spec in self.gguf.tensor_specs():
            if len(spec.shape) == 2 and spec.name.endswith(".weight"):
                prefix, _, part = spec.name.removesuffix(".weight").rpartition(".")
                layers.setdefault("" if part == "lm_head" else prefix, {})[part] = spec
        saved = 0
        for specs in layers.values():
            kept = gguf_block_linears({part: spec.qtype.name for part, spec in specs.items()})
            parts = {p for linear in kept for alternative in LINEAR_PARTS[linear] for p in alternative if p in specs}
            for part in parts:
                rows, k = specs[part].shape
                bits = NATIVE_GGUF_BLOCKS[specs[part].qtype.name]
                blocks = k // 2 + -(-k // 128) * (16 + (16 if bits == 5 else 0))
                saved += rows * (k + serving_dtype_bytes - blocks)
        return saved

    def _skipped_tensor(self, name: str) -> bool:
        """Tensors the loader does not keep: a tied LM head (it reuses the embedding), rotary buffers, and a
        multimodal checkpoint's parts that are not its language model (formats/multimodal.py)."""
        name = language_model_name(name)
        if name is None:
            return True
        tied = self.config.get("tie_word_embeddings", self.config.get("text_config", {}).get("tie_word_embeddings"))
        if name == "lm_head.weight" and tied:
            return True
        return name.endswith("rotary_emb.inv_freq")


def read_checkpoint_info(model_path: str | Path) -> CheckpointInfo:
    """Config and weight sizes of a Hugging Face directory or a .gguf file, from headers only."""
    path = str(model_path)
    if is_gguf_path(path):
        from pagedserve.formats.gguf_hf import GGUFFile  # numpy and gguf: only for GGUF files

        checkpoint = GGUFFile(path)
        return CheckpointInfo(path, checkpoint.hf_config(), True, checkpoint, checkpoint.num_parameters())
    config_path = Path(path) / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{config_path}: cannot read the model config ({exc})") from exc
    return CheckpointInfo(path, config, False)


def weight_bytes_from_safetensors_dir(path: str | Path, dtype_bytes: int,
                                      skip: Callable[[str], bool] | None = None) -> int:
    """Bytes of all weights in a checkpoint dir once floating-point tensors are cast to the serving dtype.

    Reads only the headers. Integer tensors (quantized weights, index buffers) keep their stored size.
    Tensors for which `skip(name)` is true (ones the loader drops, such as a tied LM head) are not counted.
    """
    files = safetensors_files(Path(path))
    if not files:
        raise ValueError(f"{path}: no .safetensors files")
    total = 0
    for file in files:
        for name, info in read_safetensors_header(file).tensors.items():
            if skip is not None and skip(name):
                continue
            num_elements = math.prod(info["shape"])
            dtype = info["dtype"]
            total += num_elements * (dtype_bytes if dtype in FLOAT_DTYPES else SAFETENSORS_DTYPE_BYTES[dtype])
    return total
