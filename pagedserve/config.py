"""Frozen configuration per subsystem. Pure Python: the scheduler imports it without torch.

The defaults written here are the engine's defaults: EngineArgs (engine/arg_utils.py, the flags and LLM(...)
keywords) reads each of its defaults from the field of the same setting here, so they are defined once
(tests/unit/test_defaults.py checks every setting present in both)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


def json_object(value: str | Mapping[str, Any], what: str, example: str = "") -> dict[str, Any]:
    """A flag's (or an input line's) JSON object, from its text or as a mapping given as is; ValueError
    "<what> must be a JSON object[, e.g. <example>]" with why."""
    hint = f", e.g. {example}" if example else ""
    try:
        parsed = json.loads(value) if isinstance(value, str) else dict(value)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{what} must be a JSON object{hint}: {exc}") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"{what} must be a JSON object{hint}, got {value!r}")
    return parsed


@dataclass(frozen=True)
class PoolerConfig:
    """How an embedding model pools (models/pooling_config.py reads it from the model's files)."""

    pooling_type: str  # one of models.pooling_config.POOLING_TYPES
    normalize: bool
    source: str  # where the settings came from, for logs and errors
    # Matryoshka: which `dimensions` a request may ask for. None: the model does not declare support;
    # () : any size up to the hidden size; otherwise exactly these sizes.
    matryoshka_dimensions: tuple[int, ...] | None = None

    @property
    def needs_all_tokens(self) -> bool:
        """Whether every token's hidden state counts (so a prefix-cache hit would change the result)."""
        return self.pooling_type != "lasttoken"


@dataclass(frozen=True)
class ModelConfig:
    model: str  # resolved local path: a Hugging Face directory or a .gguf file
    served_model_name: str  # the name replies carry
    dtype: str  # "float32" | "bfloat16" | "float16" (resolved, never "auto")
    max_model_len: int
    hf_config: Any  # transformers.PretrainedConfig
    architecture: str  # e.g. "LlamaForCausalLM"
    task: str = "generate"  # "generate" | "embed"
    pooler: PoolerConfig | None = None  # when task == "embed"
    seed: int | None = 0
    quantization: str | None = None
    # int8 instead of a GGUF's blocks because the model verifies speculative drafts (platform.default_quantization)
    int8_for_drafts: bool = False
    enforce_eager: bool = False
    reference_kernels: bool = False  # plain F.linear everywhere (correctness checks)
    trust_remote_code: bool = False
    # Sampling defaults for requests that do not set them (--generation-config): SamplingParams' field names
    default_sampling: dict[str, Any] = field(default_factory=dict)
    # Every request's max_tokens at most this (vLLM's override_max_tokens: --generation-config FOLDER's or
    # --override-generation-config's max_new_tokens); None: no cap
    max_tokens_cap: int | None = None
    served_model_aliases: tuple[str, ...] = ()  # more names requests may use (--served-model-name A B ...)
    max_logprobs: int = 20  # most logprobs / prompt_logprobs a request may ask for (-1: the vocabulary)

    @property
    def is_gguf(self) -> bool:
        from pagedserve.formats import is_gguf_path

        return is_gguf_path(self.model)

    def get_vocab_size(self) -> int:  # vLLM's ModelConfig API
        return self.hf_config.vocab_size


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_blocks: int = 0  # resolved by the engine from the memory plan or an override
    enable_prefix_caching: bool = True
    # The sliding-window layers' K/V pool of their own (core/kv_cache_manager.py), where some layers have a window
    # and others none: its blocks (the null block included) and the window; 0 and None: one pool for every layer.
    num_window_blocks: int = 0
    sliding_window: int | None = None
    kv_cache_dtype: str = "auto"  # "auto" = the model dtype
    # A server idle this long hands its free KV blocks' pages back (CPU; LLMEngine.idle); 0: never.
    idle_release_s: float = 600.0

    @property
    def num_gpu_blocks(self) -> int:  # vLLM's name (its blocks on whatever device)
        return self.num_blocks


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    max_waiting_requests: int = 1024  # the server answers 429 past this
    policy: str = "fcfs"  # "fcfs" | "priority": lower `priority` first, then arrival (vLLM's --scheduling-policy)
    long_prefill_token_threshold: int = 0  # vLLM's: a prompt's chunk per step at most this (0: the budget)


@dataclass(frozen=True)
class DeviceConfig:
    device: str = "cpu"  # "cpu" | "cuda"
    num_threads: int = 1  # torch intra-op threads on CPU
    cpu_give_way: bool = True  # fewer threads while other processes keep the CPUs busy (engine/cpu_share.py)


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1  # ranks, each a process holding a shard (pagedserve/distributed)
    # The cores of each rank (resolved); with one rank those --cpu-binding named, else () (not bound)
    cpu_binding: tuple[tuple[int, ...], ...] = ()
    all_reduce: str = "auto"  # "auto" (shared memory where it runs, else gloo), "shm" or "gloo"
    collective_timeout_s: float = 30.0  # a collective waiting longer for a peer fails the step


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    device: DeviceConfig
    memory_plan: Any = None  # memory.plan.MemoryPlan that sized the KV cache (None when built by hand)
    fault_injection: str | None = None  # test-only: engine/faults.py's spec of faults to raise; None = off
    structured_outputs: Any = None  # structured.params.StructuredOutputsConfig (None: its defaults)
    speculative: Any = None  # spec_decode.config.SpeculativeConfig; None = no speculative decoding
    draft_model: ModelConfig | None = None  # speculative decoding's draft model (method draft_model)
    parallel: ParallelConfig = ParallelConfig()

    # vLLM's VllmConfig names, for code that reads llm.llm_engine.vllm_config.model_config and the like (the
    # fields inside are pagedserve's: max_model_len, dtype, block_size, max_num_seqs, ... share vLLM's names)
    model_config = property(lambda self: self.model)
    cache_config = property(lambda self: self.cache)
    scheduler_config = property(lambda self: self.scheduler)
    device_config = property(lambda self: self.device)
    parallel_config = property(lambda self: self.parallel)
