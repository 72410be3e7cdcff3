"""Attention reads the paged pool without copies proportional to max_model_len x batch (#19 item 2): what one
step materialises is measured (the K/V positions each gather copies, the query x key pairs of each prefill SDPA
call, and with torch's profiler the largest buffer any op allocates) on the torch path, where decodes are
gathered, and compared with the plan's bounds and across max_model_len."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from pagedserve.entrypoints.llm import LLM
from pagedserve.layers import attention
from pagedserve.sampling_params import SamplingParams

NUM_SEQS, PROMPT_LEN, STEP_TOKENS = 8, 300, 128
CHUNK_PAIRS = 4096  # small, so that the tiny model's prefill chunks must be split over their queries


def run_long_context_batch(model: str, max_model_len: int, monkeypatch: pytest.MonkeyPatch) -> dict:
    """8 prompts of 300 tokens prefilled in 128-token chunks, then decoded together; what attention made."""
    llm = LLM(model, dtype="float32", max_model_len=max_model_len, max_num_seqs=NUM_SEQS,
              max_num_batched_tokens=STEP_TOKENS, reference_kernels=True, enable_prefix_caching=False)
    gathered: list[int] = []
    prefill_pairs: list[int] = []
    real_gather, real_sdpa = attention.LayerKVCache.gather, F.scaled_dot_product_attention

    def gather(cache, slots, dtype):
        gathered.append(slots.numel())
        return real_gather(cache, slots, dtype)

    def sdpa(q, k, v, **kwargs):
        if q.shape[-2] > 1:
            prefill_pairs.append(q.shape[-2] * k.shape[-2])
        return real_sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(attention.LayerKVCache, "gather", gather)
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", sdpa)
    monkeypatch.setattr(attention, "ATTENTION_CHUNK_PAIRS", CHUNK_PAIRS)
    generator = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, 500, (PROMPT_LEN,), generator=generator).tolist()}
               for _ in range(NUM_SEQS)]
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        outputs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    monkeypatch.undo()
    largest_op = max(e.self_cpu_memory_usage for e in prof.events() if e.name != "[memory]")
    return {"gathered": gathered, "prefill_pairs": prefill_pairs, "largest_op_bytes": largest_op,
            "tokens": [o.outputs[0].token_ids for o in outputs], "plan": llm.engine.config.memory_plan}


def test_long_context_step_allocates_nothing_proportional_to_max_model_len(tiny_model_dir, monkeypatch):
    # 2 layers, 2 KV heads of 16, fp32: 128 B per K (or V) position; trained (its config says) for 8192
    model = tiny_model_dir("llama", max_position_embeddings=8192)
    short = run_long_context_batch(model, 1024, monkeypatch)
    long = run_long_context_batch(model, 8192, monkeypatch)
    assert long["tokens"] == short["tokens"]
    longest_context = PROMPT_LEN + 6
    # Decodes are gathered in groups of at most max(longest context, tokens in the step) positions: never the
    # 8 x ~300 positions of the whole batch at once (the copy the old torch path made every layer).
    assert short["gathered"] and max(long["gathered"]) <= max(longest_context, STEP_TOKENS)
    assert max(long["gathered"]) < NUM_SEQS * PROMPT_LEN
    # A prefill chunk's queries are split to keep each call within CHUNK_PAIRS query x key pairs (a whole
    # 128-token chunk against 300 keys would be 38400).
    assert max(long["prefill_pairs"]) <= CHUNK_PAIRS
    # Nothing in the step grows with max_model_len: the same largest buffer at 1024 and 8192 positions ...
    assert long["largest_op_bytes"] == short["largest_op_bytes"]
    assert long["gathered"] == short["gathered"] and long["prefill_pairs"] == short["prefill_pairs"]
    # ... and what was gathered is within the plan's bound for it.
    plan = long["plan"]
    assert max(long["gathered"]) * 2 * 2 * 16 * 4 <= plan.activations.gathered_kv
