"""Linear layers for inference; which one a model's layers use is decided in layers/backend.py.

On CPU, weights are re-laid out once so that batch-1 decode streams them at memory speed: bf16 for
pagedserve's native kernel where the CPU has AVX512-BF16, else oneDNN's blocked layout
(`mkldnn._reorder_linear_weight` + `mkldnn._linear_pointwise`; 2-4x `F.linear` at batch 1, e.g. 9728x896
bf16 at M=1: 1.75 ms plain vs 0.51 ms packed on one core). int8 weights use the native int8 kernel.
Where an op is missing or fails its self-check, plain F.linear is used (see benchmarks/PROFILE.md).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.kernels import CpuKernels
from pagedserve.memory import weight_format

logger = logging.getLogger(__name__)


class _HotPathModule(nn.Module):
    """A module whose forward reads its buffers through plain attributes (nn.Module's buffer lookup costs
    ~1 us per access on the per-step path); `_alias_buffers` sets them, and runs again whenever the
    buffers are replaced (`.to()`, `.float()`, ...)."""

    def _alias_buffers(self) -> None:
        raise NotImplementedError

    def _apply(self, fn, recurse=True):
        result = super()._apply(fn, recurse)
        self._alias_buffers()
        return result


class PackedLinear(_HotPathModule):
    """y = x @ W^T + b with W re-laid out once for a CPU kernel. x: [N, in] -> [N, out].

    bf16 on CPUs with AVX512-BF16: pagedserve's own kernel (pagedserve/kernels, `ps_linear_bf16`), which
    streams W at memory speed at batch 1 and keeps up with oneDNN up to prefill sizes (measured on the
    2-core Zen 5: 0.99 GB of Qwen2.5-0.5B weights at batch 1 in 33 ms vs oneDNN's 49; equal at 32-512
    rows); on Xeons with AMX it runs on the tiles at every batch size (1.5-2.2 TFLOP/s at prefill sizes on
    2 vCPUs, ~8x vdpbf16ps, level with oneDNN). Otherwise (float32, other CPUs): oneDNN's blocked layout."""

    def __init__(self, weight: torch.Tensor | list[torch.Tensor], bias: torch.Tensor | None,
                 native: CpuKernels | None = None) -> None:
        """`native`: the kernels to run a bf16 CPU weight on (layers/backend.py decides); None: oneDNN.
        `weight` may be a list of row parts (a fused q/k/v or gate/up): the native kernel packs them as
        they are (CpuKernels.pack_bf16), oneDNN gets them stacked."""
        super().__init__()
        parts = weight if isinstance(weight, list) else [weight]
        self.in_features = parts[0].shape[1]
        self.out_features = sum(p.shape[0] for p in parts)
        self.native = native
        self.implementation = "onednn" if native is None else "native-bf16"  # weight_format.LINEAR_IMPLEMENTATIONS
        if self.native is not None:
            self.register_buffer("packed_weight", self.native.pack_bf16(parts))
        else:
            stacked = torch.cat(parts) if len(parts) > 1 else parts[0]
            self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(stacked, None))
        self.register_buffer("bias", bias)
        self._alias_buffers()

    def _alias_buffers(self) -> None:
        self._packed, self._bias = self.packed_weight, self.bias

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of W, [*ids.shape, in], gathered from the native packed layout [N/NB, K/2, NB, 2]: a
        tied embedding looks its tokens up here, so the table is held once (the packed copy the logits
        need) instead of twice (272 MB saved for Qwen2.5-0.5B in bf16). Exact: the same bf16 values."""
        flat = ids.reshape(-1)
        block = self._packed.shape[2]
        picked = self._packed[flat // block, :, flat % block, :]  # [T, K/2, 2]
        return picked.reshape(*ids.shape, self.in_features)

    def native_fields(self) -> list[int] | None:
        """This linear's entry in the native decode stack's table (cpu_kernels.c, ps_decode_stack):
        [kind 0 = bf16 packed, weight, bias or 0, 0, 0]; None where it does not run the native kernel."""
        if self.native is None:
            return None
        return [0, self._packed.data_ptr(), 0 if self._bias is None else self._bias.data_ptr(), 0, 0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None:
            rows = x.reshape(-1, self.in_features).contiguous()
            y = self.native.linear_bf16(rows, self._packed, self._bias, self.out_features)
            return y.view(*x.shape[:-1], self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self._bias, "none", [], "")



class PlainLinear(nn.Module):
    """F.linear on an inference-only weight (used where packing is unavailable: GPUs, other CPUs)."""

    implementation = "plain"  # weight_format.LINEAR_IMPLEMENTATIONS
    native = None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        self.register_buffer("weight", weight)
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


@dataclass
class QuantizedWeight:
    """A weight already in int8 (one float32 scale per output row) and the model dtype it stands in for.
    GGUF block-quantized tensors arrive like this under `--quantization int8` (models/gguf_loader.py), so
    they never pass through a bf16 copy."""

    qweight: torch.Tensor  # [out, in] int8
    scales: torch.Tensor  # [out] float32
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    def dequantized(self) -> torch.Tensor:
        """The weight the int8 values stand for, [out, in] in `dtype` (scaled in float32, then rounded once)."""
        return dequantize_int8(self.qweight, self.scales, self.dtype)


@dataclass
class BlockWeight:
    """A GGUF matrix kept in its own 4- or 5-bit blocks of 32 (ggml's Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K) for the
    native kernel (`CpuKernels.linear_q`; cpu_kernels.c's layout): each block is w = d q + m. GGUF tensors of those
    types arrive like this under `--quantization gguf` (the default for a block-quantized GGUF on a CPU with the
    native kernels), so a 4-bit file streams 5-6 bits a weight at decode instead of int8's 8."""

    qs: torch.Tensor  # [out, in / 2] uint8: each block's 16 nibble bytes (low nibble weight j, high 16 + j)
    ss: torch.Tensor  # [out, ceil(in / 128), 16] uint8: each group of 4 blocks' scale bytes
    qh: torch.Tensor | None  # [out, ceil(in / 128), 2] int64: the fifth bits (Q5_*), or None
    kind: int  # kernels.Q_FIVE | kernels.Q_K bits
    dtype: torch.dtype  # the model dtype it stands in for

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.qs.shape[0], self.qs.shape[1] * 2))

    @property
    def device(self) -> torch.device:
        return self.qs.device

    @property
    def bits(self) -> int:
        return 4 if self.qh is None else 5

    def narrow(self, start: int, rows: int) -> BlockWeight:
        """Rows start .. start + rows - 1 (views)."""
        return self.map_rows(lambda t: t.narrow(0, start, rows))

    def map_rows(self, fn) -> BlockWeight:
        """The same weight with `fn` (a row selection or reordering) applied to each of its row-indexed tensors."""
        return BlockWeight(fn(self.qs), fn(self.ss), None if self.qh is None else fn(self.qh), self.kind, self.dtype)

    def dequantized_float32(self) -> torch.Tensor:
        """[out, in] float32: d q + m per block in float32 as gguf.quants computes it (so equal to its dequantization
        bit for bit: Q4_0's d (q - 8) is d q + (-8 d), both exact; K-quants' (D sc) q - Dmin mn)."""
        from pagedserve.kernels import Q_K

        n, blocks = self.qs.shape[0], self.qs.shape[1] // 16
        nibbles = self.qs.reshape(n, blocks, 16)
        q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).to(torch.int32)  # [n, blocks, 32]
        if self.qh is not None:
            shifts = torch.tensor([0, 16, 32, 48], dtype=torch.int64)
            halves = (self.qh[..., None] >> shifts) & 0xFFFF  # [n, groups, 2 (low/high nibbles), 4 blocks]
            halves = halves.permute(0, 1, 3, 2).reshape(n, -1, 2)[:, :blocks]  # [n, blocks, 2]
            bits = (halves[..., None] >> torch.arange(16, dtype=torch.int64)) & 1  # [n, blocks, 2, 16]
            q = q + 16 * bits.reshape(n, blocks, 32).to(torch.int32)
        ss = self.ss.contiguous()
        if self.kind & Q_K:
            big = ss[..., :4].contiguous().view(torch.float16).float()  # [n, groups, 2]: D, Dmin
            d = (ss[..., 4:8].float() * big[..., :1]).reshape(n, -1)[:, :blocks]
            m = -(ss[..., 8:12].float() * big[..., 1:]).reshape(n, -1)[:, :blocks]
        else:
            dm = ss.view(torch.float16).float().reshape(n, -1, 2)[:, :blocks]
            d, m = dm.unbind(-1)
        return (q.float() * d[..., None] + m[..., None]).reshape(n, blocks * 32)

    def dequantized(self) -> torch.Tensor:
        """The weight in the model dtype (float32 values rounded once)."""
        return self.dequantized_float32().to(self.dtype)

    def to_int8(self, native: CpuKernels | None = None) -> QuantizedWeight:
        """The same matrix requantized per row to int8 (as the loader requantizes other GGUF types), for linears
        whose parts cannot all keep their blocks (a fused q/k/v of mixed types) or that run no native kernel."""
        weight = self.dequantized_float32()
        qweight, scales = native.quantize_rows_i8(weight) if native is not None else quantize_int8_per_channel(weight)
        return QuantizedWeight(qweight, scales, self.dtype)


def weight_of(linear: nn.Linear) -> torch.Tensor | QuantizedWeight | BlockWeight:
    """The loaded weight of `linear`: a tensor, or the QuantizedWeight or BlockWeight the loader attached to it."""
    return getattr(linear, "quantized_weight", None) or linear.weight


def warm_up_rows(model: nn.Module) -> int:
    """Rows a warm-up prefill needs for every linear of `model` to run each of its paths: one more than the
    largest batch up to which a linear keeps its kernel before switching to a dense matmul
    (Int8Linear.max_kernel_rows), 0 where none switches."""
    limits = [m.max_kernel_rows for m in model.modules() if getattr(m, "max_kernel_rows", None) is not None]
    return max(limits) + 1 if limits else 0


class Int8Linear(_HotPathModule):
    """Weight-only int8 with one scale per output channel (symmetric): W ~= q * scale[:, None].

    Halves weight memory against bf16. Where the native kernels run (AVX-512 VNNI, AVX2) the weights are
    kept in the native kernel's blocked layout (pagedserve/kernels): decode batches stream them at memory
    speed (2x `aten._weight_int8pack_mm` at batch 1 on the 2-core Zen 5), and prefill-sized batches run on
    exact bf16 panels of them. Batches above `kernels.int8_max_rows(dtype)` (only float32 activations on a CPU
    with AVX512-BF16: 32) dequantize to the model dtype and use one dense matmul. Elsewhere
    `aten._weight_int8pack_mm` dequantizes on the fly."""

    def __init__(self, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None,
                 native: CpuKernels | None = None) -> None:
        """`native`: the native kernels to run on, for a CPU weight in float32 or bf16 (layers/backend.py
        decides, weight_format.native_linear); None: torch's `_weight_int8pack_mm`."""
        super().__init__()
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        self.native = native
        self.implementation = "torch-int8" if native is None else "native-int8"  # weight_format.LINEAR_IMPLEMENTATIONS
        if isinstance(weight, QuantizedWeight):
            qweight, scales, dtype = weight.qweight, weight.scales, weight.dtype
        else:
            (qweight, scales), dtype = (native.quantize_rows_i8(weight) if native is not None
                                        else quantize_int8_per_channel(weight)), weight.dtype
        scales = scales.to(dtype)  # the effective scales are the model-dtype ones on every path
        self.max_kernel_rows = native.int8_max_rows(dtype) if native is not None else None
        if native is not None:
            self.register_buffer("qweight_packed", native.pack_rows(qweight))
            self.register_buffer("row_sums", native.row_sums(qweight))
            self.register_buffer("scales32", scales.float())
        else:
            self.register_buffer("qweight", qweight)  # [out, in] int8
        self.register_buffer("scales", scales)  # [out]
        self.register_buffer("bias", bias)
        self._alias_buffers()

    def _alias_buffers(self) -> None:
        self._packed = getattr(self, "qweight_packed", None)
        self._scales32 = getattr(self, "scales32", None)
        self._row_sums = getattr(self, "row_sums", None)
        self._bias = self.bias

    def native_fields(self) -> list[int] | None:
        """As PackedLinear.native_fields: [1 = int8, weight, bias or 0, float32 scales, row sums]; the
        stack runs it for up to `max_kernel_rows` rows."""
        if self.native is None:
            return None
        bias = 0 if self._bias is None else self._bias.data_ptr()
        return [1, self._packed.data_ptr(), bias, self._scales32.data_ptr(), self._row_sums.data_ptr()]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None:
            if self.max_kernel_rows is None or x.shape[0] <= self.max_kernel_rows:
                return self.native.linear_i8(x.contiguous(), self._packed, self._scales32, self._row_sums,
                                              self._bias, self.out_features)
            return F.linear(x, self.dequantized(), self.bias)
        if x.dtype != torch.float32 and x.device.type == "cpu" and x.shape[-1] % 16:
            # torch's CPU kernel faults on bfloat16 rows whose length is not a multiple of 16 (QA-M: a MoE
            # expert of width 40 killed the process): those rows go through its float32 kernel
            y = torch.ops.aten._weight_int8pack_mm(x.float(), self.qweight, self.scales.float()).to(x.dtype)
        else:
            y = torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.scales)
        return y if self.bias is None else y + self.bias

    def int8_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(int8 [out, in], scales [out] in the model dtype), whatever the layout they are kept in."""
        if self.native is not None:
            return self.native.unpack_rows(self.qweight_packed, self.out_features), self.scales
        return self.qweight, self.scales

    def dequantized(self) -> torch.Tensor:
        """The weight the int8 values stand for, [out, in] in the model dtype (its scales are model-dtype ones)."""
        qweight, scales = self.int8_weight()
        return dequantize_int8(qweight, scales, scales.dtype)


class BlockLinear(_HotPathModule):
    """A GGUF matrix served from its own 4- or 5-bit blocks (BlockWeight) on the native kernel, at every
    batch size (`CpuKernels.linear_q`): activations rounded per row to 15-bit integers, as the int8 kernel does,
    and exact integer sums per block of 32. The rows are re-laid out once into the kernel's records (a sequential
    run per 4 rows)."""

    max_kernel_rows = None

    def __init__(self, weight: BlockWeight, bias: torch.Tensor | None, native: CpuKernels) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.native = native
        self.kind = weight.kind
        self.implementation = "native-gguf"  # weight_format.LINEAR_IMPLEMENTATIONS
        self.dtype = weight.dtype
        self.register_buffer("packed", native.pack_q_rows(weight.qs.contiguous(), weight.ss.contiguous(),
                                                          None if weight.qh is None else weight.qh.contiguous()))
        self.register_buffer("bias", bias)
        self._alias_buffers()

    def _alias_buffers(self) -> None:
        self._packed, self._bias = self.packed, self.bias

    @property
    def bits(self) -> int:
        from pagedserve.kernels import Q_FIVE

        return 5 if self.kind & Q_FIVE else 4

    def native_fields(self) -> list[int] | None:
        """As PackedLinear.native_fields: [2 = ggml blocks, records, bias or 0, kind, 0]."""
        return [2, self._packed.data_ptr(), 0 if self._bias is None else self._bias.data_ptr(), self.kind, 0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.native.linear_q(x.contiguous(), self._packed, self.kind, self._bias, self.out_features)

    def block_weight(self) -> BlockWeight:
        qs, ss, qh = self.native.unpack_q_rows(self._packed, self.out_features, self.in_features)
        return BlockWeight(qs, ss, qh, self.kind, self.dtype)

    def dequantized(self) -> torch.Tensor:
        """The weight the blocks stand for, [out, in] in the model dtype."""
        return self.block_weight().dequantized()


def dequantize_int8(qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """W = q * scale[:, None] for int8 [out, in] and per-row scales [out], multiplied in the scales' dtype and
    returned in `dtype`. The one dequantizer of per-row int8 (Int8Linear, QuantizedWeight)."""
    return (qweight.to(scales.dtype) * scales[:, None]).to(dtype)


def quantize_int8_per_channel(weight: torch.Tensor, rows_per_chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight, float32 scales): round-to-nearest with scale = max|row| / 127; a float32 copy of at
    most `rows_per_chunk` rows at a time."""
    qweight = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scales = torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device)
    for start in range(0, weight.shape[0], rows_per_chunk):
        w32 = weight[start:start + rows_per_chunk].float()
        chunk_scales = (w32.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
        qweight[start:start + rows_per_chunk] = torch.round(w32 / chunk_scales[:, None]).clamp(-127, 127)
        scales[start:start + rows_per_chunk] = chunk_scales
    return qweight, scales


def packing_supported(device: str, dtype: torch.dtype) -> bool:
    """oneDNN packing works here and reproduces F.linear on a probe matmul (where memory/weight_format.py
    tries it: the memory plan assumes it works there)."""
    from pagedserve.memory.probe import cpu_flags

    tried = weight_format.onednn_may_pack(device, str(dtype).removeprefix("torch."), cpu_flags())
    if not tried or not torch.backends.mkldnn.is_available():
        return False
    try:
        weight = torch.randn(48, 32).to(dtype)
        x = torch.randn(3, 32).to(dtype)
        packed = PackedLinear(weight, None)(x)
        ok = torch.allclose(packed.float(), F.linear(x, weight).float(), rtol=1e-2, atol=1e-2)
    except (RuntimeError, AttributeError) as exc:
        logger.info("oneDNN packed linear unavailable (%s); using F.linear", exc)
        return False
    return bool(ok)


def fuse_rows(*linears: nn.Linear, native: CpuKernels | None = None
              ) -> tuple[torch.Tensor | QuantizedWeight | BlockWeight, torch.Tensor | None]:
    """Stack several linears that read the same input into one weight (and bias). Per-row int8 weights
    stack exactly: their rows and scales are concatenated; so do GGUF blocks of one kind (width and scales). Blocks
    beside other weights are requantized to int8 first (by `native` where given)."""
    weights = [weight_of(l) for l in linears]
    if all(isinstance(w, BlockWeight) for w in weights) and len({w.kind for w in weights}) == 1:
        qh = None if weights[0].qh is None else torch.cat([w.qh for w in weights])
        return (BlockWeight(torch.cat([w.qs for w in weights]), torch.cat([w.ss for w in weights]), qh,
                            weights[0].kind, weights[0].dtype), fuse_biases(*linears))
    weights = [w.to_int8(native) if isinstance(w, BlockWeight) else w for w in weights]
    if all(isinstance(w, QuantizedWeight) for w in weights):
        weight: torch.Tensor | QuantizedWeight = QuantizedWeight(
            torch.cat([w.qweight for w in weights]), torch.cat([w.scales for w in weights]), weights[0].dtype)
    else:
        weight = torch.cat([w if isinstance(w, torch.Tensor) else w.dequantized() for w in weights], dim=0)
    return weight, fuse_biases(*linears)


def fuse_biases(*linears: nn.Linear) -> torch.Tensor | None:
    """The biases of linears stacked as fuse_rows stacks their weights (zeros for one without), or None."""
    biases = [l.bias for l in linears]
    if all(b is None for b in biases):
        return None
    known = next(b for b in biases if b is not None)
    filled = [b if b is not None else torch.zeros(l.out_features, dtype=known.dtype, device=known.device)
              for b, l in zip(biases, linears)]
    return torch.cat(filled)
