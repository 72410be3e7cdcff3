"""The checks a prompt passes before it is queued, each written once.

LLMEngine.add_request runs them on every request (LLM, AsyncEngine); the HTTP layer runs the same functions
earlier, with the request's own max_tokens and input numbers, so that a bad request is a 400 before any
stream starts. Each raises InvalidRequestError naming the field (`param`) the client must change. The checks
of a request body's shape (an empty list of prompts, too many stop strings) stay in the HTTP layer.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence

from pagedserve.exceptions import InvalidRequestError


def token_id_list(values: Iterable, param: str) -> list[int]:
    """Token ids as Python ints: numpy's integers (an array's items) too, as vLLM takes them; anything else that is
    not an integer (a string, a float, a bool) is an InvalidRequestError naming it."""
    if isinstance(values, (bytes, bytearray, memoryview)):  # iterates as ints: b"Hi" would be ids 72, 105
        raise InvalidRequestError(f"{param}: token ids must be a list of integers, got {type(values).__name__} "
                                  "(for text, decode the bytes to a str first)", param=param)
    out = []
    for value in values:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise InvalidRequestError(f"{param}: token ids must be integers, got {value!r} "
                                      f"({type(value).__name__})", param=param)
        out.append(int(value))
    return out


def check_token_ids(token_ids: Sequence[int], vocab_size: int, param: str, label: str | None = None) -> None:
    """Every id must index the vocabulary (ids index the embedding table and the logits). The message starts
    with `label` (default: `param`; "" for none)."""
    bad = [t for t in token_ids if not (isinstance(t, int) and 0 <= t < vocab_size)]
    if bad:
        label = param if label is None else label
        prefix = f"{label}: " if label else ""
        raise InvalidRequestError(f"{prefix}token id {bad[0]} is out of range [0, {vocab_size})", param=param)


def check_not_empty(prompt_ids: Sequence[int]) -> None:
    if not prompt_ids:
        raise InvalidRequestError("the prompt is empty", param="prompt")


def generation_max_tokens(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int,
                          param: str = "max_tokens", prompt_param: str = "prompt") -> int:
    """How many tokens a generation request may produce: `max_tokens`, or what the context leaves when it is
    None. 400 when max_tokens < 1 or when the prompt with max_tokens (at least one token) passes
    max_model_len, naming the prompt's field (`prompt_param`: prompt, or messages) when the prompt alone leaves
    no room. `param` is the field the client set (max_tokens or max_completion_tokens)."""
    if max_tokens is not None and max_tokens < 1:
        raise InvalidRequestError(f"{param} must be at least 1, got {max_tokens}", param=param)
    if num_prompt_tokens >= max_model_len:
        verb = "are" if prompt_param.endswith("s") else "is"
        raise InvalidRequestError(f"This model's maximum context length is {max_model_len} tokens. However, the "
                                  f"{prompt_param} {verb} {num_prompt_tokens} tokens long, which leaves no room for "
                                  f"the completion. Please reduce the {prompt_param}.", param=prompt_param)
    total = num_prompt_tokens + (max_tokens or 1)
    if total > max_model_len:
        raise InvalidRequestError(f"This model's maximum context length is {max_model_len} tokens. However, "
                                  f"you requested {total} tokens ({num_prompt_tokens} in the prompt, "
                                  f"{max_tokens or 1} for the completion). Please reduce the prompt or {param}.",
                                  param=param)
    return max_tokens if max_tokens is not None else max_model_len - num_prompt_tokens


def check_generation_prompt(prompt_ids: Sequence[int], max_model_len: int, vocab_size: int) -> None:
    """A prompt to generate from: not empty, room for at least one output token, ids in the vocabulary."""
    check_not_empty(prompt_ids)
    generation_max_tokens(len(prompt_ids), None, max_model_len)
    check_token_ids(prompt_ids, vocab_size, "prompt")


def check_pooling_prompt(prompt_ids: Sequence[int], max_model_len: int, vocab_size: int,
                         label: str = "input", param: str = "input") -> None:
    """A prompt to embed: not empty, ids in the vocabulary, at most max_model_len tokens (the HTTP layer
    names the input by its index in `label`, the request field in `param`)."""
    check_not_empty(prompt_ids)
    check_token_ids(prompt_ids, vocab_size, param, label)
    if len(prompt_ids) > max_model_len:
        raise InvalidRequestError(f"This model's maximum context length is {max_model_len} tokens. However, "
                                  f"{label} has {len(prompt_ids)} tokens. Please shorten it, or pass "
                                  "truncate_prompt_tokens to cut it.", param=param)
