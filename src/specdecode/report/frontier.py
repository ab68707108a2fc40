"""Speed against fidelity across targets (`bench --targets`): which precision, runtime and
configuration is the fastest lossless way to run the model here, for the fidelity a user needs.

A run with several targets (`bench.targets`) measures, interleaved over the same prompts, each
target's plain decoding and speculative configurations, and llama-cpp-python's own plain
decoding of the same GGUF (the *reference*: what a user runs today). Per target and batch size
this module computes a `TargetPoint`:

- the target's *fastest lossless configuration*: the speculative configuration with the highest
  measured speedup over the target's own plain decoding among those demonstrated to win (CI
  lower bound above 1, audit passed: `analysis.is_on`), else plain decoding itself. Lossless is
  relative to the target: its output is the target's plain output;
- its tokens/s and, paired over the same requests with the run's bootstrap, its ratio to the
  reference's plain decoding (and the target's plain decoding's ratio);
- the target's *fidelity*: agreement with the fp32 target measured at load (teacher-forced top-1
  agreement and mean KL(p_fp32 || p_target), `agreement`), and the share of requests whose
  greedy plain output equals fp32's plain output in this run.

The *frontier* is the set of points no other point beats on fidelity (top-1 at least as high,
KL at least as low) and speed (tokens/s at least as high), better on one. `choose` applies the
user's fidelity rule (`parse_fidelity`: fp32, any, kl=X, top1=X) and returns the fastest
admissible point with its paired ratio over the runner-up (so a tie within noise is said).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from specdecode.bench.peers import is_peer
from specdecode.bench.records import RequestSample
from specdecode.errors import SpecDecodeError
from specdecode.models import backends, precision
from specdecode.report.analysis import (
    Analysis,
    ConfigSummary,
    Interval,
    is_on,
    measure_speedup,
)

# fidelity is measured against this target; --fidelity takes its name for "its output"
REFERENCE_TARGET = precision.REFERENCE.name
FIDELITY_CHOICES = f"{REFERENCE_TARGET} | any | kl=X | top1=X"
DEFAULT_FIDELITY = "any"


# ------------------------------------------------------------------------------- fidelity rule


@dataclass(frozen=True)
class FidelityRule:
    """Which targets a user accepts: `kind` "fp32" (the fp32 target's output: KL 0 and top-1
    1), "any", "kl" (mean KL with fp32 at most `bound` nats) or "top1" (top-1 agreement with
    fp32 at least `bound`)."""

    kind: str
    bound: float = math.nan

    @property
    def text(self) -> str:
        return self.kind if self.kind in (REFERENCE_TARGET, "any") else \
            f"{self.kind}={self.bound:g}"

    def describe(self) -> str:
        return {REFERENCE_TARGET: "the fp32 target's output",
                "any": "any target",
                "kl": f"mean KL from fp32 at most {self.bound:g} nats",
                "top1": f"top-1 agreement with fp32 at least {self.bound:.1%}"}[self.kind]

    def admits(self, fidelity: Fidelity | None) -> bool:
        """Whether a target of this measured fidelity (None: not measured) qualifies."""
        if self.kind == "any":
            return True
        if fidelity is None:
            return False
        if self.kind == REFERENCE_TARGET:
            return fidelity.mean_kl == 0.0 and fidelity.top1 == 1.0
        if self.kind == "kl":
            return fidelity.mean_kl <= self.bound
        return fidelity.top1 >= self.bound


def parse_fidelity(text: str | None) -> FidelityRule:
    """`--fidelity` as a FidelityRule (None: DEFAULT_FIDELITY); SpecDecodeError naming the
    value otherwise."""
    value = (text if text is not None else DEFAULT_FIDELITY).strip().lower()
    if value in (REFERENCE_TARGET, "any"):
        return FidelityRule(value)
    kind, sep, number = value.partition("=")
    try:
        bound = float(number) if sep else math.nan
    except ValueError:
        bound = math.nan
    if kind == "kl" and math.isfinite(bound) and bound >= 0:
        return FidelityRule("kl", bound)
    if kind == "top1" and 0 <= bound <= 1:
        return FidelityRule("top1", bound)
    raise SpecDecodeError(f"--fidelity must be {FIDELITY_CHOICES} (kl: nats >= 0, top1: a share "
                          f"in 0..1), got {text!r}")


# --------------------------------------------------------------------------------- the points


@dataclass(frozen=True)
class Fidelity:
    """A target's measured closeness to fp32 (see the module docstring)."""

    top1: float
    mean_kl: float
    max_kl: float
    positions: int


@dataclass
class TargetPoint:
    """One target at one batch size: its plain decoding, its fastest lossless configuration,
    their speed against the reference, and its fidelity."""

    target: str
    batch_size: int
    plain: ConfigSummary
    best: ConfigSummary  # `plain` itself when no speculative configuration is on
    fidelity: Fidelity | None
    same_output: tuple[int, int] | None = None  # (identical, compared) with fp32 plain's
    vs_reference: Interval | None = None  # best's tok/s over the reference's, paired
    plain_vs_reference: Interval | None = None
    decode_vs_reference: Interval | None = None  # the same after each request's first token
    plain_decode_vs_reference: Interval | None = None
    on_frontier: bool = False

    @property
    def tok_s(self) -> float:
        return self.best.throughput_tok_s

    @property
    def speedup(self) -> Interval | None:
        """The best configuration's speedup over the target's own plain decoding."""
        return None if self.best is self.plain or self.best.speedup is None \
            else self.best.speedup.total_ratio

    def to_dict(self) -> dict[str, Any]:
        return {"target": self.target, "batch_size": self.batch_size,
                "plain": self.plain.spec.name, "plain_tok_s": self.plain.throughput_tok_s,
                "best": self.best.spec.name, "best_tok_s": self.tok_s,
                "speedup": _iv(self.speedup), "vs_reference": _iv(self.vs_reference),
                "plain_vs_reference": _iv(self.plain_vs_reference),
                "decode_vs_reference": _iv(self.decode_vs_reference),
                "plain_decode_vs_reference": _iv(self.plain_decode_vs_reference),
                "fidelity": None if self.fidelity is None else vars(self.fidelity),
                "same_output": self.same_output, "on_frontier": self.on_frontier}


def _iv(iv: Interval | None) -> dict[str, float] | None:
    return None if iv is None else {"estimate": iv.estimate, "low": iv.low, "high": iv.high}


def is_targets_run(analysis: Analysis) -> bool:
    """Whether the run measured several targets (its configurations name their target)."""
    return any(c.target for c in analysis.results.header.configs)


def target_facts(analysis: Analysis) -> dict[str, dict[str, Any]]:
    """What the runner recorded about each target at load (`bench.targets`), by name."""
    details = analysis.results.header.runner.get("details") or {}
    facts = details.get("targets") if isinstance(details, dict) else None
    return facts if isinstance(facts, dict) else {}


def fidelity_of(facts: dict[str, Any]) -> Fidelity | None:
    """A target's recorded agreement with fp32 as a Fidelity (None: not measured)."""
    a = facts.get("agreement")
    if not isinstance(a, dict) or a.get("top1") is None or a.get("mean_kl") is None:
        return None
    return Fidelity(float(a["top1"]), float(a["mean_kl"]), float(a.get("max_kl") or math.nan),
                    int(a.get("positions") or 0))


def fastest_lossless(analysis: Analysis, plain: ConfigSummary,
                     candidates: Sequence[ConfigSummary]) -> ConfigSummary:
    """The candidate with the highest speedup over `plain` among those demonstrated to win
    (`is_on`), else `plain`."""
    on = [s for s in candidates if is_on(analysis, s) and s.speedup is not None]
    return max(on, key=lambda s: s.speedup.total_ratio.estimate) if on else plain  # type: ignore[union-attr]


def reference_summary(analysis: Analysis, batch: int) -> ConfigSummary | None:
    """llama.cpp's plain decoding at `batch`: llama-cpp-python's `Llama.generate` (the peer),
    else the llama.cpp target's plain decoding on this engine."""
    at = [s for s in analysis.configs if s.spec.batch_size == batch and s.n_requests]
    peer = next((s for s in at if s.spec.drafter == "llamacpp-generate"), None)
    if peer is not None:
        return peer
    host = backends.peer_target().name
    return next((s for s in at if s.spec.target == host and s.spec.is_plain), None)


def ratio(analysis: Analysis, mine: ConfigSummary, theirs: ConfigSummary | None,
          after_first: bool = False) -> Interval | None:
    """`mine`'s tokens/s over `theirs`' on the requests both measured (whole requests, or
    `after_first` each request's first token; paired bootstrap as every speedup of the
    report); None without `theirs` or common requests."""
    if theirs is None:
        return None
    results = analysis.results
    measured = measure_speedup(results.samples_of(mine.key), results.samples_of(theirs.key),
                               theirs.spec.name, analysis.n_resamples, analysis.seed)
    if measured is None:
        return None
    return measured.decode_ratio if after_first else measured.total_ratio


def same_outputs(mine: Sequence[RequestSample], reference: Sequence[RequestSample]
                 ) -> tuple[int, int] | None:
    """(requests whose greedy output equals the reference's, greedy requests compared)."""
    ref = {(s.prompt_id, s.turn): s.output_units() for s in reference
           if s.temperature == 0.0 and not s.failed}
    pairs = [(s.output_units(), ref[(s.prompt_id, s.turn)]) for s in mine
             if s.temperature == 0.0 and not s.failed and (s.prompt_id, s.turn) in ref]
    return (sum(a == b for a, b in pairs), len(pairs)) if pairs else None


def target_points(analysis: Analysis) -> list[TargetPoint]:
    """One TargetPoint per (target, batch size) with a measured plain configuration, in the
    order the run lists its targets, frontier marked (see the module docstring)."""
    facts = target_facts(analysis)
    order = list(facts) or list(dict.fromkeys(c.target for c in analysis.results.header.configs))
    points = []
    for batch in analysis.batch_sizes:
        reference = reference_summary(analysis, batch)
        fp32_plain = next((s for s in analysis.configs if s.spec.batch_size == batch
                           and s.spec.target == REFERENCE_TARGET and s.spec.is_plain), None)
        for target in order:
            mine = [s for s in analysis.configs if s.spec.batch_size == batch
                    and s.spec.target == target and s.n_requests and not is_peer(s.spec.drafter)]
            plain = next((s for s in mine if s.spec.is_plain), None)
            if plain is None:
                continue
            best = fastest_lossless(analysis, plain, [s for s in mine if not s.spec.is_plain])
            same = None if fp32_plain is None else same_outputs(
                analysis.results.samples_of(plain.key), analysis.results.samples_of(
                    fp32_plain.key))
            points.append(TargetPoint(
                target, batch, plain, best, fidelity_of(facts.get(target, {})), same,
                vs_reference=ratio(analysis, best, reference),
                plain_vs_reference=ratio(analysis, plain, reference),
                decode_vs_reference=ratio(analysis, best, reference, after_first=True),
                plain_decode_vs_reference=ratio(analysis, plain, reference, after_first=True)))
    for batch in analysis.batch_sizes:
        mark_frontier([p for p in points if p.batch_size == batch])
    return points


def dominates(a: TargetPoint, b: TargetPoint) -> bool:
    """a is at least as faithful (top-1, KL) and as fast as b, and better on one."""
    fa, fb = a.fidelity, b.fidelity
    if fa is None or fb is None:
        return False
    at_least = fa.top1 >= fb.top1 and fa.mean_kl <= fb.mean_kl and a.tok_s >= b.tok_s
    better = fa.top1 > fb.top1 or fa.mean_kl < fb.mean_kl or a.tok_s > b.tok_s
    return at_least and better


def mark_frontier(points: Sequence[TargetPoint]) -> None:
    """Set `on_frontier` on the points of one batch size that no other point dominates
    (points without a measured fidelity are never on it)."""
    for p in points:
        p.on_frontier = p.fidelity is not None and math.isfinite(p.tok_s) and not any(
            dominates(q, p) for q in points if q is not p)


# ---------------------------------------------------------------------------------- the choice


@dataclass
class Choice:
    """The fastest admissible point under a fidelity rule at one batch size, and how far it is
    ahead of the next admissible one (paired ratio; None when it is alone)."""

    rule: FidelityRule
    point: TargetPoint | None
    runner_up: TargetPoint | None = None
    lead: Interval | None = None  # point.best tok/s over runner_up.best's

    @property
    def tied(self) -> bool:
        """The runner-up is within the noise: the lead's interval reaches 1."""
        return self.lead is not None and not self.lead.low > 1.0


def choose(analysis: Analysis, points: Sequence[TargetPoint], rule: FidelityRule,
           batch: int) -> Choice:
    """Among the points at `batch` whose fidelity the rule admits, the one with the highest
    tokens/s of its fastest lossless configuration."""
    admitted = sorted((p for p in points if p.batch_size == batch and rule.admits(p.fidelity)
                       and math.isfinite(p.tok_s)), key=lambda p: -p.tok_s)
    if not admitted:
        return Choice(rule, None)
    best = admitted[0]
    if len(admitted) == 1:
        return Choice(rule, best)
    second = admitted[1]
    return Choice(rule, best, second, ratio(analysis, best.best, second.best))
