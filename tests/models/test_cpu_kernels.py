"""The native CPU kernels (pagedserve/kernels/cpu_kernels.c) against the torch reference they replace.

Tolerances: float32 kernels differ from torch only in summation order (relative 1e-5). In bfloat16
both sides compute in float32 and round once at the same points, so outputs may differ by one bf16
rounding step (relative 2^-8) where a float32 sum lands near a rounding boundary, and only rarely.
"""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F

from pagedserve import envs
from pagedserve.kernels import SOURCE, build, load, load_status
from pagedserve.layers.linear import quantize_int8_per_channel
from tests.models.kernel_reference import reference_rms_norm, unpack_bf16


def _native_isa() -> str | None:
    """The ISA the library must build for on this CPU, from its flags (what the compiler's -march=native
    sees) and PAGEDSERVE_CPU_ISA, or None where neither applies."""
    try:
        flags = set(next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split())
    except (OSError, StopIteration):
        return None
    if platform.machine() != "x86_64":
        return None
    if {"avx512f", "avx512bw", "avx512_vnni"} <= flags and envs.cpu_isa() in ("native", "avx512-vnni"):
        return "avx512"
    if {"avx2", "fma", "f16c"} <= flags:
        return "avx2"
    return None


def test_kernels_load_wherever_the_cpu_has_a_native_isa(tmp_path):
    isa = _native_isa()
    kernels = load_status()[0]  # what cpu_kernels() gives the engine (this module's fixture patches that name)
    if isa is None:
        assert kernels is None
        return
    assert kernels is not None and kernels.isa == isa
    # The build cache, on a small source under the kernels' name and with their flags (the kernels' own build is
    # the one load_status gave; building them here took ~7 s, twice, to show what a few lines show).
    source = tmp_path / SOURCE.name
    source.write_text("int ps_cache_check(int x) { return x + 1; }\n")
    first = build(source, cache_root=tmp_path)
    assert build(source, cache_root=tmp_path) == first  # cached: the second start does not rebuild
    assert list((tmp_path / "kernels").glob("*.so")) == [first]
    changed = tmp_path / "changed" / SOURCE.name  # a new version of the source gets its own build
    changed.parent.mkdir()
    changed.write_text(source.read_text() + "/* changed */\n")
    second = build(changed, cache_root=tmp_path)
    assert second != first and sorted((tmp_path / "kernels").glob("*.so")) == sorted([first, second])


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    a, e = actual.float(), expected.float()
    scale = e.abs().max().clamp(min=1e-6)
    if dtype == torch.float32:
        assert (a - e).abs().max() / scale < 1e-5, what
    else:
        rel = (a - e).abs() / e.abs().clamp(min=scale * 1e-2)
        assert rel.max() <= 2 ** -7, f"{what}: max relative difference {rel.max():.3g}"
        assert (a != e).float().mean() < 0.05, f"{what}: too many values off by a rounding step"


DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9, 16, 17, 32, 33, 70])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_i8_matches_dequantized_matmul(kernels, dtype, m, with_bias):
    """AVX2: pairs of blocks below 64 rows (two rows per pass after the first), the integer tile from 64; AVX512-BF16: panels above 32 rows for bf16
    activations (on AMX tiles where granted; 70 rows leave a 6-row tail)."""
    _check_linear_i8(kernels, dtype, m, with_bias, n=37, k=8192 + 128)  # N not a multiple of the 4-row block; K
    # spans two int32 flush segments


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_one_row_int8_linear_streams_two_runs_per_thread(kernels, dtype, threads):
    """Batch 1 on AVX-512 streams two runs of 4-row blocks per thread (the halves of its share; an odd share's last
    block alone, the partial last block after them): 67 whole blocks and a 3-row one give shares of 67, 33 + 34 and
    22 + 22 + 23 blocks. The row gets the bits it gets beside another row, and the dequantized product's value."""
    n, k = 4 * 67 + 3, 8192 + 128  # K spans two int32 flush segments
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _check_linear_i8(kernels, dtype, 1, True, n=n, k=k)
        torch.manual_seed(threads)
        qweight, scales = quantize_int8_per_channel(torch.randn(n, k))
        packed, sums, bias = kernels.pack_rows(qweight), kernels.row_sums(qweight), torch.randn(n).to(dtype)
        x = torch.randn(2, k).to(dtype)
        alone = kernels.linear_i8(x[:1], packed, scales, sums, bias, n)
        assert torch.equal(alone[0], kernels.linear_i8(x, packed, scales, sums, bias, n)[0])
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [64, 100])
def test_linear_i8_panels_cover_every_block(kernels, dtype, m):
    """Several panel blocks, the last one partial, each filled from every 4-row block and 64-column chunk."""
    _check_linear_i8(kernels, dtype, m, True, n=3 * kernels.bf16_block + 11, k=192)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1025, 1035, 1060])
def test_linear_i8_prefill_chunks_with_a_short_last_one(kernels, dtype, m):
    """A prefill of more than 1024 rows at K <= 1024 runs in 512-row chunks: the last one 1, 11 or 36 rows (on AMX
    tiles, fewer than 16 rows once segfaulted: their zero-padded copy was not made)."""
    _check_linear_i8(kernels, dtype, m, True, n=40, k=128)


@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_prefill_rows_equal_the_rows_alone(kernels, dtype):
    """AVX2 and AVX-512 without BF16: prefill-sized batches run an integer tile over int16 panels (vpmaddwd,
    vpdpwssd) with the decode kernel's exact sums, so every row of a prompt gets the bits it gets alone (a decode
    step): across tiles of 6 rows and their tail, chunks of rows (K = 4864: 64-row chunks), int32 runs of 512
    columns with a partial last one, and a partial last block of outputs."""
    if not kernels.int8_prefill_exact:
        pytest.skip(f"the {kernels.build} build's prefill runs bf16 panels (float32 sums), not the integer tile")
    _check_rows_alone(kernels, dtype, k=4864, batches=(64, 65, 70, 131), seed=4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [896, 4864])
def test_batch_invariant_mode_gives_prefill_rows_the_bits_they_get_alone(kernels, dtype, k):
    """PAGEDSERVE_BATCH_INVARIANT: where prefill batches take the bf16 panels (AVX512-BF16, AMX), the integer tile
    runs instead at every K, so a prompt's rows get the bits they get alone; float32 activations keep the kernel
    at every batch size instead of dequantizing above 32 rows."""
    was = kernels.batch_invariant
    kernels.set_batch_invariant(True)
    try:
        assert kernels.int8_prefill_exact and kernels.int8_max_rows(torch.float32) is None
        _check_rows_alone(kernels, dtype, k=k, batches=(64, 65, 70, 131), seed=6)
    finally:
        kernels.set_batch_invariant(was)
    if not kernels.int8_prefill_exact and dtype == torch.bfloat16:  # the panels' float32 sums give other bits
        with pytest.raises(AssertionError):
            _check_rows_alone(kernels, dtype, k=k, batches=(64,), seed=6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [896, 1024 + 64])
def test_int8_decode_batches_give_every_row_the_bits_it_gets_alone(kernels, dtype, k):
    """Batches of 32-63 rows: on AVX-512 (without AMX-INT8 tiles taking them) those with K <= 1024 run the integer
    tile (i8_gemm) instead of the row kernel, with the same exact sums; K = 1088 keeps the row kernel; below 32 rows
    the row kernel's passes (the first streaming the block, the later ones holding it in registers). Every row
    must equal what it gets alone (a decode step, a speculative verification), across tiles of 6 rows, every
    weight vector of a 64-output block (one run of the tile) and a partial last block."""
    _check_rows_alone(kernels, dtype, k=k, batches=(5, 6, 15, 16, 17, 22, 31, 32, 33, 40, 63), seed=5)


def _check_rows_alone(kernels, dtype: torch.dtype, k: int, batches: tuple[int, ...], seed: int) -> None:
    """Each batch of the first rows of x gives every row the bits it gets alone (int8 linear, a partial last block of
    outputs, one row with a large int16 step)."""
    torch.manual_seed(seed)
    n = 2 * kernels.bf16_block + 5
    qweight, scales = quantize_int8_per_channel(torch.randn(n, k))
    packed, sums = kernels.pack_rows(qweight), kernels.row_sums(qweight)
    bias = torch.randn(n).to(dtype)
    x = torch.randn(max(batches), k).to(dtype)
    x[7, 5] = 60.0
    alone = torch.cat([kernels.linear_i8(x[i:i + 1], packed, scales, sums, bias, n) for i in range(len(x))])
    for rows in batches:
        assert torch.equal(kernels.linear_i8(x[:rows], packed, scales, sums, bias, n), alone[:rows]), rows


def _check_linear_i8(kernels, dtype: torch.dtype, m: int, with_bias: bool, n: int, k: int) -> None:
    torch.manual_seed(m)
    qweight, scales = quantize_int8_per_channel(torch.randn(n, k))
    x = torch.randn(m, k).to(dtype)
    x[0, 0] = 40.0  # an outlier sets the row's int16 step
    bias = torch.randn(n).to(dtype) if with_bias else None
    y = kernels.linear_i8(x, kernels.pack_rows(qweight), scales, kernels.row_sums(qweight), bias, n)
    dequantized = qweight.float() * scales[:, None]
    exact = x.float() @ dequantized.t()
    # The kernel widens x to int16 with step max|x| / 32767: each product is off by at most half a step.
    step = x.float().abs().amax(1, keepdim=True) / 32767
    bound = step / 2 * dequantized.abs().sum(1) + exact.abs() * 1e-6
    expected = exact.to(dtype) if bias is None else exact.to(dtype) + bias
    assert y.shape == (m, n) and y.dtype == dtype
    if dtype == torch.float32:
        assert ((y - expected).abs() <= bound).all()
    else:  # plus one bf16 rounding of the result; with a bias, each side first rounds the product itself, and a
        # product near a rounding midpoint may go either way (one bf16 step of it) before the bias is added
        product_step = exact.abs() * 2 ** -7 if bias is not None else 0
        assert ((y.float() - expected.float()).abs() <= bound + product_step + expected.float().abs() * 2 ** -7).all()
        assert (y != expected).float().mean() < 0.2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_transformers_formula(kernels, dtype, with_residual):
    torch.manual_seed(0)
    x = (torch.randn(5, 128) * 3).to(dtype)
    residual = torch.randn(5, 128).to(dtype) if with_residual else None
    weight = (1 + torch.randn(128) * 0.1).to(dtype)
    out, new_residual = kernels.rms_norm(x, weight, 1e-6, residual)
    h = x + residual if with_residual else x
    if with_residual:
        assert torch.equal(new_residual, h)  # the add is rounded exactly as torch rounds it
    else:
        assert new_residual is None
    _close(out, reference_rms_norm(h, weight, 1e-6), dtype, "rms_norm")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_gemma_rms_norm_matches_transformers_formula(kernels, dtype, with_residual):
    """Gemma's norm: x * rsqrt(mean(x^2) + eps) * (1 + weight), all in float32, rounded once (transformers'
    Gemma2RMSNorm); the kernel is given the float32 gain 1 + weight."""
    torch.manual_seed(0)
    x = (torch.randn(5, 128) * 3).to(dtype)
    residual = torch.randn(5, 128).to(dtype) if with_residual else None
    gain = 1.0 + (torch.randn(128) * 0.3).to(dtype).float()
    out, new_residual = kernels.rms_norm(x, gain, 1e-6, residual, gain=True)
    h = x + residual if with_residual else x
    if with_residual:
        assert torch.equal(new_residual, h)
    h32 = h.float()
    expected = (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + 1e-6) * gain).to(dtype)
    _close(out, expected, dtype, "rms_norm_gain")
    llama = kernels.rms_norm(x, gain.to(dtype), 1e-6, residual)[0]  # Llama's rounds before it scales
    assert dtype == torch.float32 or not torch.equal(llama, out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation,torch_op", [("silu", F.silu),
                                                 ("gelu_pytorch_tanh", lambda g: F.gelu(g, approximate="tanh"))])
def test_gate_mul_matches_torch(kernels, dtype, activation, torch_op):
    """act(gate) * up as transformers computes it (act in float32, rounded, then the product rounded): the kernel's
    exp-based forms (GELU's tanh as a sigmoid of twice its argument) differ from torch's by float32 rounding only."""
    torch.manual_seed(0)
    gate_up = (torch.randn(3, 2 * 160) * 4).to(dtype)
    gate_up[0, :6] = torch.tensor([-100.0, 100.0, 0.0, -20.0, 1e-3, -1e-3]).to(dtype)  # saturating and tiny inputs
    gate, up = gate_up.split(160, dim=-1)
    _close(kernels.gate_mul(gate_up, activation), torch_op(gate) * up, dtype, activation)


def test_gate_mul_takes_only_the_native_activations(kernels):
    with pytest.raises(ValueError, match="activation 'gelu' is not native"):
        kernels.gate_mul(torch.zeros(1, 64), "gelu")  # the exact (erf) GELU: torch ops
    silu, gelu = kernels.gate_mul(torch.ones(1, 64)), kernels.gate_mul(torch.ones(1, 64), "gelu_pytorch_tanh")
    assert silu[0, 0].item() == pytest.approx(F.silu(torch.tensor(1.0)).item())  # the default: SiLU
    assert gelu[0, 0].item() == pytest.approx(F.gelu(torch.tensor(1.0), approximate="tanh").item())


def _reference_decode(q, k_cache, v_cache, slots, lens, scale):
    """Decode attention written out in torch with the roundings of torch's CPU flash-attention kernel
    (which transformers' SDPA path runs): float32 scores and softmax, the unnormalised weights rounded
    to the model dtype before they meet V, the float32 sum of the unrounded weights dividing at the
    end. (Checked bit for bit against F.scaled_dot_product_attention on single-head 4-D inputs.)"""
    out = torch.empty(q.shape, dtype=q.dtype)
    group = q.shape[1] // k_cache.shape[1]
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            k = k_cache[slots[b, :lens[b]], h // group].float()  # [L, D]
            v = v_cache[slots[b, :lens[b]], h // group].float()
            scores = (q[b, h].float() @ k.t()) * scale
            weights = torch.exp(scores - scores.max())
            out[b, h] = (weights.to(q.dtype).float() @ v / weights.sum()).to(q.dtype)
    return out


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_argmax_rows_picks_what_torch_max_picks(kernels, threads):
    """Greedy sampling's argmax: ties (the first), NaN (the first NaN), -inf and inf, tails past the vectors, and
    rows cut into runs (fewer rows than threads, 4096+ values) whose results combine in order."""
    generator = torch.Generator().manual_seed(threads)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for m in (1, 2, 3, 5):
            for width in (1, 7, 16, 17, 4099, 3 * 4096 + 5, 49152):
                x = torch.randint(-3, 4, (m, width), generator=generator).float()  # many ties per row
                if width > 20:
                    x[0, width // 2 + 1:] += 1.0  # the largest value first appears in a later run of row 0
                if m > 1:
                    x[1] = float("-inf")
                    x[1, width - 1] = float("inf") if width > 1 else x[1, 0]
                if m > 2 and width > 9:
                    x[2, width - 3] = float("nan")  # in the last run, maybe in the tail: counts as the largest
                    x[2, width - 1] = float("nan")
                if m > 3 and width > 9000:
                    x[3, 4100] = float("nan")
                    x[3, width - 2] = 10.0
                assert torch.equal(kernels.argmax_rows(x), torch.max(x, dim=-1).indices), (m, width)
        logits = torch.randn(5, 151936, generator=generator)  # a verification's rows of Qwen2.5's vocabulary
        assert torch.equal(kernels.argmax_rows(logits), logits.argmax(dim=-1))
    finally:
        torch.set_num_threads(previous)


def test_reference_decode_is_torch_sdpa_rounding():
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 1, n, 64).bfloat16() for n in (1, 33, 33))
    sdpa = F.scaled_dot_product_attention(q, k, v, scale=0.125)
    ours = _reference_decode(q[0, 0].unsqueeze(0), k[0, 0].unsqueeze(1), v[0, 0].unsqueeze(1),
                             torch.arange(33).unsqueeze(0), torch.tensor([33]), 0.125)
    assert torch.equal(ours.flatten(), sdpa.flatten())


@pytest.fixture(params=["fma", "vdpbf16ps"])
def attention_kernels(kernels, request):
    """The kernels with bf16 attention by float32 FMAs, then by vdpbf16ps (where the build has AVX512-BF16; else
    skipped): the CPU's rule picks one (probe.bf16_attention_by_dot), and both must stay correct and keep every
    path's bits alike. The CPU's choice is restored after."""
    chosen = kernels.bf16_dot_attention
    if kernels.set_bf16_attention(request.param == "vdpbf16ps") != (request.param == "vdpbf16ps"):
        kernels.set_bf16_attention(chosen)
        pytest.skip(f"{kernels.build} build: no AVX512-BF16, so bf16 attention runs on FMAs only")
    yield kernels
    kernels.set_bf16_attention(chosen)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d", [(4, 4, 64), (14, 2, 64), (8, 2, 128), (4, 1, 256), (8, 4, 256)])
def test_decode_attention_matches_sdpa_over_gathered_context(attention_kernels, dtype, hq, hkv, d):
    torch.manual_seed(hq + d)
    num_slots, max_len = 300, 70
    k_cache = torch.randn(num_slots, hkv, d).to(dtype)
    v_cache = torch.randn(num_slots, hkv, d).to(dtype)
    lens = torch.tensor([1, 17, 70, 33], dtype=torch.int64)  # tails of every length mod 16, and 1
    slots = torch.stack([torch.randperm(num_slots)[:max_len] for _ in lens])
    # q as the model passes it: a view into a [B, Hq + Hkv, D] tensor (rows not contiguous)
    qk = torch.randn(len(lens), hq + hkv, d).to(dtype)
    q = qk[:, :hq]
    scale = d ** -0.5
    out = attention_kernels.decode_attention(q, k_cache, v_cache, slots, lens, scale)
    _close(out, _reference_decode(q, k_cache, v_cache, slots, lens, scale), dtype, "decode_attention")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d", [(14, 2, 64), (9, 3, 64), (6, 2, 128), (12, 2, 128), (16, 2, 64), (4, 2, 96),
                                      (4, 1, 256), (10, 2, 256)])
def test_decode_attention_grouped_heads_equal_each_head_alone(attention_kernels, dtype, hq, hkv, d):
    """Query heads that share a KV head read its rows widened once, chunk by chunk (64 positions); each head's
    output must still be bit-equal to that head attending alone (one query head per KV head: straight from
    the pool, no chunks). Contexts of 1 to 3 chunks, with tails of every kind; D = 96 takes the generic path.
    Groups of 3-8 heads: the weighted sums take them in parts (7 -> 4 + 3 on AVX-512), and AVX2 over slices of
    the head size (D = 256: AVX-512 too, and the head alone sums AVX2's two halves of it one after the other)."""
    torch.manual_seed(hq * d)
    num_slots, max_len = 400, 200
    k_cache = torch.randn(num_slots, hkv, d).to(dtype)
    v_cache = torch.randn(num_slots, hkv, d).to(dtype)
    lens = torch.tensor([1, 64, 65, 129, 200, 77], dtype=torch.int64)
    slots = torch.stack([torch.randperm(num_slots)[:max_len] for _ in lens])
    q = torch.randn(len(lens), hq, d).to(dtype)
    scale = d ** -0.5
    grouped = attention_kernels.decode_attention(q, k_cache, v_cache, slots, lens, scale)
    _close(grouped, _reference_decode(q, k_cache, v_cache, slots, lens, scale), dtype, "decode_attention")
    group = hq // hkv
    for h in range(hq):
        k_one, v_one = (c[:, h // group:h // group + 1].contiguous() for c in (k_cache, v_cache))
        alone = attention_kernels.decode_attention(q[:, h:h + 1], k_one, v_one, slots, lens, scale)
        assert torch.equal(alone[:, 0], grouped[:, h]), f"query head {h}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d", [(14, 2, 64), (9, 3, 64), (4, 4, 64), (6, 2, 128), (4, 2, 96), (4, 1, 256),
                                      (2, 2, 256)])
def test_decode_attention_rows_of_one_context_equal_each_row_alone(attention_kernels, dtype, hq, hkv, d):
    """Rows whose contexts are one another's plus a position (a speculative verification's 1 + k rows) share
    each widened chunk of it; each row's output must be bit-equal to the row attending alone. Runs that cross
    chunk borders (63 .. 67, 127 .. 145: longer than one piece of MAX_RUN rows), a run of one, a row with the
    same length but other slots (not in the run), one query head per KV head (4, 4) and the generic D = 96."""
    torch.manual_seed(hq * d + 1)
    num_slots, max_len = 400, 160
    k_cache = torch.randn(num_slots, hkv, d).to(dtype)
    v_cache = torch.randn(num_slots, hkv, d).to(dtype)
    shared, other = torch.randperm(num_slots)[:max_len], torch.randperm(num_slots)[:max_len]
    lens = list(range(63, 68)) + [30] + list(range(127, 146)) + [146]
    tables = [shared] * (len(lens) - 1) + [other]  # the last row: one more position, but another context
    slots = torch.stack(tables)
    lens = torch.tensor(lens, dtype=torch.int64)
    q = torch.randn(len(lens), hq, d).to(dtype)
    scale = d ** -0.5
    together = attention_kernels.decode_attention(q, k_cache, v_cache, slots, lens, scale)
    _close(together, _reference_decode(q, k_cache, v_cache, slots, lens, scale), dtype, "decode_attention")
    for b in range(len(lens)):
        alone = attention_kernels.decode_attention(q[b:b + 1], k_cache, v_cache, slots[b:b + 1], lens[b:b + 1], scale)
        assert torch.equal(alone[0], together[b]), f"row {b} (context {int(lens[b])})"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d", [(14, 2, 64), (9, 3, 64), (4, 4, 64), (6, 2, 128), (4, 2, 96), (4, 1, 256)])
@pytest.mark.parametrize("start,num", [(0, 70), (37, 70), (130, 1)])
@pytest.mark.parametrize("scratch", [1 << 30, 0])
def test_prefill_attention_rows_equal_decode_rows_alone(attention_kernels, dtype, hq, hkv, d, start, num, scratch):
    """A prefill chunk's rows at positions start .. start + num - 1 attend causally over start + num paged positions:
    each row must be bit-equal to a decode row with its context alone, and close to torch's roundings. A fresh
    chunk (start 0), one after prior context (chunked prefill, a prefix hit), a single row; pieces of 16 rows
    sharing a widened context, and of 1 row where the scratch allows no more (scratch 0)."""
    torch.manual_seed(hq * d + start + num)
    num_slots, context = 400, start + num
    k_cache = torch.randn(num_slots, hkv, d).to(dtype)
    v_cache = torch.randn(num_slots, hkv, d).to(dtype)
    slots = torch.randperm(num_slots)[:context]  # paged: the sequence's positions anywhere in the pool
    qkv = torch.randn(num, hq + 2 * hkv, d).to(dtype)  # q as the model passes it: a view, rows not contiguous
    q = qkv[:, :hq]
    scale = d ** -0.5
    out = attention_kernels.prefill_attention(q, k_cache, v_cache, slots, start, scale, scratch)
    lens = torch.arange(start + 1, context + 1)
    table = slots.expand(num, context)
    expected = _reference_decode(q, k_cache, v_cache, table, lens, scale).float()
    # The float32 sums run in another order than torch's, and a weighted sum that cancels to a small value keeps
    # the error of its large terms: within a bf16 step of the largest output (each row's equality with the decode
    # kernel, whose closeness to torch is tested above, is the strict part)
    tolerance = expected.abs().max() * (2 ** -7 if dtype == torch.bfloat16 else 1e-5)
    assert (out.float() - expected).abs().max() <= tolerance
    if dtype == torch.bfloat16:
        assert (out.float() != expected).float().mean() < 0.05
    for i in range(num):
        alone = attention_kernels.decode_attention(q[i:i + 1], k_cache, v_cache, table[i:i + 1], lens[i:i + 1], scale)
        assert torch.equal(alone[0], out[i]), f"row {i} (position {start + i})"


@pytest.mark.parametrize("hq,hkv,d", [(14, 2, 64), (4, 2, 128), (8, 2, 256)])
def test_every_attention_path_scores_bf16_rows_alike(attention_kernels, hq, hkv, d):
    """Where the CPU has bf16 dot products, bf16 scores take them (dot_scores), and their lane sums round in
    another order than float32 FMAs: every path must then take them alike, or a verification row, a prefill row
    or a head of a group would differ from the decode row alone. Such a difference is one last bit of a score,
    which the bf16 outputs seldom show: here the scores are large (q scaled by 32) and the contexts long, and a
    head alone left on the FMA scores fails this (tried; with q unscaled it passed). Paths: heads of a group
    against one head alone (read straight from the pool), a run of rows against each row alone, a prefill chunk
    against decode rows. On other builds every path is on the FMA scores, and this checks the same equalities."""
    torch.manual_seed(7)
    num_slots, context, num = 1200, 1000, 6
    k_cache, v_cache = (torch.randn(num_slots, hkv, d).bfloat16() for _ in range(2))
    slots = torch.randperm(num_slots)[:context]
    q = (torch.randn(num, hq, d) * 32).bfloat16()
    scale = d ** -0.5
    lens = torch.arange(context - num + 1, context + 1)
    table = slots.expand(num, context).contiguous()
    together = attention_kernels.decode_attention(q, k_cache, v_cache, table, lens, scale)
    prefill = attention_kernels.prefill_attention(q, k_cache, v_cache, slots, context - num, scale, 1 << 30)
    group = hq // hkv
    for b in range(num):
        alone = attention_kernels.decode_attention(q[b:b + 1], k_cache, v_cache, table[b:b + 1], lens[b:b + 1], scale)
        assert torch.equal(alone[0], together[b]), f"row {b} in a run"
        assert torch.equal(alone[0], prefill[b]), f"prefill row {b}"
        for h in range(hq):
            k_one, v_one = (c[:, h // group:h // group + 1].contiguous() for c in (k_cache, v_cache))
            head = attention_kernels.decode_attention(q[b:b + 1, h:h + 1], k_one, v_one, table[b:b + 1],
                                                      lens[b:b + 1], scale)
            assert torch.equal(head[0, 0], alone[0, h]), f"row {b}, query head {h} alone"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d", [(4, 1, 256), (9, 3, 64), (4, 1, 64), (6, 3, 128), (8, 1, 128), (4, 2, 64)])
@pytest.mark.parametrize("cap", [None, 2.0])
def test_few_tasks_split_over_the_threads_give_the_bits_of_one_thread(attention_kernels, dtype, hq, hkv, d, cap):
    """Where a step's runs x KV heads are fewer than the threads (a Gemma 3 row at batch 1; 3 KV heads on 4 threads)
    and the contexts are long, every thread works on every task (attend_split: scores by chunks of positions, V's
    sums by parts of the lanes): each output must be bit-equal to the one thread's (which runs each task whole), at
    2, 3 and 4 threads (2 or 4 lane parts), for a row alone, a verification run and a prefill chunk."""
    torch.manual_seed(hq * d + hkv)
    num_slots, context = 1300, 1200
    k_cache, v_cache = (torch.randn(num_slots, hkv, d) * 2).to(dtype), torch.randn(num_slots, hkv, d).to(dtype)
    slots = torch.randperm(num_slots)[:context]
    q = (torch.randn(5, hq, d) * 2).to(dtype)
    scale = d ** -0.5
    lens = torch.tensor([context - 4, 300, 257, 1024, 1000])  # alone: split from 256 x 256 positions x lanes on
    table = slots.expand(5, context).contiguous()
    run = torch.arange(context - 4, context + 1)  # 5 rows of one context: one run

    def outputs() -> list[torch.Tensor]:
        alone = [attention_kernels.decode_attention(q[b:b + 1], k_cache, v_cache, table[b:b + 1], lens[b:b + 1],
                                                    scale, cap) for b in range(5)]
        return alone + [attention_kernels.decode_attention(q, k_cache, v_cache, table, run, scale, cap),
                        attention_kernels.prefill_attention(q, k_cache, v_cache, slots, context - 5, scale, 1 << 30,
                                                            cap)]

    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = outputs()
        for threads in (2, 3, 4):
            torch.set_num_threads(threads)
            for i, (a, b) in enumerate(zip(one, outputs())):
                assert torch.equal(a, b), f"{threads} threads, output {i}"
    finally:
        torch.set_num_threads(previous)
    if cap is None:
        _close(one[0], _reference_decode(q[:1], k_cache, v_cache, table[:1], lens[:1], scale), dtype, "decode")


FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def _fp8_pool(fp8: torch.dtype, dtype: torch.dtype, num_slots: int, hkv: int, d: int, seed: int):
    """An fp8 KV pool as the engine writes it (LayerKVCache.write: each (slot, head) row over its own scale), its
    values spread over 2^-30 .. 4 within each row (so both formats' subnormals and zeros occur), and the 16/32-bit pool
    the torch path gathers from it (value x scale rounded to `dtype`)."""
    from pagedserve.layers.attention import LayerKVCache

    generator = torch.Generator().manual_seed(seed)
    cache = LayerKVCache(*(torch.zeros(num_slots, hkv, d, dtype=fp8) for _ in range(2)),
                         *(torch.zeros(num_slots, hkv, 1, dtype=dtype) for _ in range(2)))
    k, v = (torch.randn(num_slots, hkv, d, generator=generator) * 4
            * torch.exp2(-torch.randint(0, 31, (num_slots, hkv, d), generator=generator).float()) for _ in range(2))
    cache.write(k.to(dtype), v.to(dtype), torch.arange(num_slots))
    k16, v16 = cache.gather(torch.arange(num_slots), dtype)
    return cache, k16.contiguous(), v16.contiguous()


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_rows_widen_to_their_values_times_their_scales(kernels, fp8, dtype):
    """Every finite fp8 code, as V rows of one-position contexts (whose output is the V row): the kernel's widening of
    the bytes (fp8_half: e4m3's bits put in fp16's places, its subnormals included; e5m2's as fp16's top byte) must
    give torch's value of each code times the row's scale, rounded to the activation dtype as the torch path rounds
    it. The scales are powers of two and others, so that the product rounds."""
    codes = torch.arange(256, dtype=torch.uint8).view(fp8)
    finite = codes[codes.float().isfinite()]
    d = 64
    rows = -(-len(finite) // d)
    v = torch.zeros(rows * d, dtype=torch.uint8).view(fp8)
    v[:len(finite)] = finite
    v = v.view(rows, 1, d)
    scales = torch.tensor([1.0, 0.3711, 2.0 ** -12, 3.1e-3][:rows]).to(dtype).view(rows, 1, 1)
    q = torch.randn(rows, 1, d).to(dtype)
    out = kernels.decode_attention(q, v, v, torch.arange(rows).view(rows, 1), torch.ones(rows, dtype=torch.int64),
                                   d ** -0.5, kv_scales=(scales, scales))
    assert torch.equal(out, v.to(dtype) * scales)


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d", [(14, 2, 64), (4, 4, 64), (6, 2, 128), (4, 1, 256), (4, 2, 96)])
def test_fp8_pool_attention_is_the_16_32_bit_paths_over_its_values(kernels, fp8, dtype, hq, hkv, d):
    """An fp8 pool's rows are read as value x scale (rounded to the activation dtype) into the attention's widened or
    paired copies, and every path then runs as over a 16/32-bit pool holding those values: each output must be
    bit-equal to that path's over the gathered pool, with bf16 attention by FMAs and by vdpbf16ps (where the build
    has it). Rows alone (one query head per KV head: read straight from a 16-bit pool), a run of verification rows, a
    prefill chunk, and one row over 1200 positions (few tasks: split over the threads where there are 2 or more).
    The 16-bit path's closeness to torch and its equalities between paths are tested above."""
    num_slots, context = 1300, 1200
    cache, k16, v16 = _fp8_pool(fp8, dtype, num_slots, hkv, d, seed=hq * d + hkv)
    torch.manual_seed(hq + d)
    slots = torch.randperm(num_slots)[:context]
    q = (torch.randn(6, hq, d) * 2).to(dtype)
    scale = d ** -0.5
    table = slots.expand(6, context).contiguous()

    def outputs(k_cache, v_cache, kv_scales) -> list[torch.Tensor]:
        def decode(rows, lens):
            return kernels.decode_attention(q[rows], k_cache, v_cache, table[rows], torch.tensor(lens), scale,
                                            kv_scales=kv_scales)

        return [decode(slice(0, 4), [1, 17, 70, 300]), decode(slice(0, 6), list(range(195, 201))),
                decode(slice(0, 1), [context]),
                kernels.prefill_attention(q, k_cache, v_cache, slots[:137], 131, scale, 1 << 30, kv_scales=kv_scales)]

    chosen = kernels.bf16_dot_attention
    try:
        for dot in (False, True):
            kernels.set_bf16_attention(dot)
            for i, (got, want) in enumerate(zip(outputs(cache.k, cache.v, cache.scales), outputs(k16, v16, None))):
                assert torch.equal(got, want), f"output {i}, bf16 attention by vdpbf16ps: {kernels.bf16_dot_attention}"
    finally:
        kernels.set_bf16_attention(chosen)


def test_the_bf16_attention_switch_changes_only_the_roundings(kernels):
    """Where the build has vdpbf16ps, the two bf16 attentions round their sums in different orders: outputs must
    differ somewhere (else set_bf16_attention switched nothing) and agree within bf16 rounding."""
    if not kernels.bf16_dot:
        pytest.skip(f"{kernels.build} build: no AVX512-BF16, one bf16 attention only")
    torch.manual_seed(3)
    hq, hkv, d, num_slots, context = 14, 2, 64, 2100, 2000
    k_cache, v_cache = (torch.randn(num_slots, hkv, d).bfloat16() for _ in range(2))
    slots = torch.randperm(num_slots)[:context].expand(32, context).contiguous()
    # flat scores: many V rows in each sum, so the order of the additions shows in some last bits
    q, lens = torch.randn(32, hq, d).bfloat16(), torch.randint(1, context + 1, (32,))
    chosen = kernels.bf16_dot_attention
    outs = {}
    for on in (True, False):
        assert kernels.set_bf16_attention(on) == on
        outs[on] = kernels.decode_attention(q, k_cache, v_cache, slots, lens, d ** -0.5)
    kernels.set_bf16_attention(chosen)
    assert not torch.equal(outs[True], outs[False])
    torch.testing.assert_close(outs[True].float(), outs[False].float(), rtol=2 ** -6, atol=2 ** -7)


# decode batches take the integer kernel, prefill-sized bf16 ones its bf16 panels; float32 ones above
# kernels.int8_max_rows (AVX512-BF16 only: 32) the dequantized matmul
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 40, 80])
def test_int8_linear_layer_on_both_paths(kernels, dtype, rows):
    from pagedserve.layers.linear import Int8Linear

    torch.manual_seed(rows)
    weight, bias = torch.randn(70, 64).to(dtype), torch.randn(70).to(dtype)
    layer = Int8Linear(weight, bias, kernels)
    assert layer.native is not None
    assert layer.max_kernel_rows == kernels.int8_max_rows(dtype)
    x = torch.randn(rows, 64).to(dtype)
    expected = (torch.nn.functional.linear(x.float(), layer.dequantized().float()).to(dtype) + bias).float()
    # int16 activations and bf16 roundings (of the product, then of the bias add): well within 2^-6 of the scale
    assert (layer(x).float() - expected).abs().max() <= expected.abs().max() * 2 ** -6
    assert (layer.dequantized().float() - weight.float()).abs().max() <= weight.float().abs().amax() / 127


def test_bf16_parts_pack_as_their_rows_stacked(kernels):
    """q/k/v (or gate/up) packed part by part straight into one buffer equal the stacked weight packed, the
    last part's padding included; parts that do not hold whole blocks are refused, never mis-packed."""
    nb = kernels.bf16_block
    generator = torch.Generator().manual_seed(8)
    parts = [torch.randn(rows, 96, generator=generator).bfloat16() for rows in (4 * nb, nb, nb + 3)]
    packed = kernels.pack_bf16(parts)
    assert torch.equal(packed, kernels.pack_bf16(torch.cat(parts)))
    assert kernels.can_pack_parts([nb, nb + 3]) and not kernels.can_pack_parts([nb + 1, nb])
    with pytest.raises(ValueError, match="whole blocks"):
        kernels.pack_bf16([parts[2], parts[0]])
    with pytest.raises(ValueError, match=r"weight\[1\]"):
        kernels.pack_bf16([parts[0], parts[1][:, :80]])
    odd = torch.randn(nb + 5, 80, generator=generator).bfloat16()  # 40 column pairs: the last tile of 16 is partial
    assert torch.equal(unpack_bf16(kernels.pack_bf16(odd), nb + 5), odd)


@pytest.mark.parametrize("rows", [*range(1, 14), 40])  # every row count of a tile (6 rows on AVX2, 12 on AVX-512)
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_linear_matches_torch(kernels, rows, with_bias):
    torch.manual_seed(rows)
    n, k = 100, 96  # N not a multiple of the 64-output block
    weight = torch.randn(n, k).bfloat16()
    bias = torch.randn(n).bfloat16() if with_bias else None
    x = torch.randn(rows, k).bfloat16()
    packed = kernels.pack_bf16(weight)
    assert torch.equal(unpack_bf16(packed, n), weight)
    y = kernels.linear_bf16(x, packed, bias, n)
    # both sum the exact products in float32 (in different orders), add the bias and round once
    _close(y, torch.nn.functional.linear(x, weight, bias), torch.bfloat16, "linear_bf16")


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_one_row_bf16_linear_streams_its_blocks_in_groups(kernels, threads):
    """Batch 1 (a decode step) streams several weight blocks at once (AVX512-BF16: up to 4 of each thread's even
    share, the share's last group shorter; AVX2: groups of 4, the rest block by block): 13 blocks give shares of 13,
    6 + 7 and 4 + 4 + 5 blocks for 1-3 threads, so last groups of 1, 2 and 3 blocks, the last block partial. The
    row gets the bits it gets beside other rows, and torch's value within a rounding step."""
    torch.manual_seed(threads)
    n, k = 12 * kernels.bf16_block + 5, 128
    weight, bias = torch.randn(n, k).bfloat16(), torch.randn(n).bfloat16()
    x = torch.randn(7, k).bfloat16()
    packed = kernels.pack_bf16(weight)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = kernels.linear_bf16(x[:1], packed, bias, n)
        beside = kernels.linear_bf16(x, packed, bias, n)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(alone[0], beside[0])
    _close(alone, torch.nn.functional.linear(x[:1], weight, bias), torch.bfloat16, f"linear_bf16, {threads} threads")


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(kernels, dtype):
    """Below prefill sizes (63 rows) a row's output is bit for bit the one it gets alone, in both linears: a
    decode step, the rows of a speculative verification and a batch of a few requests agree exactly, which is
    what makes speculative decoding's greedy output identical to the plain path's on the native kernels."""
    torch.manual_seed(1)
    n, k = 70, 256
    weight = torch.randn(n, k)
    qweight, scales = quantize_int8_per_channel(weight)
    packed_i8, sums = kernels.pack_rows(qweight), kernels.row_sums(qweight)
    x = torch.randn(63, k).to(dtype)
    alone_i8 = torch.cat([kernels.linear_i8(x[r:r + 1], packed_i8, scales, sums, None, n) for r in range(63)])
    # every row, not only the first: the AVX2 int8 kernel runs row 0 (and a 2-row batch's row 1) on its own and
    # the later rows two at a time (an odd count leaves one alone)
    for rows in (2, 3, 4, 5, 9, 16, 17, 32, 63):
        assert torch.equal(kernels.linear_i8(x[:rows], packed_i8, scales, sums, None, n), alone_i8[:rows]), rows
    if dtype == torch.bfloat16:
        packed = kernels.pack_bf16(weight.bfloat16())
        alone = torch.cat([kernels.linear_bf16(x[r:r + 1], packed, None, n) for r in range(63)])
        for rows in (2, 5, 9, 12, 13, 17, 23, 63):
            assert torch.equal(kernels.linear_bf16(x[:rows], packed, None, n), alone[:rows]), rows


@pytest.mark.parametrize("dtype", DTYPES)
def test_avx_vnni_int8_sums_are_the_plain_avx2_ones_bit_for_bit(kernel_build_of, kernels, dtype):
    """The avx2-vnni build (one vpdpwssd where the AVX2 build runs vpmaddwd + vpaddd) gives every int8 path the
    same integers, so the same outputs bit for bit: batch 1 and the block pairs, the two-row passes of 3-63 rows,
    the prefill tile from 64 rows, across int32 flushes (every 2048 columns; the tile's every 512)."""
    build = kernel_build_of[0]
    assert kernels.avx_vnni == (build == "avx2-vnni")
    if not kernels.avx_vnni:
        pytest.skip(f"the {build} build has no AVX-VNNI sums")
    plain, why = load("avx2")
    assert plain is not None and not plain.avx_vnni, why
    torch.manual_seed(5)
    n, k = 2 * kernels.bf16_block + 13, 2 * 2048 + 320
    qweight, scales = quantize_int8_per_channel(torch.randn(n, k))
    packed, sums = kernels.pack_rows(qweight), kernels.row_sums(qweight)
    assert torch.equal(packed, plain.pack_rows(qweight))
    bias = torch.randn(n).to(dtype)
    x = torch.randn(131, k).to(dtype)
    x[3, 7] = 80.0  # one row with a large step
    for rows in (1, 2, 3, 5, 9, 63, 64, 131):
        assert torch.equal(kernels.linear_i8(x[:rows], packed, scales, sums, bias, n),
                           plain.linear_i8(x[:rows], packed, scales, sums, bias, n)), rows


def _require_amx(kernels, flags: set[str] | frozenset[str]) -> None:
    """Skip unless this CPU has the AMX `flags`, AMX is not turned off and this build has the AMX paths; then the
    kernels must have turned AMX on."""
    from pagedserve.memory.probe import cpu_flags

    if not flags <= cpu_flags():
        pytest.skip(f"no AMX here (needs the CPU flags {sorted(flags)}): the vector kernel runs")
    if not envs.cpu_amx_enabled():
        pytest.skip("PAGEDSERVE_CPU_AMX=0: the vector kernel runs")
    if kernels.build != "native":
        pytest.skip(f"the {kernels.build} build has no AMX path (a fixed -march without AMX)")
    assert kernels.amx, "the CPU has AMX but the kernels did not turn it on (no tile state from Linux?)"


@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_linear_on_amx_tiles_is_bit_equal_to_the_vector_kernel(kernels, dtype):
    """Where the CPU has AMX-INT8 the int8 kernel's batches of 2-63 rows run on its tiles (TDPBUSD) with the same
    exact integer sums as vpdpbusd: every row equals what it gets alone (one row: the vector kernel), in whole
    groups of 16 rows, in the last, partly garbage-filled group and in batches under 16 rows; K spans two int32
    flush segments and N leaves a partial group of 32 outputs."""
    _require_amx(kernels, {"amx_tile", "amx_int8"})
    assert kernels.amx_int8, "the CPU has AMX-INT8 but the int8 kernel was built without it"
    torch.manual_seed(3)
    n, k = 70, 8192 + 128
    qweight, scales = quantize_int8_per_channel(torch.randn(n, k))
    packed, sums = kernels.pack_rows(qweight), kernels.row_sums(qweight)
    bias = torch.randn(n).to(dtype)
    x = torch.randn(63, k).to(dtype)
    alone = torch.cat([kernels.linear_i8(x[i:i + 1], packed, scales, sums, bias, n) for i in range(63)])
    for rows in (2, 3, 5, 6, 7, 15, 16, 17, 40, 63):
        assert torch.equal(kernels.linear_i8(x[:rows], packed, scales, sums, bias, n), alone[:rows]), rows


@pytest.mark.parametrize("k", [96, 128, 896])  # 96: not whole AMX tiles of columns (the vector kernel runs)
def test_bf16_linear_on_amx_tiles(kernels, k):
    """Where the CPU has AMX (Sapphire Rapids and later Xeons) bf16 linears run on its tiles at every batch
    size: each row of x must equal what it gets alone, in full tiles of 16 rows, in the zero-padded last
    group and in batches under 16 rows (shorter tiles), and agree with torch as the vector kernel does."""
    from pagedserve.memory.probe import AMX_BF16_FLAGS

    _require_amx(kernels, AMX_BF16_FLAGS)
    torch.manual_seed(k)
    n = 200  # three 64-output blocks and a partial one
    weight, bias = torch.randn(n, k).bfloat16(), torch.randn(n).bfloat16()
    x = torch.randn(45, k).bfloat16()
    packed = kernels.pack_bf16(weight)
    y = kernels.linear_bf16(x, packed, bias, n)
    _close(y, torch.nn.functional.linear(x, weight, bias), torch.bfloat16, f"linear_bf16 on AMX, K={k}")
    for rows in (1, 3, 15, 16, 17, 33):
        for start in (0, 5, 45 - rows):
            part = kernels.linear_bf16(x[start:start + rows].contiguous(), packed, bias, n)
            assert torch.equal(part, y[start:start + rows]), (rows, start)


def test_bf16_linear_takes_prefill_rows_in_chunks_with_the_same_sums(kernels):
    """Above 512 rows (K <= 1024) the kernel walks the rows in chunks: every output row must equal the
    one computed alone (same sums, same order), including the last, partial chunk."""
    torch.manual_seed(0)
    n, k, rows = 130, 128, 1100  # chunks of 512, 512, 76
    weight, bias = torch.randn(n, k).bfloat16(), torch.randn(n).bfloat16()
    x = torch.randn(rows, k).bfloat16()
    packed = kernels.pack_bf16(weight)
    y = kernels.linear_bf16(x, packed, bias, n)
    for row in (0, 511, 512, 1023, 1024, 1099):
        assert torch.equal(y[row], kernels.linear_bf16(x[row:row + 1], packed, bias, n)[0])
    _close(y, torch.nn.functional.linear(x, weight, bias), torch.bfloat16, "linear_bf16, 1100 rows")


def test_the_backend_gives_bf16_linears_the_native_kernel(kernels):
    from pagedserve.layers.backend import KernelBackend

    weight = torch.randn(70, 64).bfloat16()
    backend = KernelBackend.choose("cpu", torch.bfloat16)
    assert backend.native is kernels and backend.linear_kind == "packed" and backend.native_bf16_linears
    layer = backend.make_linear(weight, None)
    assert layer.native is kernels
    x = torch.randn(2, 3, 64).bfloat16()  # leading dims are kept
    _close(layer(x), torch.nn.functional.linear(x, weight), torch.bfloat16, "PackedLinear")
    fp32 = KernelBackend.choose("cpu", torch.float32)  # float32 linears stay on oneDNN, the rest is native
    assert fp32.make_linear(weight.float(), None).native is None and fp32.native is kernels
    reference = KernelBackend.choose("cpu", torch.bfloat16, reference=True)
    assert reference.native is None and type(reference.make_linear(weight, None)).__name__ == "PlainLinear"
    int8 = KernelBackend.choose("cpu", torch.bfloat16, "int8").make_linear(weight, None)
    assert int8.native is kernels
    assert KernelBackend.choose("cpu", torch.bfloat16, "int8").make_linear(weight[:, :48], None).native is None
    with pytest.raises(ValueError, match="quantization 'int4' is not supported"):
        KernelBackend.choose("cpu", torch.bfloat16, "int4")


def test_packed_rows_are_the_embedding_rows(kernels, tiny_model_dir):
    """A tied embedding reads its rows from the packed logits weight: exactly the table's rows."""
    from pagedserve import LLM
    from pagedserve.layers.linear import PackedLinear

    weight = torch.randn(130, 64).bfloat16()  # 130 rows: the last block of 64 is partly padding
    ids = torch.tensor([[0, 63, 64], [129, 5, 64]])
    assert torch.equal(PackedLinear(weight, None, kernels).rows(ids), weight[ids])
    llm = LLM(tiny_model_dir("qwen2", "bfloat16"), dtype="bfloat16", device="cpu", max_model_len=64)  # tied embeddings
    model = llm.engine.runner.model
    assert type(model.model.embed_tokens).__name__ == "PackedRowsEmbedding"
    assert "model.embed_tokens.weight" not in dict(model.named_parameters())  # one copy of the table


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 7])
def test_rope_kv_write_matches_rotary_then_index_copy(kernels, dtype, tokens):
    from pagedserve.layers.rotary import apply_rotary

    torch.manual_seed(tokens)
    hq, hkv, d = 6, 2, 64
    qkv = torch.randn(tokens, hq + 2 * hkv, d).to(dtype)
    angles = torch.rand(tokens, d) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    slots = torch.randperm(40)[:tokens]
    k_cache, v_cache = torch.zeros(40, hkv, d, dtype=dtype), torch.zeros(40, hkv, d, dtype=dtype)
    expected_qk = apply_rotary(qkv[:, :hq + hkv], cos.unsqueeze(1), sin.unsqueeze(1))  # the torch path
    expected_v = qkv[:, hq + hkv:].clone()
    kernels.rope_kv_write(qkv, cos, sin, k_cache, v_cache, slots, hq)
    _close(qkv[:, :hq + hkv], expected_qk, dtype, "rotated q/k")
    assert torch.equal(k_cache[slots], qkv[:, hq:hq + hkv])  # the rotated K, as stored in place
    assert torch.equal(v_cache[slots], expected_v)
    untouched = torch.ones(40, dtype=torch.bool)
    untouched[slots] = False
    assert not k_cache[untouched].any() and not v_cache[untouched].any()


def _fp8_code_rows(fp8: torch.dtype, dtype: torch.dtype, d: int) -> torch.Tensor:
    """Rows of d values whose largest magnitude is the format's largest value (so their scale is 1 and the values are
    converted as they are): every positive finite code, the midpoints between neighbouring codes (ties: to even),
    values just beside each midpoint, and all of them negated; representable in `dtype`."""
    codes = torch.arange(128, dtype=torch.uint8).view(fp8).float()
    codes = codes[codes.isfinite()].sort().values
    top = torch.finfo(fp8).max
    mids = (codes[1:] + codes[:-1]) / 2
    values = torch.cat([codes, mids, mids * (1 + 2 ** -7), mids * (1 - 2 ** -7)]).to(dtype).float()  # (all but the
    values = values[values <= top]  # last two exact in bf16: those round to the next bf16 values, beside the midpoint)
    values = torch.cat([values, -values])
    rows = -(-len(values) // (d - 1))
    table = torch.zeros(rows * (d - 1))
    table[:len(values)] = values
    table = torch.cat([torch.full((rows, 1), top), table.view(rows, d - 1)], dim=1)
    table[1::2, 0] = -top  # the largest magnitude negative in every other row
    return table.to(dtype)


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_kv_write_into_an_fp8_pool_is_layer_kv_cache_write(kernels, fp8, dtype):
    """Into an fp8 pool the fused kernel writes each (rotated) K row and each V row over its own scale as
    LayerKVCache.write (torch ops) writes the same rows: the same bytes and scales. First rows of every code, midpoint
    and near-midpoint (scale 1: the conversion's rounding itself, _fp8_code_rows), without rotary; then rotated rows
    spread over 2^-30 .. 4 (subnormals and zeros) and one all-zero row (its scale the clamp's 1e-12)."""
    from pagedserve.layers.attention import LayerKVCache

    hq, hkv, d = 2, 2, 64
    rows = _fp8_code_rows(fp8, dtype, d)
    tokens = -(-len(rows) // (2 * hkv))
    kv = torch.zeros(tokens * 2 * hkv, d, dtype=dtype)
    kv[:len(rows)] = rows
    generator = torch.Generator().manual_seed(5)
    spread = torch.randn(tokens, hq + 2 * hkv, d, generator=generator) * 4 \
        * torch.exp2(-torch.randint(0, 31, (tokens, hq + 2 * hkv, d), generator=generator).float())
    spread[0, hq] = 0.0
    angles = torch.rand(tokens, d, generator=generator) * 6
    for qkv, tables in ((torch.cat([torch.randn(tokens, hq, d).to(dtype), kv.view(tokens, 2 * hkv, d)], dim=1), None),
                        (spread.to(dtype), (angles.cos().to(dtype), angles.sin().to(dtype)))):
        slots = torch.randperm(tokens + 5)[:tokens]

        def pool() -> LayerKVCache:
            return LayerKVCache(*(torch.zeros(tokens + 5, hkv, d, dtype=fp8) for _ in range(2)),
                                *(torch.zeros(tokens + 5, hkv, 1, dtype=dtype) for _ in range(2)))

        native, expected = pool(), pool()
        kernels.rope_kv_write(qkv, *(tables or (None, None)), native.k, native.v, slots, hq, kv_scales=native.scales)
        expected.write(qkv[:, hq:hq + hkv], qkv[:, hq + hkv:], slots)  # the kernel's rotated K, in place
        for got, want in ((native.k, expected.k), (native.v, expected.v)):
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        assert torch.equal(native.k_scale, expected.k_scale) and torch.equal(native.v_scale, expected.v_scale)
        if tables is None:  # every code row at scale 1 (the rest of the last token's heads are zeros)
            assert int((native.k_scale[slots] == 1).sum() + (native.v_scale[slots] == 1).sum()) == len(rows)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cap", [2.0, 50.0])
def test_capped_decode_attention_is_the_torch_paths(attention_kernels, dtype, cap):
    """Gemma 2's softcapped scores: in bf16 the native decode kernel takes transformers' eager roundings (layers/
    attention.attend: q.k, the scaled score, the quotient, tanh and product each rounded; the softmax normalised,
    then rounded), so its rows are the torch path's bit for bit; in float32 they differ by summation order."""
    from pagedserve.layers.attention import attend

    torch.manual_seed(int(cap))
    hq, hkv, d, length, scale = 4, 2, 64, 300, 24 ** -0.5
    q = (torch.randn(3, hq, d) * 2).to(dtype)
    k_cache, v_cache = (torch.randn(length, hkv, d) * 2).to(dtype), torch.randn(length, hkv, d).to(dtype)
    slots, lens = torch.stack([torch.randperm(length) for _ in range(3)]), torch.tensor([300, 17, 150])
    out = attention_kernels.decode_attention(q, k_cache, v_cache, slots, lens, scale, cap)
    for b in range(3):
        context = slots[b, :int(lens[b])]
        expected = attend(q[b:b + 1].unsqueeze(2), k_cache[context].transpose(0, 1)[None],
                          v_cache[context].transpose(0, 1)[None], None, scale, cap)[0, :, 0]
        if dtype == torch.bfloat16:
            assert torch.equal(out[b], expected)
        else:
            torch.testing.assert_close(out[b], expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cap", [2.0, 50.0])
@pytest.mark.parametrize("d", [64, 256])
def test_capped_prefill_rows_equal_capped_decode_rows_alone(attention_kernels, dtype, cap, d):
    """Batch-invariant mode runs Gemma 2's prefill chunks on the native prefill kernel with the cap: each row must be
    bit-equal to the decode row with its context alone (so the chunking does not show), and the cap must be applied
    (rows differ from uncapped ones)."""
    torch.manual_seed(int(cap) + d)
    hq, hkv, start, num, scale = 4, 2, 37, 40, 24 ** -0.5
    k_cache, v_cache = (torch.randn(100, hkv, d) * 2).to(dtype), torch.randn(100, hkv, d).to(dtype)
    slots = torch.randperm(100)[:start + num]
    q = (torch.randn(num, hq, d) * 2).to(dtype)
    out = attention_kernels.prefill_attention(q, k_cache, v_cache, slots, start, scale, 1 << 30, cap)
    assert not torch.equal(out, attention_kernels.prefill_attention(q, k_cache, v_cache, slots, start, scale,
                                                                    1 << 30))
    table, lens = slots.expand(num, start + num), torch.arange(start + 1, start + num + 1)
    for i in range(num):
        alone = attention_kernels.decode_attention(q[i:i + 1], k_cache, v_cache, table[i:i + 1], lens[i:i + 1], scale,
                                                   cap)
        assert torch.equal(alone[0], out[i]), f"row {i}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_kv_write_without_tables_writes_the_heads_as_projected(kernels, dtype):
    """SmolLM3's NoPE layers: no cos/sin, so q and k stay as projected (normed first where norms are given) and K/V
    reach the pool unrotated."""
    from pagedserve.layers.norm import RMSNorm

    torch.manual_seed(3)
    hq, hkv, d, tokens = 4, 2, 64, 3
    qkv = torch.randn(tokens, hq + 2 * hkv, d).to(dtype)
    projected = qkv.clone()
    slots = torch.tensor([2, 0, 5])
    k_cache, v_cache = torch.zeros(6, hkv, d, dtype=dtype), torch.zeros(6, hkv, d, dtype=dtype)
    kernels.rope_kv_write(qkv, None, None, k_cache, v_cache, slots, hq)
    assert torch.equal(qkv, projected)
    assert torch.equal(k_cache[slots], projected[:, hq:hq + hkv])
    assert torch.equal(v_cache[slots], projected[:, hq + hkv:])
    norm = RMSNorm(d, 1e-6)
    norm.weight.data = (torch.rand(d) + 0.5).to(dtype)
    kernels.rope_kv_write(qkv, None, None, k_cache, v_cache, slots, hq, (norm.weight, norm.weight, 1e-6))
    _close(qkv[:, :hq + hkv], norm.torch_forward(projected[:, :hq + hkv]), dtype, "normed, unrotated q/k")
    with pytest.raises(ValueError, match="cos and sin"):
        kernels.rope_kv_write(qkv, torch.zeros(tokens, d, dtype=dtype), None, k_cache, v_cache, slots, hq)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("gemma", [False, True], ids=["qwen3", "gemma3"])
def test_rope_kv_write_norms_query_and_key_heads_first(kernels, dtype, d, gemma):
    """Qwen3 and Gemma 3: each query / key head RMSNorm-ed with its own weight before rotary (transformers' order),
    in the same call; V untouched. Against the torch path: the norm's torch_forward per head (Gemma's: a float32
    gain, one rounding), then apply_rotary."""
    from pagedserve.layers.norm import RMSNorm
    from pagedserve.layers.rotary import apply_rotary
    from pagedserve.models.gemma import GemmaRMSNorm

    torch.manual_seed(d)
    hq, hkv, tokens, eps = 4, 2, 5, 1e-6
    qkv = (torch.randn(tokens, hq + 2 * hkv, d) * 3).to(dtype)
    angles = torch.rand(tokens, d) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    norms = []
    for _ in range(2):
        norm = (GemmaRMSNorm if gemma else RMSNorm)(d, eps)
        norm.weight.data = (torch.rand(d) - (0.5 if gemma else -0.5)).to(dtype)  # Gemma's scale is 1 + weight
        if gemma:
            norm.prepare()
        norms.append(norm)
    q, k, v = qkv.split([hq, hkv, hkv], dim=1)
    normed = torch.cat((norms[0].torch_forward(q), norms[1].torch_forward(k)), dim=1)
    expected_qk = apply_rotary(normed, cos.unsqueeze(1), sin.unsqueeze(1))
    expected_v = v.clone()
    slots = torch.tensor([3, 0, 7, 5, 1])
    k_cache, v_cache = torch.zeros(8, hkv, d, dtype=dtype), torch.zeros(8, hkv, d, dtype=dtype)
    kernels.rope_kv_write(qkv, cos, sin, k_cache, v_cache, slots, hq,
                          (norms[0].native_weight(), norms[1].native_weight(), eps), gain=gemma)
    _close(qkv[:, :hq + hkv], expected_qk, dtype, "normed and rotated q/k")
    assert torch.equal(k_cache[slots], qkv[:, hq:hq + hkv]) and torch.equal(v_cache[slots], expected_v)


def test_weight_buffer_is_an_ordinary_tensor_by_default(kernels, monkeypatch):
    monkeypatch.delenv("PAGEDSERVE_HUGE_PAGES", raising=False)
    plain = kernels.weight_buffer(3, 1 << 20, dtype=torch.bfloat16)
    assert plain.shape == (3, 1 << 20) and plain.untyped_storage().resizable()  # torch's allocator


def test_weight_buffer_is_zeroed_and_starts_on_a_huge_page(kernels, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_HUGE_PAGES", "1")
    big = kernels.weight_buffer(3, 1 << 20, dtype=torch.bfloat16)  # 6 MiB
    assert not big.untyped_storage().resizable()  # its own mapping
    assert big.shape == (3, 1 << 20) and big.dtype == torch.bfloat16 and big.is_contiguous()
    assert big.data_ptr() % (2 << 20) == 0  # huge pages can back it from its first byte
    assert not big.any()
    big.fill_(1.5)
    import gc
    gc.collect()  # the mapping lives as long as the tensor, not as long as the local objects that made it
    assert big.float().sum().item() == 1.5 * 3 * (1 << 20)
    small = kernels.weight_buffer(4, 8, dtype=torch.int8)  # below one huge page: an ordinary tensor
    assert small.shape == (4, 8) and small.untyped_storage().resizable()


# ---- loading: weights to per-row int8 ---------------------------------------------------------------------
# Exact equality: both sides dequantize each value with the same float32 multiply (and add, rounded
# separately), divide by the same float32 scale and round half to even; nothing is summed.
def _random_blocks(qtype, rows: int, in_features: int, generator: torch.Generator) -> torch.Tensor:
    """Random ggml blocks of `qtype` whose fp16 scale fields hold finite values of mixed magnitudes."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as Q

    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = torch.randint(0, 256, (rows * in_features // block_size, type_size), dtype=torch.uint8,
                           generator=generator)
    scale_fields = (0, 2) if qtype in (Q.Q4_1, Q.Q5_1) else (0,)
    for start in scale_fields:
        values = torch.randn(blocks.shape[0], generator=generator) * torch.tensor([1e-3, 0.02, 0.5])[
            torch.randint(0, 3, (blocks.shape[0],), generator=generator)]
        blocks[:, start:start + 2] = values.half().view(torch.uint8).view(-1, 2)
    blocks[0, :2] = 0  # a zero scale (fp16 0.0)
    return blocks.view(rows, -1)


@pytest.mark.parametrize("qtype_name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_gguf_blocks_requantize_to_the_torch_paths_int8_bit_for_bit(kernels, qtype_name: str) -> None:
    from gguf.constants import GGMLQuantizationType as Q
    from gguf.quants import dequantize

    from pagedserve.models.gguf_dequant import _dequantize_blocks_torch

    qtype = Q[qtype_name]
    generator = torch.Generator().manual_seed(int(qtype))
    for rows, in_features in ((7, 64), (33, 576), (2, 32)):
        blocks = _random_blocks(qtype, rows, in_features, generator)
        expected = quantize_int8_per_channel(_dequantize_blocks_torch(blocks.numpy(), qtype, torch.float32))
        q, scales = kernels.requant_gguf_i8(blocks, int(qtype), in_features)
        assert torch.equal(q, expected[0]) and torch.equal(scales, expected[1])
        reference = torch.from_numpy(dequantize(blocks.numpy(), qtype))  # gguf's own numpy decoder
        assert torch.equal(quantize_int8_per_channel(reference)[0], q)
    assert kernels.requant_gguf_i8(blocks, int(Q.Q6_K), in_features) is None  # left to the torch path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_rows_matches_quantize_int8_per_channel(kernels, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(5)
    weight = (torch.randn(67, 320, generator=generator) * torch.rand(67, 1, generator=generator)).to(dtype)
    weight[3] = 0  # the scale's lower clamp
    weight[4, :2] = torch.tensor([127.0, 0.5])  # an exact tie: half to even gives 0, not 1
    weight[5, :3] = torch.tensor([-254.0, 1.0, 3.0])  # ties at +-0.5 and 1.5 steps of a 2.0 scale
    q, scales = kernels.quantize_rows_i8(weight)
    expected = quantize_int8_per_channel(weight)
    assert torch.equal(q, expected[0]) and torch.equal(scales, expected[1])
    assert q[4, 1] == 0 and q[5, 1] == 0 and q[5, 2] == 2
    # K not a multiple of the vector width: the tail runs one value at a time, the maximum in it too.
    tail = (torch.randn(9, 333, generator=generator)).to(dtype)
    tail[2, 330] = 40.0
    q, scales = kernels.quantize_rows_i8(tail)
    expected = quantize_int8_per_channel(tail)
    assert torch.equal(q, expected[0]) and torch.equal(scales, expected[1]) and q[2, 330] == 127


def test_row_sums_are_torchs(kernels) -> None:
    generator = torch.Generator().manual_seed(6)
    q = torch.randint(-127, 128, (37, 577), dtype=torch.int8, generator=generator)
    q[0] = 127  # 577 x 127 needs more than 16 bits
    assert torch.equal(kernels.row_sums(q), q.sum(dim=1, dtype=torch.int32))


def test_the_decode_stack_layout_reports_every_field_it_has(kernels):
    """ps_layer_layout returns how many fields the library's layout has even when asked for fewer, so a field
    added in C and not in the wrapper makes layer_layout refuse instead of passing unnoticed."""
    import ctypes

    names = len(kernels.layer_layout)
    few = (ctypes.c_int64 * 3)()
    assert kernels.lib.ps_layer_layout(few, 3) == names
    assert list(few) == [kernels.layer_layout[name] for name in ("in_norm", "post_norm", "qkv")]


# ---- GGUF blocks as stored (ps_linear_q) --------------------------------------------------------------------------

def _gguf_matrix(qtype, n: int, k: int, seed: int):
    """(ggml blocks uint8 [n, row bytes] of a random matrix, what they stand for in float64 per gguf.quants)."""
    import numpy as np
    from gguf.quants import dequantize

    from tests.models.gguf_utils import _encode

    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    w[0, :32] = 0.0  # a block of zeros: d = 0
    w[1, :32] += 0.3  # a block of positive values only (a K-quant's offset 0)
    blocks, _ = _encode(w, qtype)
    exact = torch.from_numpy(dequantize(blocks, qtype).reshape(n, k)).double()
    return torch.from_numpy(blocks.view(np.uint8).reshape(n, -1).copy()), exact


def _block_cases():
    """(type, in_features): the 32-value types with groups of 128 columns that leave 1-3 blocks over; K-quants in
    whole superblocks of 256."""
    from gguf import GGMLQuantizationType as QType

    small = [(q, k) for q in (QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1) for k in (32, 96, 576, 1056)]
    return small + [(q, k) for q in (QType.Q4_K, QType.Q5_K) for k in (256, 768, 1280)]


@pytest.mark.parametrize("qtype,k", _block_cases(), ids=lambda v: getattr(v, "name", str(v)))
@pytest.mark.parametrize("dtype", DTYPES)
def test_gguf_block_linear_matches_the_dequantized_matmul(kernels, qtype, dtype, k):
    """x [M, K] against the blocks' values, each row within what the kernel's roundings allow: x rounded per row to
    integers v of step xs = max|x| / 32256 (|x - xs v| <= xs / 2: at most xs / 2 sum|w| on a row's output), exact
    integer sums per block, then float32 terms d_b sum q v and m_b sum v (at most 31 |d_b| + |m_b| a column, whatever
    |w| is once they cancel), ~K / 16 + 16 of them added (2^-24 each), then the output's roundings (bf16: the
    product's, then the bias add's, 2^-9 each). Decode-sized batches (below 8 rows: AVX2's Q_TILE_ROWS, 12 on AVX-512)
    give every row the bits it gets alone; bigger ones (the tile) too in batch-invariant mode, where they take the same
    kernel."""
    from pagedserve.layers.linear import BlockWeight

    n = 37  # not a multiple of the 4-row block
    blocks, exact = _gguf_matrix(qtype, n, k, seed=k)
    rows = kernels.pack_gguf_q(blocks, int(qtype), k)
    assert rows is not None and (rows[2] is None) == (qtype.name.startswith("Q4"))
    assert torch.equal(BlockWeight(*rows, torch.float32).dequantized_float32().double(), exact)
    packed, kind = kernels.pack_q_rows(*rows[:3]), rows[3]
    unpacked = kernels.unpack_q_rows(packed, n, k)
    assert all(a is b is None or torch.equal(a, b) for a, b in zip(unpacked, rows[:3]))
    torch.manual_seed(k)
    x = torch.randn(70, k).to(dtype)
    x[5, 3] = 40.0  # a row with a large step
    bias = torch.randn(n).to(dtype)
    x64 = x.double()
    product = x64 @ exact.T
    step = x64.abs().amax(dim=1, keepdim=True) / 32256
    # the float32 terms are d_b sum q v and m_b sum v: up to 31 |d| + |m| a column, whatever |w| is once they cancel
    # (each block's m: its value at q = 0; d: at q = 1 less m)
    zero_qh = None if rows[2] is None else torch.zeros_like(rows[2])
    m = BlockWeight(torch.zeros_like(rows[0]), rows[1], zero_qh, kind, torch.float32).dequantized_float32().double()
    d = BlockWeight(torch.full_like(rows[0], 0x11), rows[1], zero_qh, kind, torch.float32).dequantized_float32() - m
    terms = 31 * d.abs() + m.abs()
    bound = step / 2 * exact.abs().sum(dim=1) + 2 ** -24 * (k / 16 + 16) * (x64.abs() @ terms.T)
    if dtype == torch.bfloat16:
        bound = bound + 2 ** -8 * (product.abs() + (product + bias.double()).abs())
    previous = kernels.batch_invariant
    for invariant in (False, True):
        kernels.set_batch_invariant(invariant)
        try:
            y = kernels.linear_q(x, packed, kind, bias, n)
            assert ((y.double() - (product + bias.double())).abs() <= bound + 1e-30).all()
            alone = torch.cat([kernels.linear_q(x[i:i + 1], packed, kind, bias, n) for i in range(70)])
            assert torch.equal(kernels.linear_q(x[:7], packed, kind, bias, n), alone[:7])
            if invariant:
                assert torch.equal(y, alone)
        finally:
            kernels.set_batch_invariant(previous)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_one_row_gguf_block_linear_streams_two_runs_per_thread(kernels, threads):
    """One row of x takes block b with block b + half on each thread (two runs a thread), from 8 blocks a thread:
    the same sums in the same order as the row's pass inside a batch (bit-equal), the odd block left over too."""
    from gguf import GGMLQuantizationType as QType

    n, k = 4 * (2 * 8 * threads + 3) - 2, 320  # an odd block count, a last block of 2 rows
    blocks, exact = _gguf_matrix(QType.Q5_1, n, k, seed=threads)
    rows = kernels.pack_gguf_q(blocks, int(QType.Q5_1), k)
    packed = kernels.pack_q_rows(*rows[:3])
    torch.manual_seed(threads)
    x = torch.randn(3, k).bfloat16()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        one = kernels.linear_q(x[1:2].contiguous(), packed, rows[3], None, n)
        batch = kernels.linear_q(x, packed, rows[3], None, n)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(one, batch[1:2])
    assert (one.double() - x[1:2].double() @ exact.T).abs().max() < 0.05


def test_prefill_sized_gguf_block_batches_run_in_chunks_of_rows(kernels):
    """Past 512 rows the tile takes the rows in chunks (its int16 copy of x stays bounded): the first chunk's rows are
    the rows of a 512-row call, every row near the product of the blocks' values."""
    from gguf import GGMLQuantizationType as QType

    n, k = 21, 256
    blocks, exact = _gguf_matrix(QType.Q4_K, n, k, seed=7)
    rows = kernels.pack_gguf_q(blocks, int(QType.Q4_K), k)
    packed = kernels.pack_q_rows(*rows[:3])
    torch.manual_seed(7)
    x = torch.randn(530, k)
    y = kernels.linear_q(x, packed, rows[3], None, n)
    assert torch.equal(y[:512], kernels.linear_q(x[:512].contiguous(), packed, rows[3], None, n))
    reference = x.double() @ exact.T
    assert ((y.double() - reference).abs() <= 1e-3 * reference.abs().max()).all()


def test_gguf_block_packing_refuses_what_the_kernel_does_not_take(kernels):
    """Other block types and widths not of whole blocks are left to the int8 path (None); so is a Q4_0 whose implied
    m = -8 d overflows fp16 (d above 8188). A matrix of one block a row packs."""
    import numpy as np
    from gguf import GGMLQuantizationType as QType

    blocks, _ = _gguf_matrix(QType.Q8_0, 4, 64, seed=1)
    assert kernels.pack_gguf_q(blocks, int(QType.Q8_0), 64) is None
    blocks, _ = _gguf_matrix(QType.Q4_0, 4, 64, seed=1)
    assert kernels.pack_gguf_q(blocks[:, :-18].contiguous(), int(QType.Q4_0), 32) is not None
    huge = blocks.clone()
    huge[2, 0:2] = torch.from_numpy(np.array([9000.0], dtype=np.float16).view(np.uint8))
    assert kernels.pack_gguf_q(huge, int(QType.Q4_0), 64) is None
    assert kernels.pack_gguf_q(blocks[:, :-2].contiguous(), int(QType.Q4_0), 48) is None  # not whole blocks
