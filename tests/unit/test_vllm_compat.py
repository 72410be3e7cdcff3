"""vLLM settings pagedserve takes without a setting of its own (engine/vllm_compat.py): a `vllm serve` command line
parses, each ignored flag is named in the log with why, and a refused one fails before anything loads."""

from __future__ import annotations

import argparse
import re
import shlex

import pytest

from pagedserve.cli import serve
from pagedserve.engine import vllm_compat
from pagedserve.engine.arg_utils import EngineArgs, RequestLimits
from pagedserve.entrypoints.openai.options import ServeOptions

VLLM_COMMAND = ("serve Qwen/Qwen2.5-0.5B-Instruct --host 0.0.0.0 --port 8001 --dtype bfloat16 --max-model-len 4096 "
                "--gpu-memory-utilization 0.9 --trust-remote-code --disable-log-requests --swap-space 4 "
                "--enable-prefix-caching --max-num-seqs 64 -tp 1 -pp 1 --served-model-name qwen -O3 "
                "--enable-auto-tool-choice --tool-call-parser hermes --distributed-executor-backend mp")


def parse(command: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers())
    return parser.parse_args(shlex.split(command))


def test_a_vllm_serve_command_line_parses_and_each_ignored_flag_is_explained():
    args = parse(VLLM_COMMAND)
    engine = EngineArgs.from_cli_args(args)
    assert (engine.model, engine.dtype, engine.max_model_len, engine.max_num_seqs) == (
        "Qwen/Qwen2.5-0.5B-Instruct", "bfloat16", 4096, 64)
    options = ServeOptions.from_cli_args(args, limits=RequestLimits.from_cli_args(args))
    assert (options.port, options.active_tool_call_parser) == (8001, "hermes")
    notes = vllm_compat.check(vars(args))
    assert [note.split(" has no effect: ")[0] for note in notes] == [
        "--trust-remote-code", "--disable-log-requests", "--swap-space 4", "--compilation-config 3"]
    assert "KV cache is recomputed" in notes[2]
    assert vllm_compat.check(vars(parse("serve"))) == []  # nothing given, nothing said


@pytest.mark.parametrize("flags,message", [
    ("-pp 2", "--pipeline-parallel-size 2: pipeline parallelism is not supported: split a model with "
              "--tensor-parallel-size N (accepted: 1)"),
    ("--data-parallel-size 4", "--replicas N (Ray Serve)"),
    ("--tokenizer-mode mistral", "accepted: auto, hf"),
    ("--lora-modules sql=/adapters/sql", "--lora-modules sql=/adapters/sql: LoRA adapters are not supported"),
    ("--enable-lora", "merge_and_unload"),
    ("--revision v2", "huggingface-cli download MODEL --revision R --local-dir DIR"),
    ("--reasoning-parser deepseek_r1", "enable_thinking"),
])
def test_a_refused_setting_names_the_flag_and_what_to_do(flags, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        vllm_compat.check(vars(parse(f"serve m {flags}")))


def test_only_values_compare_case_insensitively_and_accept_numbers():
    assert vllm_compat.check({"pipeline_parallel_size": 1, "scheduling_policy": "FCFS", "load_format": "GGUF"}) == []


def test_llm_keywords_take_the_same_table():
    kwargs, notes = vllm_compat.split_keywords({"model": "m", "trust_remote_code": True, "swap_space": 4,
                                                "max_model_len": 512})
    assert kwargs == {"model": "m", "max_model_len": 512}
    assert notes[0].startswith("trust_remote_code=True has no effect") and notes[1].startswith("swap_space=4 ")
    with pytest.raises(ValueError, match="pipeline_parallel_size=2: pipeline parallelism is not supported"):
        vllm_compat.split_keywords({"pipeline_parallel_size": 2})


def test_the_table_never_shadows_a_setting_of_pagedserve():
    """A vLLM flag pagedserve implements is its own setting, never in the table (and no flag is listed twice)."""
    import dataclasses

    from pagedserve.entrypoints.ray_serve.args import ReplicaArgs

    own = {f.name for cls in (EngineArgs, ServeOptions, RequestLimits, ReplicaArgs) for f in dataclasses.fields(cls)}
    names = [setting.name for setting in vllm_compat.COMPAT_SETTINGS]
    assert len(names) == len(set(names)) and not own & set(names)
