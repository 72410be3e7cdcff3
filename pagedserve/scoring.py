"""Scores of text pairs from an embedding model, as vLLM's score and rerank APIs give them for embedding models:
the cosine similarity of the two texts' vectors. One home for the pairing rule and the arithmetic, used by
/score, /rerank and LLM.score."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pagedserve.exceptions import InvalidRequestError


@dataclass
class ScoringOutput:
    """vLLM's: one pair's score."""

    score: float


@dataclass
class ScoringRequestOutput:
    """vLLM's: `output.outputs.score`; the token ids are the second text's."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True


def check_pairs(left: Sequence, right: Sequence, names: tuple[str, str] = ("text_1", "text_2")) -> None:
    """InvalidRequestError unless each side has texts and the left has one (paired with every right one) or as
    many as the right (paired in order), vLLM's rule."""
    for side, name in zip((left, right), names):
        if len(side) == 0:
            raise InvalidRequestError(f"{name} must not be empty", param=name)
    if len(left) != 1 and len(left) != len(right):
        raise InvalidRequestError(f"{names[0]} has {len(left)} texts and {names[1]} {len(right)}: give one "
                                  f"{names[0]} (scored against each {names[1]}) or as many as {names[1]}",
                                  param=names[0])


def cosine_scores(left: Sequence[Sequence[float]], right: Sequence[Sequence[float]]) -> list[float]:
    """Cosine similarity of each pair (a single left vector against every right one), in float64, within [-1, 1]
    (a text with itself came out 1.0000000000000002, which range-checking clients reject)."""
    a = np.asarray(left, dtype=np.float64)
    b = np.asarray(right, dtype=np.float64)
    if len(a) == 1:
        a = np.broadcast_to(a, b.shape)
    norms = np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-12)
    return np.clip((a * b).sum(axis=1) / norms, -1.0, 1.0).tolist()
