"""GGUF's block-quantized formats decoded in torch: dequantization to a float dtype, or requantization to
per-row int8 for `--quantization int8` (no float copy of a whole tensor on the way)."""

from __future__ import annotations

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from pagedserve.kernels import CpuKernels
from pagedserve.layers.linear import QuantizedWeight, quantize_int8_per_channel

_REQUANTIZE_ROWS = 1024


def requantize_int8(stored: np.ndarray, qtype: GGMLQuantizationType, dtype: torch.dtype,
                    kernels: CpuKernels | None = None) -> QuantizedWeight:
    """Blocks [rows, bytes_per_row] -> per-row int8: each chunk of rows is dequantized to float32 (exactly
    as gguf.quants does) and quantized at once with scale max|row| / 127. `kernels` (the model's
    KernelBackend.native) do both in one pass for the 32-value formats, with the same bits."""
    if kernels is not None:
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        blocks = torch.from_numpy(np.ascontiguousarray(stored).view(np.uint8).reshape(stored.shape[0], -1))
        native = kernels.requant_gguf_i8(blocks, int(qtype), blocks.shape[1] // type_size * block_size)
        if native is not None:
            return QuantizedWeight(native[0], native[1], dtype)
    parts = [quantize_int8_per_channel(_dequantize_blocks_torch(stored[start:start + _REQUANTIZE_ROWS], qtype,
                                                                torch.float32))
             for start in range(0, stored.shape[0], _REQUANTIZE_ROWS)]
    return QuantizedWeight(torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts]), dtype)


def dequantize_to_torch(stored: np.ndarray, qtype: GGMLQuantizationType, dtype: torch.dtype) -> torch.Tensor:
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


# The block formats decoded here, chunk by chunk (others go through gguf.quants, whole tensors at a time).
TORCH_BLOCK_TYPES = frozenset(_TORCH_DEQUANTIZERS)
