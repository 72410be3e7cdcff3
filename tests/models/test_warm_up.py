"""Warm-up: short, but its first step crosses every batch size at which a linear changes paths."""

from __future__ import annotations

import torch

from pagedserve import LLM
from pagedserve.kernels import cpu_kernels
from pagedserve.layers.linear import warm_up_rows


def warm_up_steps(engine) -> list[int]:
    """Tokens of each step of one warm-up of `engine`."""
    steps = []
    execute = engine.runner.execute

    def recording(sched):
        steps.append(sched.total_num_scheduled_tokens)
        return execute(sched)

    engine.runner.execute = recording
    try:
        engine.warm_up()
    finally:
        engine.runner.execute = execute
    return steps


def test_warm_up_is_two_short_steps_where_no_linear_switches(tiny_model_dir):
    engine = LLM(tiny_model_dir("qwen2"), dtype="float32", device="cpu", max_model_len=256).engine
    assert engine.runner.warm_up_rows() == 0
    steps = warm_up_steps(engine)
    assert len(steps) == 2 and steps[0] <= 8 and steps[1] == 2  # prefill of two prompts, then one decode step
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks - 1 and not engine.kv.req_to_blocks  # none left


def test_warm_up_prefill_crosses_the_rows_where_a_linear_switches(tiny_model_dir, monkeypatch):
    engine = LLM(tiny_model_dir("qwen2"), dtype="float32", quantization="int8", device="cpu", max_model_len=256).engine
    # int8 linears with float32 activations keep the native kernel up to kernels.int8_max_rows (32 where the
    # CPU has bf16 dot products, every batch elsewhere), then run a dense matmul that compiles on first call.
    kernels = cpu_kernels()
    limit = kernels.int8_max_rows(torch.float32) if kernels is not None else None
    assert engine.runner.warm_up_rows() == warm_up_rows(engine.runner.model) == (0 if limit is None else limit + 1)
    monkeypatch.setattr(engine.runner, "warm_up_rows", lambda: 50)
    steps = warm_up_steps(engine)
    assert steps[0] >= 50 and len(steps) == 2
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks - 1 and not engine.kv.req_to_blocks
