"""Turns EngineCoreOutputs into RequestOutputs: detokenize, stop strings, logprobs, n > 1 fan-in."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from pagedserve.core.sched_output import EngineCoreOutput
from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.outputs import (CompletionOutput, EmbeddingOutput, Logprob, LogprobsDict, PoolingRequestOutput,
                                RequestMetrics, RequestOutput)
from pagedserve.pooling_params import PoolingParams, finish_embedding
from pagedserve.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _Sample:
    """One of the n completions of a request (an engine-level child request)."""

    index: int
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[LogprobsDict] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_sent_tokens: int = 0  # for DELTA outputs
    num_sent_logprobs: int = 0
    sent_finish: bool = False  # DELTA: its last output (with the finish reason) went out; it is not sent again


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[_Sample]
    metrics: RequestMetrics
    prompt_logprobs: list[LogprobsDict | None] | None = None
    num_cached_tokens: int = 0
    num_sent_prompt_logprobs: int = 0

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


@dataclass
class _PoolingState:
    """An embedding request: no samples, one result when its prompt has run."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: PoolingParams
    metrics: RequestMetrics
    normalize: bool  # the request's `normalize`, else the model's own (its Normalize module)


def _visible_tokens(core_out: EngineCoreOutput, params: SamplingParams) -> list[int]:
    """The new tokens that become text: all but a stop token that ended the request (EOS, stop_token_ids), as
    vLLM, so that its text (e.g. <|im_end|>) never shows even with skip_special_tokens=False."""
    ended_on_token = core_out.finish_reason == "stop" and not isinstance(core_out.stop_reason, str)
    if ended_on_token and core_out.new_token_ids and not params.include_stop_str_in_output:
        return core_out.new_token_ids[:-1]
    return core_out.new_token_ids


def child_request_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{index}#{request_id}"


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, _RequestState] = {}
        self.child_to_parent: dict[str, tuple[str, int]] = {}
        self.pooling: dict[str, _PoolingState] = {}
        self.failed: dict[str, str] = {}  # parent request id -> reason, for the engine to fail and report

    def has_request(self, request_id: str) -> bool:
        return request_id in self.requests or request_id in self.pooling

    def add_pooling_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                            params: PoolingParams, arrival_time: float, model_normalizes: bool) -> None:
        normalize = model_normalizes if params.normalize is None else params.normalize
        self.pooling[request_id] = _PoolingState(request_id, prompt, prompt_token_ids, params,
                                                 RequestMetrics(arrival_time), normalize)

    def _finish_pooling(self, state: _PoolingState, core_out: EngineCoreOutput | None, now: float
                        ) -> PoolingRequestOutput:
        """The result (an empty vector when aborted before its prompt ran)."""
        del self.pooling[state.request_id]
        state.metrics.finished_time = now
        embedding: list[float] = []
        if core_out is not None:
            state.metrics.first_scheduled_time = core_out.first_scheduled_time
            state.metrics.first_token_time = state.metrics.last_token_time = now
            embedding = finish_embedding(core_out.pooled, state.params.dimensions, state.normalize)
        return PoolingRequestOutput(state.request_id, state.prompt, state.prompt_token_ids,
                                    EmbeddingOutput(embedding), finished=True, metrics=state.metrics)

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float) -> list[str]:
        """Register a request; returns the child request ids the scheduler will run."""
        samples = [_Sample(i, IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params),
                           logprobs=[] if params.logprobs is not None else None,
                           cumulative_logprob=0.0 if params.logprobs is not None else None)
                   for i in range(params.n)]
        self.requests[request_id] = _RequestState(
            request_id, prompt, prompt_token_ids, params, samples,
            RequestMetrics(arrival_time, n=params.n, max_tokens=params.max_tokens),
            prompt_logprobs=[] if params.prompt_logprobs is not None else None)
        child_ids = [child_request_id(request_id, i, params.n) for i in range(params.n)]
        for i, child_id in enumerate(child_ids):
            self.child_to_parent[child_id] = (request_id, i)
        return child_ids

    def child_ids(self, request_id: str) -> list[str]:
        if request_id in self.pooling:
            return [request_id]
        state = self.requests.get(request_id)
        return [] if state is None else [child_request_id(request_id, i, state.params.n)
                                         for i in range(state.params.n)]

    def abort(self, request_id: str) -> RequestOutput | PoolingRequestOutput | None:
        """Mark every unfinished sample aborted; returns the final output (None if unknown)."""
        if request_id in self.pooling:
            return self._finish_pooling(self.pooling[request_id], None, time.monotonic())
        state = self.requests.get(request_id)
        if state is None:
            return None
        for sample in state.samples:
            if sample.finish_reason is None:
                sample.finish_reason = "abort"
        return self._finish_and_build(state)

    def process(self, outputs: list[EngineCoreOutput]
                ) -> tuple[list[RequestOutput | PoolingRequestOutput], list[str]]:
        """(outputs to deliver, child ids that hit a stop string and must be finished in the scheduler)."""
        now = time.monotonic()
        touched: dict[str, _RequestState] = {}
        stopped_children: list[str] = []
        results: list[RequestOutput | PoolingRequestOutput] = []
        for core_out in outputs:
            pooling = self.pooling.get(core_out.request_id)
            if pooling is not None:
                if core_out.pooled is not None:
                    results.append(self._finish_pooling(pooling, core_out, now))
                continue
            parent_id, index = self.child_to_parent.get(core_out.request_id, (None, 0))
            state = self.requests.get(parent_id) if parent_id else None
            if state is None:
                continue
            try:
                if self._update_sample(state, state.samples[index], core_out, now):
                    stopped_children.append(core_out.request_id)
            except Exception as exc:  # noqa: BLE001 - one request's fault (e.g. detokenizing); the engine fails it
                logger.error("request %s failed: %s: %s", parent_id, type(exc).__name__, exc, exc_info=exc)
                self.failed[parent_id] = f"{type(exc).__name__}: {exc}"
                continue
            touched[parent_id] = state
        for parent_id, state in touched.items():
            if parent_id in self.failed:
                continue
            built = self._finish_and_build(state) if state.finished else self._build(state)
            if built is not None:
                results.append(built)
        return results, stopped_children

    def take_failed(self) -> dict[str, str]:
        failed, self.failed = self.failed, {}
        return failed

    def parent_id(self, child_id: str) -> str | None:
        if child_id in self.pooling:
            return child_id
        parent = self.child_to_parent.get(child_id)
        return parent[0] if parent else None

    def _update_sample(self, state: _RequestState, sample: _Sample, core_out: EngineCoreOutput,
                       now: float) -> bool:
        """Apply one child's progress; True when a stop string ended it here."""
        state.num_cached_tokens = max(state.num_cached_tokens, core_out.num_cached_tokens)
        if state.metrics.first_scheduled_time is None:
            state.metrics.first_scheduled_time = core_out.first_scheduled_time
        # n > 1: every child prefills the same prompt; its logprobs are taken once, from the first
        if core_out.new_prompt_logprobs is not None and state.prompt_logprobs is not None and sample.index == 0:
            state.prompt_logprobs.extend(self._to_logprobs_dict(x, state.params.detokenize)
                                         for x in core_out.new_prompt_logprobs)
        if sample.finish_reason is not None:
            return False
        if core_out.new_token_ids:
            if state.metrics.first_token_time is None:
                state.metrics.first_token_time = now
            state.metrics.last_token_time = now
        visible = len(_visible_tokens(core_out, state.params))
        logprobs = core_out.new_logprobs if sample.logprobs is not None else None
        # Token by token, as they would come one per step: a stop string ends the sample at the token that
        # completes it, and the tokens after it (verified drafts, speculative decoding) are dropped.
        for i, token_id in enumerate(core_out.new_token_ids):
            sample.token_ids.append(token_id)
            if logprobs is not None:
                sample.logprobs.append(self._to_logprobs_dict(logprobs[i], state.params.detokenize))
                sample.cumulative_logprob += logprobs[i].logprob
            stop = sample.detokenizer.update([token_id]) if i < visible else None
            if stop is not None:
                sample.finish_reason, sample.stop_reason = "stop", stop
                return core_out.finish_reason is None
        if core_out.finish_reason is not None:
            sample.finish_reason, sample.stop_reason = core_out.finish_reason, core_out.stop_reason
        return False

    def _to_logprobs_dict(self, entry: Any, decode: bool = True) -> LogprobsDict | None:
        """{token id: Logprob}: the sampled (or prompt) token first, then the top ones by rank, as vLLM orders them
        (code reading the first entry takes the sampled token's logprob). A sampled token among the top ones has
        its place there as its rank, as vLLM's (a tie shares a logprob, not a rank). `decode` False
        (SamplingParams.detokenize): no decoded_token, as vLLM's."""
        if entry is None:
            return None
        text = self.tokenizer.decode if decode else lambda ids: None
        top = {token_id: Logprob(logprob, rank, text([token_id]))
               for rank, (token_id, logprob) in enumerate(zip(entry.top_ids, entry.top_logprobs), start=1)}
        sampled = top.pop(entry.token_id, None) or Logprob(entry.logprob, entry.rank, text([entry.token_id]))
        return {entry.token_id: sampled, **top}

    def _finish_and_build(self, state: _RequestState) -> RequestOutput | None:
        state.metrics.finished_time = time.monotonic()
        del self.requests[state.request_id]
        for i in range(state.params.n):
            self.child_to_parent.pop(child_request_id(state.request_id, i, state.params.n), None)
        return self._build(state, finished=True)

    def _build(self, state: _RequestState, finished: bool = False) -> RequestOutput | None:
        kind = state.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind == RequestOutputKind.DELTA
        # DELTA: a sample that finished earlier has nothing more to say (n > 1: its finish reason went out once)
        samples = [s for s in state.samples if not s.sent_finish] if delta else state.samples
        completions = [self._completion(s, delta) for s in samples]
        if delta:
            for sample in samples:
                sample.sent_finish = sample.finish_reason is not None
        prompt_logprobs = state.prompt_logprobs
        if delta and prompt_logprobs is not None:
            prompt_logprobs = prompt_logprobs[state.num_sent_prompt_logprobs:]
            state.num_sent_prompt_logprobs = len(state.prompt_logprobs)
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, completions, finished,
                             prompt_logprobs=prompt_logprobs, num_cached_tokens=state.num_cached_tokens,
                             metrics=state.metrics)

    @staticmethod
    def _completion(sample: _Sample, delta: bool) -> CompletionOutput:
        done = sample.finish_reason is not None
        if not delta:
            return CompletionOutput(sample.index, sample.detokenizer.visible_text(done), list(sample.token_ids),
                                    sample.cumulative_logprob, sample.logprobs, sample.finish_reason,
                                    sample.stop_reason)
        token_ids = sample.token_ids[sample.num_sent_tokens:]
        sample.num_sent_tokens = len(sample.token_ids)
        logprobs = None
        if sample.logprobs is not None:
            logprobs = sample.logprobs[sample.num_sent_logprobs:]
            sample.num_sent_logprobs = len(sample.logprobs)
        return CompletionOutput(sample.index, sample.detokenizer.text_to_emit(done), token_ids,
                                sample.cumulative_logprob, logprobs, sample.finish_reason, sample.stop_reason)
