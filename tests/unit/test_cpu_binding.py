"""--cpu-binding parsing and the default split of the usable cores over tensor-parallel ranks."""

from __future__ import annotations

import pytest

from pagedserve.config import ParallelConfig
from pagedserve.distributed.binding import default_binding, format_cores, numa_nodes, parse_cpu_binding
from pagedserve.memory.probe import Cores, read_cores


def test_binding_lists_one_core_list_per_rank():
    assert parse_cpu_binding("0-3,8|4-7", 2) == [[0, 1, 2, 3, 8], [4, 5, 6, 7]]
    assert format_cores([0, 1, 2, 3, 8]) == "0-3,8"


@pytest.mark.parametrize("text,size,message", [
    ("0-7|8-15", 3, "gives 2 core lists for --tensor-parallel-size 3"),
    ("0-7|7-9", 2, "gives a core to two ranks"),
    ("0-x|1", 2, "is not a core number"),
    ("7-3|1", 2, "runs backwards"),
    ("0,,1|2", 2, "empty entry"),
])
def test_bad_bindings_are_refused_naming_the_problem(text, size, message):
    with pytest.raises(ValueError, match=message):
        parse_cpu_binding(text, size)


def test_default_is_one_numa_node_per_rank_when_the_nodes_match():
    nodes = [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert default_binding(list(range(8)), 2, nodes) == nodes
    # four ranks on two nodes: equal contiguous groups instead
    assert default_binding(list(range(8)), 4, nodes) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # only some cores usable (a cgroup cpuset): the nodes' usable parts
    assert default_binding([2, 3, 4, 5], 2, nodes) == [[2, 3], [4, 5]]


def test_default_splits_evenly_and_shares_when_ranks_outnumber_cores():
    assert default_binding([0, 1], 2, nodes=[]) == [[0], [1]]
    assert default_binding([0, 1, 2], 2, nodes=[]) == [[0], [1]]
    assert default_binding([5], 2, nodes=[]) == [[5], [5]]


def test_numa_nodes_are_read_from_sysfs(tmp_path):
    for index, cpus in ((1, "4-7"), (0, "0-3")):
        (tmp_path / f"node{index}").mkdir()
        (tmp_path / f"node{index}" / "cpulist").write_text(cpus + "\n")
    assert numa_nodes(tmp_path) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_a_binding_to_cores_this_process_cannot_use_is_refused(tmp_path):
    from pagedserve.distributed.plan import resolve_parallel

    class Args:
        tensor_parallel_size, cpu_binding, num_threads, tp_all_reduce = 2, "0|4096", None, "auto"

    class Config:
        num_attention_heads, num_key_value_heads, intermediate_size = 4, 2, 128

    with pytest.raises(ValueError, match=r"names cores this process may not run on \(4096\)"):
        resolve_parallel(Args, Config, "generate", "LlamaForCausalLM", read_cores())


def test_ranks_split_physical_cores_never_two_threads_of_one_core():
    from pagedserve.distributed.plan import resolve_parallel

    class Args:
        tensor_parallel_size, cpu_binding, num_threads, tp_all_reduce = 2, None, None, "auto"

    class Config:
        num_attention_heads, num_key_value_heads, intermediate_size = 4, 2, 128

    smt = Cores(tuple((core, core + 8) for core in range(8)))  # 16 CPUs, CPU n and n + 8 share core n
    parallel, threads = resolve_parallel(Args, Config, "generate", "LlamaForCausalLM", smt)
    assert parallel.cpu_binding == ((0, 1, 2, 3), (4, 5, 6, 7)) and threads == 4
    Args.cpu_binding = "0-7|8-15"  # the user's binding is taken as given: every CPU is this process's
    parallel, threads = resolve_parallel(Args, Config, "generate", "LlamaForCausalLM", smt)
    assert parallel.cpu_binding == (tuple(range(8)), tuple(range(8, 16))) and threads == 8


def test_one_rank_is_bound_to_the_cores_named():
    """vLLM binds one process to VLLM_CPU_OMP_THREADS_BIND's cores, one thread each; pagedserve said "no effect"."""
    from pagedserve.distributed.plan import resolve_parallel

    class Args:
        tensor_parallel_size, cpu_binding, num_threads, tp_all_reduce = 1, "2-5", None, "auto"

    cores = Cores(tuple((core,) for core in range(8)))
    parallel, threads = resolve_parallel(Args, object(), "generate", "LlamaForCausalLM", cores)
    assert parallel.cpu_binding == ((2, 3, 4, 5),) and threads == 4
    Args.num_threads = 2
    assert resolve_parallel(Args, object(), "generate", "LlamaForCausalLM", cores)[1] == 2
    for word in (None, "auto", "nobind"):
        Args.cpu_binding = word
        assert resolve_parallel(Args, object(), "generate", "LlamaForCausalLM", cores) == (ParallelConfig(), None)
    Args.cpu_binding = "6-9"
    with pytest.raises(ValueError, match="names cores this process may not run on"):
        resolve_parallel(Args, object(), "generate", "LlamaForCausalLM", cores)


@pytest.mark.parametrize("env, tp, expected", [("0-3|4-7", 2, "0-3|4-7"), ("auto", 2, None), ("0-3", 1, "0-3"),
                                               (None, 2, None), ("nobind", 2, "nobind")])
def test_vllm_s_threads_bind_variable_is_the_binding_s_default(monkeypatch, caplog, env, tp, expected):
    import argparse

    from pagedserve.cli import serve
    from pagedserve.cli.common import engine_args_from_cli

    import pagedserve.memory.probe as probe

    monkeypatch.setattr(probe, "read_cores", lambda: Cores(tuple((core,) for core in range(8))))  # an 8-core box
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    if env is not None:
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", env)
    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers())
    assert engine_args_from_cli(parser.parse_args(["serve", "m", "-tp", str(tp)])).cpu_binding == expected
    assert engine_args_from_cli(parser.parse_args(["serve", "m", "-tp", "2", "--cpu-binding", "0|1"])).cpu_binding == (
        "0|1")  # the flag wins


def test_a_variable_naming_cores_this_process_cannot_use_names_the_variable(monkeypatch):
    import argparse

    from pagedserve.cli import serve
    from pagedserve.cli.common import engine_args_from_cli

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "4096")
    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers())
    with pytest.raises(ValueError, match="^VLLM_CPU_OMP_THREADS_BIND: '4096' names cores this process may not run on"):
        engine_args_from_cli(parser.parse_args(["serve", "m"]))


def test_nobind_auto_and_a_bad_variable(monkeypatch, caplog):
    """vLLM's words: nobind lets every rank run on every core (it bound them as auto does), auto is the default
    binding (the flag refused it); a bad VLLM_CPU_OMP_THREADS_BIND names the variable, not --cpu-binding."""
    import argparse

    from pagedserve.cli import serve
    from pagedserve.cli.common import engine_args_from_cli
    from pagedserve.distributed.plan import check_parallel_args, resolve_parallel

    class Args:
        tensor_parallel_size, cpu_binding, num_threads, tp_all_reduce = 2, "nobind", None, "auto"

    class Config:
        num_attention_heads, num_key_value_heads, intermediate_size = 4, 2, 128

    four = Cores(tuple((core,) for core in range(4)))
    parallel, threads = resolve_parallel(Args, Config, "generate", "LlamaForCausalLM", four)
    assert parallel.cpu_binding == ((0, 1, 2, 3), (0, 1, 2, 3)) and threads == 2
    Args.cpu_binding = "auto"
    check_parallel_args(2, "auto", "auto")
    parallel, _ = resolve_parallel(Args, Config, "generate", "LlamaForCausalLM", four)
    assert parallel.cpu_binding == ((0, 1), (2, 3))
    Args.cpu_binding, Args.tensor_parallel_size = None, 4
    one = Cores(((0,), (1,)))
    resolve_parallel(Args, Config, "generate", "LlamaForCausalLM", one)
    assert "4 tensor-parallel ranks share 2 cores" in caplog.text
    assert "slower than --tensor-parallel-size 2\n" in caplog.text + "\n"
    caplog.clear()  # a model that 2 ranks do not split (SmolLM2's 9 heads): the hint names a size it takes

    class NineHeads:
        num_attention_heads, num_key_value_heads, intermediate_size = 9, 3, 1536

    Args.tensor_parallel_size = 3
    resolve_parallel(Args, NineHeads, "generate", "LlamaForCausalLM", one)
    assert "slower than --tensor-parallel-size 1 (one process)" in caplog.text
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers())
    with pytest.raises(ValueError, match="^VLLM_CPU_OMP_THREADS_BIND: '0' gives 1 core lists"):
        engine_args_from_cli(parser.parse_args(["serve", "m", "-tp", "2"]))
