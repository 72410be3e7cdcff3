"""The offline API, like vLLM's: LLM(model, ...).generate(prompts, sampling_params) / .chat(messages) /
.embed(prompts) for embedding models."""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry

from pagedserve.beam_search import BeamSearchOutput, check_candidates, generated_tokens, scoring_params, search
from pagedserve.engine import vllm_compat
from pagedserve.engine.arg_utils import EngineArgs, keyword_aliases, read_keywords
from pagedserve.engine.llm_engine import LLMEngine, PromptType
from pagedserve.exceptions import InvalidRequestError, request_error
from pagedserve.metrics import EngineMetrics
from pagedserve.metrics_reader import Metric, get_metrics_snapshot
from pagedserve.outputs import PoolingRequestOutput, RequestOutput
from pagedserve.platform import release_free_heap
from pagedserve.pooling_params import PoolingParams, check_truncated
from pagedserve.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from pagedserve.scoring import ScoringOutput, ScoringRequestOutput, check_pairs, cosine_scores

logger = logging.getLogger(__name__)

Conversation = list[dict[str, Any]]
_Call = TypeVar("_Call", bound=Callable[..., Any])


def _one_call_at_a_time(method: _Call) -> _Call:
    """A call that runs the engine holds the LLM's lock: a call from another thread waits for it to end. Two
    threads stepping one engine each took the other's outputs (KeyError; QA-X); vLLM's LLM is not thread-safe
    either, and here the calls are served one after the other."""
    @functools.wraps(method)
    def locked(self: LLM, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)

    return locked  # type: ignore[return-value]


class LLM:
    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        """`kwargs`: EngineArgs' fields, and vLLM's that pagedserve takes without effect (trust_remote_code,
        swap_space, ...; engine/vllm_compat.py: logged) or refuses with a reason (ValueError)."""
        # vLLM's LLM defaults it to True; False records vLLM's metrics for get_metrics() (no stats line is logged)
        log_stats = kwargs.pop("disable_log_stats", True) is False
        self._lock = threading.RLock()  # _one_call_at_a_time
        # vLLM's: a constrained request's grammar begins after the think block (the text is not split here)
        self._reasoning_parser = _reasoning_parser(kwargs.pop("reasoning_parser", None))
        _check_keyword_names(kwargs)
        kwargs, notes = vllm_compat.split_keywords(kwargs, model)
        for note in notes:
            logger.info("%s", note)
        self.engine = LLMEngine.from_engine_args(EngineArgs(model=model, **read_keywords(EngineArgs, kwargs)))
        self._reasoning_tags = None  # (<think>, </think>) ids where the parser is given and they are single tokens
        if self._reasoning_parser is not None:
            from pagedserve.entrypoints.openai.reasoning import think_tag_ids

            self._reasoning_tags = think_tag_ids(self.engine.tokenizer)
        self._metrics = (EngineMetrics.for_engine(self.engine, CollectorRegistry(), outputs_per_step=False)
                         if log_stats else None)
        # Once the engine is freed, the freed C heap goes back to the system: glibc keeps it otherwise, and after
        # `del llm` a 0.5B model's ~350 MiB stayed resident until another model loaded. At the engine's end, not
        # the LLM's: a script that kept llm.llm_engine frees it later (606 MiB stayed, QA-X).
        weakref.finalize(self.engine, _release_free_heap).atexit = False

    def __del__(self) -> None:
        """Dropping an LLM frees its engine at once, the last reference unless the caller kept llm.llm_engine."""
        self.__dict__.pop("engine", None)

    @property
    def llm_engine(self) -> LLMEngine:
        """The engine, under vLLM's name for it (`llm.llm_engine`)."""
        return self.engine

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def set_tokenizer(self, tokenizer: Any) -> None:
        """vLLM's; not here: the engine's detokenizer, chat template and grammars are built on its tokenizer."""
        raise ValueError("LLM.set_tokenizer is not supported: give the tokenizer when the LLM is made, "
                         "LLM(model, tokenizer=PATH)")

    @_one_call_at_a_time
    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (vLLM's); False while requests hold blocks."""
        return self.engine.scheduler.kv.reset_prefix_cache()

    def get_metrics(self) -> list[Metric]:
        """vLLM's snapshot of the engine's vllm:* metrics since it started (metrics_reader: Counter, Gauge, Vector,
        Histogram), as its /metrics would show them. Needs LLM(..., disable_log_stats=False), as vLLM's does."""
        if self._metrics is None:
            raise RuntimeError("metrics are not recorded: create the LLM with disable_log_stats=False (vLLM's LLM "
                               "defaults it to True) to read them with get_metrics()")
        return get_metrics_snapshot(self._metrics.registry)

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate() and chat() sample with when given no SamplingParams: the model's recommended
        defaults (generation_config.json, --generation-config), else SamplingParams()'s."""
        return SamplingParams(**self.engine.config.model.default_sampling)

    @_one_call_at_a_time
    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request: Any = None, priority: Sequence[int] | None = None
                 ) -> list[RequestOutput]:
        """Run every prompt to completion in one continuous batch; outputs in input order. `use_tqdm` and
        `lora_request` are vLLM's arguments: no progress bar is drawn, and a LoRA request is refused; `priority`
        (vLLM's, one per prompt) needs scheduling_policy="priority"."""
        _check_lora(lora_request)
        prompt_list = _as_prompt_list(prompts)
        if priority is not None and len(priority) != len(prompt_list):
            raise ValueError(f"priority has {len(priority)} values for {len(prompt_list)} prompts: give one per prompt")
        # Only final outputs are returned: skip building intermediate ones every step.
        params_list = [p.clone(output_kind=RequestOutputKind.FINAL_ONLY)
                       for p in _as_params_list(sampling_params or self.get_default_sampling_params(),
                                                len(prompt_list))]
        if priority is not None:
            params_list = [p.clone(priority=int(rank)) for p, rank in zip(params_list, priority)]
        params_list = [self._with_reasoning_gate(p, prompt) for prompt, p in zip(prompt_list, params_list)]
        return self._run(self._add_all(prompt_list, params_list))

    def _with_reasoning_gate(self, params: SamplingParams, prompt: PromptType, continued: str | None = None
                             ) -> SamplingParams:
        """`params` with the grammar gated after the think block (reasoning_parser given, the request constrained,
        the model's tags single tokens); `continued`: the assistant message a continue_final_message chat
        continues."""
        if self._reasoning_parser is None or params.structured_outputs is None or params.reasoning_gate is not None:
            return params
        from pagedserve.entrypoints.openai.reasoning import grammar_gate, prompt_block

        gate = grammar_gate(self._reasoning_parser, self._reasoning_tags,
                            prompt_block(_prompt_tail(prompt, self.engine.tokenizer), continued))
        return params if gate is None else params.clone(reasoning_gate=gate)

    def chat(self, messages: Conversation | list[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, lora_request: Any = None, chat_template: str | None = None,
             chat_template_content_format: str = "auto", add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None,
             mm_processor_kwargs: dict | None = None) -> list[RequestOutput]:
        """Apply the tokenizer's chat template (or `chat_template`: a template, or a file's path as serve's
        --chat-template) to each conversation (with `tools`, OpenAI-shaped, as vLLM's LLM.chat), then generate.
        Tool calls are not parsed here: force one with SamplingParams(structured_outputs=...) or read the
        model's format from the text. continue_final_message leaves the final (assistant) message open for the
        model to go on with; it needs add_generation_prompt=False, as in vLLM. Arguments in vLLM's order;
        content may be OpenAI's list of {"type": "text"} parts (chat_template_content_format as serve's)."""
        _check_lora(lora_request)
        if mm_processor_kwargs:  # vLLM's: for image/audio processors
            raise ValueError("mm_processor_kwargs: multimodal inputs are not supported (text models only)")
        if self.engine.is_pooling:  # it said "the tokenizer has no chat template"
            raise ValueError("LLM.chat generates text; this model embeds (task embed): use LLM.embed")
        if not messages:
            raise ValueError("messages must not be empty: give a conversation (a list of {\"role\": ..., "
                             "\"content\": ...} dicts) or a list of them")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        for conversation in conversations if isinstance(conversations, list) else [conversations]:
            _check_conversation(conversation)
        if tools:
            chat_template_kwargs = {**(chat_template_kwargs or {}), "tools": tools}
        prompts = [self.apply_chat_template(c, add_generation_prompt, chat_template_kwargs, chat_template,
                                            continue_final_message, chat_template_content_format)
                   for c in conversations]
        decode = self.engine.tokenizer.decode  # outputs carry the rendered prompt's text, as vLLM's
        texts = [decode(p) for p in prompts]
        if self._reasoning_parser is not None:  # gated here, where the continued message is known
            params_list = _as_params_list(sampling_params or self.get_default_sampling_params(), len(prompts))
            sampling_params = [self._with_reasoning_gate(p, text, _message_text(c[-1]) if continue_final_message
                                                         else None)
                               for p, text, c in zip(params_list, texts, conversations)]
        return self.generate([{"prompt": t, "prompt_token_ids": p} for t, p in zip(texts, prompts)], sampling_params)

    def apply_chat_template(self, conversation: Conversation, add_generation_prompt: bool = True,
                            chat_template_kwargs: dict | None = None, chat_template: str | None = None,
                            continue_final_message: bool = False, chat_template_content_format: str = "auto"
                            ) -> list[int]:
        tokenizer = self.engine.tokenizer
        if chat_template is not None:
            from pagedserve.chat_template import load_chat_template

            template = load_chat_template(chat_template, name="LLM.chat(chat_template=...)")
            chat_template_kwargs = {**(chat_template_kwargs or {}), "chat_template": template}
        elif not getattr(tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; use generate() with a plain prompt "
                             "or give chat_template")
        from pagedserve.entrypoints.openai.chat_format import render_conversation
        from pagedserve.entrypoints.openai.options import CONTENT_FORMATS
        from pagedserve.entrypoints.openai.protocol import ChatMessage

        if chat_template_content_format not in CONTENT_FORMATS:
            raise ValueError(f"chat_template_content_format must be one of {', '.join(CONTENT_FORMATS)}, got "
                             f"{chat_template_content_format!r}")
        # chat_template_kwargs over the arguments, as vLLM's LLM.chat updates its own with them
        kwargs = {"add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message,
                  **(chat_template_kwargs or {})}
        text = render_conversation(tokenizer, [ChatMessage(**m) for m in conversation], chat_template_content_format,
                           **kwargs)
        # The template already holds any BOS token: do not add special tokens again.
        return tokenizer.encode(text, add_special_tokens=False)

    @_one_call_at_a_time
    def embed(self, prompts: PromptType | Sequence[PromptType],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              lora_request: Any = None) -> list[PoolingRequestOutput]:
        """Embed every prompt (text, token ids, or a dict with "prompt_token_ids") in one continuous batch.

        Outputs are in input order and shaped like vLLM's: `outputs[i].outputs.embedding` is a list of
        floats (normalised when the model's sentence-transformers pipeline normalises)."""
        _check_lora(lora_request)
        prompt_list = _as_prompt_list(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            params = pooling_params or PoolingParams(truncate_prompt_tokens=truncate_prompt_tokens)
            params_list = [params] * len(prompt_list)
        else:
            params_list = list(pooling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(f"got {len(params_list)} PoolingParams for {len(prompt_list)} prompts")
        return self._run(self._add_all(self._pretokenize(prompt_list, params_list), params_list))

    def score(self, data_1: PromptType | Sequence[PromptType], data_2: PromptType | Sequence[PromptType],
              truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              pooling_params: PoolingParams | None = None, lora_request: Any = None) -> list[ScoringRequestOutput]:
        """vLLM's score for an embedding model: the cosine similarity of each pair (one data_1 against every data_2,
        or pairs in order), one ScoringRequestOutput per pair (`.outputs.score`)."""
        left, right = _as_prompt_list(data_1), _as_prompt_list(data_2)
        check_pairs(left, right, ("data_1", "data_2"))
        if pooling_params is None:
            pooling_params = PoolingParams(truncate_prompt_tokens=truncate_prompt_tokens)
        outputs = self.embed(left + right, pooling_params, use_tqdm=use_tqdm, lora_request=lora_request)
        scores = cosine_scores([o.outputs.embedding for o in outputs[:len(left)]],
                               [o.outputs.embedding for o in outputs[len(left):]])
        firsts = outputs[:len(left)] * (len(right) if len(left) == 1 else 1)
        return [ScoringRequestOutput(f"{a.request_id}_{b.request_id}", ScoringOutput(score), b.prompt_token_ids)
                for a, b, score in zip(firsts, outputs[len(left):], scores)]

    @_one_call_at_a_time
    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    lora_request: Any = None, use_tqdm: bool = False, concurrency_limit: int | None = None
                    ) -> list[BeamSearchOutput]:
        """vLLM's beam search (pagedserve/beam_search.py has the rules): one BeamSearchOutput per prompt, its
        best `beam_width` sequences first. As vLLM's, a sequence's `tokens` and `text` include the prompt.
        `concurrency_limit` prompts are searched at once (default: all)."""
        _check_lora(lora_request)
        if self.engine.is_pooling:
            raise ValueError("this is an embedding model: beam search needs a generative model")
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be BeamSearchParams, got {type(params).__name__}")
        if concurrency_limit is not None and concurrency_limit < 1:
            raise ValueError(f"concurrency_limit must be >= 1, got {concurrency_limit}")
        check_candidates(params, self.engine.config.model.max_logprobs, "beam_width", "LLM(max_logprobs=...)")
        prompt_ids = [self.engine.tokenize_prompt(p)[1] for p in _as_prompt_list(prompts)]
        for ids in prompt_ids:
            self.engine.validate_prompt(ids)
            if len(ids) + params.max_tokens > self.engine.max_model_len:
                raise ValueError(f"a prompt of {len(ids)} tokens plus max_tokens {params.max_tokens} is more than "
                                 f"max_model_len ({self.engine.max_model_len}); lower max_tokens")
        group = concurrency_limit or max(1, len(prompt_ids))
        results: list[BeamSearchOutput] = []
        for first in range(0, len(prompt_ids), group):
            results.extend(self._beam_search_group(prompt_ids[first:first + group], params))
        tokenizer = self.engine.tokenizer
        for output, ids in zip(results, prompt_ids):
            for beam in output.sequences:  # a final EOS only with include_stop_str_in_output, as vLLM's
                beam.tokens = ids + generated_tokens(beam, len(ids), params.include_stop_str_in_output)
                beam.text = tokenizer.decode(beam.tokens)
        return results

    def _beam_search_group(self, prompt_ids: list[list[int]], params: BeamSearchParams) -> list[BeamSearchOutput]:
        """Search these prompts together: each step scores every live beam of every prompt in one batch."""
        searches = [search(ids, params, self.engine.eos_token_ids) for ids in prompt_ids]
        pending = {i: next(s) for i, s in enumerate(searches)}  # max_tokens >= 1: every search asks once
        best: dict[int, list] = {}
        sampling = scoring_params(params)
        while pending:
            request_ids: list[str] = []
            try:
                for sequences in pending.values():
                    for tokens in sequences:
                        request_ids.append(self.engine.add_request(None, {"prompt_token_ids": tokens}, sampling))
            except Exception:
                self.engine.abort_request(request_ids)
                raise
            outputs = iter(self._run(request_ids))
            asking: dict[int, list[list[int]]] = {}
            for i, sequences in pending.items():
                completions = [next(outputs).outputs[0] for _ in sequences]
                steps = [(c.token_ids[0], c.logprobs[0]) for c in completions]
                try:
                    asking[i] = searches[i].send(steps)
                except StopIteration as done:
                    best[i] = done.value
            pending = asking
        return [BeamSearchOutput(best[i]) for i in range(len(prompt_ids))]

    def _unsupported(name: str, why: str) -> Callable[..., Any]:  # type: ignore[misc]  # noqa: N805
        def refuse(self: LLM, *args: Any, **kwargs: Any) -> Any:
            raise ValueError(f"LLM.{name} is not supported: {why}")

        refuse.__name__ = refuse.__qualname__ = name
        refuse.__doc__ = f"vLLM's LLM.{name}; not here: {why}."
        return refuse

    # vLLM's calls for its GPU workers and profiler (an AttributeError before, QA-X)
    sleep = _unsupported("sleep", "its weights and KV cache stay in memory; del the LLM to free them")
    wake_up = _unsupported("wake_up", "an LLM never sleeps here (LLM.sleep is not supported)")
    collective_rpc = _unsupported("collective_rpc", "the model runs in this process, with no worker processes to "
                                                    "call (llm.llm_engine reaches the engine)")
    apply_model = _unsupported("apply_model", "the model runs in this process, with no worker processes to call")
    start_profile = _unsupported("start_profile", "profile the call with torch.profiler or py-spy around it")
    stop_profile = _unsupported("stop_profile", "profile the call with torch.profiler or py-spy around it")
    del _unsupported

    def classify(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM's classification call: no classification models are served here."""
        raise ValueError("LLM.classify is not supported: pagedserve serves generative and embedding models "
                         "(sequence-classification heads are not loaded); use LLM.embed or LLM.score")

    def reward(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM's reward-model call: no reward models are served here."""
        raise ValueError("LLM.reward is not supported: pagedserve serves generative and embedding models")

    def encode(self, prompts: PromptType | Sequence[PromptType],
               pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
               truncate_prompt_tokens: int | None = None, use_tqdm: bool = True, lora_request: Any = None,
               pooling_task: str | None = None) -> list[PoolingRequestOutput]:
        """vLLM's generic pooling call. This engine pools one task, "embed" (None means it): the same as
        embed(), with `outputs[i].outputs.data` the vector as a tensor."""
        if pooling_task not in (None, "embed"):
            raise ValueError(f"pooling_task {pooling_task!r} is not supported: pagedserve pools sentence "
                             "embeddings only (pooling_task='embed', or use LLM.embed)")
        return self.embed(prompts, pooling_params, truncate_prompt_tokens, use_tqdm, lora_request)

    def _pretokenize(self, prompts: list[PromptType], params_list: list[PoolingParams]) -> list[PromptType]:
        """Tokenize the text prompts in one batched tokenizer call (much faster than one at a time)."""
        if not self.engine.is_pooling:
            return prompts  # add_request raises the clear error
        texts = [i for i, p in enumerate(prompts) if isinstance(p, str)]
        if not texts or len({params_list[i].truncate_prompt_tokens for i in texts}) != 1:
            return prompts
        k = params_list[texts[0]].truncate_prompt_tokens
        k = self.engine.max_model_len if k == -1 else k
        kwargs = {} if k is None else {"truncation": True, "max_length": k}
        encoded = self.engine.tokenizer([prompts[i] for i in texts], **kwargs)["input_ids"]
        check_truncated(encoded, k)
        result = list(prompts)
        for i, ids in zip(texts, encoded):
            result[i] = {"prompt": prompts[i], "prompt_token_ids": ids}
        return result

    def _add_all(self, prompts: list[PromptType], params_list: list[Any]) -> list[str]:
        """Queue every prompt, or none: a prompt the engine refuses aborts the ones queued before it, and in a
        batch its error names it (prompts[i]: ..., as the server's 400 names prompt.i)."""
        request_ids: list[str] = []
        try:
            for prompt, params in zip(prompts, params_list):
                request_ids.append(self.engine.add_request(None, prompt, params))
        except InvalidRequestError as exc:
            self.engine.abort_request(request_ids)
            if len(prompts) == 1:
                raise
            raise InvalidRequestError(f"prompts[{len(request_ids)}]: {exc.message}", param=exc.param) from None
        except BaseException:
            self.engine.abort_request(request_ids)
            raise
        return request_ids

    def _run(self, request_ids: list[str]) -> list[RequestOutput | PoolingRequestOutput]:
        """Step until every request finished; a request the engine failed raises RequestFailedError. Whatever ends
        the call early (that, or the caller's Ctrl-C) aborts the call's other requests first, so the engine is left
        empty: before, an interrupted call's requests ran ahead of the next call's (105 s for an 8-token one)."""
        finished: dict[str, RequestOutput | PoolingRequestOutput] = {}
        try:
            while self.engine.has_unfinished_requests():
                outputs = self.engine.step()
                if self._metrics is not None:
                    self._metrics.observe_step(self.engine, outputs)
                for output in outputs:
                    if output.finished:
                        finished[output.request_id] = output
                failed = self.engine.take_failed()
                if failed:
                    request_id, reason = next(iter(failed.items()))
                    raise request_error(request_id, reason)
        except BaseException:
            finals = self.engine.abort_request([r for r in request_ids if r not in finished])
            if self._metrics is not None:  # counted as aborted, and the gauges as they are now (as the server's)
                self.engine.refresh_gauges()
                self._metrics.observe_step(self.engine, finals)
            raise
        return [finished[r] for r in request_ids]


def _release_free_heap() -> None:
    try:
        release_free_heap()
    except Exception:  # interpreter shutdown: ctypes may be gone already
        pass


def _check_keyword_names(kwargs: dict[str, Any]) -> None:
    """TypeError for a keyword LLM does not take, as EngineArgs would raise it, with the likely one (QA-X:
    gpu_memory_utilisation)."""
    import dataclasses
    import difflib

    known = ([f.name for f in dataclasses.fields(EngineArgs)] + list(keyword_aliases(EngineArgs))
             + list(vllm_compat.keyword_names()))
    for name in kwargs:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.8)
            raise TypeError(f"LLM() got an unexpected keyword argument {name!r}"
                            + (f": did you mean {close[0]!r}?" if close else ""))


def _reasoning_parser(name: Any) -> str | None:
    from pagedserve.entrypoints.openai.reasoning import PARSERS

    if name is not None and name not in PARSERS:
        raise ValueError(f"reasoning_parser={name!r}: not one of {', '.join(PARSERS)}")
    return name


def _prompt_tail(prompt: PromptType, tokenizer: Any) -> str:
    """A prompt's end as text: where a think block its template opened or closed shows (reasoning.prompt_block)."""
    from pagedserve.entrypoints.openai.reasoning import REASONING_PROMPT_TAIL

    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
        return prompt["prompt"]
    ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else prompt
    try:
        return tokenizer.decode(list(ids)[-REASONING_PROMPT_TAIL:])
    except (TypeError, ValueError, OverflowError):
        return ""  # not token ids: add_request says what is wrong with them


def _message_text(message: dict[str, Any]) -> str:
    from pagedserve.entrypoints.openai.chat_format import message_text
    from pagedserve.entrypoints.openai.protocol import ChatMessage

    return message_text(ChatMessage(**message))


def _check_lora(lora_request: Any) -> None:
    if lora_request is not None:
        raise ValueError("lora_request: LoRA adapters are not supported; merge the adapter into the weights (peft's "
                         "merge_and_unload) and load the merged checkpoint")


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, dict, bytes, bytearray)):  # bytes: one prompt, refused by add_request
        return [prompts]
    if not isinstance(prompts, Iterable):  # generate(5), generate(None): TypeError "'int' object is not iterable"
        raise InvalidRequestError(f"a prompt is a string, a list of token ids or a dict with 'prompt' or "
                                  f"'prompt_token_ids' (or a list of those), got {type(prompts).__name__}",
                                  param="prompt")
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) for p in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


def _check_conversation(conversation: Any) -> None:
    """ValueError naming what is wrong with a conversation, as the server's 400 would (a template's own error
    otherwise: jinja's UndefinedError for a message without a role)."""
    if not isinstance(conversation, (list, tuple)) or not conversation:
        raise ValueError("messages must be a list of {\"role\": ..., \"content\": ...} dicts (or a list of such "
                         f"conversations), got {type(conversation).__name__}")
    for index, message in enumerate(conversation):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{index}] must be a dict with a string \"role\"")
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise ValueError(f"messages[{index}].content must be a string, a list of parts or None, got "
                             f"{type(content).__name__}")


def _as_params_list(params: SamplingParams | Sequence[SamplingParams] | None, count: int
                    ) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    if not isinstance(params, (list, tuple)) or not all(isinstance(p, SamplingParams) for p in params):
        raise TypeError(f"sampling_params must be a SamplingParams or a list of them (one per prompt), got "
                        f"{type(params).__name__}: SamplingParams(max_tokens=..., ...)")
    params = list(params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} SamplingParams for {count} prompts; give one or one per prompt")
    return params
