"""The native kernel wrappers refuse arguments the C code would misread (kernels/__init__.py, `check`):
every wrapper is called once with what it expects, then with one argument wrong at a time, and must raise
a ValueError that says what is wrong before any native code runs."""

from __future__ import annotations

import pytest
import torch


F32, BF16, I64 = torch.float32, torch.bfloat16, torch.int64


def _with_view(table: torch.Tensor, view: int) -> torch.Tensor:
    """`table` with every layer's step view set to `view` (its column as the library lays the table out)."""
    from pagedserve.kernels import cpu_kernels

    return table.index_fill(1, torch.tensor([cpu_kernels().layer_layout["view"]]), view)


def _calls(k):
    """(wrapper name, its valid keyword arguments) for each wrapper."""
    torch.manual_seed(0)
    w_i8 = torch.randint(-127, 128, (8, 64), dtype=torch.int8)
    w_bf16 = torch.randn(16, 32).to(BF16)
    hq, hkv, d, slots_total = 2, 1, 32, 8
    step = dict(cos=torch.randn(1, d), sin=torch.randn(1, d), slots=torch.tensor([3]),
                ctx_slots=torch.tensor([[0, 1, 2, 3]]), lens=torch.tensor([4]))
    return {
        "pack_rows": dict(weight=w_i8),
        "pack_bf16": dict(weight=w_bf16),
        "linear_bf16": dict(x=torch.randn(2, 32).to(BF16), packed=k.pack_bf16(w_bf16), bias=torch.randn(16).to(BF16),
                            out_features=16),
        "linear_i8": dict(x=torch.randn(2, 64), packed=k.pack_rows(w_i8), scales=torch.rand(8),
                          row_sums=k.row_sums(w_i8), bias=torch.randn(8), out_features=8),
        "rms_norm": dict(x=torch.randn(2, 16), weight=torch.rand(16), eps=1e-6, residual=torch.randn(2, 16)),
        "gate_mul": dict(gate_up=torch.randn(2, 64)),
        "rope_kv_write": dict(qkv=torch.randn(2, hq + 2 * hkv, d), cos=torch.randn(2, d), sin=torch.randn(2, d),
                              k_cache=torch.zeros(slots_total, hkv, d), v_cache=torch.zeros(slots_total, hkv, d),
                              slots=torch.tensor([1, 5]), num_heads=hq),
        "decode_attention": dict(q=torch.randn(1, hq, d), k_cache=torch.randn(slots_total, hkv, d),
                                 v_cache=torch.randn(slots_total, hkv, d), slots=step["ctx_slots"], lens=step["lens"],
                                 scale=d ** -0.5),
        "prefill_attention": dict(q=torch.randn(3, hq, d), k_cache=torch.randn(slots_total, hkv, d),
                                  v_cache=torch.randn(slots_total, hkv, d), slots=torch.tensor([6, 0, 2, 4, 1]),
                                  start=2, scale=d ** -0.5, scratch_bytes=1 << 20),
        "argmax_rows": dict(x=torch.randn(3, 40)),
        # never run with these (the table holds no pointers): only the refusals are exercised
        "decode_stack": dict(x=torch.randn(1, 64), table=torch.zeros(2, k.layer_fields, dtype=I64),
                             final_norm=torch.rand(64),
                             views=[(step["cos"], step["sin"], step["slots"], step["ctx_slots"], step["lens"])],
                             num_heads=hq,
                             num_kv_heads=hkv, head_dim=d, intermediate=128, eps=1e-6, scale=d ** -0.5),
    }


RUNNABLE = ["pack_rows", "pack_bf16", "linear_bf16", "linear_i8", "rms_norm", "gate_mul", "rope_kv_write",
            "decode_attention", "prefill_attention", "argmax_rows"]

WRONG = [  # (wrapper, argument, wrong value or a function of the valid one)
    ("pack_rows", "weight", lambda w: w.float()),
    ("pack_rows", "weight", lambda w: w[:, :32]),
    ("pack_bf16", "weight", lambda w: w.float()),
    ("pack_bf16", "weight", lambda w: w[:, :8]),
    ("linear_bf16", "x", lambda x: x.float()),
    ("linear_bf16", "x", lambda x: x.t().contiguous().t()),
    ("linear_bf16", "x", lambda x: torch.cat([x, x], 1)),
    ("linear_bf16", "bias", lambda b: b.float()),
    ("linear_bf16", "bias", lambda b: b[:15]),
    ("linear_bf16", "packed", lambda p: p.float()),
    ("linear_bf16", "out_features", lambda n: 100),
    ("linear_i8", "x", lambda x: x[:, :32].contiguous()),
    ("linear_i8", "x", lambda x: x.double()),
    ("linear_i8", "scales", lambda s: s[:7]),
    ("linear_i8", "scales", lambda s: s.double()),
    ("linear_i8", "row_sums", lambda r: r.long()),
    ("linear_i8", "bias", lambda b: b.to(BF16)),
    ("linear_i8", "out_features", lambda n: 9),
    ("rms_norm", "weight", lambda w: w.to(BF16)),
    ("rms_norm", "weight", lambda w: w[:8]),
    ("rms_norm", "residual", lambda r: r[:1]),
    ("rms_norm", "residual", lambda r: r.t().contiguous().t()),
    ("rms_norm", "x", lambda x: x[:, :8].contiguous()),
    ("gate_mul", "gate_up", lambda g: g[:, :48].contiguous()),
    ("gate_mul", "gate_up", lambda g: g[:, :32]),
    ("rope_kv_write", "cos", lambda c: c.to(BF16)),
    ("rope_kv_write", "sin", lambda s: s[:1]),
    ("rope_kv_write", "v_cache", lambda v: v.to(BF16)),
    ("rope_kv_write", "v_cache", lambda v: v[:4]),
    ("rope_kv_write", "k_cache", lambda c: torch.zeros(8, 2, 32)),
    ("rope_kv_write", "slots", lambda s: s.int()),
    ("rope_kv_write", "qkv", lambda q: q[..., :16].contiguous()),
    ("decode_attention", "v_cache", lambda v: v[..., :16].contiguous()),
    ("decode_attention", "k_cache", lambda c: c.to(BF16)),
    ("decode_attention", "lens", lambda n: n.int()),
    ("decode_attention", "slots", lambda s: torch.cat([s, s])),
    ("prefill_attention", "q", lambda q: q.double()),
    ("prefill_attention", "k_cache", lambda c: c.to(BF16)),
    ("prefill_attention", "v_cache", lambda v: v[:4]),
    ("prefill_attention", "slots", lambda s: s[:4]),  # start + 3 rows need 5
    ("prefill_attention", "slots", lambda s: s.int()),
    ("argmax_rows", "x", lambda x: x.to(BF16)),
    ("argmax_rows", "x", lambda x: x[0]),
    ("argmax_rows", "x", lambda x: x.t()),
    ("decode_stack", "final_norm", lambda w: w[:32]),
    ("decode_stack", "final_norm", lambda w: w.to(BF16)),
    ("decode_stack", "table", lambda t: t[:, :-1].contiguous()),
    ("decode_stack", "table", lambda t: t.int()),
    ("decode_stack", "views", lambda v: [(v[0][0].to(BF16), *v[0][1:])]),  # cos
    ("decode_stack", "views", lambda v: [(*v[0][:3], v[0][3].int(), v[0][4])]),  # ctx_slots
    ("decode_stack", "views", lambda v: v + [(*v[0][:4], v[0][4][:0])]),  # a second view's lens
    ("decode_stack", "views", lambda v: []),
    ("decode_stack", "table", lambda t: _with_view(t, 1)),  # a view not given
    ("decode_stack", "table", lambda t: _with_view(t, -1)),
    ("decode_stack", "views", lambda v: [(*v[0][:2], torch.tensor([3, 4]), *v[0][3:])]),  # slots
]


@pytest.mark.parametrize("name", RUNNABLE)
def test_each_wrapper_runs_with_what_it_expects(kernels, name):
    getattr(kernels, name)(**_calls(kernels)[name])


@pytest.mark.parametrize(("name", "argument", "wrong"), WRONG, ids=[f"{n}-{a}-{i}" for i, (n, a, _) in enumerate(WRONG)])
def test_each_wrapper_refuses_a_wrong_argument(kernels, name, argument, wrong):
    arguments = _calls(kernels)[name]
    arguments[argument] = wrong(arguments[argument])
    with pytest.raises(ValueError, match="native kernel argument|not a multiple|heads|values, expected|views"):
        getattr(kernels, name)(**arguments)


def test_an_fp8_pool_comes_with_its_scales_in_the_activation_dtype(kernels):
    """An fp8 KV pool is read with its rows' scales ([S, Hkv, 1], q's dtype): without them, with scales of another
    dtype or shape, or with scales for a pool that is not fp8, the wrappers refuse before any native code runs."""
    valid = _calls(kernels)["decode_attention"]
    scales = (torch.rand(8, 1, 1), torch.rand(8, 1, 1))
    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        pool = {name: valid[name].to(fp8) for name in ("k_cache", "v_cache")}
        kernels.decode_attention(**{**valid, **pool}, kv_scales=scales)  # runs
        wrongs = (None, (scales[0].to(BF16), scales[1]), (scales[0], scales[1][:4]), (scales[0][..., 0], scales[1]))
        for wrong in wrongs:
            with pytest.raises(ValueError, match="native kernel argument"):
                kernels.decode_attention(**{**valid, **pool}, kv_scales=wrong)
    for pool in (valid, {name: valid[name].to(torch.uint8) for name in ("k_cache", "v_cache")}):
        with pytest.raises(ValueError, match="native kernel argument"):
            kernels.decode_attention(**{**valid, **pool}, kv_scales=scales)
