"""Pairing two programs' detections where near-tied scores may come in either order (their last digits differ)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence


def pair_near_ties(scores: Sequence[float], ref_scores: Sequence[float], distance: Callable[[int, int], float],
                   atol: float) -> list[int]:
    """For each detection of ours (in the given order), the index of the reference detection it is: among the
    reference's not yet paired whose score is within ``atol`` of its score, the closest by ``distance(ours, ref)``
    (``inf``: never that one, e.g. another category). Fails naming the first detection that has none; the caller
    then checks each pair's values to its own tolerances."""
    free = set(range(len(ref_scores)))
    pairs = []
    for i, score in enumerate(scores):
        tied = [j for j in sorted(free) if abs(ref_scores[j] - score) <= atol and distance(i, j) < math.inf]
        assert tied, f"detection {i} (score {score}): no reference detection of its kind within {atol} of its score"
        j = min(tied, key=lambda j: distance(i, j))
        free.remove(j)
        pairs.append(j)
    return pairs
