"""Each engine default is defined once: a setting that is both an EngineArgs field (the flags, LLM(...)
keywords) and a field of a frozen config has one default, or EngineArgs leaves it to set-up to resolve."""

from __future__ import annotations

import dataclasses
from typing import Any

from pagedserve.config import CacheConfig, DeviceConfig, ModelConfig, ParallelConfig, SchedulerConfig
from pagedserve.engine.arg_utils import EngineArgs

CONFIGS = (ModelConfig, CacheConfig, SchedulerConfig, DeviceConfig, ParallelConfig)
# EngineArgs field -> the config field it becomes, where the names differ.
RENAMED = {"tp_all_reduce": "all_reduce", "scheduling_policy": "policy"}
# EngineArgs says None / "auto" and engine/setup.py resolves it; the configs hold only resolved values.
RESOLVED_AT_SET_UP = {
    "max_num_batched_tokens": "SchedulerConfig's default (at least max_model_len without chunked prefill)",
    "max_model_len": "the model's context length (SchedulerConfig's default when it names none)",
    "device": "platform.resolve_device() (auto: a GPU where torch sees one, else the CPU)",
    "num_threads": "one per physical core this process may use (memory/probe.py's Cores)",
    "task": "what the model is (models/pooling_config.py's default_task)",
    "cpu_binding": "distributed/plan.py's resolve_parallel (one NUMA node per rank, else the cores split)",
}


def _config_defaults() -> dict[str, list[tuple[str, Any]]]:
    """config field name -> [(Config.field, default)] for every config field that has a default."""
    found: dict[str, list[tuple[str, Any]]] = {}
    for config in CONFIGS:
        for f in dataclasses.fields(config):
            if f.default is not dataclasses.MISSING:
                found.setdefault(f.name, []).append((f"{config.__name__}.{f.name}", f.default))
    return found


def test_every_setting_in_engine_args_and_a_config_has_one_default():
    configs = _config_defaults()
    shared = 0
    for f in dataclasses.fields(EngineArgs):
        for where, default in configs.get(RENAMED.get(f.name, f.name), []):
            shared += 1
            if f.name in RESOLVED_AT_SET_UP:
                assert f.default in (None, "auto"), (f"EngineArgs.{f.name} is resolved at set-up, so its default "
                                                     f"must be None or 'auto', got {f.default!r}")
            else:
                assert f.default == default, (f"EngineArgs.{f.name} defaults to {f.default!r} but {where} to "
                                              f"{default!r}: define the default once, in config.py")
    assert shared >= 10  # the comparison really ran over the settings both sides have


def test_the_resolved_list_names_only_shared_settings():
    configs = _config_defaults()
    engine_fields = {f.name for f in dataclasses.fields(EngineArgs)}
    for name in RESOLVED_AT_SET_UP:
        assert name in engine_fields and name in configs, f"{name} is no longer in both EngineArgs and a config"


def test_the_serve_command_s_flags_are_its_dataclasses_fields():
    """`pagedserve serve` with no flags builds exactly the default ServeOptions, RequestLimits and ReplicaArgs
    (the flags carry the fields' defaults, so no default is written twice), and each flag sets its field."""
    import argparse

    from pagedserve.cli import serve
    from pagedserve.engine.arg_utils import RequestLimits
    from pagedserve.entrypoints.openai.options import ServeOptions
    from pagedserve.entrypoints.ray_serve.args import ReplicaArgs

    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers())
    defaults = parser.parse_args(["serve"])
    assert ServeOptions.from_cli_args(defaults, limits=RequestLimits.from_cli_args(defaults)) == ServeOptions()
    assert ReplicaArgs.from_cli_args(defaults) == ReplicaArgs()
    assert EngineArgs.from_cli_args(defaults) == EngineArgs()
    given = parser.parse_args(["serve", "--port", "9001", "--disable-web-ui", "--enable-auto-tool-choice",
                               "--tool-call-parser", "hermes", "--max-request-body-bytes", "100", "--max-n", "3"])
    options = ServeOptions.from_cli_args(given, limits=RequestLimits.from_cli_args(given))
    assert (options.port, options.enable_web_ui, options.active_tool_call_parser) == (9001, False, "hermes")
    assert options.max_request_body_bytes == 100 and options.limits.max_n == 3
    assert ServeOptions(tool_call_parser="hermes").active_tool_call_parser is None  # without auto tool choice


def test_serve_options_name_the_flag_they_refuse():
    import pytest

    from pagedserve.entrypoints.openai.options import ServeOptions

    for options, message in ((ServeOptions(port=0), "--port must be in 1..65535"),
                             (ServeOptions(root_path="llm"), "--root-path must start with '/'"),
                             (ServeOptions(request_body_timeout_s=-1), "--request-body-timeout-s must be"),
                             (ServeOptions(enable_auto_tool_choice=True), "needs --tool-call-parser"),
                             (ServeOptions(limits=dataclasses.replace(ServeOptions().limits, max_n=0)),
                              "--max-n must be >= 1")):
        with pytest.raises(ValueError, match=message):
            options.check()
