"""The terminal summary printed at the end of `specdecode bench`: a few lines per configuration."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from specdecode.bench import interference
from specdecode.bench.hardware import describe_hardware
from specdecode.report.analysis import Analysis, ConfigSummary
from specdecode.report.recommend import Recommendation


def _f(x: float, digits: int = 2, scale: float = 1.0) -> str:
    return f"{x * scale:.{digits}f}" if math.isfinite(x) else "-"


def config_lines(analysis: Analysis, s: ConfigSummary) -> list[str]:
    """Two lines for one configuration: timing, then acceptance and speedup (speculative)."""
    lines = [f"  {s.spec.name:<18} {_f(s.throughput_tok_s, 1)} tok/s, TTFT p50 "
             f"{_f(s.ttft.p50, 0, 1000)} ms, TPOT p50/p99 {_f(s.tpot.p50, 1, 1000)}/"
             f"{_f(s.tpot.p99, 1, 1000)} ms, inter-chunk gap p50/p99 "
             f"{_f(s.chunk_gap.p50, 1, 1000)}/{_f(s.chunk_gap.p99, 1, 1000)} ms, latency "
             f"p50/p99 {_f(s.latency.p50)}/{_f(s.latency.p99)} s ({s.n_requests} requests)"]
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
    return lines + warmup_lines(s)


def warmup_lines(s: ConfigSummary) -> list[str]:
    """Cold to warm (a workload with repeat groups): mean acceptance length and alpha by place
    in the run, then for the first request of each group against its repeats."""
    w = s.warmup
    if w is None:
        return []
    slices = w.by_arrival
    ranges = " / ".join(x.label.split(" ", 1)[1] for x in slices)  # "1-6", or "3" alone
    lengths = " / ".join(_f(x.acceptance.mean_acceptance_length) for x in slices)
    alphas = " / ".join(_f(x.acceptance.alpha) for x in slices)
    first, rest = w.first, w.repeats
    return [f"  {'':<18} cold to warm, by arrival (requests {ranges} of {w.n_arrivals}): mean "
            f"acceptance length {lengths}, alpha {alphas}",
            f"  {'':<18} first of their group ({first.n_requests} requests): mean acceptance "
            f"length {_f(first.acceptance.mean_acceptance_length)}, alpha "
            f"{_f(first.acceptance.alpha)}, speedup {_f(first.speedup)}x; repeats "
            f"({rest.n_requests}): {_f(rest.acceptance.mean_acceptance_length)}, alpha "
            f"{_f(rest.acceptance.alpha)}, speedup {_f(rest.speedup)}x"]


def load_lines(report: interference.LoadReport, out_dir: Path | None) -> list[str]:
    """The machine's load through the run; the disturbed configurations and how to re-measure
    them. Nothing for a run that recorded no load (written before it was recorded)."""
    if not report.recorded:
        return []
    read = [c for c in report.configs if c.n_read]
    mean = sum(c.mean_taken_cores * c.n_read for c in read) / sum(c.n_read for c in read)
    worst = max(c.max_taken_cores for c in read)
    line = (f"machine load: other processes kept {mean:.2f} of {report.cores} cores busy on "
            f"average while measuring (worst batch {worst:.2f}), 1-minute load average up to "
            f"{max(c.max_load1 for c in read):.2f}")
    if not report.judged:
        return [line + "; not judged over HTTP (a local server's work counts as other "
                "processes)"]
    flagged = report.flagged
    if not flagged:
        return [line + "; no configuration was measured under interference"]
    lines = [line + ".", "MEASURED UNDER INTERFERENCE (speedups involving these are not "
             "reliable):"]
    lines += [f"  {interference.describe(c, report.cores)}" for c in flagged]
    lines.append(interference.rerun_advice(out_dir))
    return lines


def render_summary(
    analysis: Analysis, recommendation: Recommendation, report_path: str | None = None,
    extra: Sequence[str] = (),
) -> str:
    """The whole terminal summary: setup line, per batch size the configs, `extra` lines (the
    traffic of an open-loop replay: report.traffic), the verdict."""
    header = analysis.results.header
    load = interference.assess(header, analysis.results.samples)
    lines = [f"specdecode bench: {header.model.name} ({header.model.precision}) on "
             f"{describe_hardware(header.hardware)}; workload {header.workload.get('name')} "
             f"({header.workload.get('n_prompts')} prompts)"]
    exactness = (header.runner.get("details") or {}).get("exactness")
    if exactness:  # whether speculation here keeps the target's output (models.exactness)
        lines.append(f"target: {exactness}")
    for batch in analysis.batch_sizes:
        lines.append(f"batch size {batch}:")
        for s in analysis.configs:
            if s.spec.batch_size == batch:
                lines += config_lines(analysis, s)
                measured = load.of(s.spec.name, batch)
                if measured is not None and measured in load.flagged:
                    lines.append(f"  {'':<18} INTERFERENCE: {measured.n_disturbed} of "
                                 f"{measured.n_requests} requests measured while other work "
                                 f"kept up to {measured.max_taken_cores:.1f} cores busy")
    lines += extra
    lines += load_lines(load, Path(report_path).parent if report_path else None)
    lines.append(recommendation.render())
    if report_path:
        lines.append(f"report: {report_path}")
    return "\n".join(lines)
