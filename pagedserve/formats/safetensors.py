"""The safetensors format without torch: one file's header, and the shards of a checkpoint directory.

A file is an 8-byte little-endian header length, the JSON header (name -> dtype, shape, data_offsets relative
to the data section, plus an optional __metadata__), then the data. A sharded checkpoint names its shards in
model.safetensors.index.json; without an index every *.safetensors file of the directory is a shard.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedserve.formats.errors import REDOWNLOAD_HINT, ModelValidationError

INDEX_NAME = "model.safetensors.index.json"
# Bytes per element of the dtypes a safetensors header can name.
SAFETENSORS_DTYPE_BYTES = {
    "F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
    "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1,
}
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"})


@dataclass(frozen=True)
class SafetensorsHeader:
    """Everything in a safetensors file except the tensor data."""

    path: Path
    tensors: dict[str, dict[str, Any]]  # name -> {"dtype", "shape", "data_offsets"}; __metadata__ left out
    data_offset: int  # 8 + the header's length: where the data section starts
    file_size: int

    @property
    def required_size(self) -> int:
        """File size the header asks for: 8 + header + data."""
        return self.data_offset + max((entry["data_offsets"][1] for entry in self.tensors.values()), default=0)


def truncated_error(path: Path, expected: int, actual: int) -> ModelValidationError:
    return ModelValidationError(
        f"{path.name} is truncated: its header says {expected:,} bytes, the file has {actual:,} "
        f"({expected - actual:,} missing). {REDOWNLOAD_HINT} ({path})."
    )


def read_safetensors_header(path: str | Path) -> SafetensorsHeader:
    """Parse one file's header without reading its data; a file cut inside its header, or a header that is not
    JSON, raises ModelValidationError (a cut in the data shows as required_size > file_size)."""
    path = Path(path)
    size = path.stat().st_size
    with path.open("rb") as file:
        prefix = file.read(8)
        if len(prefix) < 8:
            raise truncated_error(path, 8, size)
        (length,) = struct.unpack("<Q", prefix)
        if 8 + length > size:
            raise truncated_error(path, 8 + length, size)
        raw = file.read(length)
    try:
        tensors = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelValidationError(
            f"{path} has a damaged safetensors header ({exc}). Download the model again."
        ) from None
    tensors.pop("__metadata__", None)
    return SafetensorsHeader(path, tensors, 8 + length, size)


def read_shard_index(model_dir: Path) -> list[str] | None:
    """The shard file names model.safetensors.index.json names (sorted, once each), or None without an index."""
    index_path = model_dir / INDEX_NAME
    if not index_path.is_file():
        return None
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelValidationError(
            f"{index_path} (safetensors shard index) is not valid JSON: {exc}. The file is damaged: download "
            "the model again."
        ) from None
    return sorted(set((index.get("weight_map") or {}).values()))


def safetensors_files(model_dir: Path) -> list[Path]:
    """The shards of a checkpoint directory: those its index names, else every *.safetensors file (sorted)."""
    shards = read_shard_index(model_dir)
    if shards is not None:
        return [model_dir / name for name in shards]
    return sorted(model_dir.glob("*.safetensors"))
