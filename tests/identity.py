"""The rule for identity tests: speculative output equals plain output, AND the speculative runs
drafted tokens and had some of them accepted. An identity check whose drafter proposed nothing
(a lookup that never matched, a refused or idle drafter, a controller that kept k at 0) is plain
decoding compared with itself and proves nothing about verification; one where every draft was
rejected never exercises the accepted path, the KV rollback's keep side or the bonus token.

Every identity test calls `assert_identical` (engine Generations) or `assert_identical_outputs`
(outputs and counters read elsewhere: a server's usage or /metrics); tests/test_identity_rule.py
holds the helper's broken variant and checks that identity tests use it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Drafted:
    """What the speculative runs of an identity check drafted and had accepted."""

    drafted: int
    accepted: int

    @property
    def rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


def assert_identical_outputs(speculative: Sequence[Sequence[Any]], plain: Sequence[Sequence[Any]],
                             drafted: int, accepted: int, label: str = "",
                             *, require_accepted: bool = True) -> Drafted:
    """Each speculative output (token ids, or text) equals its plain one, at least one token was
    drafted and (unless `require_accepted` is False: a test of the rejection path) at least one
    accepted."""
    where = f"{label}: " if label else ""
    assert len(speculative) == len(plain), f"{where}{len(speculative)} outputs, {len(plain)} plain"
    differ = [i for i, (a, b) in enumerate(zip(speculative, plain, strict=True))
              if list(a) != list(b)]
    assert not differ, f"{where}speculative output differs from plain on requests {differ}"
    assert drafted > 0, (f"{where}nothing was drafted: an identity check without drafts is plain "
                         "decoding compared with itself")
    if require_accepted:
        assert accepted > 0, (f"{where}no drafted token was accepted ({drafted} drafted): the "
                              "accepted path was never exercised")
    return Drafted(drafted, accepted)


def assert_identical(runs: Sequence[Any], plain: Sequence[Sequence[int]], label: str = "",
                     *, require_accepted: bool = True) -> Drafted:
    """`assert_identical_outputs` for engine Generations (their `output` and `counters`)."""
    return assert_identical_outputs(
        [g.output for g in runs], plain, sum(g.counters.drafted for g in runs),
        sum(g.counters.accepted for g in runs), label, require_accepted=require_accepted)
