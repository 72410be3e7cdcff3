"""LLMEngine: the synchronous step loop (schedule -> execute -> update -> detokenize)."""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from pagedserve import envs
from pagedserve.config import EngineConfig
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.sched_output import SchedulerOutput, SchedulerStats
from pagedserve.core.scheduler import Scheduler
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.engine.cpu_share import CpuShare
from pagedserve.engine.cpu_share import for_this_process as cpu_share_for_this_process
from pagedserve.engine.faults import FaultInjector, parse_fault_spec
from pagedserve.engine.memory_plan import log_memory_vs_plan
from pagedserve.engine.output_processor import OutputProcessor
from pagedserve.engine.prompt_checks import (check_generation_prompt, check_pooling_prompt, check_token_ids,
                                             token_id_list)
from pagedserve.engine.setup import (check_draft_tokenizer, check_tokenizer_fits, create_engine_config,
                                     generation_config_eos_ids, load_tokenizer, log_speculation, make_runner)
from pagedserve.engine.startup import StartupTracker
from pagedserve.exceptions import EngineDeadError, InvalidRequestError
from pagedserve.memory.pressure import MemoryPressure, give_way, release_free_kv
from pagedserve.memory.rss import ResidentMemory, resident_memory_for
from pagedserve.outputs import PoolingRequestOutput, RequestOutput
from pagedserve.platform import configure_threads
from pagedserve.pooling_params import PoolingParams, tokenize_for_pooling
from pagedserve.request import Request, RequestStatus
from pagedserve.sampling_params import SamplingParams
from pagedserve.spec_decode import make_proposer
from pagedserve.structured.admission import GrammarAdmission
from pagedserve.structured.compiler import GrammarCompiler
from pagedserve.structured.params import StructuredOutputsConfig

logger = logging.getLogger(__name__)

# A prompt given as text, token ids, or a dict {"prompt": ...} / {"prompt_token_ids": ...}.
PromptType = str | list[int] | dict


def _bind_engine_thread(engine: object, cores: list[int]) -> None:
    """Bind the thread that builds the engine (it runs its steps, and OpenMP's threads start from it) to `cores`;
    an offline caller's thread gets its affinity back when the engine is gone."""
    import threading

    from pagedserve.distributed.binding import bind_this_thread, format_cores, restore_thread_affinity

    previous = bind_this_thread(cores)
    if previous is not None:
        logger.info("engine bound to cores %s (--cpu-binding or VLLM_CPU_OMP_THREADS_BIND)", format_cores(cores))
        weakref.finalize(engine, restore_thread_affinity, threading.get_native_id(), previous)


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer: Any, startup: StartupTracker | None = None,
                 warm_up: bool = True) -> None:
        startup = startup or StartupTracker()
        self.config = config
        self.tokenizer = tokenizer
        if config.parallel.tensor_parallel_size == 1 and config.parallel.cpu_binding:  # --cpu-binding CORES
            _bind_engine_thread(self, list(config.parallel.cpu_binding[0]))
        if config.device.device == "cpu":
            previous = configure_threads(config.device.num_threads)
            if previous != config.device.num_threads:  # an offline caller's torch gets its threads back with us
                weakref.finalize(self, configure_threads, previous)
        log_speculation(config)
        startup.enter("loading_weights")
        self.eos_token_id = tokenizer.eos_token_id
        # Before the weights load: a GGUF's header (its end-of-turn ids) is parsed once, and dropped after loading.
        self.extra_eos_token_ids = generation_config_eos_ids(config.model.model, self.eos_token_id, tokenizer)
        self.runner = make_runner(config, startup.set_progress, self.eos_token_id, self.extra_eos_token_ids)
        startup.enter("allocating_kv")
        self.runner.allocate_kv_cache()
        # The scheduler allocates from it; the engine reads its written blocks (RSS) and releases free pages.
        cache = config.cache
        self.kv = KVCacheManager(cache.num_blocks, cache.block_size, cache.enable_prefix_caching,
                                 cache.num_window_blocks, cache.sliding_window)
        self.faults = FaultInjector()  # armed after warm-up: injected faults are for requests, not start-up
        proposer = make_proposer(config.speculative)
        self.scheduler = Scheduler(config.scheduler, self.kv, fault_hook=self.faults.check, proposer=proposer)
        self.output_processor = OutputProcessor(tokenizer)
        self.structured_config = config.structured_outputs or StructuredOutputsConfig()
        self.grammar_compiler = GrammarCompiler(tokenizer, config.model.hf_config.vocab_size,
                                                disable_any_whitespace=self.structured_config.disable_any_whitespace,
                                                compile_timeout_s=self.structured_config.compile_timeout_s)
        self.grammar_admission = GrammarAdmission(self.structured_config.compile_timeout_s)
        self.stats = SchedulerStats()
        self._request_counter = 0
        self._failed: dict[str, str | BaseException] = {}  # request id -> reason, not yet told to the caller
        self._is_probing = False
        self.resident_memory: ResidentMemory | None = None  # RSS against the plan, from the first served step
        self.memory_pressure: MemoryPressure | None = None  # give_way_under(): give way when the box is short
        self.cpu_share: CpuShare | None = None  # fewer threads while other processes keep the CPUs busy (after warm-up)
        self.idle_since: float | None = None  # when the last step left nothing to run (None: busy, or released)
        self.clock = time.monotonic
        if warm_up:
            startup.enter("warming_up")
            self.warm_up()
        self.cpu_share = self._cpu_share()
        self.faults.rules = parse_fault_spec(config.fault_injection)
        log_memory_vs_plan(config.memory_plan, config.device.device)
        self.resident_memory = resident_memory_for(config.memory_plan, config.device.device,
                                                   self.kv.num_blocks_written, self.kv.num_window_blocks_written)
        startup.enter("ready")

    def _cpu_share(self) -> CpuShare | None:
        """engine/cpu_share.py's watch over the CPUs, where the engine may change its thread count: one process on a
        CPU, not in batch-invariant mode, not turned off."""
        device = self.config.device
        if (device.device != "cpu" or not device.cpu_give_way or envs.batch_invariant()
                or self.config.parallel.tensor_parallel_size > 1):
            return None
        return cpu_share_for_this_process(device.num_threads)

    @property
    def cpu_threads(self) -> int | None:
        """The threads steps run on now (fewer than configured while the engine gives way), None on a GPU."""
        if self.config.device.device != "cpu":
            return None
        return self.config.device.num_threads if self.cpu_share is None else self.cpu_share.threads

    @classmethod
    def from_engine_args(cls, args: EngineArgs, startup: StartupTracker | None = None) -> "LLMEngine":
        startup = startup or StartupTracker()
        config = create_engine_config(args, startup)
        tokenizer = load_tokenizer(args.tokenizer or config.model.model)
        check_tokenizer_fits(tokenizer, config, args.tokenizer)
        check_draft_tokenizer(tokenizer, config)  # before any weight is read
        return cls(config, tokenizer, startup)

    @property
    def is_pooling(self) -> bool:
        """This engine embeds (task "embed"): it takes PoolingParams, not SamplingParams."""
        return self.config.model.task == "embed"

    def warm_up(self) -> None:
        """Pay the first request's costs now: page in every weight, build the kernels for prefill, batched
        decode with padding, greedy and random sampling and logprobs (for an embedding model: a batch of
        two prompts of different lengths, padded). Leaves no trace in caches or stats.

        Two steps (a prefill, then a decode; a draft model's proposal and verification take two more) of two
        short prompts, unless a linear switches paths above some batch size (runner.warm_up_rows): then the
        prefill holds more rows than that, since the path above (a dense oneDNN matmul) compiles on its first
        call. Every other path has no first-call cost that grows with the rows; a 41-row prefill and four
        steps were 0.5 s of the 0.5B model's start on the AVX2 box."""
        vocab_size = self.config.model.hf_config.vocab_size
        rows = self.runner.warm_up_rows()
        steps = 4 if self.config.draft_model is not None else 2
        longest = max(1, self.max_model_len - steps)
        lengths = [min(longest, max(4, rows // 2 + 4)), min(longest, max(3, rows - rows // 2 + 1))]
        prompts = [[(7 * i + 3) % vocab_size for i in range(lengths[0])],
                   [(5 * i + 1) % vocab_size for i in range(lengths[1])]]
        params: list[SamplingParams | PoolingParams] = [
            SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True, logprobs=1),
            SamplingParams(temperature=0.8, top_p=0.9, top_k=40, max_tokens=steps, ignore_eos=True, seed=0)]
        if self.is_pooling:
            params = [PoolingParams(), PoolingParams()]
        for index, (prompt, param) in enumerate(zip(prompts, params)):
            self.add_request(f"warmup-{index}", {"prompt_token_ids": prompt}, param)
        while self.has_unfinished_requests():
            self.step()
        self.scheduler.reset_after_warm_up()
        self.stats = SchedulerStats()

    @property
    def max_model_len(self) -> int:
        return self.config.model.max_model_len

    # ---- requests ----------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            # salt: add_request's; a field given as None is not given (vLLM's prompt dicts leave them out)
            unknown = sorted(k for k in set(prompt) - {"prompt", "prompt_token_ids", "cache_salt"}
                             if prompt[k] is not None)
            if unknown:  # vLLM's other prompt kinds: refused by name, never served as plain text
                raise InvalidRequestError(f"prompt field {unknown[0]!r} is not supported: pagedserve takes text "
                                          "prompts ({'prompt': ...}) and token ids ({'prompt_token_ids': ...}); "
                                          "no images, audio, prompt embeddings or encoder prompts", param="prompt")
            if "prompt_token_ids" not in prompt and "prompt" not in prompt:
                raise InvalidRequestError("a prompt dict needs 'prompt' (text) or 'prompt_token_ids'", param="prompt")
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), token_id_list(prompt["prompt_token_ids"], "prompt")
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if not isinstance(prompt, Iterable):
            raise InvalidRequestError(f"a prompt is a string, a list of token ids or a dict with 'prompt' or "
                                      f"'prompt_token_ids', got {type(prompt).__name__}", param="prompt")
        return None, token_id_list(prompt, "prompt")

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Every token that ends a generation: the tokenizer's EOS and generation_config.json's."""
        return frozenset(t for t in (self.eos_token_id, *self.extra_eos_token_ids) if t is not None)

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
        params = _with_prompt_salt(prompt, params)
        text, prompt_ids = self.tokenize_prompt(prompt)
        keep = params.truncate_prompt_tokens  # vLLM's: the prompt's last k tokens (-1: max_model_len)
        if keep is not None:
            keep = self.max_model_len if keep == -1 else keep
            if len(prompt_ids) > keep:
                text, prompt_ids = None, prompt_ids[-keep:]
        self.validate_prompt(prompt_ids)
        self.validate_token_params(params)
        grammar_future, grammar = self._submit_grammar(params)
        if self.extra_eos_token_ids and not params.ignore_eos:  # ignore_eos ignores every EOS, as vLLM's
            params = params.clone(stop_token_ids=params.stop_token_ids + self.extra_eos_token_ids)
        self.check_fits_kv_cache(len(prompt_ids), params.max_tokens)
        # A pool smaller than max_model_len (--num-gpu-blocks-override) caps what an open-ended request may write.
        max_tokens = min(self.length_cap(len(prompt_ids), params.max_tokens), self.kv_room(len(prompt_ids)))
        arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        child_ids = self.output_processor.add_request(request_id, text, prompt_ids, params, arrival_time)
        for index, child_id in enumerate(child_ids):
            child_params = params
            if params.n > 1:
                # wrapped within int64, as the seed was checked: seed 2**63 - 1 with n = 2 was refused as 2**63
                seed = None if params.seed is None else (params.seed + index + 2**63) % 2**64 - 2**63
                child_params = params.clone(n=1, best_of=None, seed=seed)  # best_of: n's, checked above
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
                                      "(e.g. --task embed; offline LLM(..., task=\"embed\")) for embeddings",
                                      param="model")
        if not isinstance(params, PoolingParams):
            raise InvalidRequestError("this is an embedding model: give PoolingParams (or use LLM.embed), not "
                                      f"{type(params).__name__}", param="model")
        text, prompt_ids = self.tokenize_pooling_prompt(prompt, params)
        self.validate_prompt(prompt_ids, is_pooling=True)
        self.validate_dimensions(params.dimensions)
        arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        self.output_processor.add_pooling_request(request_id, text, prompt_ids, params, arrival_time,
                                                  model_normalizes=self.config.model.pooler.normalize)
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

    def check_fits_kv_cache(self, num_prompt_tokens: int, max_tokens: int | None) -> None:
        """InvalidRequestError where a prompt and the max_tokens it asks for can never be in the KV cache at once
        (only with a pool smaller than max_model_len): refused before it runs, not after its prefill."""
        if max_tokens is None:
            return
        # Only what it can write before max_model_len must fit (QA: 65537 with max_model_len 256 was refused).
        max_tokens = self.length_cap(num_prompt_tokens, max_tokens)
        if max_tokens > self.kv_room(num_prompt_tokens):
            raise InvalidRequestError(f"the prompt's {num_prompt_tokens} tokens and max_tokens {max_tokens} need the "
                                      f"K/V of {num_prompt_tokens + max_tokens - 1} tokens, more than the whole KV "
                                      f"cache holds ({self.kv.capacity_tokens} tokens); lower max_tokens or give the "
                                      "engine a larger KV cache", param="max_tokens")

    def length_cap(self, num_prompt_tokens: int, max_tokens: int | None) -> int:
        """Tokens a request with this prompt may generate before max_model_len stops it, or its max_tokens where
        that is fewer: a request stops there whatever its max_tokens, as vLLM's offline engine takes any."""
        room = self.max_model_len - num_prompt_tokens
        return room if max_tokens is None else min(room, max_tokens)

    def kv_room(self, num_prompt_tokens: int) -> int:
        """Tokens a request with this prompt can generate within the whole KV cache (the last one's K/V is never
        written, so prompt + max_tokens - 1 slots)."""
        return self.kv.capacity_tokens - num_prompt_tokens + 1

    def validate_prompt(self, prompt_ids: list[int], is_pooling: bool = False) -> None:
        """InvalidRequestError for prompts this model cannot take (engine/prompt_checks.py's rules)."""
        vocab_size = self.config.model.hf_config.vocab_size
        if is_pooling:
            check_pooling_prompt(prompt_ids, self.max_model_len, vocab_size)
        else:
            check_generation_prompt(prompt_ids, self.max_model_len, vocab_size)
        capacity = self.kv.capacity_tokens  # below max_model_len only with --num-gpu-blocks-override
        if len(prompt_ids) > capacity:
            raise InvalidRequestError(f"the prompt has {len(prompt_ids)} tokens, more than the whole KV cache holds "
                                      f"({capacity} tokens); give a shorter prompt, or start the server with a "
                                      "larger KV cache", param="prompt")

    def validate_token_params(self, params: SamplingParams) -> None:
        """Token ids in sampling parameters must be in the vocabulary (they index the logits)."""
        vocab_size = self.config.model.hf_config.vocab_size
        params.update_from_tokenizer(self.tokenizer, vocab_size)  # bad_words' token ids
        check_token_ids(params.stop_token_ids, vocab_size, "stop_token_ids")
        check_token_ids(list(params.logit_bias or ()), vocab_size, "logit_bias")
        check_token_ids(list(params.allowed_token_ids or ()), vocab_size, "allowed_token_ids")
        if params.priority and self.config.scheduler.policy != "priority":
            raise InvalidRequestError("priority needs the priority scheduling policy (serve --scheduling-policy "
                                      "priority, or LLM(..., scheduling_policy=\"priority\")): requests are served "
                                      "first come, first served", param="priority")
        most = self.config.model.max_logprobs
        most = vocab_size if most == -1 else most
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            asked = value
            if value == -1:  # vLLM's: the whole vocabulary, within --max-logprobs
                value = vocab_size
                setattr(params, name, value)
            if value is not None and value > most:
                what = f"-1 (the whole vocabulary, {vocab_size})" if asked == -1 else str(value)
                raise InvalidRequestError(f"{name} must be at most {most} (--max-logprobs, offline "
                                          f"LLM(max_logprobs=...)), got {what}", param=name)

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput | PoolingRequestOutput]:
        """Abort these requests (one id or several, as vLLM's)."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
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
                                    kv_cache_usage=self.kv.usage)

    def get_tokenizer(self) -> Any:  # vLLM's LLMEngine API
        return self.tokenizer

    @property
    def model_config(self) -> Any:  # vLLM's: max_model_len, dtype, ... of the served model
        return self.config.model

    def get_model_config(self) -> Any:
        return self.config.model

    @property
    def cache_config(self) -> Any:  # vLLM's: block_size, ... of the KV cache
        return self.config.cache

    @property
    def vllm_config(self) -> EngineConfig:  # vLLM's name for the engine's whole resolved configuration
        return self.config

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.num_unfinished + len(self.grammar_admission)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or len(self.grammar_admission) > 0

    def check_health(self) -> None:
        """EngineDeadError once the runner can run no more steps (a tensor-parallel rank died), idle or not."""
        try:
            self.runner.check_health()
        except Exception as exc:
            raise EngineDeadError(str(exc)) from exc

    def kernel_report(self) -> list[str]:
        """What the model's layers run, one line per kind of layer."""
        return self.runner.kernel_report()

    def give_way_under(self, pressure: MemoryPressure | None) -> None:
        """Before each step, give KV pages back and hold admissions while `pressure` says the box is short
        (the server's, memory/pressure.py); None stops that."""
        self.memory_pressure = pressure

    def give_way(self) -> None:
        """Under memory pressure (give_way_under), hold the waiting queue and give free KV blocks' pages back:
        before each step, and every half second while idle (an idle server's prefix cache is what it can free)."""
        if self.memory_pressure is None:
            return
        if give_way(self.memory_pressure, self.scheduler, self.kv, self.runner.release_kv_pages):
            self._measure_memory()

    def idle(self) -> None:
        """Every half second while a server has nothing to run: give way under memory pressure, hand back the
        heap of compiled grammars freed since the last step (a compile given up at its time limit returns later,
        and one too large for the cache is freed then, with no step to trim after it), and keep reading the CPUs'
        load (the thread count follows the neighbours while idle: the first steps after a pause ran on the count
        from before it until two fresh readings agreed, and /metrics' pagedserve:cpu_threads kept it, QA-P)."""
        if self.cpu_share is not None:
            self.cpu_share.check(idle=True)  # the next step applies it
        self.give_way()
        self._release_when_long_idle()
        freed = self.grammar_compiler.take_freed_bytes()
        if freed and self.resident_memory is not None:
            self.resident_memory.after_step(0, self.kv.num_blocks_written, True, self.kv.num_window_blocks_written,
                                            freed)

    def _release_when_long_idle(self) -> None:
        """Once idle for --kv-cache-idle-release-s, the free KV blocks' pages go back to the system, once per idle
        spell. A block's pages stay resident once written, and the prefix cache keeps freed blocks until no
        other block is left: a light, varied load left the whole pool resident (5.6 GiB of a 6.4 GiB plan after a
        25-minute soak whose requests never held 2 % of it, QA-Y), on a box whose other services need it. The
        plan counts the whole pool all the same; this gives it back when nothing uses it."""
        limit = self.config.cache.idle_release_s
        if (not limit or self.idle_since is None or self.config.device.device != "cpu"
                or self.clock() - self.idle_since < limit):
            return
        self.idle_since = None
        if release_free_kv(self.kv, self.runner.release_kv_pages, f"idle for {limit:g} s (--kv-cache-idle-release-s), "
                           "the prefix cache emptied"):
            self._measure_memory()

    def _measure_memory(self) -> None:
        """Read RSS now that KV pages went back: /health shows it at once, not a step later (idle)."""
        if self.resident_memory is not None:
            self.resident_memory.measure(self.kv.num_blocks_written, self.kv.num_window_blocks_written)

    def is_held(self) -> bool:
        """Nothing to step but requests held by memory pressure: a step would schedule nothing."""
        return self.scheduler.hold_waiting and not self.scheduler.running and not len(self.grammar_admission)

    def observe_grammar_compiles(self, callback: Callable[[float], None] | None) -> None:
        """`callback(seconds)` after each grammar compilation (the server's metrics)."""
        self.grammar_compiler.on_compiled = callback

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        """One engine step. A fault in one request's scheduling or post-processing fails that request; a
        fault in the model step fails the step's requests (blocks freed) and a probe step decides whether the
        engine goes on (EngineDeadError if the probe fails too). take_failed() reports the failed requests."""
        self._admit_compiled_grammars()
        if self.cpu_share is not None:
            configure_threads(self.cpu_share.check())
        self.give_way()
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
        is_idle = not self.has_unfinished_requests()
        self.idle_since = self.clock() if is_idle else None
        if is_idle:
            self._release_finished()
        if self.resident_memory is not None:
            self.resident_memory.after_step(sched_out.total_num_scheduled_tokens, self.kv.num_blocks_written, is_idle,
                                            self.kv.num_window_blocks_written, self.grammar_compiler.take_freed_bytes())
        return outputs

    def _release_finished(self) -> None:
        """Going idle: the runner drops the finished requests' state now, not at the next step, which may be hours
        away. A constrained request's state holds its compiled grammar (100+ MiB for a 20,000-value choice, not
        kept by the bounded cache), and the idle trim that follows can give its pages back only once it is freed
        (QA-G). An empty step: the runner only drops state."""
        finished_ids = self.scheduler.take_finished_ids()
        if finished_ids:
            self.runner.execute(SchedulerOutput(finished_request_ids=finished_ids))

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
            self.abort_request(probe_id)  # not left queued: the next call's step tried it again (QA-T)
            self._failed.pop(probe_id, None)
            raise EngineDeadError(f"{reason}; the retry step failed too: {type(exc).__name__}: {exc}") from exc
        finally:
            self._is_probing = False
        self._failed.pop(probe_id, None)
        logger.warning("the retry step after a failed model step worked; the engine goes on")
        return outputs


def _with_prompt_salt(prompt: PromptType, params: SamplingParams) -> SamplingParams:
    """vLLM's prompt dicts carry cache_salt ({"prompt": ..., "cache_salt": ...}); pagedserve's SamplingParams too."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is None or salt == params.cache_salt:
        return params
    if params.cache_salt is not None:
        raise InvalidRequestError(f"cache_salt is given twice, {salt!r} in the prompt and {params.cache_salt!r} in "
                                  "SamplingParams: give one", param="cache_salt")
    return params.clone(cache_salt=salt)
