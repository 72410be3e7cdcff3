"""The GGUF format without torch: the header (metadata and tensor table) of a llama.cpp model file.

Parsed here in pure Python (~30x faster than gguf.GGUFReader on a 150k-token vocabulary, and it reports
truncation clearly); `gguf_hf.py` reads the tensors. Start-up reads one file's header several times (config and
memory plan, tokenizer, weights): `shared_gguf_header` parses it once for all of them.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from pagedserve.formats import GGUF_MAGIC
from pagedserve.formats.errors import LOCAL_MODEL_HINT, REDOWNLOAD_HINT, ModelValidationError

SUPPORTED_GGUF_VERSIONS: tuple[int, ...] = (2, 3)
GGUF_DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One entry of a GGUF tensor table (no data)."""

    name: str
    dims: tuple[int, ...]  # ggml order: fastest-moving dimension first
    type_id: int
    offset: int  # relative to the start of the data section
    nbytes: int  # 0 when the type id is unknown to gguf-py

    @property
    def shape(self) -> tuple[int, ...]:
        """The numpy / torch shape (ggml dims reversed)."""
        return tuple(reversed(self.dims))

    @property
    def num_elements(self) -> int:
        """Number of values in the tensor."""
        count = 1
        for dim in self.dims:
            count *= dim
        return count


@dataclass(frozen=True)
class GGUFHeader:
    """Everything in a GGUF file except the tensor data."""

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: tuple[GGUFTensorInfo, ...]
    alignment: int
    data_offset: int  # absolute file offset where the (aligned) data section starts
    file_size: int

    @property
    def architecture(self) -> str:
        """`general.architecture`, e.g. "llama"."""
        return str(self.metadata.get("general.architecture", ""))

    @property
    def required_size(self) -> int:
        """Smallest file size that holds every tensor's data."""
        ends = [self.data_offset + t.offset + t.nbytes for t in self.tensors]
        return max(ends, default=self.data_offset)


class _Cursor:
    """Little-endian reader over a buffer; running past its end raises `_Truncated`."""

    def __init__(self, buf: bytes | mmap.mmap) -> None:
        self.buf = buf
        self.pos = 0

    def unpack(self, fmt: str) -> tuple[Any, ...]:
        try:
            values = struct.unpack_from(fmt, self.buf, self.pos)
        except struct.error as exc:
            raise _Truncated(self.pos) from exc
        self.pos += struct.calcsize(fmt)
        return values

    def string(self, keep: bool = True) -> str:
        (length,) = self.unpack("<Q")
        end = self.pos + length
        if end > len(self.buf):
            raise _Truncated(self.pos)
        raw = self.buf[self.pos : end] if keep else b""
        self.pos = end
        return raw.decode("utf-8", errors="replace") if keep else ""


class _Truncated(Exception):
    def __init__(self, pos: int) -> None:
        super().__init__(pos)
        self.pos = pos


# GGUF metadata value types (gguf.constants.GGUFValueType) that have a fixed width.
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def _read_value(cur: _Cursor, type_id: int, keep: bool) -> Any:
    """One metadata value; string arrays are skipped (returned as their length) unless `keep`."""
    if type_id in _SCALAR_FORMATS:
        return cur.unpack("<" + _SCALAR_FORMATS[type_id])[0]
    if type_id == _STRING:
        return cur.string()
    if type_id != _ARRAY:
        raise ValueError(f"unknown GGUF metadata value type {type_id}")
    item_type, count = cur.unpack("<IQ")
    if item_type in _SCALAR_FORMATS:
        return list(cur.unpack(f"<{count}{_SCALAR_FORMATS[item_type]}"))
    if item_type == _STRING:
        return _string_array(cur, count, keep)
    return [_read_value(cur, item_type, keep) for _ in range(count)]


_LENGTH = struct.Struct("<Q")


def _string_array(cur: _Cursor, count: int, keep: bool) -> list[str] | int:
    """`count` length-prefixed strings (a vocabulary: ~50-150k of them), or only their count when not
    `keep`. One tight loop over the buffer instead of a method call per string: ~5x faster, which is
    ~0.2 s of every GGUF start."""
    buf, pos, size, unpack = cur.buf, cur.pos, len(cur.buf), _LENGTH.unpack_from
    values: list[str] = []
    try:
        for _ in range(count):
            (length,) = unpack(buf, pos)
            start, pos = pos + 8, pos + 8 + length
            if pos > size:
                raise _Truncated(start - 8)
            if keep:
                values.append(str(buf[start:pos], "utf-8", "replace"))
    except struct.error as exc:
        raise _Truncated(pos) from exc
    cur.pos = pos
    return values if keep else count


def _tensor_nbytes(type_id: int, num_elements: int) -> int:
    try:
        block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
    except (ValueError, KeyError):
        return 0
    return num_elements // block_size * type_size


def _read_tensor_info(cur: _Cursor) -> GGUFTensorInfo:
    name = cur.string()
    (num_dims,) = cur.unpack("<I")
    dims = tuple(cur.unpack(f"<{num_dims}Q"))
    type_id, offset = cur.unpack("<IQ")
    info = GGUFTensorInfo(name, dims, type_id, offset, 0)
    return GGUFTensorInfo(name, dims, type_id, offset, _tensor_nbytes(type_id, info.num_elements))


def _parse_gguf(path: Path, buf: bytes | mmap.mmap, keep_string_arrays: bool) -> GGUFHeader:
    cur = _Cursor(buf)
    if bytes(buf[:4]) != GGUF_MAGIC:
        raise ModelValidationError(
            f"{path} is not a GGUF file (it does not start with the bytes 'GGUF'). "
            f"{LOCAL_MODEL_HINT}; if this was meant to be a GGUF, it is damaged: download it again."
        )
    cur.pos = 4
    (version,) = cur.unpack("<I")
    if version not in SUPPORTED_GGUF_VERSIONS and int.from_bytes(version.to_bytes(4, "little"), "big") in \
            SUPPORTED_GGUF_VERSIONS:
        raise ModelValidationError(
            f"{path} is a big-endian GGUF (written for s390x); pagedserve reads little-endian GGUF files. Use the "
            "model's little-endian GGUF, or convert it with gguf-py's gguf_convert_endian.py.")
    if version not in SUPPORTED_GGUF_VERSIONS:
        raise ModelValidationError(
            f"{path} is GGUF version {version}; pagedserve reads versions {SUPPORTED_GGUF_VERSIONS}. "
            "Convert the model again with a current llama.cpp (convert_hf_to_gguf.py)."
        )
    num_tensors, num_kv = cur.unpack("<QQ")
    metadata: dict[str, Any] = {}
    for _ in range(num_kv):
        key = cur.string()
        (type_id,) = cur.unpack("<I")
        metadata[key] = _read_value(cur, type_id, keep_string_arrays)
    tensors = tuple(_read_tensor_info(cur) for _ in range(num_tensors))
    alignment = int(metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))
    data_offset = (cur.pos + alignment - 1) // alignment * alignment
    return GGUFHeader(path, version, metadata, tensors, alignment, data_offset, len(buf))


def read_gguf_header(path: str | Path, *, keep_string_arrays: bool = True) -> GGUFHeader:
    """Parse a GGUF file's metadata and tensor table without reading tensor data.

    Works on a file cut short after its header (e.g. the first part of a split download): the
    header is returned and `required_size` tells how big the whole file must be. A header that is
    itself cut off raises ModelValidationError. With `keep_string_arrays=False`, string arrays
    (vocabulary, merges) are skipped and stored as their length, which is faster.
    """
    path = Path(path)
    with open(path, "rb") as file:
        size = path.stat().st_size
        if size < 24:
            if file.read(4) != GGUF_MAGIC[:size]:  # not even the start of one: say that, not "truncated"
                _parse_gguf(path, b"", keep_string_arrays)
            raise truncated_gguf_error(path, 24, size)
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            try:
                return _parse_gguf(path, buf, keep_string_arrays)
            except ModelValidationError:
                raise
            except _Truncated as exc:
                raise ModelValidationError(
                    f"GGUF file {path} is truncated inside its header (at byte {exc.pos:,} of {size:,}). "
                    f"{REDOWNLOAD_HINT}."
                ) from None
            except (ValueError, UnicodeDecodeError) as exc:
                raise ModelValidationError(
                    f"GGUF file {path} has a damaged header ({exc}). Download or convert it again."
                ) from None


def truncated_gguf_error(path: Path, required: int, actual: int) -> ModelValidationError:
    return ModelValidationError(
        f"GGUF file {path} is truncated: its tensors need at least {required:,} bytes but the file has "
        f"{actual:,} bytes ({required - actual:,} missing). {REDOWNLOAD_HINT}."
    )


# The header with string arrays (a 150k-token vocabulary and merges: ~0.2 s to parse) of the last file asked
# for; the loader drops it once every weight has been read (loading is the last of the header's users).
_header_cache: dict[tuple[str, int, int], GGUFHeader] = {}


def file_key(path: Path) -> tuple[str, int, int]:
    stat = path.stat()
    return str(path.resolve()), stat.st_size, stat.st_mtime_ns  # a rewritten file is parsed again


def shared_gguf_header(path: Path) -> GGUFHeader:
    """read_gguf_header(path) without string arrays (a vocabulary's ~100k strings are the slow part; only the
    tokenizer needs them, and it reads its own copy: models/gguf_loader.py), parsed once while the file is
    unchanged."""
    key = file_key(path)
    header = _header_cache.get(key)
    if header is None:
        header = read_gguf_header(path, keep_string_arrays=False)
        _header_cache.clear()
        _header_cache[key] = header
    return header


def forget_gguf_header(path: Path) -> None:
    """Drop the shared header of `path` (its last user is done with it)."""
    _header_cache.pop(file_key(path), None)
