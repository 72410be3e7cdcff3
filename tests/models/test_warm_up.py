"""Warm-up: short, but its first step crosses every batch size at which a linear changes paths."""

from __future__ import annotations

import torch

from pagedserve import LLM
from pagedserve.kernels import cpu_kernels
from pagedserve.layers.linear import warm_up_rows


def warm_up_steps(engine) -> list[int]:
    """Tokens of each step of one warm-up of `engine` (not the empty call that drops finished requests' state when
    the engine goes idle: no model step)."""
    steps = []
    execute = engine.runner.execute

    def recording(sched):
        if not sched.is_empty:
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


def test_start_up_reports_packing_the_weights_as_its_own_phase(tiny_model_dir):
    """After the tensors are bound (loading_weights 100%), packing them for the kernels is where a cold start reads
    the mapped file: preparing_weights, with progress rising to 1 as the linears are made (a silent 15 s before)."""
    from pagedserve.engine.arg_utils import EngineArgs
    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.engine.startup import PHASES, StartupTracker

    startup, seen = StartupTracker(), []
    set_progress = startup.set_progress

    def recording(fraction, phase=None):
        set_progress(fraction, phase)
        seen.append((startup.phase, startup.progress))

    startup.set_progress = recording
    LLMEngine.from_engine_args(EngineArgs(model=tiny_model_dir("qwen2"), dtype="bfloat16", max_model_len=128), startup)
    assert [record.name for record in startup.history] == list(PHASES)
    packing = [progress for phase, progress in seen if phase == "preparing_weights"]
    loading = [progress for phase, progress in seen if phase == "loading_weights"]
    assert loading[-1] == 1.0 and packing[0] == 0.0 and packing[-1] == 1.0
    assert packing == sorted(packing) and len(set(packing)) > 3  # the layers' linears, one report each
    assert seen.index(("loading_weights", 1.0)) < seen.index(("preparing_weights", 0.0))
