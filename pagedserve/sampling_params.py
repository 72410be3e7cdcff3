"""SamplingParams: how one request is decoded. Validates itself; bad values raise InvalidRequestError
(a ValueError) naming the field. Checks that need the model (token ids vs vocabulary, lengths vs
max_model_len) are LLMEngine.add_request's."""

from __future__ import annotations

import copy
import math
import numbers
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from pagedserve.engine.prompt_checks import token_id_list
from pagedserve.exceptions import InvalidRequestError, check_text
from pagedserve.structured.params import ReasoningGate, StructuredOutputsParams

# Integers end up in int64 tensors (top_k, token ids) or torch.Generator seeds: beyond these they overflow.
MAX_INT64 = 2**63 - 1
MIN_INT64 = -(2**63)
# SamplingParams' number fields, as _normalize and _validate go over them
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
INT_FIELDS = ("n", "top_k", "min_tokens", "max_tokens", "logprobs", "prompt_logprobs", "seed", "priority")


class RequestOutputKind(Enum):
    """What each RequestOutput carries while streaming."""

    CUMULATIVE = 0  # the whole output so far
    DELTA = 1  # only what is new since the last output
    FINAL_ONLY = 2  # nothing until the request finishes


@dataclass
class SamplingParams:
    """Sampling parameters with vLLM/OpenAI meanings. temperature == 0 means greedy."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1, accepted for vLLM compatibility) = no top-k
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None  # only these may be sampled (vLLM's)
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    max_tokens: int | None = 16  # None = up to max_model_len
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token (the sampled one is always included)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # The output must match this grammar (JSON schema, regex, choice, EBNF): see pagedserve/structured/.
    structured_outputs: StructuredOutputsParams | None = None
    # Prefix-cache isolation (vLLM's cache_salt): blocks are reused only between requests with the same salt.
    cache_salt: str | None = None
    # With --scheduling-policy priority: lower values are scheduled first (and preempted last); vLLM's.
    priority: int = 0
    detokenize: bool = True  # vLLM's: False leaves the text empty (token ids only; no stop strings then)
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the prompt's last k tokens (-1: max_model_len)
    extra_args: dict | None = None  # vLLM's: for custom logits processors, which pagedserve has not; kept as given
    guided_decoding: StructuredOutputsParams | dict | None = None  # vLLM's older name of structured_outputs
    # vLLM's: words that must not be generated; a word's last token is banned where the output ends with the tokens
    # before it (each word as it reads alone and after a space). Their token ids: update_from_tokenizer.
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False, compare=False)
    # The grammar begins after a think block (the server's --reasoning-parser; structured/gate.py): not vLLM's field.
    reasoning_gate: ReasoningGate | None = field(default=None, repr=False, compare=False)
    # vLLM's fields that pagedserve refuses with what to do instead (they would change the output)
    logits_processors: list | None = None
    best_of: int | None = None

    def __post_init__(self) -> None:
        if self.seed == -1 and not isinstance(self.seed, bool):  # vLLM's: -1 is no seed (here only: a clone's
            self.seed = None  # seed is what it is given, e.g. the seed + i of sample i, which may be -1)
        self._normalize()
        self._validate()

    def _normalize(self) -> None:
        """vLLM's spellings to one form (idempotent: clone runs it again on fields changed after construction)."""
        for name in FLOAT_FIELDS:  # numpy's scalars (np.float32(0.7)) as Python numbers, as vLLM takes them
            value = getattr(self, name)
            if isinstance(value, numbers.Real) and not isinstance(value, (int, float)):
                setattr(self, name, float(value))
        for name in INT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, numbers.Integral) and not isinstance(value, int):
                setattr(self, name, int(value))
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name in ("stop", "stop_token_ids"):
            value = getattr(self, name) or []
            _check(isinstance(value, (list, tuple)), name, f"must be a list, got {type(value).__name__}")
            setattr(self, name, list(value))
        self.stop_token_ids = token_id_list(self.stop_token_ids, "stop_token_ids")  # numpy's integers too
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = token_id_list(self.allowed_token_ids, "allowed_token_ids")
        if self.top_k == -1:
            self.top_k = 0
        for name in ("logprobs", "prompt_logprobs"):  # vLLM's: True is 1 (the sampled token's and the top one)
            value = getattr(self, name)
            if isinstance(value, bool):
                setattr(self, name, 1 if value else None)
        if self.logit_bias is not None:
            self.logit_bias = _int_keys(self.logit_bias)
        if self.guided_decoding is not None:
            _check(self.structured_outputs is None, "guided_decoding", "give structured_outputs or guided_decoding "
                   "(its older name), not both")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_request(self.structured_outputs)

    def _validate(self) -> None:
        if self.bad_words is not None:
            _check(isinstance(self.bad_words, (list, tuple)) and all(isinstance(w, str) and w.strip()
                                                                     for w in self.bad_words),
                   "bad_words", f"must be a list of words (non-empty strings), got {self.bad_words!r}")
        _check(not self.logits_processors, "logits_processors", "are not supported: logit_bias, allowed_token_ids, "
               "penalties and structured_outputs are")
        check_best_of(self.best_of, self.n)
        _check(self.detokenize or not self.stop, "detokenize", "must be True with stop strings (they are found in "
               "the text)")
        if self.truncate_prompt_tokens is not None:
            k = self.truncate_prompt_tokens
            _check(isinstance(k, int) and not isinstance(k, bool) and (k >= 1 or k == -1), "truncate_prompt_tokens",
                   f"must be >= 1, or -1 for max_model_len, got {k!r}")
        for name in FLOAT_FIELDS:
            value = getattr(self, name)
            _check(isinstance(value, (int, float)) and math.isfinite(value), name,
                   f"must be a finite number, got {value!r}")
        for name in INT_FIELDS:
            value = getattr(self, name)
            if value is not None:
                _check(isinstance(value, int) and not isinstance(value, bool) and MIN_INT64 <= value <= MAX_INT64,
                       name, f"must be an integer in [{MIN_INT64}, {MAX_INT64}], got {value!r}")
        _check(self.n >= 1, "n", f"must be >= 1, got {self.n}")
        _check(self.temperature >= 0.0, "temperature", f"must be >= 0, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, "top_k", f"must be 0 or -1 (disabled) or >= 1, got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
               f"must be in [-2, 2], got {self.presence_penalty}")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
               f"must be in [-2, 2], got {self.frequency_penalty}")
        _check(self.repetition_penalty > 0.0, "repetition_penalty",
               f"must be > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None:
            _check(self.max_tokens >= 1, "max_tokens", f"must be >= 1, got {self.max_tokens}")
        _check(self.min_tokens >= 0, "min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens",
                   f"must be <= max_tokens={self.max_tokens}, got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):  # the upper bound is the engine's --max-logprobs
            value = getattr(self, name)
            if value is not None:
                _check(value >= -1, name, f"must be >= 0, or -1 for the whole vocabulary, got {value}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        for text in self.stop:
            check_text(text, "a stop string", param="stop")
        _check(all(isinstance(t, int) and 0 <= t <= MAX_INT64 for t in self.stop_token_ids), "stop_token_ids",
               "must be non-negative integers")
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            _check(isinstance(ids, list) and len(ids) > 0 and all(isinstance(t, int) and 0 <= t <= MAX_INT64
                                                                   for t in ids),
                   "allowed_token_ids", "must be a non-empty list of token ids (non-negative integers)")
        if self.cache_salt is not None:
            _check(isinstance(self.cache_salt, str) and self.cache_salt != "", "cache_salt",
                   "must be a non-empty string")
            check_text(self.cache_salt, "cache_salt", param="cache_salt")  # hashed as UTF-8 by the block pool
        if self.logit_bias:
            _check(all(0 <= k <= MAX_INT64 for k in self.logit_bias), "logit_bias",
                   "keys must be token ids (non-negative integers)")
            _check(all(-100.0 <= v <= 100.0 for v in self.logit_bias.values()), "logit_bias",
                   "values must be in [-100, 100]")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def update_from_tokenizer(self, tokenizer: Any, vocab_size: int) -> None:
        """vLLM's: the token ids of each of bad_words, as it reads alone and after a space (where that is other
        tokens of the same count: the word inside a sentence), for the sampler; a 400 for a word whose tokens lie
        outside the model's vocabulary."""
        if not self.bad_words:
            return
        words: list[list[int]] = []
        for word in self.bad_words:
            alone = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            words.append(alone)
            if spaced and alone and spaced[0] != alone[0] and len(spaced) == len(alone):
                words.append(spaced)
        outside = [t for ids in words for t in ids if not 0 <= t < vocab_size]
        _check(not outside, "bad_words", f"hold tokens outside the model's vocabulary ({outside[:5]})")
        self.bad_words_token_ids = [ids for ids in words if ids]

    @classmethod
    def from_optional(cls, **kwargs: Any) -> "SamplingParams":
        """vLLM's: keyword arguments where None means the field's default (max_tokens None stays None: up to
        max_model_len, as in vLLM's)."""
        return cls(**{k: v for k, v in kwargs.items() if v is not None or k == "max_tokens"})

    def clone(self, **changes: object) -> "SamplingParams":
        """A copy with `changes`, normalized and checked as a new one is: a field set after construction (top_k = -1,
        logprobs = True, logit_bias with string keys) reads as it would have in the constructor."""
        new = copy.copy(self)
        for key, value in changes.items():
            setattr(new, key, value)
        new._normalize()  # new lists (stop, stop_token_ids): the copy shares none of this one's
        new._validate()
        return new


def check_best_of(best_of: int | None, n: int) -> None:
    """A 400 unless `best_of` is unset or n: the only best_of served (SamplingParams and the OpenAI server's)."""
    if best_of is not None and best_of < n:  # QA-AF: n=2, best_of=1 was told best_of is unsupported
        raise InvalidRequestError(f"best_of ({best_of}) must be at least n ({n}): it is how many sequences are "
                                  "sampled to return n of them", param="best_of")
    _check(best_of is None or best_of == n, "best_of", "above n is not supported (vLLM's V1 engine dropped it "
           "too): sample n and rank the outputs by cumulative_logprob")


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(f"{name} {message}", param=name)


def _int_keys(logit_bias: dict) -> dict[int, float]:
    """{token id: bias} from keys that may be strings (JSON objects have string keys)."""
    try:
        return {int(k): float(v) for k, v in logit_bias.items()}
    except (TypeError, ValueError):
        raise InvalidRequestError("logit_bias must map token ids (integers) to numbers", param="logit_bias") from None


@dataclass
class BeamSearchParams:
    """vLLM's: what LLM.beam_search takes (pagedserve/beam_search.py runs it)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not 0.0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty}")

    @property
    def num_candidates(self) -> int:
        """How many next tokens each beam's scoring request asks the log-probabilities of."""
        return 2 * self.beam_width


# vLLM's former name (before 0.11) for the structured-outputs parameters, which older code imports from here.
GuidedDecodingParams = StructuredOutputsParams
