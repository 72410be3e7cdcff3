"""Read safetensors files by memory-mapping them: tensors are views of the page cache, never copied."""

from __future__ import annotations

import mmap
from collections.abc import Iterator
from pathlib import Path

import torch

from pagedserve.formats.safetensors import read_safetensors_header

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


def iter_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor of one file; tensors share the file's private mapping."""
    header = read_safetensors_header(path)
    with open(path, "rb") as f:
        # ACCESS_COPY: a private, writable view (torch wants writable buffers); pages stay shared
        # with the page cache until something writes to them, which we never do.
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    for name, info in header.tensors.items():
        begin, end = info["data_offsets"]
        dtype = _DTYPES[info["dtype"]]
        count = (end - begin) // dtype.itemsize
        if count == 0:
            yield name, torch.empty(info["shape"], dtype=dtype)
            continue
        flat = torch.frombuffer(mapped, dtype=dtype, count=count, offset=header.data_offset + begin)
        yield name, flat.view(info["shape"])

