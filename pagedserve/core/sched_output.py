"""Small dataclasses exchanged between scheduler, model runner and engine (no tensors)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedserve.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has no blocks for: first schedule, or resumed after preemption."""

    request_id: str
    token_ids: list[int]  # every known token (prompt + outputs so far)
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    sampling_params: SamplingParams
    is_pooling: bool = False
    grammar: Any = None  # compiled grammar of a constrained request (Request.grammar)
    # The sliding-window layers' own block table (core/kv_cache_manager.py; 0 where the request gave a block back);
    # empty where they have no pool of their own.
    window_block_ids: list[int] = field(default_factory=list)


@dataclass
class CachedRequestData:
    """A request the runner already knows: new blocks and the tokens to compute this step."""

    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    new_window_block_ids: list[int] = field(default_factory=list)  # appended to its window table


@dataclass
class SchedulerOutput:
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    # request_id -> tokens to compute this step; dict order is the batch order.
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    # request_id -> the token ids to compute this step (a decode step has exactly one).
    scheduled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # request_id -> whether the runner must sample after this step (all known tokens computed).
    needs_sample: dict[str, bool] = field(default_factory=dict)
    # request_id -> draft tokens to verify (speculative decoding): the last entries of scheduled_token_ids.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # request_id -> the proposer's lookahead slots it holds past this step's tokens: a draft model proposes
    # that many tokens for it after the step (the scheduler's one decision of who speculates next, and how far).
    lookahead: dict[str, int] = field(default_factory=dict)
    preempted_request_ids: list[str] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)  # runner drops their state

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


@dataclass
class ModelRunnerOutput:
    """What one forward pass produced, keyed by request id."""

    # request_id -> the tokens to append: one, or after verifying drafts the accepted ones and one more
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # request_id -> one logprobs object per sampled token (opaque to the scheduler; see worker/model_runner.py)
    logprobs: dict[str, list[Any]] = field(default_factory=dict)
    prompt_logprobs: dict[str, Any] = field(default_factory=dict)
    pooled: dict[str, Any] = field(default_factory=dict)  # request_id -> embedding (list[float])
    # Constrained requests whose grammar ended this step (it accepted a stop token): they finish "stop".
    grammar_finished: set[str] = field(default_factory=set)
    # Constrained requests whose grammar allowed no token at all (a dead end: it cannot be completed): they fail.
    grammar_dead_ends: set[str] = field(default_factory=set)
    # request_id -> what a draft model proposes to follow the request's tokens after this step (speculative
    # decoding with a draft model; spec_decode/draft.py holds them for the next step)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class EngineCoreOutput:
    """One request's progress after a step."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[Any] | None = None  # one entry per new token
    new_prompt_logprobs: Any = None
    pooled: Any = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None


@dataclass
class SchedulerStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0  # this step
    prefix_cache_queries: int = 0  # this step, in tokens
    prefix_cache_hits: int = 0
    spec_decode: Any = None  # spec_decode.proposer.SpecDecodeStats of this step, when speculating
