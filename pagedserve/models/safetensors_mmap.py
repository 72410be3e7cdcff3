"""Read safetensors files by memory-mapping them: tensors are views of the page cache, never copied."""

from __future__ import annotations

import json
import mmap
import struct
from collections.abc import Iterator
from pathlib import Path

import torch

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


def read_header(path: Path) -> tuple[dict, int]:
    """(header without __metadata__, byte offset where tensor data starts)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return header, 8 + length


def iter_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor of one file; tensors share the file's private mapping."""
    header, data_start = read_header(path)
    with open(path, "rb") as f:
        # ACCESS_COPY: a private, writable view (torch wants writable buffers); pages stay shared
        # with the page cache until something writes to them, which we never do.
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    for name, info in header.items():
        begin, end = info["data_offsets"]
        dtype = _DTYPES[info["dtype"]]
        count = (end - begin) // dtype.itemsize
        if count == 0:
            yield name, torch.empty(info["shape"], dtype=dtype)
            continue
        flat = torch.frombuffer(mapped, dtype=dtype, count=count, offset=data_start + begin)
        yield name, flat.view(info["shape"])


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    return sorted(model_dir.glob("*.safetensors"))
