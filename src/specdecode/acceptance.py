"""Expected accepted tokens of a draft whose tokens carry confidences (the probability that each
is accepted given the ones before it were): the arithmetic the controller sizes drafts with
(control.best_width) and a hybrid drafter weighs its lookup's draft with (drafters.hybrid).
Pure Python, importing nothing, so that both can use it without either importing the other.
"""

from __future__ import annotations

from collections.abc import Sequence


def expected_accepted(confidence: Sequence[float]) -> float:
    """Expected accepted tokens of a draft whose token j is accepted with probability
    confidence[j] given the ones before it were: sum_j prod_{i<=j} confidence[i]."""
    total, survive = 0.0, 1.0
    for c in confidence:
        survive *= c
        total += survive
    return total
