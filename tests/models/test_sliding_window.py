"""Sliding-window attention against transformers: a Mistral-style window on every layer (the native decode kernel
and decode stack read only the window's slots), Gemma 2/3's windows on some layers, across chunked prefill and
prefix-cache hits (chunks whose context starts past the window), and the attention paths against a dense
reference with the window written out as a mask."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.layers.attention import AttentionMetadata, LayerKVCache, PrefillSpan, paged_attention
from tests.models.test_correctness import TOLERANCE, check_against_transformers, prompt_logprob_error

WINDOW = 16  # tiny_models' Gemma window; the Mistral copies below take the same
NATIVE_SHAPE = dict(hidden_size=128, intermediate_size=256)  # head_dim 32: rotary fused, so the decode stack runs


def _mistral(tiny_model_dir, tmp_path: Path, dtype: str, **overrides) -> str:
    """The tiny llama as a Mistral with a WINDOW-token window on every layer."""
    model = tmp_path / f"mistral-{dtype}"
    shutil.copytree(tiny_model_dir("llama", dtype, **overrides), model)
    config = json.loads((model / "config.json").read_text())
    config.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=WINDOW)
    (model / "config.json").write_text(json.dumps(config))
    return str(model)


def _long_prompts() -> list[list[int]]:
    """Prompts from within the window to 5x it, so prefill, decode and their chunks cross it."""
    return [[(37 * i + 11 * n) % 500 + 3 for i in range(n)] for n in (5, WINDOW - 1, WINDOW + 3, 47, 80)]


def _check(model_dir: str, dtype: str, **engine_kwargs) -> LLM:
    return check_against_transformers(model_dir, dtype, _long_prompts(), **engine_kwargs)


def test_a_window_on_every_layer_runs_the_native_decode_stack(kernels, tiny_model_dir, tmp_path):
    llm = _check(_mistral(tiny_model_dir, tmp_path, "bfloat16", **NATIVE_SHAPE), "bfloat16")
    model = llm.engine.runner.model.model
    assert model.stack is not None and model.stack.views == [(WINDOW, "global")]  # decodes past the window ran in it
    assert {layer.self_attn.window for layer in model.layers} == {WINDOW}


@pytest.mark.parametrize("sdpa", ["0", "1"])
@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_prefill_attention_on_either_path_with_chunks_and_windows(kernels, tiny_model_dir, monkeypatch, arch, sdpa):
    """PAGEDSERVE_CPU_SDPA_PREFILL (probe.sdpa_prefill: torch's SDPA where it measured faster than the native kernel
    for prefill chunks, from SDPA_PREFILL_MIN_PAIRS on: here from 1) either way, bf16 against transformers: fresh
    prompts and 16-token chunks that read their earlier context from the pool (Gemma 3: past its window too)."""
    from pagedserve.layers import attention

    monkeypatch.setenv("PAGEDSERVE_CPU_SDPA_PREFILL", sdpa)
    monkeypatch.setattr(attention, "SDPA_PREFILL_MIN_PAIRS", 1)
    native_calls = []
    native = attention._native_prefill_attention
    monkeypatch.setattr(attention, "_native_prefill_attention", lambda *a: native_calls.append(1) or native(*a))
    model_dir = tiny_model_dir(arch, "bfloat16", **NATIVE_SHAPE, **({"head_dim": 32, "weight_std": 0.1}
                                                                     if arch == "gemma3" else {}))
    for chunked in ({}, dict(max_num_batched_tokens=WINDOW, enable_chunked_prefill=True)):
        llm = _check(model_dir, "bfloat16", **chunked)
        assert {layer.self_attn.sdpa_prefill for layer in llm.engine.runner.model.model.layers} == {sdpa == "1"}
    assert (len(native_calls) > 0) == (sdpa == "0")


@pytest.mark.parametrize("arch", ["mistral", "gemma2", "gemma3"])
def test_chunks_that_start_past_the_window(tiny_model_dir, tmp_path, arch):
    """16-token chunks: every chunk after the second attends over a context longer than the window."""
    model_dir = _mistral(tiny_model_dir, tmp_path, "float32") if arch == "mistral" else tiny_model_dir(arch)
    _check(model_dir, "float32", max_num_batched_tokens=WINDOW, enable_chunked_prefill=True)


def test_a_prefix_cache_hit_past_the_window(tiny_model_dir):
    """The second request reuses 64 cached tokens: its prefill starts at position 64, 4 windows in."""
    model_dir = tiny_model_dir("gemma3")
    llm = LLM(model_dir, dtype="float32", max_model_len=256, enable_prefix_caching=True, block_size=16)
    shared = _long_prompts()[-1][:64]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)  # (prompt logprobs skip it)
    llm.generate([{"prompt_token_ids": shared + [7]}], params)
    hit = llm.generate([{"prompt_token_ids": shared + [9, 10, 11]}], params)[0]
    assert hit.num_cached_tokens == 64
    cold = LLM(model_dir, dtype="float32", max_model_len=256, enable_prefix_caching=False)
    fresh = cold.generate([{"prompt_token_ids": shared + [9, 10, 11]}], params)[0]
    assert hit.outputs[0].token_ids == fresh.outputs[0].token_ids
    for ours, theirs in zip(hit.outputs[0].logprobs, fresh.outputs[0].logprobs):
        assert all(abs(ours[t].logprob - theirs[t].logprob) < TOLERANCE["float32"] for t in theirs)


# --- the attention paths against a dense reference --------------------------------------------------------------


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, window: int | None,
               softcap: float | None, scale: float) -> torch.Tensor:
    """Each query at `positions` over keys 0 .. its position (and within the window), written out densely."""
    groups = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("thd,shd->hts", q, kk) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    keys = torch.arange(k.shape[0])
    seen = keys[None, :] <= positions[:, None]
    if window is not None:
        seen &= keys[None, :] > positions[:, None] - window
    scores = scores.masked_fill(~seen, float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), vv)


CASES = [(None, None), (1, None), (5, None), (64, None), (None, 1.5), (5, 1.5)]  # (window, softcap)


@pytest.mark.parametrize("window, softcap", CASES)
def test_torch_path_rows_see_exactly_their_window(window, softcap):
    _check_attention(window, softcap, None)


@pytest.mark.parametrize("window, softcap", CASES)
def test_native_rows_see_exactly_their_window(kernels, window, softcap):
    """The native decode kernel reads the window's slots (AttentionMetadata.within); a prefill chunk whose
    context outruns the window takes the torch path; softcapped scores (Gemma 2) on the native decode kernel (their
    prefill chunks on torch ops)."""
    _check_attention(window, softcap, kernels)


@pytest.mark.parametrize("window", [1, 5, 64])
def test_batch_invariant_rows_past_the_window_on_the_native_kernel(kernels, monkeypatch, window):
    """In batch-invariant mode a prefill chunk whose context outruns the window takes the native decode kernel, each
    row over its own window (layers/attention._native_windowed_prefill), and must see exactly that window."""
    from pagedserve.layers import attention

    calls = []
    windowed = attention._native_windowed_prefill
    monkeypatch.setattr(attention, "_native_windowed_prefill", lambda *a: calls.append(1) or windowed(*a))
    monkeypatch.setattr(kernels, "batch_invariant", True)
    _check_attention(window, None, kernels)
    assert len(calls) == (window < 37)  # the chunk's context: 37 positions


def _check_attention(window: int | None, softcap: float | None, kernels) -> None:
    """Two decodes (contexts 40 and 7) and a prefill chunk of 12 whose context starts at 25, on one pool with its
    slots shuffled."""
    torch.manual_seed(0)
    heads, kv_heads, dim, slots = 4, 2, 32, 128
    cache = LayerKVCache(torch.zeros(slots, kv_heads, dim), torch.zeros(slots, kv_heads, dim))
    place = torch.randperm(slots)
    sequences = {"a": 40, "b": 7, "c": 37}  # c: 25 cached positions + a 12-token chunk
    keys = {name: (torch.randn(n, kv_heads, dim), torch.randn(n, kv_heads, dim)) for name, n in sequences.items()}
    where, first = {}, 0
    for name, n in sequences.items():
        where[name], first = place[first:first + n], first + n
    for name, (k, v) in keys.items():  # the step's own new tokens are written by paged_attention below
        new = 1 if name != "c" else 12
        cache.write(k[:-new], v[:-new], where[name][:-new])
    q = torch.randn(2 + 12, heads, dim)
    k_new = torch.cat([keys["a"][0][-1:], keys["b"][0][-1:], keys["c"][0][-12:]])
    v_new = torch.cat([keys["a"][1][-1:], keys["b"][1][-1:], keys["c"][1][-12:]])
    width = 40
    decode_slots = torch.zeros(2, width, dtype=torch.int64)
    decode_slots[0], decode_slots[1, :7] = where["a"], where["b"]
    meta = AttentionMetadata(torch.cat([where["a"][-1:], where["b"][-1:], where["c"][-12:]]), num_decodes=2,
                             decode_kv_slots=decode_slots, decode_context_lens=torch.tensor([40, 7]),
                             prefills=[PrefillSpan(2, 14, 25, where["c"])])
    out = paged_attention(q, k_new, v_new, cache, meta, 0.3, kernels, window=window, softcap=softcap)
    for rows, name, positions in ((slice(0, 1), "a", [39]), (slice(1, 2), "b", [6]),
                                  (slice(2, 14), "c", list(range(25, 37)))):
        expected = _reference(q[rows], *keys[name], torch.tensor(positions), window, softcap, 0.3)
        torch.testing.assert_close(out[rows], expected, atol=2e-5, rtol=1e-4)


def test_disable_sliding_window_caps_the_context_as_vllm(tiny_model_dir, tmp_path):
    """vLLM's --disable-sliding-window: the context at most the (smallest) window, a longer --max-model-len refused
    naming both ways out; without the flag the whole context is served."""
    from pagedserve.engine.arg_utils import EngineArgs
    from pagedserve.engine.setup import create_engine_config

    model_dir = tiny_model_dir("gemma2")  # windows of 16 on every other layer, 512 positions
    capped = create_engine_config(EngineArgs(model=model_dir, dtype="float32", disable_sliding_window=True))
    assert capped.model.max_model_len == WINDOW
    assert create_engine_config(EngineArgs(model=model_dir, dtype="float32")).model.max_model_len == 512
    with pytest.raises(ValueError, match="--max-model-len 16 or less, or leave out --disable-sliding-window"):
        create_engine_config(EngineArgs(model=model_dir, dtype="float32", disable_sliding_window=True,
                                        max_model_len=64))
    llama = create_engine_config(EngineArgs(model=tiny_model_dir("llama"), dtype="float32",
                                            disable_sliding_window=True))
    assert llama.model.max_model_len == 512  # no window: nothing to cap


# Configs as they are on the hub, without layer_types (transformers derives it for Qwen2/Qwen3): which layers
# transformers windows must be which pagedserve windows, whether the config is read by transformers or as plain values.
HUB_CONFIGS = {
    "qwen2.5 (window field, off)": dict(model_type="qwen2", sliding_window=16, use_sliding_window=False,
                                        max_window_layers=21),
    "qwen2 on from layer 1": dict(model_type="qwen2", sliding_window=16, use_sliding_window=True, max_window_layers=1),
    "qwen3 on, default first layer": dict(model_type="qwen3", sliding_window=16, use_sliding_window=True),
    "llama with a stray window": dict(model_type="llama", sliding_window=16),
    "mistral v0.1": dict(model_type="mistral", sliding_window=16),
    "phi3-mini-4k": dict(model_type="phi3", sliding_window=16),
    # SmolLM3 masks by layer_types whatever use_sliding_window says (it only feeds flash attention's window)
    "smollm3, window off, layer_types sliding": dict(model_type="smollm3", sliding_window=16, use_sliding_window=False,
                                                     layer_types=["sliding_attention"] * 3),
    "smollm3, window off": dict(model_type="smollm3", sliding_window=16, use_sliding_window=False),
}


@pytest.mark.parametrize("case", list(HUB_CONFIGS))
def test_the_windowed_layers_are_transformers(case):
    from transformers import AutoConfig

    from pagedserve.engine.setup import PlainDecoderConfig
    from pagedserve.models.validate import layer_windows

    values = {**HUB_CONFIGS[case], "num_hidden_layers": 3}
    config = AutoConfig.for_model(**values)
    types = getattr(config, "layer_types", None)
    expected = [16 if kind == "sliding_attention" else None for kind in types] if types else \
        [16 if values["model_type"] in ("mistral", "phi3") else None] * 3  # their classes window every layer
    assert layer_windows(config) == expected
    assert layer_windows(PlainDecoderConfig(values)) == expected


@pytest.mark.parametrize("arch, fields", [("qwen2", dict(use_sliding_window=False, max_window_layers=21)),
                                          ("qwen2", dict(use_sliding_window=True, max_window_layers=1)),
                                          ("llama", {}),
                                          ("smollm3", dict(use_sliding_window=False,
                                                           layer_types=["sliding_attention", "full_attention"]))])
def test_a_config_json_without_layer_types_against_transformers(tiny_model_dir, tmp_path, arch, fields):
    """The served config.json as the hub has it (no layer_types but where given), read without transformers where it
    can be (PlainDecoderConfig): prompt logprobs over 60 positions equal transformers' (a window on the wrong layers
    moves them by whole units)."""
    from transformers import AutoModelForCausalLM

    model = tmp_path / arch
    shutil.copytree(tiny_model_dir(arch), model)
    config = json.loads((model / "config.json").read_text())
    config.pop("layer_types", None)
    config.update(sliding_window=WINDOW, **fields)
    (model / "config.json").write_text(json.dumps(config))
    prompt = _long_prompts()[-1][:60]
    llm = LLM(str(model), dtype="float32", max_model_len=128)
    ours = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    reference_model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    assert prompt_logprob_error(ours.prompt_logprobs, reference_model, prompt) < TOLERANCE["float32"]
