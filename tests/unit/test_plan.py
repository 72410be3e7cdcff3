"""The memory plan, checked against numbers worked out by hand from the formulas in plan.py's docstring."""

from __future__ import annotations

import json
import re
import struct
from dataclasses import replace
from pathlib import Path

import pytest

from pagedserve.memory.plan import (
    GIB,
    MIB,
    InsufficientMemoryError,
    ModelShape,
    PlanRequest,
    format_plan_table,
    make_plan,
)
from pagedserve.memory import plan as plan_module
from pagedserve.memory.checkpoint import weight_bytes_from_safetensors_dir
from pagedserve.memory.probe import AvailableMemory

# A tiny decoder: 2 layers, hidden 64, intermediate 128, 4 heads of 16, 2 KV heads, vocab 100.
# Linear params per layer: qkv 64 x (4 + 2 + 2) x 16 = 8192, o 64 x 64 = 4096, mlp 3 x 64 x 128 = 24576
# -> 36864; x 2 layers = 73728. Embedding + LM head 2 x 100 x 64 = 12800. fp32: (73728 + 12800) x 4 = 346112.
TINY = ModelShape(
    num_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_kv_heads=2,
    head_dim=16, vocab_size=100, weight_bytes=346112,
)


def request(budget_bytes: int, **changes) -> PlanRequest:
    """fp32, max_model_len 64, 4 seqs, 32 batched tokens, blocks of 16, 1 MiB overhead, fraction 0.5, and
    attention that materialises its scores (so that term is checked too)."""
    base = PlanRequest(
        dtype_bytes=4, kv_dtype_bytes=4, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
        block_size=16, available=AvailableMemory(2 * budget_bytes, "MemAvailable", "test"),
        memory_fraction=0.5, runtime_overhead_bytes=MIB, materializes_attention_scores=True,
    )
    return replace(base, **changes)


def test_tiny_model_numbers_by_hand() -> None:
    plan = make_plan(TINY, request(budget_bytes=5 * MIB))
    assert TINY.num_linear_params == 73728
    assert plan.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4 == 512  # K and V x layers x kv heads x head_dim x 4 B
    assert plan.block_bytes == 16 * 512 == 8192
    act = plan.activations
    assert act.hidden == 2 * 32 * 64 * 4 == 16384
    assert act.attention == 32 * (2 * 4 + 2 * 2) * 16 * 4 == 24576
    assert act.mlp == 3 * 32 * 128 * 4 == 49152
    # One gather of at most max(M, T) = 64 positions, whatever the number of sequences.
    assert act.gathered_kv == 2 * max(64, 32) * 2 * 16 * 4 == 16384
    # One SDPA call covers min(2^21, min(T, M) x M) = 2048 query x key pairs: a bool mask, its fp32 copy
    # and (materialised here, as softcapped attention does) 4 heads of scores: three copies in the model dtype
    # (scores, capped, masked) and the float32 softmax.
    assert act.scores == 2048 * (1 + 4) + 4 * 2048 * (4 + 3 * 4) == 141312
    assert act.decode_slots == 16 * min(4, 32) * 64 == 4096
    assert act.logits == 2 * min(4, 32) * 100 * 4 == 3200
    assert plan.activation_bytes == 16384 + 24576 + 49152 + 16384 + 141312 + 4096 + 3200 == 255104
    # Left for KV: 5 MiB - weights - activations - overhead = 5242880 - 346112 - 255104 - 1048576 = 3593088,
    # 438 blocks; but 4 seqs x 64 tokens can use only 4 x 4 = 16 blocks: the workload decides.
    assert (plan.kv_rule, plan.num_kv_blocks, plan.kv_sizing) == ("utilization", 16, "workload")
    assert plan.kv_pool_bytes == 16 * 8192 == 131072
    assert plan.total_bytes == 346112 + 255104 + 1048576 + 131072 == 1780864
    assert plan.budget_bytes == 5 * MIB
    assert plan.fits and plan.shortfall_bytes == 0 and plan.suggestions == []
    assert plan.max_concurrency == 16 * 16 / 64 == 4.0


def test_tiled_attention_has_no_scores_term() -> None:
    plan = make_plan(TINY, request(budget_bytes=5 * MIB, materializes_attention_scores=False))
    assert plan.activations.scores == 2048 * (1 + 4)  # the mask and its copy only
    assert plan.activation_bytes == 255104 - 4 * 2048 * (4 + 3 * 4)


def test_an_embedding_model_has_no_logits_term() -> None:
    """It pools hidden states: no logits or sampler (the term was 60 MiB for MiniLM at 256 sequences)."""
    plan = make_plan(TINY, request(budget_bytes=5 * MIB, computes_logits=False))
    assert plan.activations.logits == 0 and plan.activation_bytes == 255104 - 3200


def test_activations_do_not_grow_with_the_batch_times_max_model_len() -> None:
    # 1000 sequences of up to 64 tokens: only the decode slot table (16 B per row and position) and the
    # logits grow with the rows in a step (min(1000, 32) = 32); the K/V gather and the scores do not.
    few, many = (make_plan(TINY, request(budget_bytes=5 * MIB, max_num_seqs=n)).activations for n in (4, 1000))
    assert (many.gathered_kv, many.scores) == (few.gathered_kv, few.scores)
    assert many.decode_slots == 16 * 32 * 64 and many.logits == 2 * 32 * 100 * 4
    # An 8-bit cache is gathered as fp8 bytes, widened and scaled: 1 + 2 x 4 B per element.
    fp8 = make_plan(TINY, request(budget_bytes=5 * MIB, kv_dtype_bytes=1, kv_scale_bytes=4)).activations
    assert fp8.gathered_kv == 2 * 64 * 2 * 16 * 9


def test_automatic_kv_pool_fills_what_is_left() -> None:
    plan = make_plan(TINY, request(budget_bytes=5 * MIB, max_num_seqs=1000))
    # Rows are capped by the batched tokens, min(1000, 32) = 32: logits 2 x 32 x 100 x 4 = 25600,
    # decode slots 16 x 32 x 64 = 32768.
    assert plan.activation_bytes == 16384 + 24576 + 49152 + 16384 + 141312 + 32768 + 25600 == 306176
    # left: 5242880 - 346112 - 306176 - 1048576 = 3542016 -> 3542016 // 8192 = 432 blocks (cap 4000).
    assert (plan.kv_rule, plan.num_kv_blocks, plan.kv_sizing) == ("utilization", 432, "budget")
    assert plan.total_bytes == 346112 + 306176 + 1048576 + 432 * 8192 == 5239808
    assert plan.fits


def test_kv_pool_never_below_one_max_model_len_sequence() -> None:
    plan = make_plan(TINY, request(budget_bytes=MIB))  # less than weights + overhead: nothing left for KV
    assert plan.num_kv_blocks == 64 // 16 == 4
    assert plan.kv_sizing == "floor"
    assert plan.total_bytes == 346112 + 255104 + 1048576 + 4 * 8192 == 1682560
    assert not plan.fits
    assert plan.shortfall_bytes == 1682560 - MIB == 633984


def test_does_not_fit_with_shortfall_and_suggestions(monkeypatch) -> None:
    # The byte arithmetic of each suggestion, without the margin they leave (test_suggestions_leave_a_margin).
    monkeypatch.setattr(plan_module, "SUGGESTION_MARGIN_FRACTION", 0.0)
    # Needs 1682560 (see above); give it 1680804: short by 1756.
    plan = make_plan(TINY, request(budget_bytes=1680804))
    assert not plan.fits
    assert plan.shortfall_bytes == 1756
    found = {s.flag: (s.value, s.needs_bytes) for s in plan.suggestions}
    # max_model_len 48: gathered kv 2x48x2x16x4 = 12288, 32x48 = 1536 pairs: scores 1536x5 + 4x1536x16 =
    # 105984, decode slots 16x4x48 = 3072 -> activations 16384 + 24576 + 49152 + 12288 + 105984 + 3072 + 3200 =
    # 214656; fixed 346112 + 214656 + 1048576 = 1609344, less the runtime overhead's rotary tables for 16
    # positions (2 x 16 x 16 x 4 = 2048) and a block-table column (4 x 8 = 32): 1607264; left 73540 -> 8 blocks
    # (one sequence needs 3).
    assert found["--max-model-len"] == ("48", 1609344 - 2048 - 32 + 8 * 8192)
    # 16 batched tokens: 8192 + 12288 + 24576 + 16384 (max(64, 16) positions) + 1024 pairs x 5 + 4x1024x16
    # + 4096 + 3200 = 139392; fixed 1534080; left 146724 -> 17 blocks, capped at the 16 the workload uses.
    assert found["--max-num-batched-tokens"] == ("16", 1534080 + 16 * 8192)
    # 3 seqs: decode slots 3072, logits 2400 -> 253280; fixed 1647968, less a block-table row (4 x 8 = 32);
    # left 32868 -> 4 blocks, one sequence. (Fewer sequences save only their slot-table rows and logits.)
    assert found["--max-num-seqs"] == ("3", 1647968 - 32 + 4 * 8192)
    # bf16 halves weights, KV and the dtype-sized activations (the mask's copy, three of the scores' four copies;
    # the softmax and logits stay fp32): 173056 + (8192 + 12288 + 24576 + 8192 + 2048 x 3 + 4 x 2048 x (4 + 3 x 2)
    # + 4096 + 3200) + 1048576 = 1370240, KV capped at 16 x 4096.
    assert found["--dtype"] == ("bfloat16", 1370240 + 16 * 4096)
    # int8 linear layers: 346112 - 73728 x 4 + 73728 + 2 x (128 + 64 + 256 + 64) scales x 4 = 129024.
    assert found["--quantization"] == ("int8", 129024 + 255104 + 1048576 + 16 * 8192)
    # fp8 KV with a 4-byte (model dtype) scale per token, head and K/V: 2 x 2 x 2 x (16 + 4) = 160 B/token,
    # blocks of 2560; its gather costs 9 B per element: 2 x 64 x 2 x 16 x 9 = 36864 -> activations 275584,
    # fixed 1670272, left 10532 -> 4 blocks, one sequence.
    assert found["--kv-cache-dtype"] == ("fp8", 1670272 + 4 * 2560)
    # A fraction of 0.5 leaves 1680804 of 3361608 bytes; 0.51 gives 1714420, enough (the shortfall is 1756).
    assert found["--gpu-memory-utilization"][0] == "0.51"
    assert make_plan(TINY, replace(request(budget_bytes=1680804), memory_fraction=0.51)).fits
    # Only options the engine supports are suggested.
    plain = make_plan(TINY, request(budget_bytes=1680804), quantizations=(), kv_cache_dtypes=())
    assert {s.flag for s in plain.suggestions} == set(found) - {"--quantization", "--kv-cache-dtype"}
    table = format_plan_table(plan)
    assert "DOES NOT FIT" in table and "short by 2 KiB" in table  # was "short by 0.00 GiB"
    assert "8-bit K/V" not in table
    assert "B/token (8-bit K/V and their scales)" in format_plan_table(make_plan(TINY, replace(
        request(budget_bytes=1680804), kv_dtype_bytes=1, kv_scale_bytes=4)))
    assert re.search(r"--max-model-len 48 +needs", table)


def with_margin(asked: PlanRequest) -> PlanRequest:
    """The request with the 2 % less memory available that a suggestion still fits in."""
    return replace(asked, available=replace(asked.available, num_bytes=int(asked.available.num_bytes * 0.98)))


def test_suggestions_leave_a_margin() -> None:
    """A suggested --max-model-len / --max-num-seqs / --max-num-batched-tokens still fits in 2 % less memory: one
    that fit to the last block (QA-O: "needs 0.87 GiB" of 0.87 available) was refused by serve a moment later.
    --max-num-seqs 3 fits only without the margin (test_does_not_fit_with_shortfall_and_suggestions)."""
    asked = request(budget_bytes=1680804)
    plan = make_plan(TINY, asked)
    flags = ("--max-model-len", "--max-num-seqs", "--max-num-batched-tokens")
    found = {s.flag: int(s.value) for s in plan.suggestions if s.flag in flags}
    assert set(found) == {"--max-model-len", "--max-num-batched-tokens"}
    for flag, value in found.items():
        assert make_plan(TINY, with_margin(replace(asked, **{flag[2:].replace("-", "_"): value}))).fits, flag


def test_explicit_kv_size_too_small_for_one_sequence() -> None:
    # 20000 B hold 2 blocks = 32 tokens, fewer than one 64-token sequence.
    plan = make_plan(TINY, request(budget_bytes=5 * MIB, kv_cache_bytes=20000))
    assert (plan.kv_rule, plan.num_kv_blocks, plan.kv_sizing) == ("explicit", 2, "explicit")
    assert not plan.fits and plan.shortfall_bytes == 0
    assert "fewer than one max_model_len=64 sequence" in plan.summary()
    found = {s.flag: s.value for s in plan.suggestions}
    assert found["--max-model-len"] == "32"  # 2 blocks hold one 32-token sequence; 48 needs 3
    # One 64-token sequence: 4 blocks of 8192 (the largest pool that fits, 450 blocks, was suggested before: a
    # 64 MiB cache too small for 8192 tokens was told to take 17.8 GiB).
    assert found["--kv-cache-memory"] == str(4 * 8192)
    # vLLM's variable for that size, rounded up: 0.00 (what the note said) means "the default size" there.
    note = next(s.note for s in plan.suggestions if s.flag == "--kv-cache-memory")
    assert note == "32 KiB; VLLM_CPU_KVCACHE_SPACE=0.01", note


def test_summary_in_gib_and_error_carries_plan() -> None:
    shape = replace(TINY, weight_bytes=int(10.5 * GIB))
    plan = make_plan(shape, request(budget_bytes=int(9.3 * GIB), runtime_overhead_bytes=int(0.6 * GIB)))
    assert re.fullmatch(r"needs 11\.10 GiB, 9\.30 GiB available, short by 1\.80 GiB", plan.summary())
    error = InsufficientMemoryError(plan)
    assert error.plan is plan and str(error).startswith(plan.summary())
    fixes = ", ".join(f"{s.flag} {s.value}" for s in plan.suggestions)
    assert plan.suggestions and str(error).endswith(f"; any one of these would fit: {fixes}")
    data = json.loads(json.dumps(plan.to_dict()))
    assert data["fits"] is False
    assert data["shortfall_bytes"] == plan.shortfall_bytes
    assert data["activations"]["total"] == plan.activation_bytes


def test_bad_request_names_the_field() -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        request(budget_bytes=MIB, max_model_len=0)
    with pytest.raises(ValueError, match="memory_fraction"):
        request(budget_bytes=MIB, memory_fraction=1.5)
    with pytest.raises(ValueError, match="kv_share"):
        request(budget_bytes=MIB, kv_share=0.0)


def test_shape_from_qwen2_config_matches_known_parameter_count() -> None:
    config = {
        "num_hidden_layers": 24, "hidden_size": 896, "intermediate_size": 4864, "num_attention_heads": 14,
        "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768,
    }
    shape = ModelShape.from_hf_config(config, weight_bytes=0)
    assert shape.head_dim == 896 // 14 == 64
    # Qwen2.5-0.5B has 494,032,768 parameters: tied embedding 151936 x 896 = 136,134,656, q/k/v biases
    # 24 x 1152 = 27,648, norms 24 x 2 x 896 + 896 = 43,904, the rest are the linear layers.
    assert shape.num_linear_params == 494032768 - 136134656 - 27648 - 43904


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int], int]]) -> None:
    header, offset = {}, 0
    for name, (dtype, shape, size) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))


def test_weight_bytes_from_safetensors_headers(tmp_path: Path) -> None:
    write_safetensors(tmp_path / "model-00001-of-00002.safetensors", {"a": ("F32", [2, 3], 24)})
    write_safetensors(tmp_path / "model-00002-of-00002.safetensors",
                      {"b": ("BF16", [4], 8), "idx": ("I64", [2], 16)})
    # Floats are counted in the serving dtype, integers as stored: bf16 -> 6 x 2 + 4 x 2 + 2 x 8 = 36.
    assert weight_bytes_from_safetensors_dir(tmp_path, dtype_bytes=2) == 36
    assert weight_bytes_from_safetensors_dir(tmp_path, dtype_bytes=4) == 6 * 4 + 4 * 4 + 16
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors"}})
    )
    assert weight_bytes_from_safetensors_dir(tmp_path, dtype_bytes=2) == 12  # only the indexed shards


def test_weight_bytes_rejects_a_truncated_header(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 10_000) + b"{}")
    with pytest.raises(ValueError, match="model.safetensors is truncated: its header says 10,008 bytes"):
        weight_bytes_from_safetensors_dir(tmp_path, dtype_bytes=2)


# ----------------------------------------------------------------------------------------------- engine terms


def test_kv_bytes_per_token_and_runtime_overhead_by_hand() -> None:
    from pagedserve.memory.sizes import (
        CPU_RUNTIME_BASE_BYTES,
        CUDA_RUNTIME_OVERHEAD_BYTES,
        TOKENIZER_BYTES_PER_TOKEN,
        TRANSFORMERS_RUNTIME_BYTES,
        GRAMMAR_CACHE_BYTES,
        STRUCTURED_OUTPUTS_BASE_BYTES,
        STRUCTURED_OUTPUTS_BYTES_PER_TOKEN,
        kv_bytes_per_token,
        runtime_overhead_bytes,
    )

    assert kv_bytes_per_token(TINY, kv_dtype_bytes=2) == 2 * 2 * 2 * 16 * 2 == 256
    # rotary: cos + sin, 64 positions x head_dim 16 x 4 B = 8192; block table 4 seqs x 4 blocks x 8 B = 128.
    cpu = runtime_overhead_bytes(TINY, max_model_len=64, max_num_seqs=4, block_size=16)
    structured = (STRUCTURED_OUTPUTS_BASE_BYTES + GRAMMAR_CACHE_BYTES  # xgrammar on first use, the grammars kept
                  + STRUCTURED_OUTPUTS_BYTES_PER_TOKEN * 100)
    assert cpu == CPU_RUNTIME_BASE_BYTES + TOKENIZER_BYTES_PER_TOKEN * 100 + structured + 8192 + 128
    assert cpu - runtime_overhead_bytes(TINY, 64, 4, 16, structured_outputs=False) == structured  # embedders
    # 65 positions need 5 blocks per sequence.
    assert runtime_overhead_bytes(TINY, 65, 4, 16) - cpu == 2 * 16 * 4 + 4 * 8
    # On a GPU the host-side tokenizer and block table do not count against the device.
    assert runtime_overhead_bytes(TINY, 64, 4, 16, on_cpu=False) == CUDA_RUNTIME_OVERHEAD_BYTES + 8192
    # A tokenizer or config read through transformers costs its import and its objects.
    assert runtime_overhead_bytes(TINY, 64, 4, 16, uses_transformers=True) - cpu == TRANSFORMERS_RUNTIME_BYTES


def test_block_bookkeeping_is_paid_per_block_and_is_resident() -> None:
    # 1000 seqs (so the pool is not capped): decode slots 16 x min(1000, 32) x 64 = 32768, logits 2 x 32 x 100 x 4
    # = 25600, no scores, only the mask -> activations 16384 + 24576 + 49152 + 16384 + 10240 + 32768 + 25600 =
    # 175104. Left 5242880 - 346112 - 175104 - 1048576 = 3673088; each block costs 8192 + 1000 -> 399 blocks.
    base = request(budget_bytes=5 * MIB, materializes_attention_scores=False, max_num_seqs=1000,
                   host_bytes_per_block=1000)
    plan = make_plan(TINY, base)
    assert plan.activation_bytes == 175104
    assert (plan.num_kv_blocks, plan.kv_sizing) == (399, "budget")
    assert plan.kv_pool_bytes == 399 * 8192 and plan.kv_bookkeeping_bytes == 399 * 1000
    assert plan.total_bytes == 346112 + 175104 + 1048576 + 399 * 9192 <= plan.budget_bytes
    # Steady: what stays resident when idle (the lazily allocated pool and the activations do not).
    assert plan.steady_bytes == 346112 + 1048576 + 399 * 1000
    assert plan.to_dict()["steady_bytes"] == plan.steady_bytes
    assert "the KV cache takes what is left, 99.75 x 64-token sequences" in plan.summary()
    table = format_plan_table(plan)
    assert re.search(r"KV bookkeeping +0\.00 GiB +1000 B of block-pool objects per block", table)
    assert re.search(r"steady +0\.00 GiB +resident once started", table)
    # An explicit pool is counted in K/V bytes; its bookkeeping comes on top.
    explicit = make_plan(TINY, replace(base, kv_cache_bytes=10 * 8192))
    assert explicit.num_kv_blocks == 10 and explicit.kv_bookkeeping_bytes == 10 * 1000


def test_weight_bytes_skip_tensors_the_loader_drops(tmp_path: Path) -> None:
    write_safetensors(tmp_path / "model.safetensors",
                      {"embed": ("F32", [4, 2], 32), "lm_head.weight": ("F32", [4, 2], 32)})
    assert weight_bytes_from_safetensors_dir(tmp_path, dtype_bytes=2) == 32
    assert weight_bytes_from_safetensors_dir(tmp_path, 2, skip=lambda name: name == "lm_head.weight") == 16


def test_checkpoint_info_of_a_model_dir_counts_a_tied_head_once(tmp_path: Path) -> None:
    from pagedserve.memory.checkpoint import dtype_bytes, read_checkpoint_info

    write_safetensors(tmp_path / "model.safetensors", {
        "model.embed_tokens.weight": ("BF16", [10, 4], 80), "lm_head.weight": ("BF16", [10, 4], 80),
        "model.layers.0.self_attn.rotary_emb.inv_freq": ("F32", [2], 8)})
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": True, "vocab_size": 10}))
    info = read_checkpoint_info(tmp_path)
    assert not info.is_gguf and info.config["vocab_size"] == 10
    assert info.weight_bytes(dtype_bytes("float32")) == 40 * 4  # the embedding only
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": False}))
    assert read_checkpoint_info(tmp_path).weight_bytes(dtype_bytes("bfloat16")) == 2 * 40 * 2
    with pytest.raises(ValueError, match="unknown dtype"):
        dtype_bytes("int4")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read the model config"):
        read_checkpoint_info(tmp_path)


def test_prepared_weights_by_layout_by_hand() -> None:
    from pagedserve.memory.sizes import prepared_weight_bytes

    # TINY: 73728 linear weights in 2 x (128 qkv + 64 o + 256 gate/up + 64 down) = 1024 output channels;
    # vocab 100 x hidden 64 = 6400 LM-head weights.
    assert TINY.num_linear_output_channels == 1024
    assert prepared_weight_bytes(TINY, 4, False, "shared", tied_embeddings=True) == 346112  # shares the tensors
    assert prepared_weight_bytes(TINY, 4, False, "none", tied_embeddings=True) == 346112  # embedders
    assert prepared_weight_bytes(TINY, 4, False, "copy", tied_embeddings=True) == 346112 + 6400 * 4
    # int8: linears 346112 - 73728 x 3 + 1024 x 4 = 129024; the head becomes 6400 + 100 x 4 scales = 6800.
    assert prepared_weight_bytes(TINY, 4, True, "int8", tied_embeddings=False) == 129024 - 6400 * 4 + 6800
    assert prepared_weight_bytes(TINY, 4, True, "int8", tied_embeddings=True) == 129024 + 6800
    with pytest.raises(ValueError, match="logits_head"):
        prepared_weight_bytes(TINY, 4, False, "packed", tied_embeddings=True)


def test_logits_head_layout_by_kernel() -> None:
    from pagedserve.memory.weight_format import WeightFormat

    onednn, native_bf16 = WeightFormat("packed", False), WeightFormat("packed", True)
    assert onednn.logits_head(tied_embeddings=True) == "copy"  # oneDNN's blocks beside the lookup rows
    assert onednn.logits_head(tied_embeddings=False) == "shared"  # the lm_head repacked in place
    assert native_bf16.logits_head(tied_embeddings=True) == "shared"  # lookups read the packed rows
    assert onednn.logits_head(tied_embeddings=True, computes_logits=False) == "none"
    assert WeightFormat("int8", False).logits_head(True) == "int8" and WeightFormat("int8", True).int8_linears
    assert WeightFormat("plain", False).logits_head(True) == "shared" and not onednn.int8_linears


# ----------------------------------------------------------------------------------------------- CPU default


# SmolLM2-135M's shape in bf16: KV 2 x 30 layers x 3 heads x 64 x 2 B = 23040 B/token; a block of 16 tokens
# is 368640 B + 288 B of bookkeeping = 368928 B. Its workload, 256 seqs x 8192 tokens, would be 131072 blocks
# (45 GiB).
SMOLLM2 = ModelShape(num_layers=30, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                     num_kv_heads=3, head_dim=64, vocab_size=49152, weight_bytes=190 * MIB)
PER_BLOCK = 16 * 23040 + 288


def host(tmp_path: Path, mem_available: int, cgroup_limit: int | None = None,
         cgroup_used: int = 0) -> AvailableMemory:
    """What probe.available_memory reads from a fake /proc/meminfo and cgroup v2 tree."""
    from pagedserve.memory.probe import available_memory

    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: {(mem_available + 2 * GIB) // 1024} kB\nMemFree: {mem_available // 1024} kB\n"
                       f"MemAvailable: {mem_available // 1024} kB\n")
    root = tmp_path / "cgroup"
    own = root / "app.scope"
    own.mkdir(parents=True)
    (root / "cgroup.controllers").write_text("memory\n")
    (own / "memory.max").write_text(f"{cgroup_limit}\n" if cgroup_limit else "max\n")
    (own / "memory.current").write_text(f"{cgroup_used}\n")
    (tmp_path / "self_cgroup").write_text("0::/app.scope\n")
    return available_memory(meminfo, root, tmp_path / "self_cgroup")


def cpu_default(available: AvailableMemory, **changes) -> PlanRequest:
    """Default serve settings on a CPU: bf16, 8192 tokens, 256 seqs, 2048 batched tokens, the shared-box rule."""
    base = PlanRequest(dtype_bytes=2, kv_dtype_bytes=2, max_model_len=8192, max_num_seqs=256,
                       max_num_batched_tokens=2048, block_size=16, available=available, kv_share=0.25,
                       runtime_overhead_bytes=512 * MIB, host_bytes_per_block=288)
    return replace(base, **changes)


@pytest.mark.parametrize("mem_available,cgroup,bound_by,num_blocks", [
    # 25 % of 64 GiB = 17179869184 B -> 46566 blocks (the budget would leave ~56 GiB, more than the 45 GiB
    # the workload can use).
    (64 * GIB, None, "MemAvailable", 46566),
    # A 24 GiB box with 22 GiB free: 5905580032 B -> 16007 blocks, ~31 sequences of 8192 tokens.
    (22 * GIB, None, "MemAvailable", 16007),
    # The same box inside a cgroup of 6 GiB with 1 GiB used: 5 GiB of headroom binds, 1342177280 B -> 3638.
    (22 * GIB, (6 * GIB, GIB), "cgroup", 3638),
    # A cgroup limit above MemAvailable does not bind.
    (22 * GIB, (64 * GIB, GIB), "MemAvailable", 16007),
], ids=["64GiB", "24GiB-box", "cgroup-6GiB", "loose-cgroup"])
def test_shared_box_default_caps_the_pool_at_a_quarter_of_available(tmp_path, mem_available, cgroup, bound_by,
                                                                    num_blocks) -> None:
    limit, used = cgroup or (None, 0)
    available = host(tmp_path, mem_available, limit, used)
    assert available.bound_by == bound_by
    plan = make_plan(SMOLLM2, cpu_default(available))
    assert (plan.kv_rule, plan.kv_sizing, plan.num_kv_blocks) == ("shared-box", "share", num_blocks)
    assert plan.num_kv_blocks * PER_BLOCK <= 0.25 * available.num_bytes < (plan.num_kv_blocks + 1) * PER_BLOCK
    assert plan.fits
    assert "shared-box default (<= 25% of" in plan.kv_sizing_text and "would need 45.00 GiB" in plan.kv_sizing_text
    # --gpu-memory-utilization given (kv_share None): vLLM's meaning, the pool takes what the budget leaves.
    utilization = make_plan(SMOLLM2, cpu_default(available, kv_share=None))
    left = int(0.9 * available.num_bytes) - (190 * MIB + plan.activation_bytes + 512 * MIB)
    assert utilization.kv_rule == "utilization"
    assert utilization.num_kv_blocks == min(131072, left // PER_BLOCK) > plan.num_kv_blocks
    # An explicit size overrides both.
    explicit = make_plan(SMOLLM2, cpu_default(available, kv_cache_bytes=600 * 368640))
    assert (explicit.kv_rule, explicit.num_kv_blocks) == ("explicit", 600)


def test_shared_box_default_takes_only_what_the_workload_can_use(tmp_path) -> None:
    # 4 seqs x 2048 tokens = 4 x 128 blocks, far below 25 % of 22 GiB.
    plan = make_plan(SMOLLM2, cpu_default(host(tmp_path, 22 * GIB), max_num_seqs=4, max_model_len=2048))
    assert (plan.kv_rule, plan.kv_sizing, plan.num_kv_blocks) == ("shared-box", "workload", 512)
    assert plan.kv_sizing_text.endswith("the workload, max_num_seqs 4 x max_model_len 2048")


def test_shared_box_default_serves_at_least_one_max_model_len_sequence(tmp_path) -> None:
    # 25 % of 2 GiB holds 1455 blocks, fewer than the 2048 of one 32768-token sequence: raised to 2048.
    plan = make_plan(SMOLLM2, cpu_default(host(tmp_path, 2 * GIB), max_model_len=32768, max_num_seqs=1))
    assert (plan.kv_sizing, plan.num_kv_blocks) == ("floor", 32768 // 16)
    assert plan.fits  # the budget (90 % of 2 GiB) still holds it next to weights, activations and overhead
    assert plan.kv_sizing_text.endswith("raised to one 32768-token sequence")


def test_shared_box_default_never_exceeds_what_the_budget_leaves(tmp_path) -> None:
    # 1.5 GiB of weights on a 3 GiB box: 25 % (768 MiB, 2182 blocks) is more than the budget leaves.
    available = host(tmp_path, 3 * GIB)
    plan = make_plan(replace(SMOLLM2, weight_bytes=1536 * MIB), cpu_default(available, max_num_seqs=16))
    left = int(0.9 * 3 * GIB) - (1536 * MIB + plan.activation_bytes + 512 * MIB)
    assert left // PER_BLOCK < int(0.25 * 3 * GIB) // PER_BLOCK == 2182
    assert (plan.kv_sizing, plan.num_kv_blocks) == ("budget", left // PER_BLOCK)
    assert plan.fits and plan.total_bytes <= plan.budget_bytes


def test_a_suggested_max_model_len_fits_with_its_own_runtime_overhead() -> None:
    """The rotary tables and block table grow with max_model_len: a plan asked for 100M positions carries tens
    of GiB of them, and the suggested length must be judged with its own (it was judged with the 100M one, so
    no length was suggested at all, or one that moved with the length asked for)."""
    from pagedserve.memory.sizes import runtime_overhead_bytes

    shape = replace(TINY, head_dim=64)

    def asked(max_model_len: int) -> PlanRequest:
        overhead = runtime_overhead_bytes(shape, max_model_len, 4, 16)
        return request(budget_bytes=2 * GIB, max_model_len=max_model_len, runtime_overhead_bytes=overhead)

    values = set()
    for length in (10**6, 10**7, 10**8):
        plan = make_plan(shape, asked(length))
        assert not plan.fits
        value = int({s.flag: s.value for s in plan.suggestions}["--max-model-len"])
        assert make_plan(shape, asked(value)).fits and make_plan(shape, with_margin(asked(value))).fits
        assert not make_plan(shape, with_margin(asked(value + 16))).fits
        values.add(value)
    assert len(values) == 1  # the largest length that fits (with the margin), whatever length was asked for
