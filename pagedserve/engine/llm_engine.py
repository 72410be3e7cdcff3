"""LLMEngine: the synchronous step loop (schedule -> execute -> update -> detokenize)."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from pagedserve.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.sched_output import SchedulerStats
from pagedserve.core.scheduler import Scheduler
from pagedserve.engine.arg_utils import SUPPORTED_KV_CACHE_DTYPES, SUPPORTED_QUANTIZATION, EngineArgs
from pagedserve.engine.output_processor import OutputProcessor
from pagedserve.engine.startup import StartupTracker
from pagedserve.models.pooling_config import is_encoder
from pagedserve.outputs import PoolingRequestOutput, RequestOutput
from pagedserve.pooling_params import PoolingParams, tokenize_for_pooling
from pagedserve.request import Request, RequestStatus
from pagedserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
# --runner (vLLM's name) -> the task it means; "auto" decides from the model.
RUNNER_TASKS: dict[str, str | None] = {"auto": None, "generate": "generate", "pooling": "embed"}

# A prompt given as text, token ids, or a dict {"prompt": ...} / {"prompt_token_ids": ...}.
PromptType = str | list[int] | dict


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer: Any, startup: StartupTracker | None = None,
                 warm_up: bool = True) -> None:
        from pagedserve.platform import configure_threads

        startup = startup or StartupTracker()
        self.config = config
        self.tokenizer = tokenizer
        if config.device.device == "cpu":
            configure_threads(config.device.num_threads)
        startup.enter("loading_weights")
        self.runner = _make_runner(config, startup.set_progress)
        startup.enter("allocating_kv")
        self.runner.allocate_kv_cache()
        self.eos_token_id = tokenizer.eos_token_id
        self.runner.eos_token_id = self.eos_token_id
        self.extra_eos_token_ids = _generation_config_eos_ids(config.model.model, self.eos_token_id)
        kv = KVCacheManager(config.cache.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, kv)
        self.output_processor = OutputProcessor(tokenizer)
        self.stats = SchedulerStats()
        self._request_counter = 0
        if warm_up:
            startup.enter("warming_up")
            self.warm_up()
        startup.enter("ready")

    @classmethod
    def from_engine_args(cls, args: EngineArgs, startup: StartupTracker | None = None) -> "LLMEngine":
        startup = startup or StartupTracker()
        config = create_engine_config(args, startup)
        tokenizer = load_tokenizer(args.tokenizer or config.model.model)
        return cls(config, tokenizer, startup)

    @property
    def is_pooling(self) -> bool:
        """This engine embeds (task "embed"): it takes PoolingParams, not SamplingParams."""
        return self.config.model.task == "embed"

    def warm_up(self) -> None:
        """Pay the first request's costs now: page in every weight, build the kernels for prefill, batched
        decode with padding, greedy and random sampling and logprobs (for an embedding model: a batch of
        two prompts of different lengths, padded). Leaves no trace in caches or stats."""
        vocab_size = self.config.model.hf_config.vocab_size
        length = max(1, min(64, self.max_model_len - 8))
        prompts = [[(7 * i + 3) % vocab_size for i in range(length)], [(5 * i + 1) % vocab_size for i in range(length // 2 + 1)]]
        params: list[SamplingParams | PoolingParams] = [
            SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=1),
            SamplingParams(temperature=0.8, top_p=0.9, top_k=40, max_tokens=4, ignore_eos=True, seed=0)]
        if self.is_pooling:
            params = [PoolingParams(), PoolingParams()]
        for index, (prompt, param) in enumerate(zip(prompts, params)):
            self.add_request(f"warmup-{index}", {"prompt_token_ids": prompt}, param)
        while self.has_unfinished_requests():
            self.step()
        self.scheduler.kv.pool.reset_prefix_cache()
        self.scheduler.kv.stats = type(self.scheduler.kv.stats)()
        self.scheduler.make_stats()
        self.stats = SchedulerStats()

    @property
    def max_model_len(self) -> int:
        return self.config.model.max_model_len

    # ---- requests ----------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        return None, list(prompt)

    def add_request(self, request_id: str | None, prompt: PromptType, params: SamplingParams | PoolingParams,
                    arrival_time: float | None = None) -> str:
        """Queue a request (PoolingParams: an embedding); raises ValueError for prompts that cannot be served."""
        if request_id is None:
            request_id = str(self._request_counter)
            self._request_counter += 1
        if self.output_processor.has_request(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(params, PoolingParams) or self.is_pooling:
            return self._add_pooling_request(request_id, prompt, params, arrival_time)
        text, prompt_ids = self.tokenize_prompt(prompt)
        self.validate_prompt(prompt_ids)
        if self.extra_eos_token_ids:
            params = params.clone(stop_token_ids=params.stop_token_ids + self.extra_eos_token_ids)
        max_tokens = self.max_model_len - len(prompt_ids)
        if params.max_tokens is not None:
            max_tokens = min(max_tokens, params.max_tokens)
        arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        child_ids = self.output_processor.add_request(request_id, text, prompt_ids, params, arrival_time)
        for index, child_id in enumerate(child_ids):
            child_params = params
            if params.n > 1:
                seed = None if params.seed is None else params.seed + index
                child_params = params.clone(n=1, seed=seed)
            self.scheduler.add_request(Request(child_id, prompt_ids, child_params, self.eos_token_id,
                                               max_tokens, arrival_time))
        return request_id

    def _add_pooling_request(self, request_id: str, prompt: PromptType, params: PoolingParams,
                             arrival_time: float | None) -> str:
        if not self.is_pooling:
            raise ValueError("this model generates text and cannot embed; start an embedding model "
                             "(e.g. --task embed) for embeddings")
        if not isinstance(params, PoolingParams):
            raise ValueError("this is an embedding model: give PoolingParams (or use LLM.embed), not "
                             f"{type(params).__name__}")
        text, prompt_ids = self.tokenize_pooling_prompt(prompt, params)
        self.validate_prompt(prompt_ids, is_pooling=True)
        self.validate_dimensions(params.dimensions)
        arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        self.output_processor.add_pooling_request(request_id, text, prompt_ids, params, arrival_time,
                                                  renormalize=self.config.model.pooler.normalize)
        self.scheduler.add_request(Request(request_id, prompt_ids, SamplingParams(max_tokens=1), None, 1,
                                           arrival_time, is_pooling=True))
        return request_id

    def tokenize_pooling_prompt(self, prompt: PromptType, params: PoolingParams) -> tuple[str | None, list[int]]:
        """(text, token ids) of an embedding prompt, truncated if params.truncate_prompt_tokens asks."""
        if isinstance(prompt, dict):
            text = prompt.get("prompt")
            prompt = prompt["prompt_token_ids"] if "prompt_token_ids" in prompt else prompt["prompt"]
        else:
            text = prompt if isinstance(prompt, str) else None
        ids = tokenize_for_pooling(self.tokenizer, prompt, params.truncate_prompt_tokens, self.max_model_len)
        return text, ids

    def validate_dimensions(self, dimensions: int | None) -> None:
        """`dimensions` only for Matryoshka models (config.json's is_matryoshka / matryoshka_dimensions)."""
        if dimensions is None:
            return
        allowed = self.config.model.pooler.matryoshka_dimensions
        hidden_size = self.config.model.hf_config.hidden_size
        if allowed is None:
            raise ValueError(f"dimensions: this model does not support Matryoshka embeddings, so its vectors "
                             f"cannot be shortened (its config.json declares neither is_matryoshka nor "
                             f"matryoshka_dimensions); omit dimensions to get all {hidden_size}")
        if allowed and dimensions not in allowed:
            raise ValueError(f"dimensions {dimensions} is not one this model was trained for: "
                             f"{', '.join(map(str, allowed))}")
        if not 1 <= dimensions <= hidden_size:
            raise ValueError(f"dimensions must be between 1 and the model's {hidden_size}, got {dimensions}")

    def validate_prompt(self, prompt_ids: list[int], is_pooling: bool = False) -> None:
        if not prompt_ids:
            raise ValueError("the prompt is empty: give at least one token")
        if is_pooling and len(prompt_ids) > self.max_model_len:
            raise ValueError(f"the input is {len(prompt_ids)} tokens long, but this model's maximum input length "
                             f"is {self.max_model_len} tokens; shorten it or set truncate_prompt_tokens")
        if not is_pooling and len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"the prompt is {len(prompt_ids)} tokens long, but this model's maximum context "
                             f"length is {self.max_model_len} tokens (prompt + output); shorten the prompt")
        vocab_size = self.config.model.hf_config.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is out of range [0, {vocab_size})")

    def abort_request(self, request_ids: list[str]) -> list[RequestOutput | PoolingRequestOutput]:
        finals = []
        for request_id in request_ids:
            self.scheduler.finish_requests(self.output_processor.child_ids(request_id),
                                           RequestStatus.FINISHED_ABORTED)
            final = self.output_processor.abort(request_id)
            if final is not None:
                finals.append(final)
        return finals

    def refresh_gauges(self) -> None:
        """Current running/waiting/KV usage outside a step (after aborts); per-step counters reset to 0."""
        scheduler = self.scheduler
        self.stats = SchedulerStats(num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
                                    kv_cache_usage=scheduler.kv.usage)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        sched_out = self.scheduler.schedule()
        runner_out = self.runner.execute(sched_out)
        core_outputs = self.scheduler.update_from_output(sched_out, runner_out)
        outputs, stopped = self.output_processor.process(core_outputs)
        if stopped:
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        self.stats = self.scheduler.make_stats()
        return outputs


def _make_runner(config: EngineConfig, progress: Any) -> Any:
    """The runner for this architecture and task: ModelRunner generates; embedding models get
    worker/pooling_runner.py's (an encoder runner without KV cache, or a decoder one that pools)."""
    if config.model.task == "embed":
        from pagedserve.worker.pooling_runner import make_pooling_runner

        return make_pooling_runner(config, config.model.hf_config, progress)
    from pagedserve.worker.model_runner import ModelRunner

    return ModelRunner(config, config.model.hf_config, progress)


def _generation_config_eos_ids(model_path: str, eos_token_id: int | None) -> list[int]:
    """EOS ids listed in generation_config.json beyond the tokenizer's (e.g. Llama 3's <|eot_id|>)."""
    path = Path(model_path) / "generation_config.json"
    if not path.is_file():
        return []
    try:
        value = json.loads(path.read_text()).get("eos_token_id")
    except (OSError, ValueError):
        return []
    ids = value if isinstance(value, list) else [value] if isinstance(value, int) else []
    return [i for i in ids if i != eos_token_id]


def load_tokenizer(path: str) -> Any:
    if path.endswith(".gguf"):
        from pagedserve.models.gguf_loader import GGUFCheckpoint

        return GGUFCheckpoint(path).build_tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def resolve_model_path(model: str | None) -> str:
    """A local path as given, or a known model name fetched into the cache."""
    if model is not None and Path(model).exists():
        return str(Path(model).resolve())
    from pagedserve.models.fetch import resolve_model

    return str(resolve_model(model))


def create_engine_config(args: EngineArgs, startup: StartupTracker | None = None) -> EngineConfig:
    """Resolve every 'auto' and default in EngineArgs into frozen configs (no weights are read)."""
    from pagedserve.models.loader import load_hf_config
    from pagedserve.models.validate import validate_model_path
    from pagedserve.platform import default_device, resolve_dtype, usable_cpu_count

    startup = startup or StartupTracker()
    check_engine_args(args)
    startup.enter("resolving")
    model_path = resolve_model_path(args.model)
    startup.enter("validating")
    validate_model_path(model_path)
    startup.enter("planning")
    hf_config = load_hf_config(model_path)
    architecture = (getattr(hf_config, "architectures", None) or ["?"])[0]
    device = default_device() if args.device == "auto" else args.device
    config_dict = hf_config.to_dict()
    model_dtype = str(config_dict.get("dtype") or config_dict.get("torch_dtype") or "")
    dtype = resolve_dtype(args.dtype, device, model_dtype.removeprefix("torch.") or None)
    task = _resolve_task(args, architecture, model_path)
    pooler = _pooler_config(model_path, architecture, hf_config) if task == "embed" else None
    max_model_len = _max_model_len(args, hf_config, model_path if task == "embed" else None)
    # An encoder attends in both directions, so a prompt cannot be split across steps: no chunked prefill,
    # and a budget that holds the longest prompt. Pooling that reads every token's hidden state cannot
    # skip a cached prefix; last-token pooling of a causal decoder can (its K/V are what a hit reuses).
    encoder = task == "embed" and is_encoder(architecture)
    chunked_prefill = args.enable_chunked_prefill and not encoder
    prefix_caching = args.enable_prefix_caching and not (pooler is not None and (encoder or pooler.needs_all_tokens))
    budget = args.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS
    if not chunked_prefill:
        budget = max(budget, max_model_len)
    from pagedserve.models.fetch import DEFAULT_MODEL

    served_name = args.served_model_name or args.model or DEFAULT_MODEL
    model = ModelConfig(model=model_path, served_model_name=served_name, dtype=dtype, max_model_len=max_model_len, hf_config=hf_config,
                        architecture=architecture, task=task, pooler=pooler, seed=args.seed,
                        quantization=args.quantization, enforce_eager=args.enforce_eager,
                        reference_kernels=args.reference_kernels)
    scheduler = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=budget,
                                max_model_len=max_model_len, enable_chunked_prefill=chunked_prefill,
                                max_waiting_requests=args.max_waiting_requests)
    num_blocks = _num_kv_blocks(args, hf_config, dtype, max_model_len)
    cache = CacheConfig(block_size=args.block_size, num_blocks=num_blocks,
                        enable_prefix_caching=prefix_caching, kv_cache_dtype=args.kv_cache_dtype)
    threads = args.num_threads or usable_cpu_count()
    return EngineConfig(model, cache, scheduler, DeviceConfig(device=device, num_threads=threads))


def check_engine_args(args: EngineArgs) -> None:
    if args.tensor_parallel_size != 1:
        raise ValueError(f"--tensor-parallel-size {args.tensor_parallel_size} is not supported yet; "
                         "use --tensor-parallel-size 1")
    if args.quantization not in SUPPORTED_QUANTIZATION:
        raise ValueError(f"--quantization {args.quantization} is not supported; supported: "
                         f"{', '.join(q for q in SUPPORTED_QUANTIZATION if q)}")
    if args.kv_cache_dtype not in SUPPORTED_KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype {args.kv_cache_dtype} is not supported; supported: "
                         f"{', '.join(SUPPORTED_KV_CACHE_DTYPES)}")
    if args.task not in ("auto", "generate", "embed"):
        raise ValueError(f"--task {args.task} is not supported; use auto, generate or embed")
    if args.runner not in RUNNER_TASKS:
        raise ValueError(f"--runner {args.runner} is not supported; use {', '.join(RUNNER_TASKS)}")
    runner_task = RUNNER_TASKS[args.runner]
    if args.task != "auto" and runner_task is not None and runner_task != args.task:
        raise ValueError(f"--runner {args.runner} contradicts --task {args.task}; give one of them")
    if args.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
        raise ValueError(f"--block-size must be a power of two from 1 to 128, got {args.block_size}")
    if args.max_num_seqs < 1:
        raise ValueError(f"--max-num-seqs must be >= 1, got {args.max_num_seqs}")
    if not 0.0 < args.gpu_memory_utilization <= 1.0:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}")


def _resolve_task(args: EngineArgs, architecture: str, model_path: str) -> str:
    """--task, else --runner, else what the model is (models/pooling_config.py's default_task)."""
    from pagedserve.models.pooling_config import DECODER_BASE_ARCHITECTURES, default_task

    task = args.task if args.task != "auto" else RUNNER_TASKS.get(args.runner)
    task = task or default_task(architecture, model_path)
    if task == "generate" and (is_encoder(architecture) or architecture in DECODER_BASE_ARCHITECTURES):
        raise ValueError(f"{architecture} is an embedding model without an LM head and cannot generate text; "
                         "serve it with --task embed (the default for it)")
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
    max_seq_length (the input length they were trained for; vLLM does the same)."""
    model_max = getattr(hf_config, "max_position_embeddings", None) or 2048
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
    return args.max_model_len


def kv_bytes_per_token(hf_config: Any, dtype_bytes: int) -> int:
    from pagedserve.models.llama import head_dim_of

    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    return 2 * hf_config.num_hidden_layers * num_kv_heads * head_dim_of(hf_config) * dtype_bytes


def _num_kv_blocks(args: EngineArgs, hf_config: Any, dtype: str, max_model_len: int) -> int:
    """KV pool size: an override, or bytes asked for, or enough for max_num_seqs full sequences capped
    at 4 GiB (vLLM-CPU's customary default). The memory planner refines this."""
    if args.num_gpu_blocks_override:
        return args.num_gpu_blocks_override
    dtype_bytes = 4 if dtype == "float32" else 2
    block_bytes = kv_bytes_per_token(hf_config, dtype_bytes) * args.block_size
    per_seq_blocks = -(-max_model_len // args.block_size)
    if args.kv_cache_memory:
        return max(2, args.kv_cache_memory // block_bytes + 1)
    wanted = args.max_num_seqs * per_seq_blocks
    capped = (4 << 30) // block_bytes
    return max(per_seq_blocks, min(wanted, capped)) + 1  # + the reserved null block
