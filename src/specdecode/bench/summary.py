"""The terminal summary printed at the end of `specdecode bench`: a few lines per configuration."""

from __future__ import annotations

import math

from specdecode.bench.hardware import describe_hardware
from specdecode.bench.recommend import Recommendation
from specdecode.bench.stats import Analysis, ConfigSummary


def _f(x: float, digits: int = 2, scale: float = 1.0) -> str:
    return f"{x * scale:.{digits}f}" if math.isfinite(x) else "-"


def config_lines(analysis: Analysis, s: ConfigSummary) -> list[str]:
    """Two lines for one configuration: timing, then acceptance and speedup (speculative)."""
    lines = [f"  {s.spec.name:<18} {_f(s.throughput_tok_s, 1)} tok/s, TTFT p50 "
             f"{_f(s.ttft.p50, 0, 1000)} ms, ITL p50/p99 {_f(s.itl.p50, 1, 1000)}/"
             f"{_f(s.itl.p99, 1, 1000)} ms, latency p50/p99 {_f(s.latency.p50)}/"
             f"{_f(s.latency.p99)} s ({s.n_requests} requests)"]
    if s.spec.is_plain:
        return lines
    a = s.acceptance
    speed = "no plain baseline"
    if s.speedup is not None:
        t, d = s.speedup.total_ratio, s.speedup.decode_ratio
        speed = (f"speedup {_f(t.estimate)}x [{_f(t.low)}, {_f(t.high)}] (after the first "
                 f"token {_f(d.estimate)}x [{_f(d.low)}, {_f(d.high)}])")
    audit = {True: "pass", False: "FAIL", None: "none"}[
        analysis.audit_passed(s.spec.name, s.spec.batch_size)]
    lines.append(f"  {'':<18} {speed}, predicted {_f(s.predicted_speedup)}x, alpha "
                 f"{_f(a.alpha)}, accepted/drafted {_f(a.rate)}, mean acceptance length "
                 f"{_f(a.mean_acceptance_length)}, audit {audit}")
    return lines


def render_summary(
    analysis: Analysis, recommendation: Recommendation, report_path: str | None = None
) -> str:
    """The whole terminal summary: setup line, per batch size the configs, the verdict."""
    header = analysis.results.header
    lines = [f"specdecode bench: {header.model.name} ({header.model.precision}) on "
             f"{describe_hardware(header.hardware)}; workload {header.workload.get('name')} "
             f"({header.workload.get('n_prompts')} prompts)"]
    for batch in analysis.batch_sizes:
        lines.append(f"batch size {batch}:")
        for s in analysis.configs:
            if s.spec.batch_size == batch:
                lines += config_lines(analysis, s)
    lines.append(recommendation.render())
    if report_path:
        lines.append(f"report: {report_path}")
    return "\n".join(lines)
