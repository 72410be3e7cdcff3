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
from pagedserve.engine.faults import FaultInjector, parse_fault_spec
from pagedserve.engine.output_processor import OutputProcessor
from pagedserve.engine.startup import StartupTracker
from pagedserve.exceptions import EngineDeadError, InvalidRequestError
from pagedserve.memory.checkpoint import CheckpointInfo
from pagedserve.memory.plan import MemoryPlan
from pagedserve.memory.probe import AvailableMemory
from pagedserve.memory.pressure import MemoryPressure, give_way
from pagedserve.memory.rss import ResidentMemory, resident_memory_for
from pagedserve.models.pooling_config import is_encoder
from pagedserve.outputs import PoolingRequestOutput, RequestOutput
from pagedserve.pooling_params import PoolingParams, tokenize_for_pooling
from pagedserve.request import Request, RequestStatus
from pagedserve.sampling_params import SamplingParams
from pagedserve.spec_decode.config import SpeculativeConfig
from pagedserve.spec_decode.ngram import NgramProposer
from pagedserve.structured.admission import GrammarAdmission
from pagedserve.structured.compiler import GrammarCompiler
from pagedserve.structured.params import StructuredOutputsConfig
from pagedserve.worker.protocol import Runner

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
        self.eos_token_id = tokenizer.eos_token_id
        self.runner = _make_runner(config, startup.set_progress, self.eos_token_id)
        startup.enter("allocating_kv")
        self.runner.allocate_kv_cache()
        self.extra_eos_token_ids = _generation_config_eos_ids(config.model.model, self.eos_token_id)
        kv = KVCacheManager(config.cache.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching)
        self.faults = FaultInjector()  # armed after warm-up: injected faults are for requests, not start-up
        proposer = NgramProposer(config.speculative) if config.speculative is not None else None
        self.scheduler = Scheduler(config.scheduler, kv, fault_hook=self.faults.check, proposer=proposer)
        self.output_processor = OutputProcessor(tokenizer)
        self.structured_config = config.structured_outputs or StructuredOutputsConfig()
        self.grammar_compiler = GrammarCompiler(tokenizer, config.model.hf_config.vocab_size,
                                                disable_any_whitespace=self.structured_config.disable_any_whitespace)
        self.grammar_admission = GrammarAdmission(self.structured_config.compile_timeout_s)
        self.stats = SchedulerStats()
        self._request_counter = 0
        self._failed: dict[str, str | BaseException] = {}  # request id -> reason, not yet told to the caller
        self._is_probing = False
        self.resident_memory: ResidentMemory | None = None  # RSS against the plan, from the first served step
        self.memory_pressure: MemoryPressure | None = None  # set by the server: give way when the box is short
        if warm_up:
            startup.enter("warming_up")
            self.warm_up()
        self.faults.rules = parse_fault_spec(config.fault_injection)
        log_memory_vs_plan(config.memory_plan, config.device.device)
        self.resident_memory = resident_memory_for(config.memory_plan, config.device.device,
                                                   self.scheduler.kv.pool.num_blocks_written)
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
        self.faults.check("add", request_id)
        if isinstance(params, PoolingParams) or self.is_pooling:
            return self._add_pooling_request(request_id, prompt, params, arrival_time)
        text, prompt_ids = self.tokenize_prompt(prompt)
        self.validate_prompt(prompt_ids)
        self.validate_token_params(params)
        grammar_future, grammar = self._submit_grammar(params)
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
            request = Request(child_id, prompt_ids, child_params, self.eos_token_id, max_tokens, arrival_time,
                              grammar=grammar)
            if grammar_future is not None and grammar is None:
                self.grammar_admission.hold(request, grammar_future)  # no KV blocks until it is compiled
            else:
                self.scheduler.add_request(request)
        return request_id

    def _submit_grammar(self, params: SamplingParams) -> tuple[Any, Any]:
        """(Future, compiled grammar or None while it compiles) for a constrained request; (None, None) for a
        free one. Raises InvalidRequestError for a grammar that is already known to be bad."""
        if params.structured_outputs is None:
            return None, None
        future = self.grammar_compiler.submit(params.structured_outputs)
        return future, future.result() if future.done() else None  # result() raises a rejected grammar's 400

    def _admit_compiled_grammars(self) -> None:
        """Move requests whose grammar is ready into the scheduler; fail those it cannot serve (a 400)."""
        if not len(self.grammar_admission):
            return
        if not self.scheduler.has_unfinished_requests():
            self.grammar_admission.wait(0.02)  # nothing else to step: do not spin while the grammar compiles
        ready, failed = self.grammar_admission.take_ready()
        for request in ready:
            self.scheduler.add_request(request)
        self._fail_children(failed)

    def _add_pooling_request(self, request_id: str, prompt: PromptType, params: PoolingParams,
                             arrival_time: float | None) -> str:
        if not self.is_pooling:
            raise InvalidRequestError("this model generates text and cannot embed; start an embedding model "
                                      "(e.g. --task embed) for embeddings", param="model")
        if not isinstance(params, PoolingParams):
            raise InvalidRequestError("this is an embedding model: give PoolingParams (or use LLM.embed), not "
                                      f"{type(params).__name__}", param="model")
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
            raise InvalidRequestError(f"dimensions: this model does not support Matryoshka embeddings, so its vectors "
                             f"cannot be shortened (its config.json declares neither is_matryoshka nor "
                             f"matryoshka_dimensions); omit dimensions to get all {hidden_size}", param="dimensions")
        if allowed and dimensions not in allowed:
            raise InvalidRequestError(f"dimensions {dimensions} is not one this model was trained for: "
                                      f"{', '.join(map(str, allowed))}", param="dimensions")
        if not 1 <= dimensions <= hidden_size:
            raise InvalidRequestError(f"dimensions must be between 1 and the model's {hidden_size}, got "
                                      f"{dimensions}", param="dimensions")

    def validate_prompt(self, prompt_ids: list[int], is_pooling: bool = False) -> None:
        """InvalidRequestError (param "prompt") for prompts this model cannot take."""
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty: give at least one token", param="prompt")
        if is_pooling and len(prompt_ids) > self.max_model_len:
            raise InvalidRequestError(f"the input is {len(prompt_ids)} tokens long, but this model's maximum input "
                                      f"length is {self.max_model_len} tokens; shorten it or set "
                                      "truncate_prompt_tokens", param="input")
        if not is_pooling and len(prompt_ids) >= self.max_model_len:
            raise InvalidRequestError(f"the prompt is {len(prompt_ids)} tokens long, but this model's maximum "
                                      f"context length is {self.max_model_len} tokens (prompt + output); shorten "
                                      "the prompt", param="prompt")
        self._check_token_ids(prompt_ids, "input" if is_pooling else "prompt")

    def validate_token_params(self, params: SamplingParams) -> None:
        """Token ids in sampling parameters must be in the vocabulary (they index the logits)."""
        self._check_token_ids(params.stop_token_ids, "stop_token_ids")
        self._check_token_ids(list(params.logit_bias or ()), "logit_bias")

    def _check_token_ids(self, token_ids: list[int], param: str) -> None:
        vocab_size = self.config.model.hf_config.vocab_size
        bad = [t for t in token_ids if not (isinstance(t, int) and 0 <= t < vocab_size)]
        if bad:
            raise InvalidRequestError(f"{param}: token id {bad[0]} is out of range [0, {vocab_size})", param=param)

    def abort_request(self, request_ids: list[str]) -> list[RequestOutput | PoolingRequestOutput]:
        finals = []
        for request_id in request_ids:
            self.grammar_admission.discard(self.output_processor.child_ids(request_id))
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
        return self.scheduler.has_unfinished_requests() or len(self.grammar_admission) > 0

    def check_health(self) -> None:
        """EngineDeadError once the runner can run no more steps (a tensor-parallel rank died), idle or not."""
        check = getattr(self.runner, "check_health", None)  # only runners with other processes have one
        if check is None:
            return
        try:
            check()
        except Exception as exc:
            raise EngineDeadError(str(exc)) from exc

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        """One engine step. A fault in one request's scheduling or post-processing fails that request; a
        fault in the model step fails the step's requests (blocks freed) and a probe step decides whether the
        engine goes on (EngineDeadError if the probe fails too). take_failed() reports the failed requests."""
        self._admit_compiled_grammars()
        if self.memory_pressure is not None:
            give_way(self.memory_pressure, self.scheduler, self.runner.kv_caches)
        sched_out = self.scheduler.schedule()
        self._fail_children(self.scheduler.take_failed())
        try:
            self.faults.check("step", *sched_out.num_scheduled_tokens)
            runner_out = self.runner.execute(sched_out)
        except Exception as exc:  # noqa: BLE001 - the step's requests fail; the probe decides the rest
            if self._is_probing:
                raise
            logger.error("model step failed for %d requests: %s: %s", len(sched_out.num_scheduled_tokens),
                         type(exc).__name__, exc, exc_info=exc)
            reason = f"the model step failed: {type(exc).__name__}: {exc}"
            self._fail_children(dict.fromkeys(sched_out.num_scheduled_tokens, reason))
            return self._probe_after_fault(reason)
        core_outputs = self.scheduler.update_from_output(sched_out, runner_out)
        self._fail_children(self.scheduler.take_failed())
        outputs, stopped = self.output_processor.process(core_outputs)
        if stopped:
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        self._fail_parents(self.output_processor.take_failed())
        self.stats = self.scheduler.make_stats()
        if self.resident_memory is not None:
            self.resident_memory.after_step(sched_out.total_num_scheduled_tokens,
                                            self.scheduler.kv.pool.num_blocks_written, not self.has_unfinished_requests())
        return outputs

    def take_failed(self) -> dict[str, str | BaseException]:
        """Requests (ids as given to add_request) failed since the last call -> reason: a string for an engine
        fault, an InvalidRequestError for a request found bad after it was queued (its grammar rejected)."""
        failed, self._failed = self._failed, {}
        return failed

    def fail_request(self, request_id: str, reason: str | BaseException) -> None:
        """End a request after a fault in its processing: its KV blocks are freed and it is reported."""
        self.grammar_admission.discard(self.output_processor.child_ids(request_id))
        self.scheduler.finish_requests(self.output_processor.child_ids(request_id), RequestStatus.FINISHED_ABORTED)
        self.output_processor.abort(request_id)
        self._failed[request_id] = reason

    def _fail_children(self, reasons: dict[str, str | BaseException]) -> None:
        parents: dict[str, str | BaseException] = {}
        for child_id, reason in reasons.items():
            parent_id = self.output_processor.parent_id(child_id)
            if parent_id is not None:
                parents.setdefault(parent_id, reason)
        self._fail_parents(parents)

    def _fail_parents(self, reasons: dict[str, str | BaseException]) -> None:
        for request_id, reason in reasons.items():
            self.fail_request(request_id, reason)

    def _probe_after_fault(self, reason: str) -> list[RequestOutput | PoolingRequestOutput]:
        """After a failed model step, run a one-token request: if that step works the engine goes on (the
        outputs of other requests that ran with it are returned); if it fails too, the engine is dead."""
        self._request_counter += 1
        probe_id = f"engine-probe-{self._request_counter}"
        params: SamplingParams | PoolingParams = (PoolingParams() if self.is_pooling
                                                  else SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        outputs: list[RequestOutput | PoolingRequestOutput] = []
        self._is_probing = True
        try:
            self.add_request(probe_id, {"prompt_token_ids": [0]}, params)
            while self.output_processor.has_request(probe_id):
                outputs.extend(o for o in self.step() if o.request_id != probe_id)
        except Exception as exc:
            raise EngineDeadError(f"{reason}; the retry step failed too: {type(exc).__name__}: {exc}") from exc
        finally:
            self._is_probing = False
        self._failed.pop(probe_id, None)
        logger.warning("the retry step after a failed model step worked; the engine goes on")
        return outputs


def _make_runner(config: EngineConfig, progress: Any, eos_token_id: int | None) -> Runner:
    """The runner for this architecture and task: ModelRunner generates; embedding models get
    worker/pooling_runner.py's (an encoder runner without KV cache, or a decoder one that pools)."""
    if config.model.task == "embed":
        from pagedserve.worker.pooling_runner import make_pooling_runner

        return make_pooling_runner(config, config.model.hf_config, progress)
    from pagedserve.worker.model_runner import ModelRunner

    return ModelRunner(config, config.model.hf_config, progress, eos_token_id=eos_token_id)


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


def create_engine_config(args: EngineArgs, startup: StartupTracker | None = None,
                         available: AvailableMemory | None = None, check_memory: bool = True) -> EngineConfig:
    """Resolve every 'auto' and default in EngineArgs into frozen configs and plan the memory (no weights are
    read). When the plan does not fit, raise InsufficientMemoryError after logging the table with the
    shortfall and the flags that would fit (check_memory=False returns the config with its plan instead).
    `available` replaces the probe of this host's (or GPU's) free memory."""
    from pagedserve.memory.checkpoint import read_checkpoint_info
    from pagedserve.models.validate import check_sliding_window, validate_model_path
    from pagedserve.platform import default_device, default_quantization, resolve_dtype, usable_cpu_count

    startup = startup or StartupTracker()
    check_engine_args(args)
    startup.enter("resolving")
    model_path = resolve_model_path(args.model)
    startup.enter("validating")
    validate_model_path(model_path)
    startup.enter("planning")
    checkpoint = read_checkpoint_info(model_path)  # headers only; a GGUF header is parsed once for all users
    hf_config = hf_config_from_checkpoint(checkpoint)
    architecture = (getattr(hf_config, "architectures", None) or ["?"])[0]
    device = default_device() if args.device == "auto" else args.device
    config_dict = hf_config.to_dict()
    model_dtype = str(config_dict.get("dtype") or config_dict.get("torch_dtype") or "")
    dtype = resolve_dtype(args.dtype, device, model_dtype.removeprefix("torch.") or None)
    task = _resolve_task(args, architecture, model_path)
    pooler = _pooler_config(model_path, architecture, hf_config) if task == "embed" else None
    max_model_len = _max_model_len(args, hf_config, model_path if task == "embed" else None)
    check_sliding_window(checkpoint.config, max_model_len)  # refused, never silently wrong past the window
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
                        quantization=default_quantization(args.dtype, args.quantization,
                                                          checkpoint.stores_quantized_matmuls(), device),
                        enforce_eager=args.enforce_eager,
                        reference_kernels=args.reference_kernels)
    scheduler = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=budget,
                                max_model_len=max_model_len, enable_chunked_prefill=chunked_prefill,
                                max_waiting_requests=args.max_waiting_requests)
    plan = plan_memory(args, checkpoint, model, scheduler, device, available)
    cache = CacheConfig(block_size=args.block_size, num_blocks=_num_kv_blocks(args, plan),
                        enable_prefix_caching=prefix_caching, kv_cache_dtype=args.kv_cache_dtype)
    threads = args.num_threads or usable_cpu_count()
    if check_memory:
        check_memory_plan(plan)
    return EngineConfig(model, cache, scheduler, DeviceConfig(device=device, num_threads=threads), memory_plan=plan,
                        fault_injection=args.fault_injection,
                        structured_outputs=StructuredOutputsConfig.parse(args.structured_outputs_config),
                        speculative=_speculative_config(args, task))


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
    parse_fault_spec(args.fault_injection)
    StructuredOutputsConfig.parse(args.structured_outputs_config)
    SpeculativeConfig.parse(args.speculative_config)
    if args.gpu_memory_utilization is not None and not 0.0 < args.gpu_memory_utilization <= 1.0:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}")


def _speculative_config(args: EngineArgs, task: str) -> SpeculativeConfig | None:
    speculative = SpeculativeConfig.parse(args.speculative_config)
    if speculative is not None and task == "embed":
        raise ValueError("--speculative-config applies to text generation, and this model embeds (task embed); "
                         "leave it out")
    return speculative


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


def _num_kv_blocks(args: EngineArgs, plan: MemoryPlan) -> int:
    """KV pool size: --num-gpu-blocks-override (testing), else the plan's blocks + the reserved null block.

    The plan sizes the pool from --kv-cache-memory (or VLLM_CPU_KVCACHE_SPACE), else by the CPU's shared-box
    default or the GPU's --gpu-memory-utilization rule (memory/plan.py): never below one full max_model_len
    sequence (else it refuses to start), never above max_num_seqs full sequences.
    """
    return args.num_gpu_blocks_override or plan.num_kv_blocks + 1


# ---- the memory plan -------------------------------------------------------------------------------
def plan_memory(args: EngineArgs, checkpoint: CheckpointInfo, model: ModelConfig, scheduler: SchedulerConfig,
                device: str, available: AvailableMemory | None = None) -> MemoryPlan:
    """The memory plan for serving `checkpoint` with these settings against the memory free now (the host's:
    cgroup limit - usage and MemAvailable; on a GPU its free memory), from headers only."""
    from dataclasses import replace

    from pagedserve.memory import plan as memory
    from pagedserve.memory.checkpoint import dtype_bytes

    if available is None:
        available = _probe_available_memory(device)
    weight_dtype_bytes = dtype_bytes(model.dtype)
    # An 8-bit KV cache (fp8*) stores one byte per value plus a scale per token and head in the model dtype.
    kv_8bit = args.kv_cache_dtype.startswith("fp8")
    kv_dtype_bytes, kv_scale_bytes = (1, weight_dtype_bytes) if kv_8bit else (weight_dtype_bytes, 0)
    shape = memory.ModelShape.from_hf_config(checkpoint.config, checkpoint.weight_bytes(weight_dtype_bytes))
    tied = bool(getattr(model.hf_config, "tie_word_embeddings", False))
    backend = _kernel_backend(model, device)
    weight_bytes = memory.prepared_weight_bytes(shape, weight_dtype_bytes, backend.linear_kind, tied,
                                                computes_logits=model.task == "generate",
                                                embedding_shares_packed=backend.native_bf16_linears)
    shape = replace(shape, weight_bytes=weight_bytes)
    block_bytes = memory.kv_bytes_per_token(shape, kv_dtype_bytes, kv_scale_bytes) * args.block_size
    kv_cache_bytes = args.kv_cache_memory
    if args.num_gpu_blocks_override:
        kv_cache_bytes = max(1, args.num_gpu_blocks_override - 1) * block_bytes  # minus the null block
    on_cpu = device == "cpu"
    overhead = memory.runtime_overhead_bytes(shape, model.max_model_len, scheduler.max_num_seqs, args.block_size,
                                             on_cpu=on_cpu)
    request = memory.PlanRequest(
        dtype_bytes=weight_dtype_bytes, kv_dtype_bytes=kv_dtype_bytes, max_model_len=model.max_model_len,
        max_num_seqs=scheduler.max_num_seqs, max_num_batched_tokens=scheduler.max_num_batched_tokens,
        block_size=args.block_size, available=available,
        memory_fraction=memory.DEFAULT_MEMORY_FRACTION if args.gpu_memory_utilization is None
        else args.gpu_memory_utilization,
        kv_share=memory.CPU_DEFAULT_KV_SHARE if on_cpu and args.gpu_memory_utilization is None else None,
        kv_cache_bytes=kv_cache_bytes, runtime_overhead_bytes=overhead,
        host_bytes_per_block=memory.HOST_BYTES_PER_KV_BLOCK if on_cpu else 0, kv_scale_bytes=kv_scale_bytes,
        quantization=model.quantization)
    plan = memory.make_plan(shape, request, quantizations=tuple(q for q in SUPPORTED_QUANTIZATION if q),
                            kv_cache_dtypes=tuple(d for d in SUPPORTED_KV_CACHE_DTYPES if d != "auto"))
    if args.num_gpu_blocks_override and plan.problems:  # testing: exactly the pool asked for, even a small one
        fits = plan.total_bytes <= plan.budget_bytes
        plan = replace(plan, problems=[], fits=fits, suggestions=[] if fits else plan.suggestions)
    return plan


def _kernel_backend(model: ModelConfig, device: str) -> Any:
    """The KernelBackend the loader will choose (it decides whether weights are copied into another format,
    and whether a tied embedding shares the packed logits matrix)."""
    from pagedserve.layers.backend import KernelBackend
    from pagedserve.platform import torch_dtype

    return KernelBackend.choose(device, torch_dtype(model.dtype), model.quantization, model.reference_kernels)


def _probe_available_memory(device: str) -> AvailableMemory:
    from pagedserve.memory import probe

    if device == "cuda":
        gpu = probe.cuda_available_memory()
        if gpu is not None:
            return gpu
    return probe.available_memory()


def check_memory_plan(plan: MemoryPlan) -> None:
    """Log the plan; when it does not fit, log it as an error and raise InsufficientMemoryError."""
    from pagedserve.memory.plan import InsufficientMemoryError, format_plan_table

    if not plan.fits:
        logger.error("refusing to start, the model does not fit in memory:\n%s", format_plan_table(plan))
        raise InsufficientMemoryError(plan)
    logger.info("%s", format_plan_table(plan))


def log_memory_vs_plan(plan: MemoryPlan | None, device: str) -> None:
    """After warm-up: the measured resident memory next to the plan's steady figure (weights + overhead +
    KV bookkeeping; the lazily allocated KV pool is resident only as written, see memory/plan.py)."""
    from pagedserve.memory import probe

    if plan is None:
        return
    mib = 1 << 20
    planned = (f"planned steady {plan.steady_bytes / mib:.0f} MiB (weights {plan.weight_bytes / mib:.0f} MiB"
               f" + overhead {plan.overhead_bytes / mib:.0f} MiB"
               f" + KV bookkeeping {plan.kv_bookkeeping_bytes / mib:.0f} MiB)")
    if device == "cuda":
        info = probe.cuda_free_memory()
        if info is not None:
            logger.info("memory: GPU %.0f MiB in use after warm-up; %s", (info[1] - info[0]) / mib, planned)
        return
    rss = probe.process_rss_bytes()
    if rss is not None:
        error = (rss - plan.steady_bytes) / max(rss, 1)
        logger.info("memory: RSS %.0f MiB after warm-up, %s: %+.1f %%; worst case with every KV block written"
                    " %.0f MiB", rss / mib, planned, 100 * error, plan.total_bytes / mib)


# ---- the model config ------------------------------------------------------------------------------
# Decoders whose transformers config the engine builds as a plain PretrainedConfig: the model-specific classes
# (LlamaConfig, ...) import ~1.5 s of transformers modules (torch.distributed, sympy) at start-up. Only when
# every value the model reads is in the checkpoint's config, so transformers' per-model defaults cannot
# differ; anything else (other models, rope scaling that needs transformers' rope functions) uses AutoConfig.
_PLAIN_CONFIG_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3"})
_PLAIN_CONFIG_REQUIRED_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                               "num_key_value_heads", "vocab_size", "max_position_embeddings")
# The same defaults in LlamaConfig, Qwen2Config and Qwen3Config (transformers 5; tests/models compare).
PLAIN_CONFIG_DEFAULTS = {"tie_word_embeddings": False, "hidden_act": "silu", "rms_norm_eps": 1e-6,
                         "attention_bias": False}


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
    """The transformers config of a checkpoint (see _PLAIN_CONFIG_MODEL_TYPES for why it is often plain)."""
    config = dict(checkpoint.config)
    if _is_plain_decoder_config(config):
        from transformers import PretrainedConfig

        return PretrainedConfig(**{**PLAIN_CONFIG_DEFAULTS, **config})
    from transformers import AutoConfig

    if checkpoint.is_gguf:
        return AutoConfig.for_model(config.pop("model_type"), **config)
    return AutoConfig.from_pretrained(checkpoint.path)
