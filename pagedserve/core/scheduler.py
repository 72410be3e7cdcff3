"""Scheduler: continuous batching inside a token budget, with chunked prefill and preemption.

Each step fills `max_num_batched_tokens` with the running requests' next tokens (one per decode,
a chunk per unfinished prefill) and then with waiting requests, at most `max_num_seqs` running.
Prefill and decode are the same thing: compute tokens num_computed_tokens .. num_tokens.
When blocks run out, the newest running request is preempted (its blocks freed, to be recomputed).
With speculative decoding a decoding request may carry draft tokens (spec_decode/): it is scheduled 1 + k query
tokens, counted in the budget, and afterwards advances by as many tokens as the runner accepted (the K/V written
for rejected drafts lie past num_computed_tokens and are overwritten later). Drafts never cause a preemption.

A fault while scheduling or updating one request fails that request alone (its blocks freed, its id
in `take_failed()`), so the step goes on for the others. So does a request that outgrows the whole KV pool on
its own (possible only with a pool smaller than max_model_len, --num-gpu-blocks-override): it would wait, or
preempt itself, forever.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable

from pagedserve.config import SchedulerConfig
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.sched_output import (CachedRequestData, EngineCoreOutput, ModelRunnerOutput,
                                          NewRequestData, SchedulerOutput, SchedulerStats)
from pagedserve.exceptions import InvalidRequestError
from pagedserve.request import Request, RequestStatus
from pagedserve.spec_decode.proposer import Proposer

logger = logging.getLogger(__name__)

# (stage, request id) -> None, called before each request is scheduled or updated; the test-only fault
# injection of engine/faults.py raises from it.
FaultHook = Callable[[str, str], None]


def _no_fault(stage: str, request_id: str) -> None:
    return None


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 fault_hook: FaultHook = _no_fault, proposer: Proposer | None = None) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.fault_hook = fault_hook
        self.proposer = proposer  # speculative decoding's draft tokens; None = off
        self._failed: dict[str, str | BaseException] = {}  # request id -> reason, since the last take_failed()
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_ids: list[str] = []  # since the last schedule(), for the runner
        self.num_preemptions_total = 0
        self._step_preemptions = 0
        self._last_prefix_stats = (0, 0)
        self.hold_waiting = False  # under memory pressure: only running requests are scheduled (memory/pressure.py)

    # ---- requests in and out -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self._enqueue(request)

    def _order(self, request: Request) -> tuple[int, float]:
        """Where a request stands in --scheduling-policy priority: lower priority value first, then arrival."""
        return request.sampling_params.priority, request.arrival_time

    def _enqueue(self, request: Request, front: bool = False) -> None:
        """Into `waiting`: at the back (fcfs; a preempted request at the front), or in priority order."""
        if self.config.policy != "priority":
            self.waiting.appendleft(request) if front else self.waiting.append(request)
            return
        key = self._order(request)
        position = next((i for i, other in enumerate(self.waiting) if self._order(other) > key), len(self.waiting))
        self.waiting.insert(position, request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """End requests from outside the step (abort, stop string); unknown ids are ignored."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free(request)

    def _free(self, request: Request) -> None:
        self.kv.free(request)
        if self.proposer is not None:
            self.proposer.drop(request.request_id, request.all_token_ids)
        self._finished_ids.append(request.request_id)
        del self.requests[request.request_id]

    def fail_request(self, request: Request, exc: BaseException) -> None:
        """End one request after a fault in its own processing; the step goes on for the others."""
        if isinstance(exc, InvalidRequestError):  # the request's own doing (it outgrew the pool): no traceback
            logger.warning("request %s failed: %s", request.request_id, exc)
            self._failed[request.request_id] = exc
        else:
            logger.error("request %s failed: %s: %s", request.request_id, type(exc).__name__, exc, exc_info=exc)
            self._failed[request.request_id] = f"{type(exc).__name__}: {exc}"
        if request.request_id in self.requests and not request.is_finished:
            self.finish_requests([request.request_id], RequestStatus.FINISHED_ABORTED)

    def take_failed(self) -> dict[str, str | BaseException]:
        """Requests failed since the last call (id -> reason: a string for a fault, an InvalidRequestError for a
        request that cannot be served), for the engine to report."""
        failed, self._failed = self._failed, {}
        return failed

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def reset_after_warm_up(self) -> None:
        """Leave no trace of warm-up's requests: no cached prefixes, counters from zero."""
        self.kv.reset_prefix_cache()
        self._last_prefix_stats = (0, 0)
        self._step_preemptions = 0
        if self.proposer is not None:
            self.proposer.reset()

    def has_unfinished_requests(self) -> bool:
        return self.num_unfinished > 0

    # ---- one step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        if self.config.policy == "priority":  # highest priority first, so the tail (victims) is the lowest
            self.running.sort(key=self._order)
        budget = self._schedule_running(out, budget)
        if not out.preempted_request_ids and not self.hold_waiting:
            self._schedule_waiting(out, budget)
        if out.lookahead and len(self.running) > self._speculation_limit():
            out.lookahead.clear()  # admissions took the batch above disable_by_batch_size: nobody speculates next
        out.finished_request_ids = self.take_finished_ids()
        return out

    def take_finished_ids(self) -> list[str]:
        """Requests finished since the last call, whose state the runner drops (each step's SchedulerOutput)."""
        finished, self._finished_ids = self._finished_ids, []
        return finished

    def _num_tokens_to_compute(self, request: Request, budget: int) -> int:
        remaining = request.num_tokens - request.num_computed_tokens
        return min(self._prefill_cap(remaining), budget, self.config.max_model_len - request.num_computed_tokens)

    def _prefill_cap(self, num_new: int) -> int:
        """vLLM's long_prefill_token_threshold: a prompt's chunk this step, so that a long prompt leaves room in the
        budget for requests behind it (chunked prefill only: a whole prompt is one step otherwise)."""
        threshold = self.config.long_prefill_token_threshold
        if threshold > 0 and self.config.enable_chunked_prefill:
            return min(num_new, threshold)
        return num_new

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        speculate = len(self.running) <= self._speculation_limit()
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            try:
                self.fault_hook("schedule", request.request_id)
                num_new = self._num_tokens_to_compute(request, budget)
                if num_new <= 0:
                    index += 1
                    continue
                drafts = self._propose(request, budget) if speculate and num_new == 1 else []
                # A draft model writes K/V for its next proposals past this step's tokens: room for them too.
                lookahead = self._lookahead(request, request.num_computed_tokens + num_new + len(drafts)) \
                    if speculate else 0
                new_blocks = None
                if drafts or lookahead:
                    new_blocks = self.kv.allocate_slots(request, num_new + len(drafts) + lookahead)
                if new_blocks is None:
                    drafts, lookahead = [], 0
                    new_blocks = self.kv.allocate_slots(request, num_new)
                while new_blocks is None:
                    if len(self.running) == 1 and self.running[0] is request:  # alone: it never fits
                        raise self._outgrows_pool(request, num_new)
                    victim = self.running.pop()  # newest first
                    self._preempt(victim, out)
                    if victim is request:
                        return budget
                    new_blocks = self.kv.allocate_slots(request, num_new)
            except Exception as exc:  # noqa: BLE001 - one request's fault; it leaves `running`
                self.fail_request(request, exc)
                continue
            out.cached_requests.append(CachedRequestData(request.request_id, new_blocks.block_ids,
                                                         request.num_computed_tokens, new_blocks.window_block_ids))
            self._record(out, request, num_new, drafts)
            if lookahead:
                out.lookahead[request.request_id] = lookahead
            budget -= num_new + len(drafts)
            index += 1
        return budget

    def _outgrows_pool(self, request: Request, num_new: int) -> InvalidRequestError:
        """The error of a request that alone needs more KV blocks than the pool has."""
        return InvalidRequestError(
            f"the request needs the K/V of {request.num_computed_tokens + num_new} tokens, more than the whole KV "
            f"cache holds ({self.kv.capacity_tokens} tokens); give a shorter prompt or max_tokens, or start the "
            "server with a larger KV cache", param="max_tokens" if request.num_output_tokens else "prompt")

    def _speculation_limit(self) -> int:
        """Running requests up to which requests speculate (-1: speculation off)."""
        return self.proposer.config.disable_by_batch_size if self.proposer is not None else -1

    def _lookahead(self, request: Request, end: int) -> int:
        """Slots past this step's tokens (which end at `end`) for the proposer's K/V of its next drafts (a draft
        model's), where this step samples the request and it is not backing off after missed drafts; within
        max_model_len."""
        if self.proposer is None or request.is_pooling or end < request.num_tokens:
            return 0
        wanted = self.proposer.lookahead(request.request_id)
        if not wanted or self.proposer.waits(request.request_id):
            return 0
        return max(0, min(wanted, self.config.max_model_len - end))

    def _propose(self, request: Request, budget: int) -> list[int]:
        """Draft tokens for a decoding request, bounded so that every one of them could be emitted: by the
        budget, max_tokens (the step also emits one token of its own) and max_model_len."""
        if request.is_pooling or request.num_computed_tokens != request.num_tokens - 1:
            return []
        room = min(budget - 1, request.max_tokens - request.num_output_tokens - 1,
                   self.config.max_model_len - request.num_tokens - 1)
        return self.proposer.propose(request.request_id, request.all_token_ids, room) if room > 0 else []

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self._step_preemptions += 1
        self._enqueue(request, front=True)
        # Victims come from the tail of `running`, which this step has not reached yet (in priority order when
        # the policy is priority: schedule() sorts it, so the lowest priority is preempted first).
        out.preempted_request_ids.append(request.request_id)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            try:
                self.fault_hook("schedule", request.request_id)
                computed = self.kv.get_computed_blocks(request)
                num_new = request.num_tokens - computed.num_tokens
                if not self.config.enable_chunked_prefill and num_new > budget:
                    break
                num_new = min(self._prefill_cap(num_new), budget)
                lookahead = self._lookahead(request, computed.num_tokens + num_new) \
                    if len(self.running) < self._speculation_limit() else 0
                if lookahead and self.kv.allocate_slots(request, num_new + lookahead, computed) is None:
                    lookahead = 0
                if not lookahead and self.kv.allocate_slots(request, num_new, computed) is None:
                    if not self.running:
                        raise self._outgrows_pool(request, num_new)
                    break
            except Exception as exc:  # noqa: BLE001 - one request's fault; it leaves `waiting`
                self.fail_request(request, exc)
                continue
            self.waiting.popleft()
            self.kv.record_lookup(request, computed)
            if request.status == RequestStatus.WAITING:
                request.num_cached_tokens = computed.num_tokens
                request.first_scheduled_time = time.monotonic()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = computed.num_tokens
            self.running.append(request)
            out.new_requests.append(NewRequestData(
                request_id=request.request_id,
                token_ids=list(request.all_token_ids),
                num_prompt_tokens=request.num_prompt_tokens,
                block_ids=self.kv.block_ids(request.request_id),
                window_block_ids=self.kv.window_block_ids(request.request_id),
                num_computed_tokens=request.num_computed_tokens,
                sampling_params=request.sampling_params,
                is_pooling=request.is_pooling,
                grammar=request.grammar,
            ))
            self._record(out, request, num_new)
            if lookahead:
                out.lookahead[request.request_id] = lookahead
            budget -= num_new

    def _record(self, out: SchedulerOutput, request: Request, num_new: int, drafts: list[int] | None = None) -> None:
        start = request.num_computed_tokens
        out.num_scheduled_tokens[request.request_id] = num_new + len(drafts or ())
        out.scheduled_token_ids[request.request_id] = request.all_token_ids[start:start + num_new] + (drafts or [])
        out.needs_sample[request.request_id] = start + num_new >= request.num_tokens
        if drafts:
            out.spec_token_ids[request.request_id] = drafts

    # ---- after the forward ---------------------------------------------------------------
    def update_from_output(self, sched_out: SchedulerOutput,
                           runner_out: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs = []
        for request_id, num_new in sched_out.num_scheduled_tokens.items():
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            try:
                self.fault_hook("postprocess", request_id)
                output = self._update_one(request, num_new, sched_out, runner_out)
                if request.status == RequestStatus.RUNNING:
                    self.kv.release_out_of_window(request)
            except Exception as exc:  # noqa: BLE001 - one request's fault; the others' outputs go on
                self.fail_request(request, exc)
                continue
            if output.new_token_ids or output.finish_reason or output.new_prompt_logprobs is not None:
                outputs.append(output)
        return outputs

    def _update_one(self, request: Request, num_new: int, sched_out: SchedulerOutput,
                    runner_out: ModelRunnerOutput) -> EngineCoreOutput:
        drafts = sched_out.spec_token_ids.get(request.request_id)
        if drafts is None:
            request.num_computed_tokens += num_new
        else:  # the last known token and the accepted drafts now have their K/V; the rest is overwritten later
            num_accepted = len(runner_out.sampled_token_ids[request.request_id]) - 1
            request.num_computed_tokens += 1 + num_accepted
            self.proposer.record(request.request_id, len(drafts), num_accepted)
        output = EngineCoreOutput(request.request_id, [], num_cached_tokens=request.num_cached_tokens,
                                  new_prompt_logprobs=runner_out.prompt_logprobs.get(request.request_id),
                                  first_scheduled_time=request.first_scheduled_time)
        if sched_out.needs_sample[request.request_id]:
            self._append_result(request, runner_out, output)
            proposed = runner_out.draft_token_ids.get(request.request_id)
            if proposed and request.status == RequestStatus.RUNNING:
                self.proposer.offer(request.request_id, request.num_tokens, proposed)
        return output

    def _append_result(self, request: Request, runner_out: ModelRunnerOutput,
                       output: EngineCoreOutput) -> None:
        if request.is_pooling:
            output.pooled = runner_out.pooled[request.request_id]
            self._finish(request, RequestStatus.FINISHED_STOPPED, output)
            return
        if request.request_id in runner_out.grammar_dead_ends:
            raise InvalidRequestError("the grammar (structured outputs or a tool's schema) allows no token after the "
                                      f"{request.num_output_tokens} tokens generated so far: it cannot be completed; "
                                      "check that every rule can end", param="structured_outputs")
        token_ids = runner_out.sampled_token_ids[request.request_id]
        logprobs = runner_out.logprobs.get(request.request_id)
        status = None
        for token_id in token_ids:  # several after a verification: each checked as if it came alone
            request.append_output_token(token_id)
            output.new_token_ids.append(token_id)
            status = self._check_stop(request)
            if status is not None:
                break
        if logprobs is not None:
            output.new_logprobs = logprobs[:len(output.new_token_ids)]
        if status is None and request.request_id in runner_out.grammar_finished:
            status = RequestStatus.FINISHED_STOPPED
        if status is not None:
            self._finish(request, status, output)

    def _finish(self, request: Request, status: RequestStatus, output: EngineCoreOutput) -> None:
        request.status = status
        self.running.remove(request)
        output.finish_reason = request.finish_reason().value
        output.stop_reason = request.stop_reason
        self._free(request)

    def _check_stop(self, request: Request) -> RequestStatus | None:
        params = request.sampling_params
        last = request.output_token_ids[-1]
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last == request.eos_token_id:
                return RequestStatus.FINISHED_STOPPED
            if last in params.stop_token_ids:
                request.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    # ---- numbers for /metrics --------------------------------------------------------------
    def make_stats(self) -> SchedulerStats:
        queries, hits = self.kv.stats.num_queries, self.kv.stats.num_hits
        last_queries, last_hits = self._last_prefix_stats
        self._last_prefix_stats = (queries, hits)
        stats = SchedulerStats(
            num_running=len(self.running), num_waiting=len(self.waiting), kv_cache_usage=self.kv.usage,
            num_preemptions=self._step_preemptions,
            prefix_cache_queries=queries - last_queries, prefix_cache_hits=hits - last_hits,
            spec_decode=self.proposer.take_stats() if self.proposer is not None else None)
        self._step_preemptions = 0
        return stats
