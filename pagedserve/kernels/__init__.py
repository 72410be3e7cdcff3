"""Native CPU kernels (cpu_kernels.c), built once per machine with the system C compiler and cached.

`cpu_kernels()` returns the loaded library wrapped for torch tensors, or None when it cannot be used
here: not an x86 CPU with AVX-512 (F, BW, VNNI) or AVX2 + FMA + F16C, no C compiler, or
PAGEDSERVE_CPU_KERNELS=0. Callers then keep the torch path, which is also the reference the tests
compare these kernels against. The instruction set is chosen once, where the library is compiled
(`-march=native`; PAGEDSERVE_CPU_ISA=avx2 builds the AVX2 kernels on an AVX-512 CPU too), and reported
by `CpuKernels.isa`.

The build (kernels/builder.py) is `cc -O3 -march=native -fopenmp -shared` on one small C file (under a
second); the result is cached in a private directory under the pagedserve cache, keyed by the source, the
compiler, the flags and the CPU, so a second start loads it in milliseconds. OpenMP resolves to the
libgomp torch has already loaded, so the kernels share torch's threads.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import mmap
import platform
import subprocess
from pathlib import Path

import torch

from pagedserve import envs
from pagedserve.kernels.builder import BUILD_FLAGS, SOURCE, KernelBuildError, build
from pagedserve.memory import weight_format
from pagedserve.memory.probe import bf16_attention_by_dot, cpu_flags, is_x86

__all__ = ["SOURCE", "CpuKernels", "KernelBuildError", "build", "cpu_kernels", "load", "load_status"]

logger = logging.getLogger(__name__)

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_INT = ctypes.c_int
_F32 = ctypes.c_float
_SIGNATURES = {
    "ps_isa": ((), _INT),
    "ps_bf16_block": ((), _INT),
    "ps_has_bf16_dot": ((), _INT),
    "ps_amx_init": ((_INT,), _INT),
    "ps_amx_int8": ((), _INT),
    "ps_avx_vnni": ((), _INT),
    "ps_advise_huge": ((_P, _I64), _I64),
    "ps_set_batch_invariant": ((_INT,), None),
    "ps_set_bf16_attention": ((_INT,), _INT),
    "ps_linear_i8": ((_P, _P, _P, _P, _P, _P, _I64, _I64, _I64, _INT, _INT), None),
    "ps_linear_bf16": ((_P, _P, _P, _P, _I64, _I64, _I64, _INT), None),
    "ps_pack_bf16": ((_P, _P, _I64, _I64, _INT), None),
    "ps_rms_norm": ((_P, _P, _P, _P, _P, _I64, _I64, _F32, _INT, _INT), None),
    "ps_rms_norm_gain": ((_P, _P, _P, _P, _P, _I64, _I64, _F32, _INT, _INT), None),
    "ps_gate_mul": ((_P, _P, _I64, _I64, _INT, _INT, _INT), None),
    "ps_rope_kv_write": ((_P, _P, _P, _P, _P, _P, _P, _INT, _P, _P, _P, _INT, _F32, _I64, _I64, _I64, _I64, _INT,
                          _INT), None),
    "ps_decode_attention": ((_P, _I64, _P, _P, _P, _P, _INT, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _F32, _F32,
                             _INT, _INT), None),
    "ps_prefill_attention": ((_P, _I64, _P, _P, _P, _P, _INT, _P, _I64, _I64, _P, _I64, _I64, _I64, _I64, _F32,
                              _F32, _INT, _INT), None),
    "ps_argmax_rows": ((_P, _I64, _I64, _P, _INT), None),
    "ps_gguf_block_bytes": ((_INT,), _I64),
    "ps_requant_gguf_i8": ((_P, _INT, _I64, _I64, _P, _P, _INT), _INT),
    "ps_quantize_rows_i8": ((_P, _INT, _I64, _I64, _P, _P, _INT), None),
    "ps_q_row_bytes": ((_INT, _I64), _I64),
    "ps_pack_gguf_q": ((_P, _INT, _I64, _I64, _P, _P, _P, _INT), _INT),
    "ps_pack_q_rows": ((_P, _P, _P, _I64, _I64, _P, _INT), None),
    "ps_linear_q": ((_P, _P, _INT, _P, _P, _I64, _I64, _I64, _INT, _INT), None),
    "ps_row_sums_i8": ((_P, _I64, _I64, _P, _INT), None),
    "ps_layer_fields": ((), _INT),
    "ps_layer_layout": ((_P, _INT), _INT),
    "ps_decode_stack": ((_P, _P, _P, _I64, _P, _P, _I64, _I64, _I64, _I64, _I64, _I64, _F32, _F32, _F32, _INT,
                         _INT), None),
    "ps_layer_attention": ((_P, _P, _P, _INT, _P, _P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _I64, _F32,
                            _F32, _F32, _INT, _INT), None),
    "ps_layer_mlp": ((_P, _P, _P, _P, _I64, _I64, _I64, _F32, _INT, _INT), None),
}
ACTIVATION_DTYPES = tuple(getattr(torch, name) for name in weight_format.NATIVE_DTYPES)  # the rule's, as torch dtypes
ISA_NAMES = {512: "avx512", 256: "avx2"}  # ps_isa() -> name; 0: neither, the torch path runs
HUGE_PAGE = 2 << 20
Q_FIVE, Q_K = 1, 2  # a GGUF block matrix's kind (cpu_kernels.c's): fifth bits (Q5_*); K-quant scales (Q4_K, Q5_K)
# An 8-bit KV pool's format for the attention kernels and the decode-stack table's kv_format (FP8_E4M3, FP8_E5M2 in
# cpu_kernels.c; 0: 16/32-bit K/V)
FP8_FORMATS = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}


def check(name: str, t: torch.Tensor, dtype: torch.dtype | tuple[torch.dtype, ...] | None = None,
          shape: tuple[int | None, ...] | None = None, contiguous: bool = True) -> None:
    """Raise ValueError unless tensor `name` is a CPU tensor of `dtype` (one of them, for a tuple), of
    `shape` (None: any size on that axis) and contiguous: what the C code reads through a raw pointer."""
    problems = []
    if t.device.type != "cpu":
        problems.append(f"on {t.device}, not the CPU")
    if dtype is not None and t.dtype not in (dtype if isinstance(dtype, tuple) else (dtype,)):
        problems.append(f"dtype {t.dtype}, expected {dtype}")
    if shape is not None and (t.dim() != len(shape) or any(w is not None and w != n for w, n in zip(shape, t.shape))):
        problems.append(f"shape {tuple(t.shape)}, expected {tuple('*' if w is None else w for w in shape)}")
    if contiguous and not t.is_contiguous():
        problems.append("not contiguous")
    if problems:
        raise ValueError(f"native kernel argument {name}: {'; '.join(problems)}")


class CpuKernels:
    """Typed entry points over the C library; each takes torch CPU tensors and checks the dtypes, shapes
    and contiguity the C code relies on (`check`: a ValueError naming the argument, never a wild read)."""

    def __init__(self, lib: ctypes.CDLL, path: Path, build: str = "native") -> None:
        self.lib = lib
        self.path = path
        self.build = build  # the build asked for (a key of builder.ISA_MARCH)
        for name, (args, result) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes = args
            fn.restype = result
        self.isa = ISA_NAMES[lib.ps_isa()]
        # bf16 linears on AMX tiles where the library was built with them and Linux grants the tile state
        # (every batch size, so a row's result never depends on the rows beside it); else vdpbf16ps / FMAs.
        self.amx = bool(lib.ps_amx_init(int(envs.cpu_amx_enabled())))
        self.amx_int8 = bool(lib.ps_amx_int8())  # int8 linears' 2-63-row batches on AMX-INT8 tiles too
        self.avx_vnni = bool(lib.ps_avx_vnni())  # the AVX2 kernels' int8 sums in one AVX-VNNI instruction
        self.bf16_block = lib.ps_bf16_block()  # outputs per block of the packed bf16 layout
        self.bf16_dot = bool(lib.ps_has_bf16_dot())  # the build multiplies bf16 pairs (AVX512-BF16)
        self.set_bf16_attention(envs.cpu_bf16_attention(default=bf16_attention_by_dot(cpu_flags())))
        self.set_batch_invariant(envs.batch_invariant())

    def set_batch_invariant(self, on: bool) -> None:
        """on: every batch size of an int8 linear takes a kernel with the decode kernel's exact integer sums, so a
        row's result never depends on the rows beside it (PAGEDSERVE_BATCH_INVARIANT). Process-wide: call it
        before a model is built (Int8Linear reads int8_max_rows once)."""
        self.batch_invariant = bool(on)
        self.lib.ps_set_batch_invariant(int(self.batch_invariant))
        # prefill-sized int8 batches: an integer tile with the decode kernel's exact sums (AVX2, AVX-512 without
        # BF16, or batch-invariant mode: a prompt's row gets the bits it gets alone), else exact bf16 panels with
        # float32 sums
        self.int8_prefill_exact = not self.bf16_dot or self.batch_invariant

    def set_bf16_attention(self, on: bool) -> bool:
        """on: bf16 attention by vdpbf16ps where the build has it (bf16 pairs into float32 sums), else by float32
        FMAs on widened rows; chosen per CPU (probe.bf16_attention_by_dot: faster on a Zen 5, slower on an Intel
        Xeon with AMX). Every attention path follows it, so they keep the same bits. Process-wide; returns
        whether vdpbf16ps now runs."""
        self.bf16_dot_attention = bool(self.lib.ps_set_bf16_attention(int(on)))
        return self.bf16_dot_attention

    def int8_max_rows(self, dtype: torch.dtype) -> int | None:
        """Rows up to which int8 linears with activations of `dtype` run the native kernel (None: every batch
        size; prefill-sized batches run it on exact bf16 panels of the weights, see cpu_kernels.c). Only float32
        activations on a CPU with bf16 dot products stop, at 32 rows: above, they dequantize and run one dense
        float32 matmul (not in batch-invariant mode)."""
        return 32 if self.bf16_dot and dtype == torch.float32 and not self.batch_invariant else None

    @staticmethod
    def supports(x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.dtype in ACTIVATION_DTYPES

    @staticmethod
    def _threads() -> int:
        return torch.get_num_threads()

    def weight_buffer(self, *shape: int, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor for a packed weight. With PAGEDSERVE_HUGE_PAGES=1: zeroed, in its own
        2 MiB-aligned mapping advised for transparent huge pages (ps_advise_huge), so all but its last
        partial 2 MiB sits on huge pages once written (a recycled heap block may already be backed by
        4 KiB pages). Freed with the tensor."""
        numel = math.prod(shape)
        nbytes = numel * dtype.itemsize
        if nbytes < HUGE_PAGE or not envs.huge_pages_enabled():
            return torch.empty(*shape, dtype=dtype)
        region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # zeroed, untouched
        view = memoryview(region)
        start = ctypes.addressof(ctypes.c_char.from_buffer(view))
        offset = -start % HUGE_PAGE
        self.lib.ps_advise_huge(start + offset, nbytes)
        return torch.frombuffer(view, dtype=dtype, count=numel, offset=offset).view(*shape)

    def pack_rows(self, weight: torch.Tensor) -> torch.Tensor:
        """int8 [N, K] -> `ps_linear_i8`'s layout: blocks of 4 rows, column chunks of 64 interleaved
        ([N/4, K/64, 4, 64], zero rows padding N), so each block streams as one sequential run.
        K must be a multiple of 64."""
        check("weight", weight, torch.int8, (None, None), contiguous=False)
        n, k = weight.shape
        if k % 64:
            raise ValueError(f"pack_rows: in_features {k} is not a multiple of 64")
        padded = weight
        if n % 4:
            padded = torch.zeros(-(-n // 4) * 4, k, dtype=weight.dtype)
            padded[:n] = weight
        out = self.weight_buffer(padded.shape[0] // 4, k // 64, 4, 64, dtype=weight.dtype)
        return out.copy_(padded.reshape(-1, 4, k // 64, 64).permute(0, 2, 1, 3))

    @staticmethod
    def unpack_rows(packed: torch.Tensor, out_features: int) -> torch.Tensor:
        """The inverse of `pack_rows`: [N, K]."""
        blocks, chunks = packed.shape[:2]
        return packed.permute(0, 2, 1, 3).reshape(blocks * 4, chunks * 64)[:out_features]

    def row_sums(self, qweight: torch.Tensor) -> torch.Tensor:
        """int32 [N]: each row's sum of int8 values (the kernel's correction for its unsigned bytes)."""
        check("qweight", qweight, torch.int8, (None, None))
        sums = torch.empty(qweight.shape[0], dtype=torch.int32)
        self.lib.ps_row_sums_i8(qweight.data_ptr(), qweight.shape[0], qweight.shape[1], sums.data_ptr(),
                                self._threads())
        return sums

    def pack_bf16(self, weight: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
        """bf16 [N, K] -> `ps_linear_bf16`'s layout [N/NB, K/2, NB, 2] (zero rows pad N), NB =
        `bf16_block` (64 with AVX512-BF16, 16 on AVX2). K must be a multiple of 16. A list of [N_i, K]
        parts (q/k/v, gate/up) packs as their rows stacked, straight into the one packed buffer, where every
        part but the last holds whole blocks (see can_pack_parts); no stacked copy is made."""
        parts = weight if isinstance(weight, list) else [weight]
        for i, part in enumerate(parts):
            check(f"weight[{i}]" if len(parts) > 1 else "weight", part, torch.bfloat16,
                  (None, parts[0].shape[1]), contiguous=False)
        k = parts[0].shape[1]
        if k % 16:
            raise ValueError(f"pack_bf16: in_features {k} is not a multiple of 16")
        if not self.can_pack_parts([p.shape[0] for p in parts]):
            raise ValueError(f"pack_bf16: parts of {[p.shape[0] for p in parts]} rows do not all hold whole "
                             f"blocks of {self.bf16_block}")
        nb = self.bf16_block
        n = sum(p.shape[0] for p in parts)
        packed = self.weight_buffer(-(-n // nb), k // 2, nb, 2, dtype=torch.bfloat16)
        first = 0
        for part in parts:
            part = part.contiguous()
            self.lib.ps_pack_bf16(part.data_ptr(), packed[first:].data_ptr(), part.shape[0], k, self._threads())
            first += part.shape[0] // nb
        return packed

    def can_pack_parts(self, rows: list[int]) -> bool:
        """Whether parts of these row counts pack one after another: all but the last whole blocks."""
        return all(n % self.bf16_block == 0 for n in rows[:-1])

    def linear_bf16(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                    out_features: int) -> torch.Tensor:
        """bf16 x [M, K] (contiguous) @ W^T (+ bias) -> [M, N]; W packed by `pack_bf16`."""
        check("x", x, torch.bfloat16, (None, None))
        m, k = x.shape
        check("packed", packed, torch.bfloat16, (-(-out_features // self.bf16_block), k // 2, self.bf16_block, 2))
        if k % 16:
            raise ValueError(f"linear_bf16: in_features {k} is not a multiple of 16")
        if bias is not None:
            check("bias", bias, torch.bfloat16, (out_features,))
        y = torch.empty(m, out_features, dtype=x.dtype)
        self.lib.ps_linear_bf16(x.data_ptr(), packed.data_ptr(), None if bias is None else bias.data_ptr(),
                                y.data_ptr(), m, out_features, k, self._threads())
        return y

    def quantize_rows_i8(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 or bf16 [N, K] -> (int8 [N, K], float32 scales [N]), exactly as layers/linear.py's
        quantize_int8_per_channel (scale max|row| / 127, round half to even), every row in one pass."""
        check("weight", weight, ACTIVATION_DTYPES, (None, None), contiguous=False)
        weight = weight.contiguous()
        q = torch.empty(weight.shape, dtype=torch.int8)
        scales = torch.empty(weight.shape[0], dtype=torch.float32)
        self.lib.ps_quantize_rows_i8(weight.data_ptr(), int(weight.dtype == torch.bfloat16), weight.shape[0],
                                     weight.shape[1], q.data_ptr(), scales.data_ptr(), self._threads())
        return q, scales

    def requant_gguf_i8(self, blocks: torch.Tensor, qtype: int, in_features: int
                        ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """uint8 [N, row bytes] of ggml 32-value blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 by their
        GGMLQuantizationType number) -> (int8 [N, K], float32 scales [N]) as dequantizing them to float32
        and quantize_rows_i8 would give; None for another type."""
        block_bytes = self.lib.ps_gguf_block_bytes(qtype)
        if block_bytes == 0 or in_features % 32:
            return None
        check("blocks", blocks, torch.uint8, (None, block_bytes * (in_features // 32)))
        q = torch.empty(blocks.shape[0], in_features, dtype=torch.int8)
        scales = torch.empty(blocks.shape[0], dtype=torch.float32)
        status = self.lib.ps_requant_gguf_i8(blocks.data_ptr(), qtype, blocks.shape[0], in_features, q.data_ptr(),
                                             scales.data_ptr(), self._threads())
        return (q, scales) if status == 0 else None

    def pack_gguf_q(self, blocks: torch.Tensor, qtype: int, in_features: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int] | None:
        """uint8 [N, row bytes] of ggml Q4_0, Q4_1, Q5_0, Q5_1, Q4_K or Q5_K blocks (GGMLQuantizationType numbers) ->
        the rows as `pack_q_rows` takes them: (nibbles uint8 [N, K / 2], scale bytes uint8 [N, ceil(K / 128), 16],
        fifth bits int64 [N, ceil(K / 128), 2] or None for 4 bits, kind: Q_FIVE | Q_K bits; cpu_kernels.c); None for
        another type, or where an implied m (-8 d, -16 d) does not fit fp16 (the caller serves the tensor another
        way)."""
        row_bytes = self.lib.ps_q_row_bytes(qtype, in_features)
        if row_bytes == 0:
            return None
        check("blocks", blocks, torch.uint8, (None, row_bytes))
        n, groups = blocks.shape[0], -(-in_features // 128)
        qs = torch.empty(n, in_features // 2, dtype=torch.uint8)
        ss = torch.empty(n, groups, 16, dtype=torch.uint8)
        qh = torch.empty(n, groups, 2, dtype=torch.int64)
        kind = self.lib.ps_pack_gguf_q(blocks.data_ptr(), qtype, n, in_features, qs.data_ptr(), ss.data_ptr(),
                                       qh.data_ptr(), self._threads())
        if kind < 0:
            return None
        return qs, ss, (qh if kind & Q_FIVE else None), kind

    def pack_q_rows(self, qs: torch.Tensor, ss: torch.Tensor, qh: torch.Tensor | None) -> torch.Tensor:
        """Rows as `pack_gguf_q` gives them -> `linear_q`'s layout: uint8 [ceil(N / 4), ceil(K / 128), record] (a
        record per 4 rows and 128 columns: their nibbles, scale bytes, fifth bits; cpu_kernels.c), so each block of
        4 rows streams as one sequential run."""
        n, k = qs.shape[0], qs.shape[1] * 2
        check("qs", qs, torch.uint8, (n, k // 2))
        check("ss", ss, torch.uint8, (n, -(-k // 128), 16))
        if qh is not None:
            check("qh", qh, torch.int64, (n, -(-k // 128), 2))
        record = 384 if qh is not None else 320
        packed = self.weight_buffer(-(-n // 4), -(-k // 128), record, dtype=torch.uint8)
        self.lib.ps_pack_q_rows(qs.data_ptr(), ss.data_ptr(), _pointer(qh), n, k, packed.data_ptr(), self._threads())
        return packed

    @staticmethod
    def unpack_q_rows(packed: torch.Tensor, out_features: int, in_features: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The inverse of `pack_q_rows`: (qs, ss, qh or None)."""
        blocks, groups, record = packed.shape
        n, k = out_features, in_features

        def rows(start: int, width: int) -> torch.Tensor:  # [N, groups * width] bytes of one field
            part = packed[:, :, start:start + 4 * width].reshape(blocks, groups, 4, width)
            return part.permute(0, 2, 1, 3).reshape(blocks * 4, groups * width)[:n]

        qs = rows(0, 64)[:, :k // 2].contiguous()
        ss = rows(256, 16).reshape(n, groups, 16).contiguous()
        if record == 320:
            return qs, ss, None
        # fifth-bit byte t of a record, bit 2 r + s -> bit t of row r's mask s (a uint64 per group, bytes little-endian)
        sliced = packed[:, :, 320:].reshape(blocks, groups, 1, 1, 8, 8).to(torch.int32)
        shifts = 2 * torch.arange(4).reshape(1, 1, 4, 1, 1, 1) + torch.arange(2).reshape(1, 1, 1, 2, 1, 1)
        bits = (sliced >> shifts) & 1  # [blocks, groups, r, s, byte, bit]
        masks = (bits << torch.arange(8, dtype=torch.int32)).sum(-1).to(torch.uint8)  # [blocks, groups, r, s, 8]
        qh = masks.permute(0, 2, 1, 3, 4).reshape(blocks * 4, groups, 16)[:n].contiguous().view(torch.int64)
        return qs, ss, qh

    def linear_q(self, x: torch.Tensor, packed: torch.Tensor, kind: int, bias: torch.Tensor | None,
                 out_features: int) -> torch.Tensor:
        """x [M, K] (contiguous, model dtype) @ W^T (+ bias) for W packed by `pack_q_rows` (`kind` as `pack_gguf_q`
        gave it; see cpu_kernels.c: x rounded to 15-bit integers per row, exact integer sums per block of 32)."""
        check("x", x, ACTIVATION_DTYPES, (None, None))
        m, k = x.shape
        if k % 32:
            raise ValueError(f"linear_q: in_features {k} is not a multiple of 32")
        if kind not in range(4):
            raise ValueError(f"linear_q: kind must be 0..3, not {kind}")
        check("packed", packed, torch.uint8, (-(-out_features // 4), -(-k // 128), 384 if kind & Q_FIVE else 320))
        if bias is not None:
            check("bias", bias, x.dtype, (out_features,))
        y = torch.empty(m, out_features, dtype=x.dtype)
        self.lib.ps_linear_q(x.data_ptr(), packed.data_ptr(), kind, _pointer(bias), y.data_ptr(), m, out_features, k,
                             x.dtype == torch.bfloat16, self._threads())
        return y

    def linear_i8(self, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, row_sums: torch.Tensor,
                  bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
        """x [M, K] (contiguous, model dtype) @ (W [N, K] int8, packed by `pack_rows`, * scales [N] float32)^T
        (+ bias [N]). x is widened to int16 per row (see cpu_kernels.c)."""
        check("x", x, ACTIVATION_DTYPES, (None, None))
        m, k = x.shape
        if k % 64:
            raise ValueError(f"linear_i8: in_features {k} is not a multiple of 64")
        check("packed", packed, torch.int8, (-(-out_features // 4), k // 64, 4, 64))
        check("scales", scales, torch.float32, (out_features,))
        check("row_sums", row_sums, torch.int32, (out_features,))
        if bias is not None:
            check("bias", bias, x.dtype, (out_features,))
        y = torch.empty(m, out_features, dtype=x.dtype)
        self.lib.ps_linear_i8(x.data_ptr(), packed.data_ptr(), scales.data_ptr(), row_sums.data_ptr(),
                              None if bias is None else bias.data_ptr(), y.data_ptr(), m, out_features, k,
                              x.dtype == torch.bfloat16, self._threads())
        return y

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None, gain: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(norm(x + residual), x + residual) or (norm(x), None); x/residual [M, H] contiguous. `gain`: `weight` is
        Gemma's float32 1 + weight, multiplied before the one rounding (ps_rms_norm_gain)."""
        check("x", x, ACTIVATION_DTYPES, (None, None))
        m, h = x.shape
        if h % 16:
            raise ValueError(f"rms_norm: hidden size {h} is not a multiple of 16")
        check("weight", weight, torch.float32 if gain else x.dtype, (h,))
        if residual is not None:
            check("residual", residual, x.dtype, (m, h))
        out = torch.empty_like(x)
        new_residual = torch.empty_like(x) if residual is not None else None
        norm = self.lib.ps_rms_norm_gain if gain else self.lib.ps_rms_norm
        norm(x.data_ptr(), None if residual is None else residual.data_ptr(),
             None if new_residual is None else new_residual.data_ptr(), weight.data_ptr(), out.data_ptr(), m, h, eps,
             x.dtype == torch.bfloat16, self._threads())
        return out, new_residual

    def gate_mul(self, gate_up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
        """gate_up [M, 2I] contiguous -> act(gate) * up [M, I], act one of weight_format.NATIVE_ACTIVATIONS (SiLU,
        GELU's tanh approximation)."""
        check("gate_up", gate_up, ACTIVATION_DTYPES, (None, None))
        if activation not in weight_format.NATIVE_ACTIVATIONS:
            raise ValueError(f"gate_mul: activation {activation!r} is not native "
                             f"(only {', '.join(weight_format.NATIVE_ACTIVATIONS)})")
        m, two_i = gate_up.shape
        if two_i % 32:
            raise ValueError(f"gate_mul: 2 x intermediate size {two_i} is not a multiple of 32")
        out = torch.empty(m, two_i // 2, dtype=gate_up.dtype)
        self.lib.ps_gate_mul(gate_up.data_ptr(), out.data_ptr(), m, two_i // 2,
                             weight_format.NATIVE_ACTIVATIONS.index(activation), gate_up.dtype == torch.bfloat16,
                             self._threads())
        return out

    def argmax_rows(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, V] float32 -> [M] int64: each row's first largest value's index (a NaN counts as the largest),
        as torch.max(x, dim=-1).indices."""
        check("x", x, torch.float32, (None, None))
        m, v = x.shape
        if v == 0:
            raise ValueError("argmax_rows: rows of no values")
        out = torch.empty(m, dtype=torch.int64)
        self.lib.ps_argmax_rows(x.data_ptr(), m, v, out.data_ptr(), self._threads())
        return out

    def rope_kv_write(self, qkv: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, num_heads: int,
                      qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None, gain: bool = False,
                      kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """In place: rotate the query and key heads of qkv [T, Hq + 2 Hkv, D] (contiguous) with cos/sin
        [T, D] (both None: no rotary, SmolLM3's NoPE layers), then write K and V of every token to the pool
        [S, Hkv, D] at slots [T] (int64). `qk_norm`: (q_norm weight [D], k_norm weight [D], eps) of per-head RMSNorms
        applied first (Qwen3); with `gain` the weights are float32 gains (Gemma 3's 1 + weight, rms_norm's `gain`).
        `kv_scales`: an fp8 pool's (as decode_attention's), each row written over its own scale as
        layers/attention.LayerKVCache.write writes it."""
        check("qkv", qkv, ACTIVATION_DTYPES, (None, None, None))
        t, h, d = qkv.shape
        hkv = (h - num_heads) // 2
        if d % 32 or h != num_heads + 2 * hkv:
            raise ValueError(f"rope_kv_write: head_dim {d} (a multiple of 32?) or {h} heads for {num_heads} query heads")
        self._check_rotary("rope_kv_write", cos, sin, qkv.dtype, t, d)
        fp8 = self._pool_format(k_cache, v_cache, qkv.dtype, kv_scales, (None, hkv, d))
        check("slots", slots, torch.int64, (t,), contiguous=False)
        q_norm = k_norm = None
        eps = 0.0
        if qk_norm is not None:
            q_norm, k_norm, eps = qk_norm
            check("q_norm", q_norm, torch.float32 if gain else qkv.dtype, (d,))
            check("k_norm", k_norm, torch.float32 if gain else qkv.dtype, (d,))
        self.lib.ps_rope_kv_write(qkv.data_ptr(), _pointer(cos), _pointer(sin), k_cache.data_ptr(),
                                  v_cache.data_ptr(), *_scale_pointers(kv_scales), fp8, slots.contiguous().data_ptr(),
                                  None if q_norm is None else q_norm.data_ptr(),
                                  None if k_norm is None else k_norm.data_ptr(), int(gain), eps, t, num_heads, hkv,
                                  d, qkv.dtype == torch.bfloat16, self._threads())

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slots: torch.Tensor, lens: torch.Tensor, scale: float, softcap: float | None = None,
                         kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """q [B, Hq, D] (rows of D contiguous, heads adjacent); caches [S, Hkv, D]; slots [B, L] int64;
        lens [B] int64 -> [B, Hq, D]. `softcap`: scores capped to softcap * tanh(score / softcap) (Gemma 2).
        `kv_scales`: an fp8 pool's (k_scale, v_scale) [S, Hkv, 1] in q's dtype (layers/attention.LayerKVCache:
        each row is its values x its scale); the pool otherwise has q's dtype."""
        q, hkv, fp8 = self._check_attention("decode_attention", q, k_cache, v_cache, kv_scales)
        b, hq, d = q.shape
        check("slots", slots, torch.int64, (b, None), contiguous=False)
        check("lens", lens, torch.int64, (b,), contiguous=False)
        slots, lens = slots.contiguous(), lens.contiguous()  # no-ops for the runner's tensors
        out = torch.empty(b, hq, d, dtype=q.dtype)
        self.lib.ps_decode_attention(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                                     *_scale_pointers(kv_scales), fp8,
                                     slots.data_ptr(), lens.data_ptr(), out.data_ptr(), b, hq, hkv, d,
                                     slots.shape[1], scale, _softcap(softcap), q.dtype == torch.bfloat16,
                                     self._threads())
        return out

    def prefill_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          slots: torch.Tensor, start: int, scale: float, scratch_bytes: int,
                          softcap: float | None = None, kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None
                          ) -> torch.Tensor:
        """A prefill chunk's queries q [T, Hq, D] at positions start .. start + T - 1 attending causally over the
        start + T positions at `slots` (int64, [start + T]; the chunk's own K/V already written there) -> [T, Hq,
        D]: each row as a decode row with its context (ps_prefill_attention). The threads' score buffers stay
        within `scratch_bytes` (fewer rows share one widened context where it is long). `softcap` and `kv_scales`:
        as decode_attention's."""
        q, hkv, fp8 = self._check_attention("prefill_attention", q, k_cache, v_cache, kv_scales)
        t, hq, d = q.shape
        check("slots", slots, torch.int64, (start + t,), contiguous=False)
        threads = self._threads()
        max_run = scratch_bytes // max(1, threads * (hq // hkv) * (start + t) * 4)
        out = torch.empty(t, hq, d, dtype=q.dtype)
        self.lib.ps_prefill_attention(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                                      *_scale_pointers(kv_scales), fp8, slots.contiguous().data_ptr(), start, t,
                                      out.data_ptr(), hq, hkv, d, max_run, scale, _softcap(softcap),
                                      q.dtype == torch.bfloat16, threads)
        return out

    @staticmethod
    def _check_attention(what: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         kv_scales: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, int, int]:
        """The attention kernels' shared checks: q [rows, Hq, D] (copied unless its heads are adjacent rows of D
        contiguous values), its KV heads and the pool's format (FP8_FORMATS; 0: q's dtype, without scales)."""
        check("q", q, ACTIVATION_DTYPES, (None, None, None), contiguous=False)
        _, hq, d = q.shape
        fp8 = CpuKernels._pool_format(k_cache, v_cache, q.dtype, kv_scales, (None, None, d))
        hkv = k_cache.shape[1]
        if d % 16 or d > 256 or hq % hkv:
            raise ValueError(f"{what}: head_dim {d} (a multiple of 16 up to 256?) or {hq} query heads "
                             f"for {hkv} KV heads")
        if q.stride(2) != 1 or q.stride(1) != d:
            q = q.contiguous()
        return q, hkv, fp8

    @staticmethod
    def _pool_format(k_cache: torch.Tensor, v_cache: torch.Tensor, dtype: torch.dtype,
                     kv_scales: tuple[torch.Tensor, torch.Tensor] | None, shape: tuple[int | None, ...]) -> int:
        """Check a K/V pool of `shape`: in `dtype`, or fp8 with its rows' scales `kv_scales` ([S, Hkv, 1] in
        `dtype`). Returns its format for the C code (FP8_FORMATS; 0: `dtype`)."""
        fp8 = FP8_FORMATS.get(k_cache.dtype, 0) if kv_scales is not None else 0
        check("k_cache", k_cache, k_cache.dtype if fp8 else dtype, shape)
        check("v_cache", v_cache, k_cache.dtype, tuple(k_cache.shape))
        if kv_scales is not None:
            if not fp8:
                raise ValueError(f"native kernel argument kv_scales: they go with an fp8 pool "
                                 f"({', '.join(map(str, FP8_FORMATS))}), not a {k_cache.dtype} one")
            for name, scales in zip(("k_scale", "v_scale"), kv_scales):
                check(name, scales, dtype, (k_cache.shape[0], k_cache.shape[1], 1))
        return fp8

    @property
    def layer_fields(self) -> int:
        """Entries per layer in `decode_stack`'s table (PS_LAYER_FIELDS in cpu_kernels.c)."""
        return self.lib.ps_layer_fields()

    @functools.cached_property
    def layer_layout(self) -> dict[str, int]:
        """`decode_stack`'s table layout as the library defines it: the column of each named field (a
        linear's entry spans `linear_fields` columns), `linear_fields` and `layer_fields`."""
        names = ("in_norm", "post_norm", "qkv", "o", "gate_up", "down", "k_cache", "v_cache", "k_scale", "v_scale",
                 "kv_format", "q_norm", "k_norm", "attn_out_norm", "mlp_out_norm", "flags", "view", "norm_gain",
                 "gelu_tanh", "linear_fields", "layer_fields", "view_fields")
        values = (ctypes.c_int64 * len(names))()
        if self.lib.ps_layer_layout(values, len(names)) != len(names):
            raise RuntimeError("the kernel library's decode-stack layout has other fields than this wrapper")
        return dict(zip(names, values))

    @staticmethod
    def _check_rotary(what: str, cos: torch.Tensor | None, sin: torch.Tensor | None, dtype: torch.dtype, rows: int,
                      head_dim: int) -> None:
        """cos/sin [rows, head_dim] contiguous in `dtype`, or both None (a layer without rotary)."""
        if (cos is None) != (sin is None):
            raise ValueError(f"{what}: cos and sin are given together or not at all")
        for name, table in (("cos", cos), ("sin", sin)):
            if table is None:
                continue
            check(name, table, dtype)
            if table.numel() != rows * head_dim:
                raise ValueError(f"{what}: {name} has {table.numel()} values, expected {rows} x {head_dim}")

    def _check_step(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, slots: torch.Tensor,
                    ctx_slots: torch.Tensor, lens: torch.Tensor, head_dim: int) -> None:
        """What a decode-only step's native calls rely on: x [B, H] contiguous in the model dtype, cos/sin
        [B, D] (or None: no rotary), int64 slots [B], ctx_slots [B, L] and lens [B]."""
        check("x", x, ACTIVATION_DTYPES, (None, None))
        b = x.shape[0]
        self._check_rotary("decode step", cos, sin, x.dtype, b, head_dim)
        check("slots", slots, torch.int64, (b,))
        check("ctx_slots", ctx_slots, torch.int64, (b, None))
        check("lens", lens, torch.int64, (b,))

    def _check_layer(self, row: torch.Tensor) -> None:
        check("row", row, torch.int64, (self.layer_fields,))

    def layer_attention(self, row: torch.Tensor, x: torch.Tensor, residual: torch.Tensor, first: bool,
                        cos: torch.Tensor | None, sin: torch.Tensor | None, slots: torch.Tensor,
                        ctx_slots: torch.Tensor, lens: torch.Tensor, num_heads: int, num_kv_heads: int,
                        head_dim: int, eps: float, scale: float, softcap: float | None = None) -> torch.Tensor:
        """One decoder layer's attention half for a decode-only step (cpu_kernels.c, ps_layer_attention):
        `row` is the layer's row of the decode-stack table; `residual` [B, H] is updated in place (set to x
        on the `first` layer). Returns the o projection's output [B, H]."""
        self._check_step(x, cos, sin, slots, ctx_slots, lens, head_dim)
        self._check_layer(row)
        check("residual", residual, x.dtype, tuple(x.shape))
        y = torch.empty_like(x)
        b, h = x.shape
        self.lib.ps_layer_attention(row.data_ptr(), x.data_ptr(), residual.data_ptr(), int(first), y.data_ptr(),
                                    _pointer(cos), _pointer(sin), slots.data_ptr(), ctx_slots.data_ptr(),
                                    lens.data_ptr(), b, ctx_slots.shape[1], h, num_heads, num_kv_heads, head_dim,
                                    eps, scale, _softcap(softcap), x.dtype == torch.bfloat16, self._threads())
        return y

    def layer_mlp(self, row: torch.Tensor, y: torch.Tensor, residual: torch.Tensor, intermediate: int,
                  eps: float) -> torch.Tensor:
        """One decoder layer's MLP half (ps_layer_mlp): (with sandwich norms y normed in place,) post-norm of y +
        residual (updated in place), the gated MLP. Its output norm, if any, is the caller's (after reducing)."""
        self._check_layer(row)
        check("y", y, ACTIVATION_DTYPES, (None, None))
        check("residual", residual, y.dtype, tuple(y.shape))
        out = torch.empty_like(y)
        self.lib.ps_layer_mlp(row.data_ptr(), y.data_ptr(), residual.data_ptr(), out.data_ptr(), y.shape[0],
                              y.shape[1], intermediate, eps, y.dtype == torch.bfloat16, self._threads())
        return out

    def decode_stack(self, x: torch.Tensor, table: torch.Tensor, final_norm: torch.Tensor,
                     views: list[tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor,
                                       torch.Tensor]],
                     num_heads: int, num_kv_heads: int, head_dim: int, intermediate: int, eps: float, scale: float,
                     softcap: float | None = None) -> torch.Tensor:
        """Every decoder layer of a decode-only step in one call: x [B, H] embeddings -> the final norm's
        output [B, H]. `table` [layers, layer_fields] int64 holds each layer's pointers (see
        cpu_kernels.c, ps_decode_stack); `views`: per step view (a layer's `view` column picks one) its cos/sin
        [B, D] (None: its layers have no rotary), the new tokens' slots [B] in its layers' pools, ctx_slots [B, L]
        and lens [B] (int64). The final norm is a float32 gain where the layers' norms are (their `norm_gain`
        flag)."""
        layout = self.layer_layout
        check("table", table, torch.int64, (None, self.layer_fields))
        if not views or table.shape[0] == 0 or not 0 <= int(table[:, layout["view"]].min()) \
                or int(table[:, layout["view"]].max()) >= len(views):
            raise ValueError(f"decode_stack: {table.shape[0]} layers' views, {len(views)} given")
        for view in views:
            self._check_step(x, *view, head_dim)
        b, h = x.shape
        gain = bool(int(table[0, layout["flags"]]) & layout["norm_gain"])
        check("final_norm", final_norm, torch.float32 if gain else x.dtype, (h,))
        pointers = torch.tensor([[_pointer(cos), _pointer(sin), slots.data_ptr(), ctx.data_ptr(), lens.data_ptr(),
                                  ctx.shape[1]] for cos, sin, slots, ctx, lens in views], dtype=torch.int64)
        if pointers.shape[1] != layout["view_fields"]:
            raise RuntimeError("the kernel library's step view has other fields than this wrapper")
        out = torch.empty_like(x)
        self.lib.ps_decode_stack(x.data_ptr(), out.data_ptr(), table.data_ptr(), table.shape[0],
                                 final_norm.data_ptr(), pointers.data_ptr(), b, h, num_heads,
                                 num_kv_heads, head_dim, intermediate, eps, scale, _softcap(softcap),
                                 x.dtype == torch.bfloat16, self._threads())
        return out


def _softcap(softcap: float | None) -> float:
    """An attention softcap for the C code: 0 for none; a cap must be positive (tanh(score / cap) * cap)."""
    if softcap is None:
        return 0.0
    if not softcap > 0:
        raise ValueError(f"attention softcap {softcap}: a positive number or None")
    return float(softcap)


def _pointer(t: torch.Tensor | None) -> int:
    """A tensor's data pointer for the C code, NULL (0) for None."""
    return 0 if t is None else t.data_ptr()


def _scale_pointers(kv_scales: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[int, int]:
    return (0, 0) if kv_scales is None else (kv_scales[0].data_ptr(), kv_scales[1].data_ptr())


@functools.lru_cache(maxsize=1)
def load_status() -> tuple[CpuKernels | None, str]:
    """(the native kernels or None, why not / what was loaded), decided once per process: the build
    PAGEDSERVE_CPU_ISA asks for (envs.cpu_isa; default the best this CPU has)."""
    try:
        isa = envs.cpu_isa()
    except ValueError as exc:  # the engine's argument check reports it first; here the torch path just runs
        isa = "?"  # a value PAGEDSERVE_CPU_ISA was set to: asked for, and refused
        kernels, why = None, str(exc)
    else:
        kernels, why = load(isa)
    if kernels is None:  # a build that failed, or one PAGEDSERVE_CPU_ISA asked for and this CPU cannot run, warns
        asked = isa != "native" and envs.cpu_kernels_enabled()
        log = logger.warning if why.startswith("could not") or asked else logger.info
        log("native CPU kernels not used (%s); using torch ops", why)
    return kernels, why


@functools.lru_cache(maxsize=None)
def load(isa: str = "native") -> tuple[CpuKernels | None, str]:
    """The kernels built for `isa` (builder.ISA_MARCH: "native", or a fixed build on a CPU with the flags it
    needs, builder.BUILD_FLAGS), or None and why not. Each ISA's library loads once; two can be loaded side by
    side (the tests run the AVX2 kernels next to the AVX-512 ones on an AVX-512 CPU)."""
    if not envs.cpu_kernels_enabled():
        return None, "disabled by PAGEDSERVE_CPU_KERNELS=0"
    if not is_x86():
        return None, f"written for x86-64 (AVX-512 or AVX2); this is {platform.machine()}"
    missing = sorted(BUILD_FLAGS.get(isa, frozenset()) - cpu_flags())
    if missing:  # it would die on its first instruction this CPU lacks
        return None, (f"PAGEDSERVE_CPU_ISA={isa} needs the CPU flags {', '.join(missing)}, which this CPU lacks; "
                      "unset it for the best build this CPU runs")
    try:
        path = build(isa=isa)  # a cache that cannot be made or trusted: a private directory for this process
        lib = ctypes.CDLL(str(path))
        if lib.ps_isa() not in ISA_NAMES:
            return None, "this CPU has neither AVX-512 (F, BW, VNNI) nor AVX2 + FMA + F16C"
        kernels = CpuKernels(lib, path, isa)
        asked = "" if isa == "native" else f", PAGEDSERVE_CPU_ISA={isa}"
        return kernels, f"loaded {path} ({kernels.isa}{', AMX' if kernels.amx else ''}{asked})"
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        return None, f"could not build or load them: {exc}"


def cpu_kernels() -> CpuKernels | None:
    """The native kernels, or None where they cannot run; callers then use torch ops."""
    return load_status()[0]
