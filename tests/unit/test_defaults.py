"""Each engine default is defined once: a setting that is both an EngineArgs field (the flags, LLM(...)
keywords) and a field of a frozen config has one default, or EngineArgs leaves it to set-up to resolve."""

from __future__ import annotations

import dataclasses
from typing import Any

from pagedserve.config import CacheConfig, DeviceConfig, ModelConfig, ParallelConfig, SchedulerConfig
from pagedserve.engine.arg_utils import EngineArgs

CONFIGS = (ModelConfig, CacheConfig, SchedulerConfig, DeviceConfig, ParallelConfig)
# EngineArgs field -> the config field it becomes, where the names differ.
RENAMED = {"tp_all_reduce": "all_reduce"}
# EngineArgs says None / "auto" and engine/setup.py resolves it; the configs hold only resolved values.
RESOLVED_AT_SET_UP = {
    "max_num_batched_tokens": "SchedulerConfig's default (at least max_model_len without chunked prefill)",
    "max_model_len": "the model's context length (SchedulerConfig's default when it names none)",
    "device": "platform.default_device()",
    "num_threads": "the cores this process may use",
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
