"""PoolingParams: how one embedding request is pooled and post-processed (pure Python, like SamplingParams)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pagedserve.exceptions import InvalidRequestError


@dataclass
class PoolingParams:
    """Per-request embedding options, with vLLM's names.

    `dimensions` keeps the first N values (Matryoshka). `normalize` scales the (kept) vector to unit length;
    None means the model's own choice (True when its sentence-transformers pipeline has a Normalize module),
    as vLLM's `normalize`. `truncate_prompt_tokens` = k keeps k tokens of a longer
    prompt: a text is cut on the tokenizer's `truncation_side` (BERT and most embedders: the end, keeping the
    final special token), token ids to their last k (vLLM's); -1 means the model's max_model_len. Without it, a prompt longer
    than max_model_len is an error, never silently cut.
    """

    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None
    normalize: bool | None = None
    task: str | None = None  # vLLM's: the pooling task; this engine pools "embed" (None means it)

    def __post_init__(self) -> None:
        if self.task not in (None, "embed"):
            raise InvalidRequestError(f"PoolingParams task {self.task!r} is not supported: pagedserve pools sentence "
                                      "embeddings only (task 'embed')", param="task")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise InvalidRequestError(f"normalize must be true, false or null, got {self.normalize!r}",
                                      param="normalize")
        if self.dimensions is not None and self.dimensions < 1:
            raise InvalidRequestError(f"dimensions must be >= 1, got {self.dimensions}", param="dimensions")
        k = self.truncate_prompt_tokens
        if k is not None and k < 1 and k != -1:
            raise InvalidRequestError(f"truncate_prompt_tokens must be >= 1 (or -1 for the model's maximum), got {k}",
                                      param="truncate_prompt_tokens")


def tokenize_for_pooling(tokenizer: Any, prompt: str | list[int], truncate_prompt_tokens: int | None,
                         max_model_len: int) -> list[int]:
    """Token ids of an embedding prompt (text or ids), truncated as PoolingParams documents."""
    k = truncate_prompt_tokens
    if k == -1:
        k = max_model_len
    if isinstance(prompt, str):
        if k is None:
            return tokenizer.encode(prompt)
        ids = tokenizer(prompt, truncation=True, max_length=k)["input_ids"]
        check_truncated([ids], k)
        return ids
    ids = list(prompt)
    return ids if k is None or len(ids) <= k else ids[-k:]  # token ids: the last k, as vLLM keeps them


def check_truncated(encoded: list[list[int]], k: int | None) -> None:
    """A 400 where a text cut to k tokens is still longer: k is fewer than the special tokens the tokenizer adds
    (it embedded the special tokens alone, and counted the uncut length)."""
    if k is not None and any(len(ids) > k for ids in encoded):
        longest = max(len(ids) for ids in encoded)
        raise InvalidRequestError(f"truncate_prompt_tokens {k} is fewer than the special tokens the tokenizer adds to "
                                  f"a text ({longest} tokens remain after cutting): give at least that many",
                                  param="truncate_prompt_tokens")


def finish_embedding(vector: list[float], dimensions: int | None, normalize: bool) -> list[float]:
    """The pooled vector as returned: its first `dimensions` values (Matryoshka), scaled to unit length if
    `normalize` (vLLM's order: truncate, then normalise)."""
    kept = vector if dimensions is None or dimensions >= len(vector) else vector[:dimensions]
    if not normalize:
        return kept
    norm = max(math.hypot(*kept), 1e-12)
    return [x / norm for x in kept]
