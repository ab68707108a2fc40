"""The arithmetic of acceptance: expected accepted tokens of a draft whose tokens carry
confidences (the probability that each is accepted given the ones before it were), which the
controller sizes drafts with (control.best_width) and a hybrid drafter weighs its lookup's draft
with (drafters.hybrid); expected tokens of a step at a per-token acceptance, and the margin by
which speculation must be expected to beat plain decoding, which the controller and ngram+auto's
choice of its model part (drafters.auto) both use. Pure Python, importing nothing, so that the
controller and the drafters can use it without either importing the other.
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


# Speculating must be expected to beat plain decoding by this fraction: the cost model is
# measured, not exact (noise, and per-row verification work besides the forward pass), and a
# wrong "on" costs the batch's every row, a wrong "off" only the gain.
PAY_MARGIN = 0.05


def expected_tokens(alpha: float, k: float) -> float:
    """E(k): expected tokens emitted by one step drafting k tokens at per-token acceptance
    alpha, (1 - alpha^(k+1)) / (1 - alpha); k + 1 at alpha = 1. The one definition: the
    controller's choices, the report's predicted speedup (report.analysis) and ngram+auto's
    choice (drafters.auto) all use it."""
    if k == 0:
        return 1.0
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)
