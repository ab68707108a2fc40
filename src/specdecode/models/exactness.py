"""Whether a target may speculate: the one decision, and the words every report uses for it.

Speculation keeps the target's output only where a position's logits do not depend on what else
is scored with it. A target speculates when that holds: refused before anything loads where a
precision breaks it by construction (int8), else measured (models.invariance: every backend's
load-time check, measured again, wider, for a drafter that scores wider calls than the load
checked). A target that is not exact is refused, with the cause and the fix, unless the
environment sets SPECDECODE_ALLOW_INEXACT=1: then it speculates with a warning, and what it
reports (the bench report's first line and header, `generate --json`, the server's /metrics)
says "inexact" beside the measured difference. 0 or unset refuses; any other value is an error
naming it.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

from specdecode.errors import SpecDecodeError
from specdecode.models.invariance import DEFAULT_WIDTH, Invariance
from specdecode.models.precision import coupling, speculative_names
from specdecode.models.target import Target

ALLOW_INEXACT = "SPECDECODE_ALLOW_INEXACT"


def allow_inexact() -> bool:
    """SPECDECODE_ALLOW_INEXACT: "1" lets a target that is not batch-invariant speculate, "0"
    or unset refuses; anything else is an error naming the value."""
    value = os.environ.get(ALLOW_INEXACT, "").strip()
    if value in ("", "0"):
        return False
    if value == "1":
        return True
    raise SpecDecodeError(
        f"{ALLOW_INEXACT}={value!r} is not 0 or 1: set it to 1 to speculate on a target that "
        "is not batch-invariant (its outputs may then differ from plain decoding), or 0 / "
        "unset it to refuse")


def _inexact_message(what: str, why: str, measured: Invariance | None = None) -> str:
    found = "" if measured is None else f" ({measured.describe()})"
    return (f"speculative decoding needs a batch-invariant target, and {what} is not{found}: "
            f"{why}; the output could not be token-identical to its plain decoding. Use "
            f"--drafter none, or set {ALLOW_INEXACT}=1 to speculate anyway")


def check_precision(precision: str) -> None:
    """Before anything loads: refuse speculation on a precision that is row-coupled by
    construction (int8; its copy stays available as a drafter, where invariance does not
    matter), unless SPECDECODE_ALLOW_INEXACT=1."""
    why = coupling(precision)
    if why is None or allow_inexact():
        return
    raise SpecDecodeError(_inexact_message(f"--precision {precision}", why) +
                          f" (--precision {', '.join(speculative_names())} run on the "
                          "row-invariant kernels; a quantized copy of the target can still be "
                          "the drafter)")


@dataclass(frozen=True)
class Verdict:
    """Whether a target passed its invariance check, and whether it may speculate."""

    exact: bool
    speculates: bool  # exact, or allowed by SPECDECODE_ALLOW_INEXACT=1
    invariance: Invariance | None  # None: refused by construction, not measured
    why: str = ""  # the cause where not exact

    @property
    def status(self) -> str:
        """"exact", "inexact (allowed by SPECDECODE_ALLOW_INEXACT=1)" or "inexact (speculation
        refused)": what reports and metrics labels say."""
        if self.exact:
            return "exact"
        return (f"inexact (allowed by {ALLOW_INEXACT}=1)" if self.speculates
                else "inexact (speculation refused)")

    def describe(self) -> str:
        measured = "" if self.invariance is None else f" ({self.invariance.describe()})"
        if self.exact:
            return f"exact: batch-invariant{measured}"
        return f"{self.status}: NOT batch-invariant{measured}: {self.why}"

    def as_dict(self) -> dict[str, Any]:
        return {"status": self.status, "exact": self.exact, "speculates": self.speculates,
                "invariance": None if self.invariance is None else self.invariance.as_dict(),
                "why": self.why or None}


def invariance_of(target: Target, width: int = DEFAULT_WIDTH) -> Invariance:
    """The target's measured invariance, measured now (and recorded on it) where its loader did
    not or checked narrower calls than `width`."""
    measured = target.invariance
    if measured is None or measured.width < width:
        measured = target.check_invariance(width)
    return measured


def verdict(target: Target, width: int = DEFAULT_WIDTH) -> Verdict:
    """The one decision: may `target` speculate with calls of up to `width` positions?"""
    allowed = allow_inexact()  # read first: a bad value is an error on any target
    why = coupling(target.precision)  # the precision's record: no row-invariant kernel path
    if why is not None:
        return Verdict(False, allowed, None, why)
    measured = invariance_of(target, width)
    if measured.exact:
        return Verdict(True, True, measured)
    return Verdict(False, allowed, measured,
                   measured.cause or "cause unknown (please report it with the output of "
                   "`specdecode costs`)")


def require_speculation(target: Target, width: int = DEFAULT_WIDTH) -> Verdict:
    """The verdict, or SpecDecodeError where speculation is refused; a warning on stderr where
    an inexact target speculates because SPECDECODE_ALLOW_INEXACT=1."""
    found = verdict(target, width)
    what = f"this {target.backend} {target.precision} target"
    if not found.speculates:
        raise SpecDecodeError(_inexact_message(what, found.why, found.invariance))
    if not found.exact:
        print(f"warning: {what} is NOT batch-invariant ({found.describe()}); speculating anyway "
              f"because {ALLOW_INEXACT}=1: outputs may differ from plain decoding",
              file=sys.stderr)
    return found
