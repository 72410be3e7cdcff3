"""pagedserve/scoring.py's cosine: a score clients may range-check."""

from __future__ import annotations

import numpy as np

from pagedserve.scoring import cosine_scores


def test_cosine_scores_stay_within_minus_one_and_one():
    """A vector with itself is 1 up to float64 rounding: 1.0000000000000002 reached a client (QA-T, an empty query
    against an empty document); the scores are clipped to [-1, 1]."""
    vectors = np.random.default_rng(0).standard_normal((500, 384)).astype(np.float32)
    same = cosine_scores(vectors, vectors)
    assert max(same) == 1.0 and min(same) > 0.999999
    opposite = cosine_scores(vectors, -vectors)
    assert min(opposite) == -1.0
    assert cosine_scores([[0.0, 0.0]], [[1.0, 2.0]]) == [0.0]
