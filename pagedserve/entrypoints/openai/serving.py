"""Serving layer: OpenAI requests -> engine requests -> OpenAI responses (JSON or SSE chunks)."""

from __future__ import annotations

import asyncio
import codecs
import dataclasses
import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from pagedserve.entrypoints.openai.options import ServeOptions
from pagedserve.engine.async_engine import AsyncEngine
from pagedserve.engine.prompt_checks import check_not_empty, check_token_ids, generation_max_tokens
from pagedserve.entrypoints.openai.errors import APIError, error_body, to_api_error
from pagedserve.exceptions import InvalidRequestError, check_text
from pagedserve.entrypoints.openai.protocol import (ChatCompletionRequest, ChatMessage, CompletionRequest,
                                                    DetokenizeRequest, TokenizeRequest, generation_prompt,
                                                    refused_field)
from pagedserve.entrypoints.openai.chat_format import (RESERVED_TEMPLATE_KWARGS, chat_delta, chat_finish_reason,
                                                       chat_logprobs, message_text, reasoning_fields,
                                                       render_conversation, token_text)
from pagedserve.entrypoints.openai.reasoning import (REASONING_PROMPT_TAIL, grammar_gate, prompt_block,
                                                     think_tag_ids, with_reasoning)
from pagedserve.entrypoints.openai.tool_calls import (ToolCallReader, ToolChoice, make_reader, read_all,
                                                      resolve_tool_choice)
from pagedserve.chat_template import select_template
from pagedserve.structured.admission import compile_timeout_error
from pagedserve.outputs import CompletionOutput, LogprobsDict, RequestOutput
from pagedserve.sampling_params import RequestOutputKind, SamplingParams, check_best_of
from pagedserve.tokenizer import TokenBytes

_DONE = object()
logger = logging.getLogger(__name__)


@dataclass
class _Prompt:
    text: str | None
    token_ids: list[int]


@dataclass
class StartedChat:
    """A chat request checked, rendered and queued (OpenAIServing.start_chat)."""

    request_id: str
    prompt: _Prompt
    streams: AsyncIterator[tuple[int, RequestOutput]]
    tool_choice: ToolChoice | None
    params: SamplingParams
    new_reader: Callable[[], ToolCallReader]  # a reader per choice: reasoning, content and tool calls of its text


@dataclass
class _PromptTally:
    """Per prompt of a request, from its outputs: the prompt tokens the prefix cache served and the prompt's
    logprobs (they arrive as deltas, before its first generated token)."""

    cached: dict[int, int] = field(default_factory=dict)
    logprobs: dict[int, list[LogprobsDict | None]] = field(default_factory=dict)

    def add(self, prompt_index: int, output: RequestOutput) -> None:
        self.cached[prompt_index] = output.num_cached_tokens
        self.logprobs.setdefault(prompt_index, []).extend(output.prompt_logprobs or [])

    @property
    def num_cached(self) -> int:
        return sum(self.cached.values())


class _TextOffsets:
    """Legacy logprobs' text_offset of a choice's tokens: the characters of its text before each token, a
    character split across tokens counted once, at the token that completes it (the text shows it whole)."""

    def __init__(self, token_bytes: Callable[[int], bytes]) -> None:
        self.token_bytes = token_bytes
        self.offset = 0
        self._characters = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def take(self, token_id: int) -> int:
        """The offset of this token, which then counts as read."""
        offset = self.offset
        self.offset += len(self._characters.decode(self.token_bytes(token_id)))
        return offset


@dataclass
class _Choice:
    """A completion being accumulated from DELTA outputs."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[LogprobsDict] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class OpenAIServing:
    without_chat_template = "use /v1/completions"  # where a chat without a template can go instead

    def __init__(self, engine: AsyncEngine, served_model_names: list[str], max_model_len: int,
                 options: ServeOptions | None = None) -> None:
        options = options or ServeOptions()
        self.engine = engine
        self.tool_call_parser = options.active_tool_call_parser  # --enable-auto-tool-choice --tool-call-parser
        self.reasoning_parser = options.reasoning_parser  # --reasoning-parser
        self.reasoning_tags = think_tag_ids(engine.engine.tokenizer)  # (<think>, </think>) ids, or None
        self.options = options
        self.default_sampling = engine.engine.config.model.default_sampling  # --generation-config
        self.tokenizer = engine.engine.tokenizer
        self.default_template_kwargs = options.template_kwargs()  # --default-chat-template-kwargs
        self.token_bytes = TokenBytes(self.tokenizer)  # logprobs' raw bytes of each token
        self.served_model_names = served_model_names
        self.max_model_len = max_model_len
        self.limits = options.limits
        # Tokenizing runs off the event loop, on threads started here: a first tokenization here also starts
        # the tokenizer library's own thread pool, so the first request starts no thread (no cold request 1).
        self._tokenizer_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="pagedserve-tokenize")
        self._tokenizer_pool.submit(self.tokenizer.encode, "warm up").result()

    async def in_tokenizer_pool(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool,
                                                                functools.partial(fn, *args, **kwargs))

    # ---- shared checks ----------------------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.served_model_names:
            check_text(name, "model", param="model")
            raise APIError(f"The model `{name}` does not exist. Available: {', '.join(self.served_model_names)}",
                           404, param="model", code="model_not_found")

    def _max_tokens(self, prompt: _Prompt, requested: int | None, param: str = "max_tokens",
                    prompt_param: str = "prompt") -> int:
        """max_tokens for this prompt; 400 naming both numbers if prompt + max_tokens is too long."""
        check_not_empty(prompt.token_ids)
        max_tokens = generation_max_tokens(len(prompt.token_ids), requested, self.max_model_len, param, prompt_param)
        if requested is None:  # what the context leaves, within a KV cache smaller than it (--num-gpu-blocks-override)
            room = self.engine.engine.kv_room(len(prompt.token_ids))
            max_tokens = min(max_tokens, room) if room >= 1 else max_tokens
        default = self.default_sampling.get("max_tokens")  # the model's max_new_tokens (--generation-config)
        if requested is None and default is not None:
            max_tokens = min(max_tokens, default)
        cap = self.engine.engine.config.model.max_tokens_cap  # vLLM's override_max_tokens: every request's
        return max_tokens if cap is None else min(max_tokens, cap)

    def _request_id(self, prefix: str, req: Any, raw: Request | None = None) -> str:
        """The response's id: `prefix`-the client's id (its X-Request-Id header, else its request_id field, as
        vLLM's), else a fresh one. The engine's ids add a suffix of their own (_engine_id), so two requests may share
        a client's id."""
        client_id = (raw.headers.get("x-request-id") if raw is not None else None) or req.request_id
        if client_id is None:
            return f"{prefix}-{uuid.uuid4().hex}"
        if len(client_id) > self.limits.max_request_id_chars or not client_id.isprintable():
            raise InvalidRequestError(f"request_id must be printable and at most {self.limits.max_request_id_chars} "
                                      f"characters, got {len(client_id)}", param="request_id")
        return f"{prefix}-{client_id}"

    def _check_limits(self, req: Any, prompts: list[_Prompt], max_tokens: list[int]) -> None:
        """The per-request bounds of RequestLimits, each a 400 naming its field and its flag."""
        limits = self.limits
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        checks = [
            (req.n <= limits.max_n, "n", f"n must be at most {limits.max_n} (--max-n), got {req.n}"),
            (len(stop) <= limits.max_stop_sequences, "stop",
             f"at most {limits.max_stop_sequences} stop sequences (--max-stop-sequences), got {len(stop)}"),
            (all(len(s) <= limits.max_stop_sequence_chars for s in stop), "stop",
             f"stop sequences must be at most {limits.max_stop_sequence_chars} characters "
             "(--max-stop-sequence-chars)"),
            (len(req.stop_token_ids or ()) <= limits.max_stop_token_ids, "stop_token_ids",
             f"at most {limits.max_stop_token_ids} stop_token_ids (--max-stop-token-ids), "
             f"got {len(req.stop_token_ids or ())}"),
            (len(req.logit_bias or ()) <= limits.max_logit_bias_entries, "logit_bias",
             f"at most {limits.max_logit_bias_entries} logit_bias entries (--max-logit-bias-entries), "
             f"got {len(req.logit_bias or ())}"),
        ]
        for ok, param, message in checks:
            if not ok:
                raise InvalidRequestError(message, param=param)
        budget = max(limits.max_request_tokens, self.max_model_len)
        total = sum(req.n * (len(p.token_ids) + m) for p, m in zip(prompts, max_tokens))
        if total > budget:
            raise InvalidRequestError(f"this request asks for {total} tokens (n x (prompt + max_tokens) over its "
                                      f"prompts); the server takes at most {budget} per request "
                                      "(--max-request-tokens): lower n or max_tokens", param="max_tokens")

    def _validate_for_engine(self, prompts: list[_Prompt], params_list: list[SamplingParams],
                             fields: dict[str, str] | None = None) -> None:
        """The engine's own checks (token ids vs vocabulary), run here so a stream starts only if they pass.
        `fields`: the request's name of an engine parameter where they differ (chat's top_logprobs)."""
        llm_engine = self.engine.engine
        for prompt, params in zip(prompts, params_list):
            llm_engine.validate_prompt(prompt.token_ids)
            llm_engine.check_fits_kv_cache(len(prompt.token_ids), params.max_tokens)
            try:
                llm_engine.validate_token_params(params)
            except InvalidRequestError as exc:
                raise exc.renamed(fields or {}) from None

    async def _compile_grammars(self, params_list: list[SamplingParams]) -> None:
        """Compile the requests' grammars (on the compiler's worker thread) before anything is queued, so that a
        grammar the compiler rejects or that compiles past the time limit is a 400 before any stream starts;
        the engine then finds them in its cache."""
        llm_engine = self.engine.engine
        specs = {p.structured_outputs.key: p.structured_outputs for p in params_list if p.structured_outputs}
        for spec in specs.values():
            # Checking a schema is pure Python (a megabyte of schema: seconds): off the event loop.
            submitted = await self.in_tokenizer_pool(llm_engine.grammar_compiler.submit, spec)  # 400: invalid
            future = asyncio.wrap_future(submitted)
            timeout = llm_engine.structured_config.compile_timeout_s
            done, _ = await asyncio.wait({future}, timeout=timeout)
            if not done:  # the compile's own late error comes later, when nobody waits: taken, not logged
                future.add_done_callback(lambda late: late.cancelled() or late.exception())
                raise compile_timeout_error(timeout, spec)
            future.result()  # 400: the compiler rejected it

    async def _tokenize(self, text: str, add_special_tokens: bool = True, param: str | None = None) -> list[int]:
        """The text's tokens. With `param` (a prompt that must fit the context, not truncated), a text too long
        for any tokenization to fit is a 400 before it is tokenized (an 8 MiB prompt took 20 s to refuse)."""
        # a lone surrogate: a 400 here (an embedding model's transformers tokenizer raised a TypeError: a 500)
        check_text(text, f"the {param or 'prompt'}", param=param or "prompt")
        if param is not None and len(text) > self.max_model_len:
            longest = await self.in_tokenizer_pool(self._longest_token_chars)
            if len(text) > self.max_model_len * longest:
                raise InvalidRequestError(f"This model's maximum context length is {self.max_model_len} tokens. "
                                          f"However, the {param} {'are' if param.endswith('s') else 'is'} "
                                          f"{len(text)} characters long, and no token of "
                                          f"this vocabulary covers more than {longest}. Please reduce the {param}.",
                                          param=param)
        return await self.in_tokenizer_pool(self.tokenizer.encode, text, add_special_tokens=add_special_tokens)

    @functools.cache  # noqa: B019 - one serving layer per server, kept for its life
    def _longest_token_chars(self) -> int:
        """The most characters one token stands for (its bytes bound them), over the whole vocabulary."""
        return max(1, max(len(self.token_bytes(i)) for i in range(len(self.tokenizer))))

    # ---- /v1/completions --------------------------------------------------------------------------
    def _truncate(self, prompt: _Prompt, keep: int | None) -> _Prompt:
        """vLLM's truncate_prompt_tokens: the prompt's last `keep` tokens (-1: max_model_len of them)."""
        if keep is None:
            return prompt
        if keep == -1:
            keep = self.max_model_len
        if not 1 <= keep <= self.max_model_len:
            raise InvalidRequestError(f"truncate_prompt_tokens must be -1 or in [1, {self.max_model_len}] (the "
                                      f"model's maximum context length), got {keep}", param="truncate_prompt_tokens")
        if len(prompt.token_ids) <= keep:
            return prompt
        return _Prompt(None, prompt.token_ids[-keep:])  # its text no longer matches: echo decodes the ids

    async def _completion_prompts(self, prompt: Any, add_special_tokens: bool = True, truncating: bool = False
                                  ) -> list[_Prompt]:
        param = None if truncating else "prompt"
        if isinstance(prompt, str):
            return [_Prompt(prompt, await self._tokenize(prompt, add_special_tokens, param))]
        if not prompt:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        if all(isinstance(p, int) for p in prompt):
            return [_Prompt(None, list(prompt))]
        if len(prompt) > self.limits.max_prompts_per_request:  # before tokenizing them all
            raise InvalidRequestError(f"at most {self.limits.max_prompts_per_request} prompts per request "
                                      f"(--max-prompts-per-request), got {len(prompt)}", param="prompt")
        if all(isinstance(p, str) for p in prompt):
            return [_Prompt(p, await self._tokenize(p, add_special_tokens, param)) for p in prompt]
        if all(isinstance(p, list) for p in prompt):
            return [_Prompt(None, list(p)) for p in prompt]
        raise InvalidRequestError("prompt must be a string, a list of strings, token ids, or lists of token ids",
                                  param="prompt")

    async def create_completion(self, req: CompletionRequest, raw: Request) -> Any:
        self.check_model(req.model)
        if req.suffix:
            raise InvalidRequestError("suffix is not supported", param="suffix")
        check_best_of(req.best_of, req.n)
        req.check_fields({})
        prompts = await self._completion_prompts(req.prompt, req.add_special_tokens,
                                                 truncating=req.truncate_prompt_tokens is not None)
        prompts = [self._truncate(p, req.truncate_prompt_tokens) for p in prompts]
        # echo with max_tokens 0 (vLLM's): the prompt alone, with its logprobs; one token is generated and dropped
        prompt_only = req.echo and req.max_tokens == 0
        max_tokens = [self._max_tokens(prompt, 1 if prompt_only else req.max_tokens) for prompt in prompts]
        self._check_limits(req, prompts, max_tokens)
        prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else req.prompt_logprobs
        params_list = [self._params(req, m, req.logprobs, prompt_logprobs) for m in max_tokens]
        self._validate_for_engine(prompts, params_list)
        if not req.use_beam_search:
            for prompt, params in zip(prompts, params_list):
                if params.structured_outputs is not None:  # (the prompt's tail decoded only for these)
                    self._gate_grammar(params, self._prompt_block(prompt))
        request_id = self._request_id("cmpl", req, raw)
        if req.use_beam_search:
            streams = self._start_beam_search(request_id, req, prompts, max_tokens, params_list, req.logprobs)
        else:
            await self._compile_grammars(params_list)
            streams = self._start(request_id, prompts, params_list)
        if prompt_only:
            streams = _without_generated(streams)
        if req.stream:
            return _sse(self._completion_stream(request_id, req, prompts, streams))
        tally = _PromptTally()
        finals = await _collect(streams, raw, len(prompts), tally)
        return JSONResponse(self._completion_response(request_id, req, prompts, finals, tally))

    def _params(self, req: Any, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None
                ) -> SamplingParams:
        params = req.sampling_params(max_tokens, logprobs, prompt_logprobs, self.default_sampling)  # 400s
        params.output_kind = RequestOutputKind.DELTA
        return params

    def _start(self, request_id: str, prompts: list[_Prompt], params_list: list[SamplingParams]
               ) -> AsyncIterator[tuple[int, RequestOutput]]:
        room = self.engine.check_room(len(prompts))  # a 429 (or 400) before a stream's headers are out
        arrival = time.monotonic()
        self._log_requests(request_id, prompts, params_list)
        engine_id = _engine_id(request_id)
        generators = [self.engine.generate(f"{engine_id}-{i}", {"prompt": p.text, "prompt_token_ids": p.token_ids},
                                           params, arrival, reservation=room)
                      for i, (p, params) in enumerate(zip(prompts, params_list))]
        if self.options.enable_log_outputs:
            generators = [self._logged_outputs(f"{engine_id}-{i}", g) for i, g in enumerate(generators)]
        return _merge(generators)

    def _log_requests(self, request_id: str, prompts: list[_Prompt], params_list: list[SamplingParams]) -> None:
        """--enable-log-requests: each prompt's request, as it starts."""
        if self.options.enable_log_requests:
            for i, (prompt, params) in enumerate(zip(prompts, params_list)):
                self._log_request(f"{request_id}-{i}", prompt, params)

    def _start_beam_search(self, request_id: str, req: Any, prompts: list[_Prompt], max_tokens: list[int],
                           params_list: list[SamplingParams], num_logprobs: int | None
                           ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """use_beam_search: each prompt's search (serving_beam.py), n engine requests at a time."""
        from pagedserve.entrypoints.openai.serving_beam import beam_search_outputs

        from pagedserve.beam_search import check_candidates

        beams = [req.beam_search_params(m) for m in max_tokens]  # 400s for fields beam search cannot honour
        check_candidates(beams[0], self.engine.engine.config.model.max_logprobs, "n", "--max-logprobs")
        needed = len(prompts) * req.n
        if needed > self.engine.capacity:
            raise InvalidRequestError(f"use_beam_search with n={req.n} over {len(prompts)} prompt(s) runs {needed} "
                                      f"requests at once; the server takes at most {self.engine.capacity} "
                                      "(--max-num-seqs plus --max-waiting-requests): lower n", param="n")
        self.engine.check_room(needed)  # a 429 before anything starts; later steps are never refused
        self._log_requests(request_id, prompts, params_list)  # (beam searches were not logged)
        engine_id = _engine_id(request_id)
        generators = [beam_search_outputs(self.engine, f"{engine_id}-{i}", p.text, p.token_ids, beam, params,
                                          num_logprobs)
                      for i, (p, beam, params) in enumerate(zip(prompts, beams, params_list))]
        return _merge(generators)

    async def _logged_outputs(self, request_id: str, outputs: AsyncIterator[RequestOutput]
                              ) -> AsyncIterator[RequestOutput]:
        """--enable-log-outputs (vLLM's): each completion's text and token count when it finishes, cut to
        --max-log-len."""
        texts: dict[int, list[str]] = {}
        counts: dict[int, int] = {}
        try:
            async for output in outputs:
                for completion in output.outputs:
                    texts.setdefault(completion.index, []).append(completion.text)
                    counts[completion.index] = counts.get(completion.index, 0) + len(completion.token_ids)
                    if completion.finish_reason is not None:
                        text = "".join(texts[completion.index])
                        limit = self.options.max_log_len
                        logger.info("Generated response %s (choice %d): output: %r, %d tokens, finish_reason: %s",
                                    request_id, completion.index, text if limit is None else text[:limit],
                                    counts[completion.index], completion.finish_reason)
                yield output
        finally:
            await outputs.aclose()  # a client that left: the request is aborted now, not when collected

    def _as_ids(self, req: Any) -> bool:
        """Logprobs' tokens as "token_id:N" (vLLM's return_tokens_as_token_ids: the request's, else the server's
        --return-tokens-as-token-ids), for clients that need the exact ids (text can merge or split tokens)."""
        asked = req.return_tokens_as_token_ids
        return self.options.return_tokens_as_token_ids if asked is None else asked

    def _usage(self, num_prompt: int, num_completion: int, tally: _PromptTally) -> dict:
        """OpenAI's usage; with --enable-prompt-tokens-details, the prompt tokens the prefix cache served, where
        there were any."""
        usage = _usage(num_prompt, num_completion)
        if self.options.enable_prompt_tokens_details and tally.num_cached:
            usage["prompt_tokens_details"] = {"cached_tokens": tally.num_cached}
        return usage

    def _log_request(self, request_id: str, prompt: _Prompt, params: SamplingParams) -> None:
        """--enable-log-requests (vLLM's line), prompt text and token ids cut to --max-log-len. A prompt without
        text (a rendered chat, token ids) shows its tokens decoded, special tokens included."""
        limit = self.options.max_log_len
        ids = prompt.token_ids if limit is None else prompt.token_ids[:limit]
        text = prompt.text if prompt.text is not None else self.tokenizer.decode(ids, skip_special_tokens=False)
        text = text if limit is None else text[:limit]
        logger.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s (%d tokens)", request_id, text,
                    params, ids, len(prompt.token_ids))

    def _completion_response(self, request_id: str, req: CompletionRequest, prompts: list[_Prompt],
                             finals: dict[int, dict[int, _Choice]], tally: _PromptTally) -> dict:
        choices = []
        num_completion = 0
        for prompt_index, prompt in enumerate(prompts):
            for index, choice in sorted(finals[prompt_index].items()):
                num_completion += len(choice.token_ids)
                text = choice.text
                logprobs = None
                if req.logprobs is not None:
                    logprobs = self._choice_logprobs(req, prompt, tally.logprobs.get(prompt_index, []),
                                                     choice.token_ids, choice.logprobs,
                                                     _TextOffsets(self.token_bytes))
                if req.echo:
                    text = self._prompt_text(prompt) + text
                body = {"index": prompt_index * req.n + index, "text": text, "logprobs": logprobs,
                        "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason}
                if req.prompt_logprobs is not None:
                    body["prompt_logprobs"] = prompt_logprobs_json(tally.logprobs.get(prompt_index, []))
                if req.return_token_ids:  # vLLM's
                    body.update(prompt_token_ids=prompt.token_ids, token_ids=choice.token_ids)
                choices.append(body)
        num_prompt = sum(len(p.token_ids) for p in prompts)
        return {"id": request_id, "object": "text_completion", "created": int(time.time()), "system_fingerprint": None,
                "model": self.served_model_names[0], "choices": choices,
                "usage": self._usage(num_prompt, num_completion, tally)}

    def _prompt_text(self, prompt: _Prompt) -> str:
        return prompt.text if prompt.text is not None else self.tokenizer.decode(prompt.token_ids)

    def _choice_logprobs(self, req: CompletionRequest, prompt: _Prompt, prompt_lps: list[LogprobsDict | None],
                         token_ids: list[int], logprobs: list[LogprobsDict], offsets: _TextOffsets) -> dict:
        """A choice's legacy logprobs; with echo, the prompt's tokens come first (the first one has no logprob), as
        OpenAI's API and vLLM give them, and text offsets run over the whole echoed text (what
        lm-evaluation-harness reads for loglikelihoods)."""
        as_ids = self._as_ids(req)
        if not req.echo:
            return self._completion_logprobs(token_ids, logprobs, req.logprobs, offsets, as_ids)
        echoed = self._completion_logprobs(prompt.token_ids, prompt_lps, req.logprobs, offsets, as_ids)
        generated = self._completion_logprobs(token_ids, logprobs, req.logprobs, offsets, as_ids)
        return {key: echoed[key] + generated[key] for key in echoed}

    def _completion_logprobs(self, token_ids: list[int], logprobs: list[LogprobsDict], num_top: int,
                             offsets: _TextOffsets, as_ids: bool = False) -> dict:
        """OpenAI's legacy completions logprobs format for these tokens, their text offsets taken from `offsets`.
        `as_ids` (vLLM's return_tokens_as_token_ids): tokens written "token_id:N"; offsets still count the text."""
        tokens, token_logprobs, top, text_offset = [], [], [], []
        for token_id, step in zip(token_ids, logprobs):
            entry = step.get(token_id) if step else None
            text = entry.decoded_token if entry else self.tokenizer.decode([token_id])
            tokens.append(token_text(token_id, text, as_ids))
            token_logprobs.append(entry.logprob if entry else None)
            # the chosen token and the top num_top, as OpenAI's legacy format has them (up to logprobs + 1), the
            # chosen one first as vLLM's; where two tokens read alike (byte fragments) the key keeps the chosen's
            shown = None
            if step:
                shown = {} if entry is None else {token_text(token_id, entry.decoded_token, as_ids): entry.logprob}
                for i, lp in step.items():
                    if lp.rank <= num_top:
                        shown.setdefault(token_text(i, lp.decoded_token, as_ids), lp.logprob)
            top.append(shown)
            text_offset.append(offsets.take(token_id))
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": text_offset}

    async def _completion_stream(self, request_id: str, req: CompletionRequest, prompts: list[_Prompt],
                                 streams: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[str]:
        created = int(time.time())
        num_completion = 0
        per_choice: dict[int, int] = {}  # tokens so far of each choice (continuous usage, as vLLM's)
        echoed: set[int] = set()
        sent_prompt_ids: set[int] = set()  # choices whose prompt_token_ids went out (return_token_ids)
        offsets: dict[int, _TextOffsets] = {}
        tally = _PromptTally()
        async for prompt_index, output in streams:
            tally.add(prompt_index, output)
            for completion in output.outputs:
                index = prompt_index * req.n + completion.index
                text = completion.text
                num_completion += len(completion.token_ids)
                per_choice[index] = per_choice.get(index, 0) + len(completion.token_ids)
                if not completion.token_ids and not completion.finish_reason and not text:
                    continue  # (a prompt's logprobs arrive before its first token: the echo waits for them)
                logprobs = None
                echo = req.echo and index not in echoed
                if echo:
                    echoed.add(index)
                    text = self._prompt_text(prompts[prompt_index]) + text
                if req.logprobs is not None and completion.logprobs is not None:
                    choice_offsets = offsets.setdefault(index, _TextOffsets(self.token_bytes))
                    if echo:
                        logprobs = self._choice_logprobs(req, prompts[prompt_index], tally.logprobs[prompt_index],
                                                         completion.token_ids, completion.logprobs, choice_offsets)
                    else:
                        logprobs = self._completion_logprobs(completion.token_ids, completion.logprobs,
                                                             req.logprobs, choice_offsets, self._as_ids(req))
                chunk = {"id": request_id, "object": "text_completion", "created": created,
                         "model": self.served_model_names[0],
                         "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                      "finish_reason": completion.finish_reason,
                                      "stop_reason": completion.stop_reason}]}
                if echo and req.prompt_logprobs is not None:
                    chunk["choices"][0]["prompt_logprobs"] = prompt_logprobs_json(tally.logprobs[prompt_index])
                if req.return_token_ids:  # vLLM's: each chunk's new ids, the prompt's with a choice's first chunk
                    chunk["choices"][0]["token_ids"] = completion.token_ids
                    if index not in sent_prompt_ids:
                        sent_prompt_ids.add(index)
                        chunk["choices"][0]["prompt_token_ids"] = prompts[prompt_index].token_ids
                if _continuous_usage(req):  # this choice's tokens, and its own prompt's
                    chunk["usage"] = self._usage(len(prompts[prompt_index].token_ids), per_choice[index], tally)
                yield _chunk(chunk)
        if self._include_usage(req):
            num_prompt = sum(len(p.token_ids) for p in prompts)
            yield _chunk({"id": request_id, "object": "text_completion", "created": created,
                          "model": self.served_model_names[0], "choices": [],
                          "usage": self._usage(num_prompt, num_completion, tally)})

    # ---- /v1/chat/completions ---------------------------------------------------------------------
    def _check_chat_fields(self, req: ChatCompletionRequest) -> None:
        if req.functions:
            raise InvalidRequestError("functions is OpenAI's deprecated form of tools; give tools (and "
                                      "tool_choice) instead", param="functions")
        if req.top_logprobs is not None and not req.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs set to true", param="top_logprobs")
        if not req.messages:
            raise InvalidRequestError("messages must not be empty", param="messages")
        check_best_of(req.best_of, req.n)
        req.check_fields({} if self.options.trust_request_chat_template else {"chat_template": None})
        if req.prompt_logprobs is not None and req.stream:
            raise InvalidRequestError("prompt_logprobs are given in a chat response that is not streamed; set "
                                      "stream to false", param="prompt_logprobs")

    def _request_template(self, req: ChatCompletionRequest | TokenizeRequest) -> str | None:
        """A request's own chat_template: rendered with --trust-request-chat-template, else a 400 (vLLM's rule)."""
        template = (req.model_extra or {}).get("chat_template")
        if template is None:
            return None
        if not self.options.trust_request_chat_template:
            raise refused_field("chat_template")
        if not isinstance(template, str):
            raise InvalidRequestError("chat_template must be a string (a Jinja template)", param="chat_template")
        return template

    def _prompt_tools(self, req: ChatCompletionRequest | TokenizeRequest) -> list[dict] | None:
        """The tools the template shows: none under tool_choice "none" with --exclude-tools-when-tool-choice-none."""
        if self.options.exclude_tools_when_tool_choice_none and getattr(req, "tool_choice", None) == "none":
            return None
        return req.tools

    def _include_usage(self, req: Any) -> bool:
        """A stream ends with a usage chunk: stream_options.include_usage, or --enable-force-include-usage."""
        return bool(req.stream_options and req.stream_options.include_usage) or self.options.enable_force_include_usage

    def template_has_tools(self, request_template: str | None = None) -> bool:
        """The chat template a request with tools renders writes tool definitions (it reads the `tools` variable):
        the request's own (--trust-request-chat-template), else the tokenizer's, of named templates the one
        select_template picks with tools ("tool_use", as Hermes-2-Pro and Hermes-3 ship it; looking for "tools" in
        the dict found its keys and refused tool_choice "auto")."""
        template = request_template
        if template is None:
            try:
                template = select_template(getattr(self.tokenizer, "chat_template", None), tools=[])
            except ValueError:  # no template, or named ones without a default: rendering says so
                return False
        return "tools" in template

    async def _tool_choice(self, req: ChatCompletionRequest) -> ToolChoice | None:
        """The request's tool choice; its tools' schemas are checked off the event loop (thousands of tools:
        seconds of pure Python)."""
        resolve = functools.partial(resolve_tool_choice, req.tools, req.tool_choice, req.parallel_tool_calls,
                                    self.tool_call_parser, self.template_has_tools(self._request_template(req)))
        return await self.in_tokenizer_pool(resolve) if req.tools else resolve()

    async def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool,
                          continue_final_message: bool = False, kwargs: dict | None = None,
                          tools: list[dict] | None = None, add_special_tokens: bool = False,
                          chat_template: str | None = None, must_fit: bool = False) -> list[int]:
        """A chat's prompt tokens. `chat_template`: a request's own (--trust-request-chat-template)."""
        if not getattr(self.tokenizer, "chat_template", None) and chat_template is None:
            raise InvalidRequestError(f"this model has no chat template; {self.without_chat_template}, or start "
                                      "the server with --chat-template FILE", param="messages")
        reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs or ()))
        if reserved:
            raise InvalidRequestError(f"chat_template_kwargs may not set {', '.join(reserved)} (the server sets them)",
                                      param="chat_template_kwargs")
        kwargs = {**self.default_template_kwargs, **(kwargs or {})}
        if chat_template is not None:
            kwargs["chat_template"] = chat_template
        if tools:
            kwargs = {**(kwargs or {}), "tools": tools}
        try:  # off the event loop: a 100,000-message chat renders for a second
            text = await self.in_tokenizer_pool(
                render_conversation, self.tokenizer, messages, self.options.chat_template_content_format,
                add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                **(kwargs or {}))
        except InvalidRequestError:
            raise
        except Exception as exc:  # template errors (e.g. roles it rejects) are the client's to fix
            raise InvalidRequestError(f"the chat template rejected the messages: {exc}", param="messages") from None
        return await self._tokenize(text, add_special_tokens=add_special_tokens, param="messages" if must_fit else None)

    async def create_chat_completion(self, req: ChatCompletionRequest, raw: Request) -> Any:
        chat = await self.start_chat(req, "chatcmpl", raw)
        request_id, prompt, streams, tool_choice = chat.request_id, chat.prompt, chat.streams, chat.tool_choice
        prompt_ids = prompt.token_ids
        if req.stream:
            return _sse(self._chat_stream(chat, req))
        tally = _PromptTally()
        finals = await _collect(streams, raw, 1, tally)
        choices = []
        named = tool_choice is not None and tool_choice.mode == "named"
        echo = self._chat_echo(req)
        for index, choice in sorted(finals[0].items()):
            read = read_all(chat.new_reader(), choice.text)
            message: dict[str, Any] = {"role": self.options.response_role, "content": echo + read.content}
            if self.reasoning_parser is not None:  # vLLM's: content null where the reply was all reasoning
                message.update(reasoning_fields(read.reasoning), content=echo + read.content or None)
            if read.calls:
                message.update(content=echo + read.content or None, tool_calls=read.calls)
            choices.append({"index": index, "message": message,
                            "logprobs": chat_logprobs(choice.token_ids, choice.logprobs, req.top_logprobs or 0,
                                                      self.token_bytes, self._as_ids(req)) if req.logprobs else None,
                            "finish_reason": chat_finish_reason(choice.finish_reason, bool(read.calls), named,
                                                                choice.stop_reason),
                            "stop_reason": choice.stop_reason,
                            **({"token_ids": choice.token_ids} if req.return_token_ids else {})})
        num_completion = sum(len(c.token_ids) for c in finals[0].values())
        body = {"id": request_id, "object": "chat.completion", "created": int(time.time()), "system_fingerprint": None,
                "model": self.served_model_names[0], "choices": choices,
                "usage": self._usage(len(prompt_ids), num_completion, tally)}
        if req.return_token_ids:  # vLLM's
            body["prompt_token_ids"] = prompt_ids
        if req.prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs_json(tally.logprobs.get(0, []))
        return JSONResponse(body)

    def _chat_echo(self, req: ChatCompletionRequest) -> str:
        """vLLM's chat `echo`: the final message's text where the reply continues it (no generation prompt, or a
        final message in the reply's role), to stand before the reply's content; else ""."""
        last = req.messages[-1]
        if not req.echo or (generation_prompt(req) and last.role != self.options.response_role):
            return ""
        return message_text(last)

    async def start_chat(self, req: ChatCompletionRequest, id_prefix: str, raw: Request | None = None
                         ) -> StartedChat:
        """Check, render and queue a chat request (400s before anything is queued). The chat route and the
        Responses API (serving_responses.py) answer it."""
        self.check_model(req.model)
        self._check_chat_fields(req)
        tool_choice = await self._tool_choice(req)
        prompt_ids = await self.render_chat(req.messages, generation_prompt(req), req.continue_final_message,
                                            _template_kwargs(req), tools=self._prompt_tools(req),
                                            add_special_tokens=req.add_special_tokens,
                                            chat_template=self._request_template(req),
                                            must_fit=req.truncate_prompt_tokens is None)
        prompt = self._truncate(_Prompt(None, prompt_ids), req.truncate_prompt_tokens)
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = self._max_tokens(prompt, getattr(req, param), param, "messages")
        self._check_limits(req, [prompt], [max_tokens])
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self._params(req, max_tokens, logprobs, req.prompt_logprobs)
        grammar = tool_choice.grammar if tool_choice is not None else None
        if grammar is not None and tool_choice.mode == "auto" and (params.structured_outputs is not None
                                                                    or req.use_beam_search):
            grammar = None  # response_format shapes the whole reply (no call can start), as before strict calls
        if grammar is not None:
            if req.use_beam_search:
                raise InvalidRequestError(f"tool_choice {tool_choice.mode!r} is enforced by a grammar, which cannot be "
                                          "combined with use_beam_search", param="tool_choice")
            if params.structured_outputs is not None:
                raise InvalidRequestError(f"tool_choice {tool_choice.mode!r} is enforced by a grammar, which cannot be "
                                          "combined with response_format or structured_outputs", param="tool_choice")
            params.structured_outputs = grammar
        if tool_choice is not None and tool_choice.mode == "auto":
            params.skip_special_tokens = False  # tool-call tags may be special tokens (Qwen's <tool_call>)
        self._validate_for_engine([prompt], [params], {"logprobs": "top_logprobs"})
        block = self._prompt_block(prompt, message_text(req.messages[-1]) if req.continue_final_message else None)
        if not req.use_beam_search:
            self._gate_grammar(params, block)
        request_id = self._request_id(id_prefix, req, raw)
        if req.use_beam_search:
            streams = self._start_beam_search(request_id, req, [prompt], [max_tokens], [params], logprobs)
        else:
            await self._compile_grammars([params])
            streams = self._start(request_id, [prompt], [params])

        def new_reader() -> ToolCallReader:
            return with_reasoning(make_reader(tool_choice, self.tool_call_parser), self.reasoning_parser, block,
                                  constrained=params.structured_outputs is not None and params.reasoning_gate is None)

        return StartedChat(request_id, prompt, streams, tool_choice, params, new_reader)

    def _prompt_block(self, prompt: _Prompt, continued: str | None = None) -> str | None:
        """reasoning.prompt_block for a prompt (None without --reasoning-parser)."""
        if self.reasoning_parser is None:
            return None
        tail = self.tokenizer.decode(prompt.token_ids[-REASONING_PROMPT_TAIL:], skip_special_tokens=False)
        return prompt_block(tail, continued)

    def _gate_grammar(self, params: SamplingParams, block: str | None) -> None:
        """With --reasoning-parser, a constrained request's grammar begins after the think block (vLLM's, whatever
        the endpoint)."""
        if params.structured_outputs is not None:
            params.reasoning_gate = grammar_gate(self.reasoning_parser, self.reasoning_tags, block)

    async def _chat_stream(self, chat: StartedChat, req: ChatCompletionRequest) -> AsyncIterator[str]:
        request_id, prompt, streams, tool_choice = chat.request_id, chat.prompt, chat.streams, chat.tool_choice
        created = int(time.time())
        base = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                "model": self.served_model_names[0]}
        for index in range(req.n):
            delta = {"role": self.options.response_role, "content": ""}
            chunk = {**base, "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}]}
            if _continuous_usage(req):
                chunk["usage"] = _usage(len(prompt.token_ids), 0)
            if req.return_token_ids and index == 0:  # vLLM's: the prompt's ids with the first chunk
                chunk["prompt_token_ids"] = prompt.token_ids
            yield _chunk(chunk)
        echo = self._chat_echo(req)
        for index in range(req.n if echo else 0):  # vLLM's: the echoed text in a chunk of its own per choice
            chunk = {**base, "choices": [{"index": index, "delta": {"content": echo}, "logprobs": None,
                                          "finish_reason": None}]}
            if _continuous_usage(req):
                chunk["usage"] = _usage(len(prompt.token_ids), 0)
            yield _chunk(chunk)
        num_completion = 0
        per_choice = [0] * req.n  # tokens so far of each choice (continuous usage, as vLLM's)
        held_ids: list[list[int]] = [[] for _ in range(req.n)]  # return_token_ids: ids of chunks held back
        readers = [chat.new_reader() for _ in range(req.n)]
        tally = _PromptTally()
        async for prompt_index, output in streams:
            tally.add(prompt_index, output)
            for completion in output.outputs:
                num_completion += len(completion.token_ids)
                per_choice[completion.index] += len(completion.token_ids)
                reader = readers[completion.index]
                events = reader.feed(completion.text)
                if completion.finish_reason is not None:
                    events += reader.finish()
                held_ids[completion.index] += completion.token_ids
                if not completion.finish_reason and not events and (
                        not completion.token_ids or (not reader.passes_text_through and not req.logprobs)):
                    continue  # nothing new, or a reader holding text (e.g. a tool call being read): no empty delta
                logprobs = None
                if req.logprobs and completion.logprobs is not None:
                    logprobs = chat_logprobs(completion.token_ids, completion.logprobs, req.top_logprobs or 0,
                                             self.token_bytes, self._as_ids(req))
                finish_reason = completion.finish_reason
                if finish_reason is not None:
                    finish_reason = chat_finish_reason(finish_reason, reader.num_calls > 0,
                                                       tool_choice is not None and tool_choice.mode == "named",
                                                       completion.stop_reason)
                chunk = {**base, "choices": [{"index": completion.index, "delta": chat_delta(events),
                                              "logprobs": logprobs, "finish_reason": finish_reason,
                                              "stop_reason": completion.stop_reason}]}
                if req.return_token_ids:  # this chunk's ids and those of chunks held back before it
                    chunk["choices"][0]["token_ids"], held_ids[completion.index] = held_ids[completion.index], []
                if _continuous_usage(req):
                    chunk["usage"] = self._usage(len(prompt.token_ids), per_choice[completion.index], tally)
                yield _chunk(chunk)
        if self._include_usage(req):
            yield _chunk({**base, "choices": [], "usage": self._usage(len(prompt.token_ids), num_completion, tally)})

    # ---- /tokenize, /detokenize ------------------------------------------------------------------
    async def tokenize(self, req: TokenizeRequest) -> dict:
        self.check_model(req.model)
        if req.messages is not None and req.prompt is not None:
            raise InvalidRequestError("give either prompt or messages, not both", param="prompt")
        extra = req.model_extra or {}
        for name in ("documents", "mm_processor_kwargs"):  # refused by chat too: the tokens would not be its
            if extra.get(name) is not None:
                raise refused_field(name)
        if req.messages is not None:  # the prompt a chat completion with these fields would get
            tokens = await self.render_chat(req.messages, generation_prompt(req), req.continue_final_message,
                                            _template_kwargs(req), tools=self._prompt_tools(req),
                                            add_special_tokens=bool(req.add_special_tokens),
                                            chat_template=self._request_template(req))
        elif req.prompt is not None:
            tokens = await self._tokenize(req.prompt, req.add_special_tokens is not False)
        else:
            raise InvalidRequestError("give either prompt or messages", param="prompt")
        result = {"count": len(tokens), "max_model_len": self.max_model_len, "tokens": tokens}
        if req.return_token_strs:
            result["token_strs"] = self.tokenizer.convert_ids_to_tokens(tokens)
        return result

    async def detokenize(self, req: DetokenizeRequest) -> dict:
        self.check_model(req.model)
        check_token_ids(req.tokens, self.engine.engine.config.model.hf_config.vocab_size, "tokens", label="")
        return {"prompt": self.tokenizer.decode(req.tokens)}


# ---- helpers ---------------------------------------------------------------------------------------
async def _without_generated(streams: AsyncIterator[tuple[int, RequestOutput]]
                             ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The outputs with their generated tokens dropped (echo with max_tokens 0): prompt logprobs and the finish
    ("length") remain."""
    try:
        async for prompt_index, output in streams:
            outputs = [dataclasses.replace(c, text="", token_ids=[], logprobs=[] if c.logprobs is not None else None,
                                           cumulative_logprob=None) for c in output.outputs]
            yield prompt_index, dataclasses.replace(output, outputs=outputs)
    finally:
        await streams.aclose()  # a client gone: its requests are aborted through the streams


def _engine_id(request_id: str) -> str:
    """The engine's id of a response's request: unique even where clients chose the same request_id."""
    return f"{request_id}-{uuid.uuid4().hex[:8]}"


def _template_kwargs(req: ChatCompletionRequest | TokenizeRequest) -> dict[str, Any] | None:
    """The chat template's extra variables: the request's chat_template_kwargs, with its reasoning_effort (as vLLM
    gives it to reasoning models' templates) unless those set one."""
    if req.reasoning_effort is None:
        return req.chat_template_kwargs
    return {"reasoning_effort": req.reasoning_effort, **(req.chat_template_kwargs or {})}


def prompt_logprobs_json(steps: list[LogprobsDict | None]) -> list[dict | None]:
    """vLLM's prompt_logprobs: per prompt token (the first has none), {token id: {logprob, rank, decoded_token}}."""
    return [None if step is None else {str(token_id): {"logprob": lp.logprob, "rank": lp.rank,
                                                       "decoded_token": lp.decoded_token}
                                       for token_id, lp in step.items()} for step in steps]


def _continuous_usage(req: Any) -> bool:
    """vLLM's stream_options.continuous_usage_stats (with include_usage): in every chunk, the usage so far of its
    choice (its prompt's tokens, its own generated tokens), as vLLM counts it."""
    options = req.stream_options
    return bool(options and options.include_usage and options.continuous_usage_stats)


def _usage(num_prompt: int, num_completion: int) -> dict:
    return {"prompt_tokens": num_prompt, "completion_tokens": num_completion,
            "total_tokens": num_prompt + num_completion}


def _chunk(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def _sse(chunks: AsyncIterator[str], done: bool = True) -> StreamingResponse:
    """An SSE response of `chunks`, ending with `data: [DONE]` (the completions and chat streams; not the
    Responses stream, whose last event says it ended)."""
    async def body() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield chunk
        except Exception as exc:  # after the headers went out, errors travel as an SSE event
            error = to_api_error(exc)
            yield _chunk(error_body(error.message, error.status, error.param, error.code, error.request_id))
        if done:
            yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _merge(generators: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several request streams; closing the merged stream aborts every request."""
    if len(generators) == 1:
        async for output in generators[0]:
            yield 0, output
        return
    # Bounded: a caller that stops taking (a client that stopped reading) holds the pumps, so outputs wait in each
    # request's own stream, where the engine ends a request nobody reads (async_engine.STALLED_S).
    queue: asyncio.Queue = asyncio.Queue(maxsize=2 * len(generators))

    async def pump(index: int, generator: AsyncIterator[RequestOutput]) -> None:
        try:
            async for output in generator:
                await queue.put((index, output))
        except asyncio.CancelledError:
            raise  # the merged stream was closed: nobody waits for the rest
        except Exception as exc:
            await queue.put((index, exc))
            return
        await queue.put((index, _DONE))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(generators)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


async def _collect(streams: AsyncIterator[tuple[int, RequestOutput]], raw: Request, num_prompts: int,
                   tally: _PromptTally | None = None) -> dict[int, dict[int, _Choice]]:
    """Accumulate DELTA outputs into whole choices (and each prompt's cached tokens and logprobs into `tally`);
    abort if the client goes away meanwhile."""
    choices: dict[int, dict[int, _Choice]] = {i: {} for i in range(num_prompts)}
    tally = _PromptTally() if tally is None else tally

    async def consume() -> None:
        async for prompt_index, output in streams:
            tally.add(prompt_index, output)
            for completion in output.outputs:
                _accumulate(choices[prompt_index].setdefault(completion.index, _Choice()), completion)

    await consume_unless_disconnected(consume(), streams, raw)
    return choices


async def consume_unless_disconnected(consume: Any, streams: Any, raw: Request) -> None:
    """Await `consume` (a coroutine reading `streams`); if the client goes away first, cancel it and
    close the streams, which aborts their requests and frees their KV blocks. The disconnect is awaited, as
    vLLM's with_cancellation does (polled every 0.5 s, a gone client's request held its room meanwhile)."""
    task = asyncio.create_task(consume)
    watcher = asyncio.create_task(_until_disconnected(raw))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await streams.aclose()
        raise APIError("client disconnected", 499)
    task.result()


async def _until_disconnected(raw: Request) -> None:
    """Return when the client has gone (the body was read already: the next message is the disconnect)."""
    while (await raw.receive())["type"] != "http.disconnect":
        pass


def _accumulate(choice: _Choice, completion: CompletionOutput) -> None:
    choice.text += completion.text
    choice.token_ids.extend(completion.token_ids)
    if completion.logprobs:
        choice.logprobs.extend(completion.logprobs)
    if completion.finish_reason is not None:
        choice.finish_reason, choice.stop_reason = completion.finish_reason, completion.stop_reason
