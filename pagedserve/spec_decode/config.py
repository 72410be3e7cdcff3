"""--speculative-config (vLLM's flag and LLM(speculative_config=...)'s dict), parsed and checked once."""

from __future__ import annotations

from dataclasses import dataclass, fields

from pagedserve.config import json_object

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16
# Past this many running requests no request speculates (vLLM's disable_by_batch_size): a large batch is
# compute-bound on a CPU, so verifying k extra tokens per request costs about k extra steps' worth of work.
DEFAULT_DISABLE_BY_BATCH_SIZE = 4
_EXAMPLE = '\'{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\''
_DRAFT_EXAMPLE = '\'{"model": "/path/to/small-model", "num_speculative_tokens": 4}\''
NGRAM_KEYS = ("prompt_lookup_max", "prompt_lookup_min", "ngram_cache_requests")


@dataclass(frozen=True)
class SpeculativeConfig:
    """method "ngram" (prompt lookup): the longest suffix of a request's tokens (between prompt_lookup_min and
    prompt_lookup_max tokens long) that occurred earlier in its prompt or output proposes the tokens that
    followed it there, up to num_speculative_tokens of them.
    method "draft_model" (vLLM's, chosen by giving "model"): a smaller model that shares the target's
    tokenizer proposes num_speculative_tokens greedy tokens each step (worker/draft_model.py)."""

    method: str = "ngram"
    model: str | None = None  # the draft model (path or packaged name) for method draft_model
    num_speculative_tokens: int = 0
    prompt_lookup_max: int = 5  # vLLM's defaults when neither bound is given
    prompt_lookup_min: int = 5
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE
    # pagedserve's extension: also look the suffix up in the tokens of the last N finished requests (0: off).
    ngram_cache_requests: int = 0

    @classmethod
    def parse(cls, value: str | dict | None) -> "SpeculativeConfig | None":
        """From the flag's JSON or the dict (None: speculation off); ValueError naming the problem and the fix."""
        if value is None:
            return None
        if isinstance(value, SpeculativeConfig):
            return value
        spec = json_object(value, "--speculative-config", _EXAMPLE)
        method = spec.get("method", "draft_model" if "model" in spec else None)
        if method is None:  # vLLM refuses this too ("num_speculative_tokens was provided but without ... model")
            raise ValueError(f"--speculative-config: give \"method\": \"ngram\" for prompt lookup, or a draft "
                             f"\"model\": {_EXAMPLE} or {_DRAFT_EXAMPLE}")
        if method == "[ngram]":  # vLLM's older spelling
            method = "ngram"
        if method not in METHODS:
            raise ValueError(f"--speculative-config: method {method!r} is not supported; pagedserve has "
                             f"{', '.join(METHODS)}: {_EXAMPLE} or {_DRAFT_EXAMPLE}")
        spec = _without_one_rank(spec)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ValueError(f"--speculative-config: unknown key {unknown[0]!r}; known: {', '.join(sorted(known))}")
        if method == "draft_model":
            return cls._parse_draft(spec)
        if "model" in spec:
            raise ValueError(f"--speculative-config: method ngram takes no \"model\"; for a draft model leave "
                             f"\"method\" out: {_DRAFT_EXAMPLE}")
        lookup_max, lookup_min = spec.get("prompt_lookup_max"), spec.get("prompt_lookup_min")
        for name in ("prompt_lookup_max", "prompt_lookup_min"):  # checked as given, before one stands for both
            number = spec.get(name)
            if number is not None and (isinstance(number, bool) or not isinstance(number, int) or number < 1):
                raise ValueError(f"--speculative-config: {name} must be an integer >= 1, got {number!r}: {_EXAMPLE}")
        if lookup_max is None and lookup_min is None:
            lookup_max = lookup_min = cls.prompt_lookup_max
        elif lookup_max is None:
            lookup_max = lookup_min
        elif lookup_min is None:
            lookup_min = lookup_max
        values = {"num_speculative_tokens": spec.get("num_speculative_tokens"), "prompt_lookup_max": lookup_max,
                  "prompt_lookup_min": lookup_min,
                  "disable_by_batch_size": spec.get("disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE)}
        for name, number in values.items():
            if isinstance(number, bool) or not isinstance(number, int) or number < 1:
                raise ValueError(f"--speculative-config: {name} must be an integer >= 1, got {number!r}: {_EXAMPLE}")
        cache = spec.get("ngram_cache_requests", 0)
        if isinstance(cache, bool) or not isinstance(cache, int) or cache < 0:
            raise ValueError(f"--speculative-config: ngram_cache_requests must be an integer >= 0 (0: off), got "
                             f"{cache!r}")
        values["ngram_cache_requests"] = cache
        if values["num_speculative_tokens"] > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"--speculative-config: num_speculative_tokens is at most {MAX_SPECULATIVE_TOKENS}, "
                             f"got {values['num_speculative_tokens']}")
        if lookup_min > lookup_max:
            raise ValueError(f"--speculative-config: prompt_lookup_min ({lookup_min}) must be <= prompt_lookup_max "
                             f"({lookup_max})")
        return cls(method=method, **values)

    @classmethod
    def _parse_draft(cls, spec: dict) -> "SpeculativeConfig":
        model = spec.get("model")
        if not isinstance(model, str) or not model:
            raise ValueError(f"--speculative-config: method draft_model needs \"model\", the draft model's path or "
                             f"packaged name: {_DRAFT_EXAMPLE}")
        given = [key for key in NGRAM_KEYS if key in spec]
        if given:
            raise ValueError(f"--speculative-config: {given[0]} applies to method ngram, not to a draft model; "
                             f"leave it out: {_DRAFT_EXAMPLE}")
        values = {"num_speculative_tokens": spec.get("num_speculative_tokens"),
                  "disable_by_batch_size": spec.get("disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE)}
        for name, number in values.items():
            if isinstance(number, bool) or not isinstance(number, int) or number < 1:
                raise ValueError(f"--speculative-config: {name} must be an integer >= 1, got {number!r}: "
                                 f"{_DRAFT_EXAMPLE}")
        if values["num_speculative_tokens"] > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"--speculative-config: num_speculative_tokens is at most {MAX_SPECULATIVE_TOKENS}, "
                             f"got {values['num_speculative_tokens']}")
        return cls(method="draft_model", model=model, **values)


def _without_one_rank(spec: dict) -> dict:
    """vLLM's draft_tensor_parallel_size (its draft-model examples give 1): 1, the draft on the target's one
    process per rank, is what pagedserve does; other sizes are refused by name."""
    if "draft_tensor_parallel_size" not in spec:
        return spec
    size = spec["draft_tensor_parallel_size"]
    if size not in (None, 1) or isinstance(size, bool):
        raise ValueError(f"--speculative-config: draft_tensor_parallel_size {size!r} is not supported: the draft "
                         "model runs whole in each process (give 1 or leave it out)")
    return {key: value for key, value in spec.items() if key != "draft_tensor_parallel_size"}
