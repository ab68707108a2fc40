"""Compare two benchmark reports, e.g. before and after a target swap or an upgrade.

For every configuration (name, batch size) present in both, each metric's change NEW - OLD gets
a bootstrap confidence interval (requests as units, paired by prompt and turn when both runs
measured the same ones, independent otherwise; ITL percentiles resample whole requests).
A change is flagged only when that interval excludes 0: at 95 % confidence about one unchanged
metric in twenty is flagged by chance, and p99s of a few dozen requests are the least reliable.
Metrics: alpha, accepted/drafted (speculative configs), TTFT / ITL / request latency p50 and p99,
and throughput (here: output tokens over the summed request latencies, which equals the
report's throughput at batch size 1).

The tuned drafter and k are called stale when the target's weight hash changed, when NEW's
recommendation differs from OLD's (drafter, k, or enabling at all), or when the configuration
OLD recommended no longer shows a speedup whose interval lies above 1 in NEW.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from specdecode.bench.records import RequestSample
from specdecode.bench.store import Results, load_report, results_from_report
from specdecode.report.analysis import (
    DEFAULT_RESAMPLES,
    Interval,
    analyze,
    bootstrap_replicates,
    column_percentile,
    interval_from,
    jsonable,
    pooled_percentile_replicates,
    ratio_of_sums,
)
from specdecode.report.recommend import Recommendation, recommend

ReportLike = Results | dict[str, Any] | str | Path
Replicates = Callable[[Sequence[RequestSample], np.random.Generator, int], tuple[float,
                                                                                  np.ndarray]]


@dataclass(frozen=True)
class MetricChange:
    """One metric of one configuration: OLD, NEW and the interval of NEW - OLD."""

    config: str
    batch_size: int
    metric: str
    old: float
    new: float
    diff: Interval
    significant: bool


@dataclass
class CompareResult:
    """Everything `compare` found; `render()` gives the text version."""

    changes: list[MetricChange]
    only_in_old: list[tuple[str, int]]
    only_in_new: list[tuple[str, int]]
    stale: bool
    stale_reasons: list[str]
    old_recommendation: Recommendation
    new_recommendation: Recommendation
    notes: list[str] = field(default_factory=list)

    @property
    def flagged(self) -> list[MetricChange]:
        """The changes beyond noise."""
        return [c for c in self.changes if c.significant]

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["old_recommendation"] = self.old_recommendation.to_dict()
        data["new_recommendation"] = self.new_recommendation.to_dict()
        return dict(jsonable(data))

    def render(self) -> str:
        """Plain-text rendering: staleness verdict, flagged changes, what was not compared."""
        lines = ["Tuned drafter and k are STALE: re-tune." if self.stale else
                 "Tuned drafter and k still hold."]
        lines += [f"- {r}" for r in self.stale_reasons]
        lines.append(f"{len(self.flagged)} of {len(self.changes)} metric changes are beyond "
                     "noise (95% bootstrap interval of NEW - OLD excludes 0):")
        for c in self.flagged:
            lines.append(f"  {c.config} (batch size {c.batch_size}) {c.metric}: "
                         f"{_g(c.old)} -> {_g(c.new)} (change {_g(c.diff.estimate)}, "
                         f"CI [{_g(c.diff.low)}, {_g(c.diff.high)}])")
        for label, keys in (("only in OLD", self.only_in_old), ("only in NEW",
                                                                 self.only_in_new)):
            if keys:
                lines.append(f"{label}: " + ", ".join(f"{n} (batch {b})" for n, b in keys))
        lines += [f"Note: {n}" for n in self.notes]
        return "\n".join(lines)


def _g(x: float) -> str:
    return f"{x:.4g}" if math.isfinite(x) else "-"


def _as_results(report: ReportLike) -> Results:
    if isinstance(report, Results):
        return report
    if isinstance(report, dict):
        return results_from_report(report)
    return load_report(report)


def _table(samples: Sequence[RequestSample]) -> np.ndarray:
    """Per-sample columns: accepted, accepted + rejections, drafted, tokens, latency, TTFT,
    sum of min(p, q), positions it was summed over."""
    return np.array([[s.accepted, s.accepted + s.rejections, s.drafted, s.output_tokens,
                      s.latency_s, s.ttft_s, s.alpha_micro / 1e6, s.alpha_positions]
                     for s in samples], dtype=float).reshape(-1, 8)


def _column_metric(stat: Callable[[np.ndarray], np.ndarray]) -> Replicates:
    def run(samples: Sequence[RequestSample], rng: np.random.Generator,
            n: int) -> tuple[float, np.ndarray]:
        data = _table(samples)
        if data.shape[0] == 0:
            return math.nan, np.full(n, math.nan)
        with np.errstate(divide="ignore", invalid="ignore"):
            return float(stat(data[None, ...])[0]), bootstrap_replicates(data, stat, n, rng)
    return run


def _itl_metric(q: float) -> Replicates:
    def run(samples: Sequence[RequestSample], rng: np.random.Generator,
            n: int) -> tuple[float, np.ndarray]:
        groups = [np.asarray(s.itl_s, dtype=float) for s in samples]
        pooled = np.concatenate(groups) if groups else np.empty(0)
        estimate = float(np.percentile(pooled, q, method="linear")) if pooled.size else math.nan
        return estimate, pooled_percentile_replicates(groups, [q], n, rng)[:, 0]
    return run


def metric_table(speculative: bool, direct_alpha: bool = False) -> dict[str, Replicates]:
    """The metrics compared, by name (acceptance metrics only for speculative configs).

    alpha is the engine's min(p, q) measure when `direct_alpha`, else the i.i.d. estimate.
    """
    metrics: dict[str, Replicates] = {}
    if speculative:
        metrics["alpha"] = _column_metric(ratio_of_sums(6, 7) if direct_alpha
                                          else ratio_of_sums(0, 1))
        metrics["accepted/drafted"] = _column_metric(ratio_of_sums(0, 2))
    for q in (50, 99):
        metrics[f"ttft_p{q}_s"] = _column_metric(column_percentile(5, q))
        metrics[f"itl_p{q}_s"] = _itl_metric(q)
        metrics[f"latency_p{q}_s"] = _column_metric(column_percentile(4, q))
    metrics["throughput_tok_s"] = _column_metric(ratio_of_sums(3, 4))
    return metrics


def compare_config(
    key: tuple[str, int], old: Sequence[RequestSample], new: Sequence[RequestSample],
    speculative: bool, n_resamples: int = DEFAULT_RESAMPLES, seed: int = 0,
) -> list[MetricChange]:
    """Every metric's change for one configuration, with its bootstrap interval.

    When both runs measured the same (prompt, turn) units, the resamples are paired (the same
    units drawn on both sides), which removes prompt-to-prompt variation from the difference;
    otherwise the two runs are resampled independently.
    """
    old, new = sorted(old, key=_unit), sorted(new, key=_unit)
    paired = [_unit(s) for s in old] == [_unit(s) for s in new]
    direct = all(any(s.alpha_positions for s in run) for run in (old, new))
    out = []
    for i, (name, metric) in enumerate(metric_table(speculative, direct).items()):
        old_est, old_reps = metric(old, np.random.default_rng([seed, i, 0]), n_resamples)
        new_seed = [seed, i, 0] if paired else [seed, i, 1]
        new_est, new_reps = metric(new, np.random.default_rng(new_seed), n_resamples)
        diff = interval_from(new_est - old_est, new_reps - old_reps)
        significant = math.isfinite(diff.low) and diff.excludes(0.0)
        out.append(MetricChange(key[0], key[1], name, old_est, new_est, diff, significant))
    return out


def _unit(s: RequestSample) -> tuple[str, int]:
    return (s.prompt_id, s.turn)


def _rec_key(rec: Recommendation) -> tuple[bool, str | None, int | None]:
    return (rec.enable, rec.drafter, rec.k)


def stale_reasons(
    old: Results, new: Results, old_rec: Recommendation, new_rec: Recommendation,
    new_speedup_low: dict[tuple[str, int], float],
) -> list[str]:
    """Why the tuned drafter and k no longer hold (empty: they still do)."""
    reasons = []
    if old.header.model.weight_hash != new.header.model.weight_hash:
        reasons.append(f"the target's weights changed (hash {old.header.model.weight_hash[:12]}"
                       f" -> {new.header.model.weight_hash[:12]})")
    if old.header.model.precision != new.header.model.precision:
        reasons.append(f"the target's precision changed ({old.header.model.precision} -> "
                       f"{new.header.model.precision}): another precision is another target")
    if old.header.model.name != new.header.model.name:
        reasons.append(f"the target changed ({old.header.model.name} -> "
                       f"{new.header.model.name})")
    if _rec_key(old_rec) != _rec_key(new_rec):
        def say(r: Recommendation) -> str:
            return f"{r.config} (drafter {r.drafter}, k={r.k})" if r.enable else "off"
        reasons.append(f"the best configuration changed: OLD recommended {say(old_rec)}, NEW "
                       f"measurements recommend {say(new_rec)}")
    if old_rec.enable and old_rec.config is not None:
        for batch in old_rec.batch_sizes_on:
            low = new_speedup_low.get((old_rec.config, batch), math.nan)
            if not low > 1.0:
                reasons.append(f"{old_rec.config} at batch size {batch}: the speedup interval's "
                               f"lower bound is now {_g(low)} (not above 1)")
    return reasons


def _by_key(results: Results) -> dict[tuple[str, int], list[RequestSample]]:
    out: dict[tuple[str, int], list[RequestSample]] = {}
    for s in results.samples:
        out.setdefault((s.config, s.batch_size), []).append(s)
    return out


def compare(
    old_report: ReportLike, new_report: ReportLike, *, n_resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
) -> CompareResult:
    """Compare OLD and NEW (Results, report.json dicts, or paths to report.json / .jsonl)."""
    old, new = _as_results(old_report), _as_results(new_report)
    old_analysis = analyze(old, n_resamples=n_resamples, seed=seed)
    new_analysis = analyze(new, n_resamples=n_resamples, seed=seed)
    old_rec, new_rec = recommend(old_analysis), recommend(new_analysis)
    old_keys = {c.key for c in old_analysis.configs}
    new_keys = {c.key for c in new_analysis.configs}
    old_samples, new_samples = _by_key(old), _by_key(new)
    changes: list[MetricChange] = []
    for summary in new_analysis.configs:
        if summary.key in old_keys:
            changes += compare_config(summary.key, old_samples.get(summary.key, []),
                                      new_samples.get(summary.key, []),
                                      not summary.spec.is_plain, n_resamples, seed)
    lows = {c.key: c.speedup.total_ratio.low for c in new_analysis.configs
            if c.speedup is not None}
    reasons = stale_reasons(old, new, old_rec, new_rec, lows)
    notes = []
    if old.header.hardware != new.header.hardware:
        notes.append("the two runs were measured on different hardware")
    if old.header.workload.get("fingerprint") != new.header.workload.get("fingerprint"):
        notes.append("the two runs used different workloads: changes may reflect the prompts")
    return CompareResult(
        changes=changes,
        only_in_old=sorted(old_keys - new_keys),
        only_in_new=sorted(new_keys - old_keys),
        stale_reasons=reasons,
        stale=bool(reasons),
        old_recommendation=old_rec,
        new_recommendation=new_rec,
        notes=notes,
    )
