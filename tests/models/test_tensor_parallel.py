"""Tensor parallelism (--tensor-parallel-size 2, one thread per rank on this box) against one process.

Greedy tokens must be equal and every top-5 logprob within 5e-5 (float32). The shards compute the same
products as one process, but o, down and the logits are summed in another order (two partial sums of half the
inner dimension, added by the all-reduce, instead of one run over it): observed differences are a few 1e-6,
as for the batched-vs-single differences test_correctness.py argues its 5e-5 from. A wrong split (a head on
the wrong rank, a bias added twice, a vocabulary row off by one) moves logprobs by whole units.
"""

from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.distributed.sharding import ShardLayout, check_tensor_parallel
from tests.models.test_correctness import make_prompts

TOLERANCE = 5e-5
NUM_TOKENS = 24
TOP_K = 5

# (arch, overrides): what each case covers besides its architecture.
CASES = {
    # head_dim 32: the native rotary + KV-write kernel; one KV head for two ranks: replicated; o has a bias
    "llama-kv1-obias": ("llama", dict(hidden_size=128, intermediate_size=256, num_key_value_heads=1,
                                      attention_bias=True)),
    "qwen2-odd-vocab": ("qwen2", dict(vocab_size=515)),  # tied, q/k/v bias, 515 rows: the last rank pads one
    "qwen3": ("qwen3", {}),  # q/k norms per head
    "phi3": ("phi3", {}),  # fused qkv_proj and gate_up_proj: each rank's rows of each part
    "granite-obias": ("granite", dict(attention_bias=True)),  # scales; o's bias scaled once, on rank 0
    "gemma2": ("gemma2", {}),  # sandwich norms, softcapped scores and logits (capped once, after the gather)
    "gemma3": ("gemma3", {}),  # q/k norms, sliding-window layers with a rotary of their own
    "smollm3": ("smollm3", {}),  # layers without rotary
}


def run(model_dir: str, prompts, tp: int, logprobs: int | None = TOP_K, keep_workers: bool = False, **kwargs):
    """`keep_workers`: the caller closes the runner (it goes on using the engine)."""
    llm = LLM(model_dir, dtype="float32", device="cpu", max_model_len=256, tensor_parallel_size=tp, **kwargs)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=logprobs)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return llm, [o.outputs[0] for o in outputs]
    finally:
        if tp > 1 and not keep_workers:
            llm.engine.runner.close()  # the worker, and this thread's cores


def assert_same_logprobs(ours, reference) -> None:
    for position, (step, ref) in enumerate(zip(ours, reference)):
        top = {t for t, lp in step.items() if lp.rank <= TOP_K}
        ref_top = {t for t, lp in ref.items() if lp.rank <= TOP_K}
        assert top == ref_top, f"position {position}: top-{TOP_K} {sorted(top)} vs {sorted(ref_top)}"
        for token_id in top:
            diff = abs(step[token_id].logprob - ref[token_id].logprob)
            assert diff <= TOLERANCE, f"position {position} token {token_id}: |{diff:.3g}| > {TOLERANCE}"


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_give_one_process_tokens_and_logprobs(tiny_model_dir, case):
    arch, overrides = CASES[case]
    model_dir = tiny_model_dir(arch, **overrides)
    from transformers import AutoTokenizer

    prompts = make_prompts(AutoTokenizer.from_pretrained(model_dir))
    _, expected = run(model_dir, prompts, tp=1)
    tp_llm, got = run(model_dir, prompts, tp=2)
    assert tp_llm.engine.runner.group.stats.num_calls > 0  # the collectives really ran
    for ours, reference in zip(got, expected):
        assert ours.token_ids == reference.token_ids
        assert_same_logprobs(ours.logprobs, reference.logprobs)


@pytest.mark.parametrize("collectives", ["shm", "gloo"])
def test_chunked_prefill_prefix_cache_and_preemption_with_two_ranks(tiny_model_dir, collectives):
    """7-token prefill chunks, prompts sharing a 48-token prefix, and a pool too small for all of them: the
    ranks' KV pools must stay in step through chunking, prefix hits and preemption (recompute). gloo: the
    collectives' path where shared memory is not used (other CPUs than x86)."""
    model_dir = tiny_model_dir("qwen2", vocab_size=515)
    prefix = list(range(10, 58))
    prompts = [prefix + [100 + i, 200 + i, 300 + i] for i in range(6)] + [list(range(60, 90))]
    _, expected = run(model_dir, prompts, tp=1, logprobs=None, enable_prefix_caching=False)
    llm, got = run(model_dir, prompts, tp=2, logprobs=None, max_num_batched_tokens=7, num_gpu_blocks_override=12,
                   tp_all_reduce=collectives)
    assert llm.engine.runner.group.kind == {"shm": "shared memory", "gloo": "gloo"}[collectives]
    scheduler = llm.engine.scheduler
    assert scheduler.num_preemptions_total > 0
    assert scheduler.kv.stats.num_hits > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]


def test_memory_pressure_gives_back_every_ranks_pages(tiny_model_dir):
    """Under memory pressure free KV blocks' pages go back on every rank, not only rank 0's: each rank holds its
    own KV heads of the same blocks, so the workers release as many bytes as rank 0 (their RSS drops), and
    generation afterwards gives the same tokens (released pages read back as zeros on every rank)."""
    import psutil

    from pagedserve.memory.pressure import MemoryPressure, PressureThresholds, release_block_pages
    from pagedserve.memory.probe import AvailableMemory

    model_dir = tiny_model_dir("llama", hidden_size=128, intermediate_size=256, num_key_value_heads=2)
    prompts = [list(range(5 + i, 205 + i)) for i in range(8)]  # 8 x 200 tokens: 16 blocks of 128 written per rank
    llm, first = run(model_dir, prompts, tp=2, logprobs=None, block_size=128, keep_workers=True)
    try:
        runner = llm.engine.runner
        worker = psutil.Process(runner.workers.processes[0].pid)
        pools = runner.kv_pools()
        block_bytes = 128 * pools[0].k.stride(0) * pools[0].k.element_size()
        written = sum(int(pool.k.view(-1, 128 * pools[0].k.stride(0)).any(dim=1).sum()) for pool in pools)
        assert written >= 2 * 16  # 2 layers x 16 blocks, the same blocks on every rank
        rss = worker.memory_info().rss
        available, now = [AvailableMemory(1 << 20, "MemAvailable", "simulated", total_bytes=1 << 34)], [0.0]
        llm.engine.give_way_under(MemoryPressure(lambda: available[0], PressureThresholds.for_memory(1 << 34),
                                                 clock=lambda: now[0]))
        llm.engine.step()  # every block is free: the engine gives way on both ranks
        assert all(not bool(pool.k.any()) and not bool(pool.v.any()) for pool in pools)
        dropped = rss - worker.memory_info().rss  # the worker's K and V pages of those blocks went back
        assert dropped >= 0.8 * 2 * written * block_bytes, (dropped, written, block_bytes)
        block_ids = list(range(llm.engine.config.cache.num_blocks))
        rank0 = release_block_pages(pools, block_ids, 128)
        assert runner.release_kv_pages(block_ids, 128) == 2 * rank0  # each rank counts its own share
        available[0], now[0] = AvailableMemory(1 << 33, "MemAvailable", "simulated", total_bytes=1 << 34), 1.0
        params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
        again = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        assert [o.outputs[0].token_ids for o in again] == [o.token_ids for o in first]
    finally:
        llm.engine.runner.close()


def test_shard_layout_splits_heads_vocab_and_replicates_kv_heads():
    class Config:
        num_attention_heads, num_key_value_heads, hidden_size, intermediate_size, vocab_size = 8, 2, 64, 96, 515

    layouts = [ShardLayout.for_config(Config, rank, 4) for rank in range(4)]
    assert [lay.local_heads for lay in layouts] == [2] * 4
    assert [(lay.kv_head_start, lay.local_kv_heads) for lay in layouts] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert [lay.vocab_start for lay in layouts] == [0, 129, 258, 387] and layouts[0].vocab_per_rank == 129
    import torch

    table = torch.arange(515 * 2, dtype=torch.float32).view(515, 2)
    last = layouts[3].shard("model.embed_tokens.weight", table)
    assert last.shape == (129, 2) and torch.equal(last[:128], table[387:]) and not last[128].any()
    down = torch.arange(64 * 96).view(64, 96)
    assert torch.equal(layouts[1].shard("model.layers.0.mlp.down_proj.weight", down), down[:, 24:48])
    norm = torch.ones(64)
    assert layouts[2].shard("model.layers.0.input_layernorm.weight", norm) is norm


def test_sizes_that_do_not_divide_are_refused_with_the_sizes_that_do():
    class Config:
        num_attention_heads, num_key_value_heads, hidden_size, intermediate_size, vocab_size = 14, 2, 896, 4864, 10

    with pytest.raises(ValueError, match=r"14 attention heads do not divide by 4.*Sizes that work: 1, 2$"):
        check_tensor_parallel(Config, 4)


def test_the_memory_plan_is_per_rank_and_refuses_with_numbers(tiny_model_dir, caplog):
    from pagedserve.engine.arg_utils import EngineArgs
    from pagedserve.engine.setup import create_engine_config
    from pagedserve.memory.plan import InsufficientMemoryError
    from pagedserve.memory.probe import AvailableMemory

    model_dir = tiny_model_dir("qwen2", vocab_size=515)
    available = AvailableMemory(8 << 30, "MemAvailable", "test")

    def plan(tp: int, memory: AvailableMemory = available, **kwargs):
        args = EngineArgs(model=model_dir, dtype="float32", max_model_len=256, tensor_parallel_size=tp, **kwargs)
        return create_engine_config(args, available=memory, check_memory=False).memory_plan

    one, two = plan(1), plan(2)
    assert two.kv_bytes_per_token * 2 == one.kv_bytes_per_token  # 2 KV heads: one per rank
    assert 0.45 < two.weight_bytes / one.weight_bytes < 0.6  # halves, but for the replicated norms
    assert two.budget_bytes == pytest.approx(one.budget_bytes / 2, rel=1e-6)  # the ranks share the host
    with pytest.raises(InsufficientMemoryError, match="short by"):
        args = EngineArgs(model=model_dir, dtype="float32", max_model_len=256, tensor_parallel_size=2)
        create_engine_config(args, available=AvailableMemory(int(1.5 * one.total_bytes), "MemAvailable", "test"))
    assert "per tensor-parallel rank" in caplog.text


def test_speculative_decoding_seeded_sampling_and_grammars_with_two_ranks(tiny_model_dir):
    """Rank-0-only work around the sharded model: drafts verified as extra decode rows, seeded sampling, and a
    grammar mask, each giving one process's tokens (the workers only see the forward's inputs)."""
    from transformers import AutoTokenizer

    from pagedserve.structured import StructuredOutputsParams
    from tests.models.test_speculative import SPEC, WEIGHT_STD

    model_dir = tiny_model_dir("llama", weight_std=WEIGHT_STD)  # small weights: it loops, so drafts get accepted
    prompts = [{"prompt_token_ids": p} for p in make_prompts(AutoTokenizer.from_pretrained(model_dir))[:4]]
    params = [SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, max_tokens=NUM_TOKENS, ignore_eos=True, seed=7),
              SamplingParams(temperature=1.0, max_tokens=40, seed=3,
                             structured_outputs=StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2}")),
              SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)]

    def texts(tp: int):
        llm = LLM(model_dir, dtype="float32", device="cpu", max_model_len=256, tensor_parallel_size=tp,
                  speculative_config=SPEC)
        try:
            outputs = llm.generate(prompts, params)
            return [o.outputs[0].token_ids for o in outputs], llm.engine.scheduler.proposer.totals
        finally:
            if tp > 1:
                llm.engine.runner.close()

    expected, _ = texts(1)
    got, totals = texts(2)
    assert totals.num_accepted_tokens > 0
    assert got == expected


def test_a_gguf_served_from_int8_blocks_splits_its_quantized_rows_and_columns(tmp_path, capfd):
    """Q8_0 matrices arrive as int8 rows with one scale each (QuantizedWeight): q/k/v and gate/up take rows and
    their scales, o and down take columns and keep the row scales, so each rank's values are exactly its part of
    one process's; only the summation order differs (float32 activations: the tolerance above)."""
    from gguf import GGMLQuantizationType

    from tests.models.gguf_utils import tiny_model, write_test_gguf

    path = str(write_test_gguf(tiny_model("qwen2", hidden_size=128, intermediate_size=256), tmp_path / "q8.gguf",
                               GGMLQuantizationType.Q8_0))
    prompts = [list(range(5 + i, 30 + i)) for i in range(3)]
    _, expected = run(path, prompts, tp=1, quantization="int8")
    llm, got = run(path, prompts, tp=2, quantization="int8")
    assert llm.engine.config.model.quantization == "int8"
    assert "INFO [tp rank 1]" not in capfd.readouterr().err  # rank 1 logs at this process's level (WARNING here)
    # This rank's half of the embedding holds its own memory, not the whole decoded table (a view kept all of
    # it alive: ~136 MiB per rank over the plan for Qwen2.5-Coder's GGUF)
    embedding = next(p for name, p in llm.engine.runner.model.named_parameters() if "embed_tokens" in name)
    assert embedding.untyped_storage().nbytes() == embedding.numel() * embedding.element_size()
    for ours, reference in zip(got, expected):
        assert ours.token_ids == reference.token_ids
        assert_same_logprobs(ours.logprobs, reference.logprobs)


def test_a_ggufs_blocks_become_int8_rows_for_ranks_and_the_plan_says_so(tmp_path, caplog):
    """Ranks split each matrix and a GGUF's 4/5-bit blocks are not split: the config says int8 for them, asked
    for or by default (the loader ran int8 while the plan and doctor said "gguf"), and --quantization gguf says
    why it is not served as asked."""
    from gguf import GGMLQuantizationType

    from pagedserve.engine.arg_utils import EngineArgs
    from pagedserve.engine.setup import create_engine_config
    from pagedserve.platform import native_kernels_run
    from tests.models.gguf_utils import tiny_model, write_test_gguf

    path = str(write_test_gguf(tiny_model("qwen2", hidden_size=128, intermediate_size=256), tmp_path / "q4.gguf",
                               GGMLQuantizationType.Q4_0))
    blocks = native_kernels_run()  # without the native kernels the file is dequantized to the dtype
    for quantization in (None, "gguf"):
        caplog.clear()
        config = create_engine_config(EngineArgs(model=path, max_model_len=128, tensor_parallel_size=2,
                                                 quantization=quantization))
        assert config.model.quantization == ("int8" if blocks else None)
        assert ("blocks are not split across ranks" in caplog.text) == (blocks and quantization == "gguf")
    single = create_engine_config(EngineArgs(model=path, max_model_len=128, quantization="gguf"))
    assert single.model.quantization == ("gguf" if blocks else None)


# Gemma 3 with head_dim 32: its sandwich norms' MLP output norm applied after the reduce, windowed layers' own views
STACK_GEMMA3 = ("gemma3", dict(hidden_size=128, intermediate_size=256, head_dim=32, weight_std=0.1))


@pytest.mark.parametrize("dtype,quantization,case,kv_cache_dtype", [
    ("bfloat16", None, CASES["llama-kv1-obias"], "auto"), ("float32", "int8", CASES["llama-kv1-obias"], "auto"),
    ("bfloat16", None, STACK_GEMMA3, "auto"), ("bfloat16", None, CASES["llama-kv1-obias"], "fp8")],
    ids=["bf16", "int8", "gemma3", "bf16-fp8-kv"])
def test_the_decode_stack_runs_layer_by_layer_with_two_ranks_and_changes_nothing(tiny_model_dir, dtype,
                                                                                 quantization, case, kv_cache_dtype):
    """With two ranks a decode-only step runs every layer's C attention and MLP halves (cpu_kernels.c), all-
    reducing after each, where the native kernels run: rank 0's tokens and logprobs are bit for bit those of
    its per-layer path (the same kernels and collectives in the same order; rank 1 keeps its stack), an fp8 KV
    cache's too (each rank's table points at its own pools' scales)."""
    from pagedserve.kernels import cpu_kernels
    from tests.models.test_decode_stack import _generate

    if cpu_kernels() is None:
        pytest.skip("no native kernels on this CPU: the per-layer torch path runs (the other tests)")
    arch, overrides = case
    model_dir = tiny_model_dir(arch, dtype, **overrides)
    kwargs = {"quantization": quantization} if quantization else {}
    llm = LLM(model_dir, dtype=dtype, device="cpu", max_model_len=256, tensor_parallel_size=2,
              enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype, **kwargs)
    try:
        with_stack, stack_steps = _generate(llm, stack_enabled=True)
        without, no_stack_steps = _generate(llm, stack_enabled=False)
        assert any("two native calls per layer" in line for line in llm.engine.runner.model.kernel_report())
    finally:
        llm.engine.runner.close()
    assert stack_steps >= 11 and no_stack_steps == 0
    for a, b in zip(with_stack, without):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs  # exact


def test_an_offline_caller_gets_its_threads_and_cores_back(tiny_model_dir):
    """LLM(tensor_parallel_size=2) binds the calling thread to rank 0's cores and runs torch on its threads;
    once the LLM is gone the caller's torch threads were left at rank 0's count (the cores came back)."""
    import gc
    import os

    import torch

    before = (torch.get_num_threads(), os.sched_getaffinity(0))
    llm = LLM(tiny_model_dir("llama"), tensor_parallel_size=2, dtype="float32", max_model_len=64)
    assert llm.generate("Hi", SamplingParams(max_tokens=2, ignore_eos=True))[0].outputs[0].token_ids
    del llm
    gc.collect()
    assert (torch.get_num_threads(), os.sched_getaffinity(0)) == before


def test_one_process_runs_on_the_cores_named_and_gives_them_back(tiny_model_dir):
    """cpu_binding with one rank (vLLM's VLLM_CPU_OMP_THREADS_BIND binds its one process too): the engine's thread,
    and so OpenMP's, on those cores with one torch thread each while the LLM lives; the caller's back after."""
    import gc
    import os

    import torch

    before = (torch.get_num_threads(), os.sched_getaffinity(0))
    core = max(before[1])
    llm = LLM(tiny_model_dir("llama"), cpu_binding=str(core), dtype="float32", max_model_len=64)
    assert os.sched_getaffinity(0) == {core} and torch.get_num_threads() == 1
    assert llm.generate("Hi", SamplingParams(max_tokens=2, ignore_eos=True))[0].outputs[0].token_ids
    del llm
    gc.collect()
    assert (torch.get_num_threads(), os.sched_getaffinity(0)) == before
